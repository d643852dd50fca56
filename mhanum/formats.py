"""Floating-point formats as data, and exact rounding into them.

A :class:`Format` is a binary floating-point format described by its precision ``p`` (significand
bits, the implicit bit included), its exponent range ``[emin, emax]``, whether it has infinities and
its largest finite value. Everything else (unit roundoff, smallest normal and subnormal, the spacing
of the format at a value) follows.

:func:`round_to` rounds a numpy array into a format exactly: one correct rounding from the float64
value, never via an intermediate format. (Converting float64 to ``ml_dtypes.bfloat16`` through
float32 rounds twice, as ml_dtypes before 0.7 did: ``1 + 2**-8 + 2**-30`` becomes ``1.0`` instead
of ``1 + 2**-7``.)
The rounding is done on the bits of the carrier (float64 for numpy; float32 or float64 inside JAX),
so a compiler cannot elide it, and the same algorithm serves both.

Overflow follows IEEE 754 with an unbounded exponent: a value is rounded to ``p`` bits first, and
overflows if the rounded value exceeds the largest finite number. Round-to-nearest then gives
``inf`` (or NaN in ``float8_e4m3fn``, which has no infinity, as ``ml_dtypes`` does); round toward
zero gives the largest finite number.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mhanum._errors import InvalidArgument

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = ["FORMATS", "Format", "get_format", "representable", "round_to", "ulp"]

RoundingMode = Literal["nearest", "toward_zero"]
_MODES = ("nearest", "toward_zero")


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    Attributes:
        name: canonical name (``"float32"``, ``"bfloat16"``, ``"tf32"``, ...).
        precision: ``p``, the number of significand bits including the implicit bit.
        emin: exponent of the smallest normal number, ``2**emin``.
        emax: exponent of the largest binade.
        has_inf: whether the format represents infinities.
        max_finite: the largest finite value.
        storage: name of the numpy/JAX dtype that holds its values (``tf32`` is stored in float32).
    """

    name: str
    precision: int
    emin: int
    emax: int
    has_inf: bool
    max_finite: float
    storage: str

    @property
    def u(self) -> float:
        """Unit roundoff ``2**-p`` (round-to-nearest)."""
        return math.ldexp(1.0, -self.precision)

    @property
    def eps(self) -> float:
        """Machine epsilon ``2**(1-p)``, the spacing of the format at 1."""
        return math.ldexp(1.0, 1 - self.precision)

    @property
    def smallest_normal(self) -> float:
        """``2**emin``."""
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """``2**(emin - p + 1)``."""
        return math.ldexp(1.0, self.emin - self.precision + 1)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype that stores the format's values exactly."""
        return np.dtype(getattr(ml_dtypes, self.storage, None) or self.storage)

    @property
    def jax_dtype(self) -> np.dtype:
        """The JAX dtype that stores the format's values exactly."""
        return jnp.dtype(self.numpy_dtype)

    def __str__(self) -> str:
        return self.name


def _ieee(name: str, p: int, emin: int, emax: int, storage: str | None = None) -> Format:
    max_finite = math.ldexp(2.0 - math.ldexp(1.0, 1 - p), emax)
    return Format(name, p, emin, emax, True, max_finite, storage or name)


FORMATS: Mapping[str, Format] = {
    f.name: f
    for f in (
        _ieee("float64", 53, -1022, 1023),
        _ieee("float32", 24, -126, 127),
        _ieee("tf32", 11, -126, 127, storage="float32"),
        _ieee("bfloat16", 8, -126, 127),
        _ieee("float16", 11, -14, 15),
        Format("float8_e4m3fn", 4, -6, 8, False, 448.0, "float8_e4m3fn"),
        _ieee("float8_e5m2", 3, -14, 15),
    )
}
"""Every format mhanum knows, by canonical name."""

_ALIASES = {
    "fp64": "float64", "f64": "float64", "double": "float64",
    "fp32": "float32", "f32": "float32", "single": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8-e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2", "fp8-e5m2": "float8_e5m2",
}  # fmt: skip


def get_format(fmt: Format | str | Any, *, argname: str = "fmt") -> Format:
    """Look a format up by name, alias (``"bf16"``, ``"fp16"``, ...) or dtype.

    Args:
        fmt: a :class:`Format`, a name or alias, or a numpy/JAX/ml_dtypes dtype.
        argname: the argument name to quote in the error message.

    Raises:
        InvalidArgument: if the format is unknown.

    Examples:
        >>> get_format("bf16").precision
        8
        >>> get_format("float32").u == 2.0**-24
        True
    """
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        name = _ALIASES.get(fmt.lower(), fmt.lower())
    else:
        try:
            name = np.dtype(fmt).name
        except TypeError:
            name = repr(fmt)
    if name in FORMATS:
        return FORMATS[name]
    known = ", ".join(sorted(FORMATS))
    msg = f"{argname}: expected one of {known} (or an alias such as 'bf16'), got {fmt!r}"
    raise InvalidArgument(msg)


# The carrier is the float type the arithmetic runs in; rounding acts on its bits.
@dataclasses.dataclass(frozen=True)
class _Carrier:
    precision: int
    emin: int
    float_dtype: Any
    uint_dtype: Any


_CARRIERS = {
    "float64": _Carrier(53, -1022, np.float64, np.uint64),
    "float32": _Carrier(24, -126, np.float32, np.uint32),
}


def _round_bits(x: jax.Array, carrier: _Carrier, fmt: Format, mode: str) -> jax.Array:
    """Round the carrier array ``x`` into ``fmt`` inside JAX (:func:`round_jax`).

    In the normal range of ``fmt``, rounding to ``p`` bits is an integer operation on the carrier's
    bits (the carry out of the significand moves into the exponent, as it must). In the subnormal
    range the quantum is fixed, ``q = 2**(emin - p + 1)``, and ``|x|/q`` (an exact power-of-two
    scaling) is rounded to an integer. :func:`_round_in_place` is the same algorithm for numpy,
    step for step (``tests/test_formats.py`` checks the two agree on every bit pattern class).
    """
    drop = carrier.precision - fmt.precision
    if drop <= 0 and fmt.emin <= carrier.emin:
        return x
    uint = carrier.uint_dtype
    one = uint(1)
    drop_u = uint(drop)
    low = (one << drop_u) - one
    mag = jax.lax.bitcast_convert_type(jnp.abs(x), uint)
    if mode == "nearest":
        half_minus_one = (one << (drop_u - one)) - one
        mag = mag + half_minus_one + ((mag >> drop_u) & one)
    rounded = jax.lax.bitcast_convert_type(mag & ~low, carrier.float_dtype)

    if fmt.emin > carrier.emin:
        quantum = math.ldexp(1.0, fmt.emin - fmt.precision + 1)
        tiny = jnp.abs(x) < fmt.smallest_normal
        scaled = jnp.where(tiny, jnp.abs(x), 0) * carrier.float_dtype(1.0 / quantum)
        integral = jnp.round(scaled) if mode == "nearest" else jnp.trunc(scaled)
        rounded = jnp.where(tiny, integral * carrier.float_dtype(quantum), rounded)

    big = carrier.float_dtype(fmt.max_finite)
    if mode == "nearest":
        overflow = jnp.inf if fmt.has_inf else jnp.nan
        rounded = jnp.where(rounded > big, carrier.float_dtype(overflow), rounded)
    else:
        keep_inf = jnp.isinf(x) & fmt.has_inf
        rounded = jnp.where((rounded > big) & ~keep_inf, big, rounded)
        if not fmt.has_inf:
            rounded = jnp.where(jnp.isinf(x), carrier.float_dtype(jnp.nan), rounded)
    rounded = jnp.where(jnp.isnan(x), x, rounded)
    return jnp.copysign(rounded, x)


def _round_in_place(x: np.ndarray, fmt: Format, mode: str) -> np.ndarray:
    """:func:`_round_bits` for a float64 numpy array, in place on a fresh ``|x|``: the same steps
    and the same bits, with each rare case (a subnormal of ``fmt``, an overflow, a NaN) a pass
    over its own entries only. ``x`` itself is read, never written."""
    carrier = _CARRIERS["float64"]
    drop = carrier.precision - fmt.precision
    if drop <= 0 and fmt.emin <= carrier.emin:
        return x
    rounded = np.abs(x, out=np.empty_like(x))
    tiny = rounded < fmt.smallest_normal if fmt.emin > carrier.emin else None
    tiny_values = rounded[tiny] if tiny is not None and tiny.any() else None
    _round_significand(rounded.view(np.uint64), drop, mode)
    if tiny_values is not None:  # the subnormal range: a multiple of the quantum
        quantum = math.ldexp(1.0, fmt.emin - fmt.precision + 1)
        scaled = tiny_values * (1.0 / quantum)
        integral = np.round(scaled) if mode == "nearest" else np.trunc(scaled)
        rounded[tiny] = integral * quantum
    _overflow(rounded, x, fmt, mode)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = x[nan]
    np.copysign(rounded, x, out=rounded)
    return rounded if rounded.ndim else rounded[()]  # (a 0-d input: a scalar, as numpy gives)


def _round_significand(mag: np.ndarray, drop: int, mode: str) -> None:
    """Round the magnitudes' bits ``mag`` (uint64, in place) to ``53 - drop`` significant bits:
    to nearest with ties to even (add half an ulp less one, plus the kept last bit), or toward
    zero; the carry out of the significand moves into the exponent."""
    one, drop_u = np.uint64(1), np.uint64(drop)
    if mode == "nearest":
        carry = mag >> drop_u
        carry &= one
        carry += (one << (drop_u - one)) - one
        mag += carry
    mag &= ~((one << drop_u) - one)


def _overflow(rounded: np.ndarray, x: np.ndarray, fmt: Format, mode: str) -> None:
    """Past the largest finite number after rounding: ``inf`` to nearest (NaN without an
    infinity), the largest finite number toward zero (an infinite ``x`` stays infinite where
    ``fmt`` has infinities, NaN where it has none); in place on ``rounded``."""
    over = rounded > fmt.max_finite
    if mode == "nearest":
        if over.any():
            rounded[over] = np.inf if fmt.has_inf else np.nan
        return
    infinite = np.isinf(x)
    if fmt.has_inf:
        over &= ~infinite
    if over.any():
        rounded[over] = fmt.max_finite
    if not fmt.has_inf and infinite.any():
        rounded[infinite] = np.nan


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        msg = f"mode: expected one of {_MODES}, got {mode!r}"
        raise InvalidArgument(msg)


def _as_float64(x: ArrayLike, argname: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu" and arr.dtype.kind != "V" and not _is_ml_float(arr.dtype):
        msg = f"{argname}: expected a real numeric array, got dtype {arr.dtype}"
        raise InvalidArgument(msg)
    return arr.astype(np.float64)


def _is_ml_float(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.finfo(dtype)
    except (TypeError, ValueError):
        return False
    return True


def round_to(x: ArrayLike, fmt: Format | str, mode: RoundingMode = "nearest") -> np.ndarray:
    """Round ``x`` into ``fmt`` exactly, once, from its float64 value.

    Args:
        x: array-like of real numbers (any float dtype, ml_dtypes included); converted to float64
            exactly when it is a float array.
        fmt: target format (name, alias or :class:`Format`).
        mode: ``"nearest"`` (round to nearest, ties to even) or ``"toward_zero"`` (truncation, as
            tensor cores normalise).

    Returns:
        A float64 array of the same shape whose values are exactly representable in ``fmt``
        (or ±inf/NaN on overflow, as described in the module docstring).

    Raises:
        InvalidArgument: for an unknown format or mode, or a non-numeric ``x``.

    Examples:
        >>> float(round_to(1 + 2**-8 + 2**-30, "bfloat16"))  # above the midpoint: rounds up
        1.0078125
        >>> float(round_to(-1e9, "float16"))
        -inf
        >>> float(round_to(470.0, "float8_e4m3fn"))  # no infinity: overflow is NaN
        nan
    """
    _check_mode(mode)
    f = get_format(fmt)
    arr = _as_float64(x, "x")
    return _round_in_place(arr, f, mode)


def round_jax(x: jax.Array, fmt: Format | str, mode: RoundingMode = "nearest") -> jax.Array:
    """:func:`round_to` for a float32 or float64 JAX array, usable inside ``jax.jit``.

    The result has the dtype of ``x`` (the carrier). Rounding into a format at least as precise as
    the carrier, with no narrower exponent range, is the identity. A float32 carrier cannot hold
    float64 values: round float64 data with a float64 carrier.

    On XLA's CPU backend float32 arithmetic flushes subnormal results to zero; the rounding itself
    is integer arithmetic and does not, but values produced by float32 arithmetic around it may be
    flushed.
    """
    _check_mode(mode)
    f = get_format(fmt)
    dtype = jnp.dtype(x.dtype)
    if dtype.name not in _CARRIERS:
        msg = f"x: expected a float32 or float64 JAX array, got dtype {dtype}"
        raise InvalidArgument(msg)
    return _round_bits(x, _CARRIERS[dtype.name], f, mode)


def ulp(x: ArrayLike, fmt: Format | str) -> np.ndarray:
    """The spacing of ``fmt`` at ``x``: ``2**(max(e, emin) - p + 1)`` where ``2**e <= |x| < 2**(e+1)``.

    For ``|x|`` in the subnormal range (and 0) this is the smallest subnormal. Values of ``x`` above
    the format's range get the spacing of the top binade extended (``2**(e - p + 1)``); an
    infinite ``x`` gets ``inf`` (the spacing grows without bound) and NaN stays NaN.

    Examples:
        >>> float(ulp(1e9, "float32"))
        64.0
        >>> float(ulp(0.0, "float16")) == 2.0**-24
        True
        >>> ulp([np.inf, -np.inf, np.nan], "bfloat16").tolist()
        [inf, inf, nan]
    """
    f = get_format(fmt)
    arr = np.abs(_as_float64(x, "x"))
    _, e = np.frexp(arr)
    exponent = np.where(arr > 0, np.maximum(e - 1, f.emin), f.emin)
    spacing = np.ldexp(1.0, exponent - f.precision + 1)
    # |x| itself where it is inf or NaN; [()] keeps a scalar's result a numpy scalar
    result: np.ndarray = np.where(np.isfinite(arr), spacing, arr)[()]
    return result


def representable(x: ArrayLike, fmt: Format | str) -> np.ndarray:
    """Whether each finite value of ``x`` is exactly a value of ``fmt`` (infinities: if ``fmt`` has them)."""
    arr = _as_float64(x, "x")
    rounded = round_to(arr, fmt)
    return (rounded == arr) | (np.isinf(arr) & np.isinf(rounded))
