"""Validation at the boundary: shapes, dtypes and values checked before tracing.

Values are checked only when they are concrete (numpy arrays, or JAX arrays outside a trace):
inside ``jax.jit`` NaN and Inf are results to measure, not errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import ml_dtypes
import numpy as np

from mhanum._errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mhanum._types import Array, ArrayLike


def is_traced(x: object) -> bool:
    return isinstance(x, jax.core.Tracer)


def is_exact_float_dtype(dtype: np.dtype) -> bool:
    """Whether every value of ``dtype`` is a float64: float16/32/64 and the ml_dtypes floats.

    (``np.longdouble`` is excluded: its values need not be exact in float64.)
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "fV" or dtype.itemsize > 8:
        return False
    try:
        ml_dtypes.finfo(dtype)
    except (TypeError, ValueError):
        return False
    return True


def float_array(x: ArrayLike, name: str, *, min_ndim: int = 0) -> Array:
    """``x`` as an array with a real floating dtype (JAX arrays and tracers are kept as they are)."""
    arr = x if isinstance(x, jax.Array) else np.asarray(x)
    if not is_exact_float_dtype(np.dtype(arr.dtype)):
        msg = f"{name}: expected a floating-point array, got dtype {arr.dtype}"
        raise InvalidArgument(msg)
    if arr.ndim < min_ndim:
        msg = (
            f"{name}: expected an array with at least {min_ndim} dimensions, got shape {arr.shape}"
        )
        raise InvalidArgument(msg)
    return arr


def check_finite(x: ArrayLike, name: str, *, allow_neg_inf: bool = False) -> None:
    """Raise if a concrete ``x`` holds NaN or Inf (``-inf`` allowed on request), naming the index."""
    if is_traced(x):
        return
    values = np.asarray(x).astype(np.float64)
    bad = np.isnan(values) | (np.isposinf(values) if allow_neg_inf else np.isinf(values))
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        allowed = "finite values or -inf" if allow_neg_inf else "finite values"
        msg = f"{name}: expected {allowed}, got {values[index]} at index {index}"
        raise InvalidArgument(msg)


def broadcast(shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The broadcast of the named shapes, or an error naming them."""
    try:
        return tuple(np.broadcast_shapes(*shapes.values()))
    except ValueError:
        described = ", ".join(f"{n} {s}" for n, s in shapes.items())
        msg = f"{', '.join(shapes)}: expected broadcastable batch dimensions, got {described}"
        raise InvalidArgument(msg) from None


def check_broadcastable_to(x: ArrayLike, name: str, target: tuple[int, ...]) -> None:
    shape = tuple(np.shape(x))
    try:
        ok = np.broadcast_shapes(shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        msg = f"{name}: expected a shape broadcastable to {target}, got {shape}"
        raise InvalidArgument(msg)


def positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        msg = f"{name}: expected a positive integer, got {value!r}"
        raise InvalidArgument(msg)
    return int(value)


def scale_value(scale: float | None, d_k: int, *, placement: str = "scores") -> float:
    """The softmax scale: ``1/sqrt(d_k)`` in float64 by default, else a finite number.

    Negative scales (PyTorch's SDPA tests use ``-1e4``) and zero are valid computations; with
    the scale split over ``q`` and ``k`` (``placement="qk"``) it must be ``>= 0`` (its square
    root is applied to both).
    """
    if scale is None:
        return 1.0 / float(np.sqrt(d_k))
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        msg = f"scale: expected None or a finite real number, got {scale!r}"
        raise InvalidArgument(msg)
    if not np.isfinite(scale):
        msg = f"scale: expected None or a finite real number, got {scale!r}"
        raise InvalidArgument(msg)
    if placement == "qk" and scale < 0:
        msg = (
            f"scale: expected a scale >= 0 with numerics.scale='qk' (sqrt(scale) is applied to q "
            f"and k), got {scale!r}"
        )
        raise InvalidArgument(msg)
    return float(scale)


def softcap_value(cap: float | None) -> float | None:
    """A logit soft-cap ``c`` (``c·tanh(s/c)``, Gemma 2's 50.0): ``None`` or a finite number > 0."""
    if cap is None:
        return None
    ok = isinstance(cap, (int, float, np.floating)) and not isinstance(cap, bool)
    if not ok or not np.isfinite(cap) or cap <= 0:
        msg = (
            f"softcap: expected a finite number > 0 (the cap c of c·tanh(s/c)) or None, got {cap!r}"
        )
        raise InvalidArgument(msg)
    return float(cap)


def descale_value(
    descale: Sequence[float] | None, placement: str = "scores"
) -> tuple[float, float, float] | None:
    """fp8 descale factors ``(d_q, d_k, d_v)``: ``None`` or three finite float32 numbers > 0.

    They multiply the scores' scale (``d_q·d_k``) and the output (``d_v``), as FlashAttention-3
    applies them; the scale must be on the scores.
    """
    if descale is None:
        return None
    try:
        values = tuple(descale)
    except TypeError:
        values = ()
    ok = len(values) == 3 and all(
        isinstance(x, (int, float, np.floating)) and not isinstance(x, bool) for x in values
    )
    if ok:
        floats = tuple(float(x) for x in values)
        with np.errstate(over="ignore"):  # a factor past float32's range is refused below
            ok = all(np.isfinite(x) and x > 0 and float(np.float32(x)) == x for x in floats)
    if not ok:
        msg = f"descale: expected three finite float32 numbers > 0 (d_q, d_k, d_v), got {descale!r}"
        raise InvalidArgument(msg)
    if placement != "scores":
        msg = (
            f"descale: expected numerics.scale='scores' (the factors join the scores' scale), "
            f"got {placement!r}"
        )
        raise InvalidArgument(msg)
    return floats  # type: ignore[return-value]
