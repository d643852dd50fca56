"""mhanum: numerical analysis of multi-head attention.

Attention in JAX with explicit numerics, certified arbitrary-precision references, error metrics,
and (in :mod:`mhanum.bounds`) error bounds stated as theorems.

The public names are imported on first access (PEP 562), so ``import mhanum`` is cheap and imports
neither JAX nor Hypothesis; ``mhanum.bounds`` and the other submodules load the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

from mhanum._version import __version__

if TYPE_CHECKING:
    from mhanum import (
        bounds,
        cases,
        formats,
        masks,
        metrics,
        models,
        parallel,
        reference,
        search,
        strategies,
        summation,
    )
    from mhanum._errors import CertificationError, InvalidArgument
    from mhanum.adapters.compare import compare
    from mhanum.emulate.attention import attention, multi_head_attention, softmax
    from mhanum.emulate.backward import attention_grad, mha_grad
    from mhanum.formats import Format, get_format, round_to
    from mhanum.gradients import Gradients, MHAGradients
    from mhanum.models import audit
    from mhanum.numerics import PRESETS, Backward, Numerics
    from mhanum.params import MHAParams

__all__ = [
    "PRESETS",
    "Backward",
    "CertificationError",
    "Format",
    "Gradients",
    "InvalidArgument",
    "MHAGradients",
    "MHAParams",
    "Numerics",
    "__version__",
    "attention",
    "attention_grad",
    "audit",
    "bounds",
    "cases",
    "compare",
    "formats",
    "get_format",
    "masks",
    "metrics",
    "mha_grad",
    "models",
    "multi_head_attention",
    "parallel",
    "reference",
    "round_to",
    "search",
    "softmax",
    "strategies",
    "summation",
]

# The module that defines each public name that is not itself a submodule.
_DEFINED_IN = {
    "CertificationError": "mhanum._errors",
    "InvalidArgument": "mhanum._errors",
    "compare": "mhanum.adapters.compare",
    "attention": "mhanum.emulate.attention",
    "multi_head_attention": "mhanum.emulate.attention",
    "softmax": "mhanum.emulate.attention",
    "attention_grad": "mhanum.emulate.backward",
    "mha_grad": "mhanum.emulate.backward",
    "Gradients": "mhanum.gradients",
    "MHAGradients": "mhanum.gradients",
    "audit": "mhanum.models",
    "Backward": "mhanum.numerics",
    "Format": "mhanum.formats",
    "get_format": "mhanum.formats",
    "round_to": "mhanum.formats",
    "PRESETS": "mhanum.numerics",
    "Numerics": "mhanum.numerics",
    "MHAParams": "mhanum.params",
}


def __getattr__(name: str) -> Any:
    """Import a public name, or a public submodule, on first access."""
    if name in _DEFINED_IN:
        value = getattr(importlib.import_module(_DEFINED_IN[name]), name)
        globals()[name] = value
        return value
    if name.isidentifier() and not name.startswith("_"):
        submodule = f"{__name__}.{name}"
        if importlib.util.find_spec(submodule) is not None:
            return importlib.import_module(submodule)  # the import binds it here
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """This package, whose submodule ``mhanum.attention`` shares its name with a function.

    Importing a submodule binds it as an attribute of its package; when the name is one of
    ``_DEFINED_IN``, the binding is skipped, so ``mhanum.attention`` stays the function however
    the submodule was imported first (``import mhanum.attention`` still loads it).
    """

    def __setattr__(self, name: str, value: object) -> None:
        if (
            name in _DEFINED_IN
            and isinstance(value, types.ModuleType)
            and value.__name__ == f"{__name__}.{name}"
        ):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
