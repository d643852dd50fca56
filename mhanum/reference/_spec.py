"""The reference's options and the validated attention problem it computes: digits, precision, backend, the score's specification."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import mpmath
import numpy as np

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.params import MHAParams

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

_FULLY_MASKED = ("nan", "zero", "uniform")
BACKENDS = ("auto", "dd", "exact", "mpmath", "arb")
"""The backends, fastest first: see :func:`max_digits` and ``docs/performance.md``."""
MAX_DIGITS = 2000
_MIN_MAX_PREC = 64
# Bits beyond ceil(digits * log2(10)) at the starting working precision.
_GUARD_BITS = 32
# Bits beyond the working precision of the dyadic approximation of an irrational scale.
SCALE_GUARD_BITS = 64
# Bits of the scale approximation used only to choose each row's largest score.
ARGMAX_SCALE_BITS = 64

# A backend's computation at one working precision: mpf outputs (zeros in undefined rows) and a
# boolean array marking the rows (all axes but the last) that are undefined.
Compute = Callable[[mpmath.MPContext], tuple[np.ndarray, np.ndarray]]
# Whether the exact output at an index (of a defined row) is provably 0.
ExactZero = Callable[[tuple[int, ...]], bool]


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated keyword options shared by both public functions."""

    digits: int
    max_prec: int
    fully_masked: str
    backend: str
    return_mpf: bool


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """How scores become probabilities; the arrays have the full scores shape ``(..., Lq, Lk)``.

    Attributes:
        excluded: True where a key is excluded (``mask`` False or ``bias`` ``-inf``).
        bias: float64 bias with ``-inf`` replaced by 0, or ``None``.
        scale: the exact scale as ``(man, exp)``, or ``None`` for ``1/sqrt(d_k)``.
        d_k: the length of the score dot products.
        fully_masked: the fully-masked-row policy.
        softcap: the logit soft-cap ``c`` (``c·tanh(s/c)`` before the bias), or ``None``.
    """

    excluded: np.ndarray
    bias: np.ndarray | None
    scale: tuple[int, int] | None
    d_k: int
    fully_masked: str
    softcap: float | None = None


# --- validation --------------------------------------------------------------------------------


def check_options(
    digits: int, max_prec: int, fully_masked: str, backend: str, return_mpf: bool
) -> Options:
    if not _is_int(digits) or not 1 <= digits <= MAX_DIGITS:
        msg = f"digits: expected an integer in [1, {MAX_DIGITS}], got {digits!r}"
        raise InvalidArgument(msg)
    if not _is_int(max_prec) or max_prec < _MIN_MAX_PREC:
        msg = f"max_prec: expected an integer >= {_MIN_MAX_PREC}, got {max_prec!r}"
        raise InvalidArgument(msg)
    if max_prec < start_prec(int(digits)):
        msg = (
            f"max_prec: expected at least {start_prec(int(digits))} bits for digits={digits}, "
            f"got {max_prec}"
        )
        raise InvalidArgument(msg)
    if fully_masked not in _FULLY_MASKED:
        msg = f"fully_masked: expected one of 'nan', 'zero', 'uniform', got {fully_masked!r}"
        raise InvalidArgument(msg)
    if backend not in BACKENDS:
        msg = f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        raise InvalidArgument(msg)
    if not isinstance(return_mpf, (bool, np.bool_)):
        msg = f"return_mpf: expected a bool, got {return_mpf!r}"
        raise InvalidArgument(msg)
    return Options(int(digits), int(max_prec), fully_masked, backend, bool(return_mpf))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def start_prec(digits: int) -> int:
    """Starting working precision in bits for ``digits`` significant digits."""
    return math.ceil(digits * math.log2(10)) + _GUARD_BITS


def _float_array(x: ArrayLike, name: str, min_ndim: int) -> np.ndarray:
    """``x`` converted exactly to float64, after checking its dtype and rank."""
    return np.asarray(V.float_array(x, name, min_ndim=min_ndim)).astype(np.float64)


def _broadcast_to(x: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return np.broadcast_to(x, shape)
    except ValueError:
        msg = f"{name}: expected a shape broadcastable to {shape}, got {x.shape}"
        raise InvalidArgument(msg) from None


def check_scale(scale: object) -> tuple[int, int] | None:
    """The scale as an exact ``(man, exp)`` pair, or ``None`` for ``1/sqrt(d_k)``."""
    if scale is None:
        return None
    arr = np.asarray(scale)
    numeric = arr.dtype.kind in "iu" or V.is_exact_float_dtype(arr.dtype)
    if arr.ndim != 0 or not numeric or isinstance(scale, (bool, np.bool_)):
        msg = f"scale: expected None or a finite real number, got {scale!r}"
        raise InvalidArgument(msg)
    value = float(arr.astype(np.float64))
    if not math.isfinite(value) or (arr.dtype.kind in "iu" and int(arr) != value):
        msg = f"scale: expected None or a finite real number exact in float64, got {scale!r}"
        raise InvalidArgument(msg)
    return float_pair(value)


def score_spec(
    mask: masks.Band | ArrayLike | None,
    bias: ArrayLike | None,
    scale: tuple[int, int] | None,
    shape: tuple[int, ...],
    d_k: int,
    fully_masked: str,
    softcap: float | None = None,
) -> ScoreSpec:
    """Check ``mask``, ``bias`` and ``softcap`` against the scores ``shape`` and combine them."""
    excluded = ~np.asarray(masks.dense(masks.normalise(mask, shape), shape))
    bias64 = None
    if bias is not None:
        bias_arr = _float_array(bias, "bias", 0)
        V.check_finite(bias_arr, "bias", allow_neg_inf=True)
        bias_arr = _broadcast_to(bias_arr, "bias", shape)
        excluded = excluded | np.isneginf(bias_arr)
        bias64 = np.where(np.isneginf(bias_arr), 0.0, bias_arr)
    return ScoreSpec(excluded, bias64, scale, d_k, fully_masked, V.softcap_value(softcap))


def sink_row(x_kv: np.ndarray, params: MHAParams) -> tuple[np.ndarray, MHAParams]:
    """The sink's key and value, exactly zero after the projections, as one more row of x_kv:
    a new input column (0 for the real rows, 1 for the sink's) whose weight row is ``-b_k``
    (``-b_v``), so the sink projects to ``1·(-b) + b = 0`` and the real rows to what they did
    (exact arithmetic: the reference computes the projections exactly)."""
    lead = x_kv.shape[:-2]
    real = np.concatenate([x_kv, np.zeros((*lead, x_kv.shape[-2], 1))], axis=-1)
    row = np.zeros((*lead, 1, x_kv.shape[-1] + 1))
    row[..., -1] = 1.0
    extra = {}
    for w, b in (("wk", "bk"), ("wv", "bv")):
        bias = getattr(params, b)
        width = np.shape(getattr(params, w))[1]
        minus = np.zeros(width) if bias is None else -np.asarray(bias, np.float64)
        extra[w] = np.vstack([np.asarray(getattr(params, w), np.float64), minus[None]])
    return np.concatenate([real, row], axis=-2), dataclasses.replace(params, **extra)


def params_float64(params: MHAParams) -> MHAParams:
    """The parameters with every array converted (exactly) to a numpy float64 array."""
    converted = {
        f.name: np.asarray(value).astype(np.float64)
        for f in dataclasses.fields(params)
        if (value := getattr(params, f.name)) is not None
    }
    return dataclasses.replace(params, **converted)


def float_pair(x: float) -> tuple[int, int]:
    """A float64 as an exact ``(man, exp)`` pair."""
    mant, exp = math.frexp(float(x))
    return int(math.ldexp(mant, 53)), exp - 53


# --- the scale ---------------------------------------------------------------------------------


def scale_dyadic(spec: ScoreSpec, bits: int) -> tuple[int, int]:
    """The scale as ``(man, exp)``, exact or truncated to ``bits`` fraction bits.

    A given scale is exact, and so is ``1/sqrt(d_k)`` when ``d_k`` is a power of 4; otherwise
    ``isqrt(4**bits // d_k) * 2**-bits`` is below ``1/sqrt(d_k)`` by less than ``2**-bits``.
    """
    if spec.scale is not None:
        return spec.scale
    return math.isqrt((1 << (2 * bits)) // spec.d_k), -bits
