"""Framework adapters: load one :class:`~mhanum.MHAParams` into a framework's attention layer.

Each adapter module (``mhanum.adapters.torch``, ``.keras``, ``.flax``, ``.jax``, and ``.model``
for mhanum's own attention) imports its framework only when it is itself imported, and offers the
same functions:

* ``load(params, num_heads, ...)``: the framework layer holding exactly the given weights;
* ``extract(layer)``: the weights of a layer as an :class:`~mhanum.MHAParams`;
* ``run(layer, x_q, x_kv, mask=None, *, path=..., raw_mask=None)``: the layer's output as numpy,
  with an mhanum mask (True = attend) translated into the framework's convention, or a
  ``raw_mask`` passed through untranslated (to reproduce what a user's own call does);
* ``model(path, ...)``: a :class:`PathModel`, the :class:`~mhanum.Numerics` of the code path that
  runs and what it returns for a fully-masked row;
* ``effective_mask(raw_mask, path)``: which keys a raw framework mask really attends, in mhanum's
  convention;
* ``PATHS`` and ``version()``.

:func:`available` lists the adapters whose framework is installed, without importing any.

``mhanum.adapters.transformers`` (Hugging Face BERT, eager and sdpa attention) follows the same
pattern for a self-attention layer (``run(layer, x, mask)``: one input, key-padding masks), so it
is not among :data:`ADAPTERS`, which :func:`mhanum.compare` runs on any query and key inputs.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from mhanum.adapters._common import PathModel

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["ADAPTERS", "PathModel", "available", "get"]

ADAPTERS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "keras": ("keras", "tensorflow"),
    "flax": ("flax",),
    "jax": (),
    "model": (),
}
"""Adapter name -> the top-level packages it needs (beyond mhanum's own dependencies)."""


def available() -> tuple[str, ...]:
    """Names of the adapters whose frameworks are installed (found, not imported)."""
    return tuple(
        name
        for name, needs in ADAPTERS.items()
        if all(importlib.util.find_spec(pkg) is not None for pkg in needs)
    )


def get(name: str) -> ModuleType:
    """The adapter module ``mhanum.adapters.<name>`` (importing its framework).

    Raises:
        InvalidArgument: for an unknown name or a framework that is not installed.
    """
    from mhanum._errors import InvalidArgument

    if name not in ADAPTERS:
        msg = f"framework: expected one of {tuple(ADAPTERS)}, got {name!r}"
        raise InvalidArgument(msg)
    missing = [pkg for pkg in ADAPTERS[name] if importlib.util.find_spec(pkg) is None]
    if missing:
        msg = (
            f"framework: {name!r} needs {', '.join(missing)}, which is not installed "
            f"(pip install 'mhanum[{'tensorflow' if name == 'keras' else name}]')"
        )
        raise InvalidArgument(msg)
    return importlib.import_module(f"mhanum.adapters.{name}")
