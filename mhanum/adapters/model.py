"""mhanum's own attention as a "framework": a layer is its weights and a :class:`Numerics`.

It lets :func:`mhanum.adapters.compare.attribute` and the tests plant causes that no CPU
framework exhibits (TF32 or bfloat16 matmuls, another masking constant, another summation order)
and run without any framework installed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = [
    "PATHS",
    "ModelLayer",
    "effective_mask",
    "extract",
    "load",
    "model",
    "numerics",
    "run",
    "version",
]

PATHS = ("model",)


@dataclasses.dataclass(frozen=True)
class ModelLayer:
    """float32 weights, a head count, the numerics and the fully-masked-row policy."""

    params: MHAParams
    num_heads: int
    numerics: Numerics
    fully_masked: str = "nan"


def version() -> str:
    """mhanum's version."""
    from mhanum._version import __version__

    return __version__


def load(
    params: MHAParams,
    num_heads: int,
    *,
    numerics: Numerics | str | None = None,
    fully_masked: str = "nan",
) -> ModelLayer:
    """A :class:`ModelLayer` holding ``params`` rounded to float32 and ``numerics``.

    Raises:
        InvalidArgument: for numerics whose input format is not float32 (the adapters compare
            float32 layers), or an unknown ``fully_masked``.
    """
    num = resolve(numerics)
    if num.input != "float32":
        msg = f"numerics.input: expected 'float32' for an adapted layer, got {num.input!r}"
        raise InvalidArgument(msg)
    if fully_masked not in C.FULLY_MASKED:
        msg = f"fully_masked: expected one of {C.FULLY_MASKED}, got {fully_masked!r}"
        raise InvalidArgument(msg)
    return ModelLayer(C.float32_params(params, num_heads), int(num_heads), num, fully_masked)


def extract(layer: ModelLayer) -> MHAParams:
    """The layer's weights."""
    return layer.params


def numerics(path: str = "model", *, layer: ModelLayer | None = None) -> Numerics:
    """The layer's numerics (float32 defaults without a layer)."""
    C.check_path(path, PATHS)
    return layer.numerics if layer is not None else Numerics()


def model(path: str = "model", *, layer: ModelLayer | None = None) -> C.PathModel:
    """The :class:`~mhanum.adapters.PathModel`: the layer's own numerics, exactly."""
    fully = layer.fully_masked if layer is not None else "nan"
    return C.PathModel("model", path, numerics(path, layer=layer), fully, "mhanum/attention.py", "")


def effective_mask(raw_mask: ArrayLike, path: str = "model") -> np.ndarray:
    """mhanum's convention: True attends."""
    C.check_path(path, PATHS)
    return np.asarray(raw_mask).astype(bool)


def run(
    layer: ModelLayer,
    x_q: ArrayLike,
    x_kv: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    path: str = "model",
    raw_mask: ArrayLike | None = None,
) -> np.ndarray:
    """``mhanum.multi_head_attention`` under the layer's numerics (float32 inputs)."""
    C.check_path(path, PATHS)
    if mask is not None and raw_mask is not None:
        msg = "raw_mask: expected None when mask is given, got both"
        raise InvalidArgument(msg)
    p = layer.params
    q = C.batched(x_q, "x_q", p.d_q)
    kv = C.batched(x_kv, "x_kv", p.d_kv)
    given = mask if raw_mask is None else effective_mask(raw_mask)
    m = C.mask3(given, q.shape[0], q.shape[1], kv.shape[1])
    out = C.predict(model(layer=layer), p, q, kv, layer.num_heads, m)
    return C.unbatch(out, x_q)
