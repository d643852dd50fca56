"""A quantized KV cache as a numerical stage: the value, its emulation and the bound on the
entries the attention reads (papers/kvcache.md, Theorem K.1).

A :class:`KVQuant` states how a kernel stores K or V: the cache format (``float8_e4m3fn``,
``float8_e5m2`` or ``int8``), the granularity of its scales (one per tensor, per head, per token,
or per token and head), the scales themselves (given, or computed dynamically from the absolute
maximum, ``absmax / divisor``), how the kernel divides by them (a correctly rounded division, or
a product by the rounded reciprocal: both are covered), and where the scale is applied when the
cache is read: on the operand before the dot (``"operand"``: ``ŝ·c`` rounded into
``dequant_format``) or on the dot's result (``"accumulator"``: FlashInfer folds the K scale into
the softmax scale and multiplies its output by the V scale).

* :func:`quantize` stores ``x`` as the kernel does: codes and scales;
* :func:`dequantize` reads the codes back as the operand placement does;
* :func:`kv_error` bounds ``|x̂ - x|`` entry by entry (Theorem K.1), for every kernel that
  stores and reads as the :class:`KVQuant` states: the entries' errors that Theorem A.1 takes as
  its operands' errors (step 1). Under the accumulator placement (one scale per tensor) the
  attention is that of the codes with the scales as an fp8 descale, and Corollary K.2 takes
  K.1 over the scale as the codes' errors (:meth:`KVQuant.accumulated`).

Examples:
    >>> import numpy as np
    >>> q = KVQuant("float8_e4m3fn", granularity="token")
    >>> x = np.array([[[0.1, -3.0, 7.5, 1e-3]]])  # (heads, tokens, d)
    >>> codes, scales = quantize(x, q)
    >>> bool(np.all(np.abs(dequantize(codes, scales, q) - x) <= kv_error(x, q)))
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.formats import Format, get_format, round_to

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = [
    "GRANULARITIES",
    "KV_FORMATS",
    "PLACEMENTS",
    "KVQuant",
    "dequantize",
    "kv_error",
    "quantize",
    "scales",
]

KV_FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8")
GRANULARITIES = ("tensor", "head", "token", "token_head")
PLACEMENTS = ("operand", "accumulator")
_INT8_MAX = 127.0
_U64 = 2.0**-53


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How a kernel stores K or V in a quantized cache, and reads it back (papers/kvcache.md, K.0).

    Attributes:
        format: the cache format, one of :data:`KV_FORMATS`.
        granularity: one scale per ``"tensor"``, per ``"head"``, per ``"token"`` (over every
            head) or per ``"token_head"``; the cache is shaped ``(..., heads, tokens, d)``.
        scale: the scales, given (a positive finite number, or an array broadcastable to the
            granularity's shape ``(..., heads, tokens, 1)`` with 1 where the scale is shared),
            or ``None`` for dynamic scales ``absmax / divisor`` over each scale's entries
            (1 where they are all zero).
        divisor: the dynamic scale's divisor (default: the format's largest finite value, 448
            for ``float8_e4m3fn``, 57344 for ``float8_e5m2``, 127 for ``int8``).
        scale_format: the format the scales are computed and stored in.
        dequant_format: the format ``ŝ·c`` is rounded into when the operand placement reads it.
        placement: ``"operand"`` or ``"accumulator"`` (see the module docstring).
        saturate: whether an fp8 code beyond the format's range is clamped to its largest
            finite value (as vLLM's conversion does); without it such a code is NaN or inf and
            the bound is infinite there. int8 codes are always clamped to ``[-127, 127]``.
    """

    format: str
    granularity: str = "tensor"
    scale: Any = None
    divisor: float | None = None
    scale_format: Format | str = "float32"
    dequant_format: Format | str = "float32"
    placement: str = "operand"
    saturate: bool = True

    def __post_init__(self) -> None:
        if self.format not in KV_FORMATS:
            msg = f"kv_cache.format: expected one of {', '.join(KV_FORMATS)}, got {self.format!r}"
            raise InvalidArgument(msg)
        if self.granularity not in GRANULARITIES:
            msg = (
                f"kv_cache.granularity: expected one of {', '.join(GRANULARITIES)}, "
                f"got {self.granularity!r}"
            )
            raise InvalidArgument(msg)
        if self.placement not in PLACEMENTS:
            msg = f"kv_cache.placement: expected 'operand' or 'accumulator', got {self.placement!r}"
            raise InvalidArgument(msg)
        for name in ("scale_format", "dequant_format"):
            object.__setattr__(
                self, name, get_format(getattr(self, name), argname=f"kv_cache.{name}")
            )
        if self.divisor is not None and not (
            isinstance(self.divisor, int | float)
            and math.isfinite(self.divisor)
            and self.divisor > 0
        ):
            msg = f"kv_cache.divisor: expected a finite positive number, got {self.divisor!r}"
            raise InvalidArgument(msg)
        if self.scale is not None:
            try:
                s = np.asarray(self.scale, dtype=np.float64)
            except (TypeError, ValueError):
                msg = f"kv_cache.scale: expected positive finite scales, got {self.scale!r}"
                raise InvalidArgument(msg) from None
            if s.size == 0 or not np.all(np.isfinite(s)) or np.any(s <= 0):
                msg = (
                    "kv_cache.scale: expected positive finite scales (a zero or non-finite scale "
                    f"makes every code NaN or inf), got {self.scale!r}"
                )
                raise InvalidArgument(msg)

    @property
    def code_max(self) -> float:
        """The largest code: the fp8 format's largest finite value, or 127."""
        return _INT8_MAX if self.format == "int8" else get_format(self.format).max_finite

    def read(self, x: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """What an attention reads of ``x`` (``(..., tokens, d)``; without a heads axis, one
        head) stored in this cache, and Theorem K.1's bound on its distance to ``x``: under the
        operand placement ``fl(ŝ·c)`` in ``dequant_format``; under the accumulator placement
        ``ŝ·c`` exactly (float64 holds the product of a scale and a code), the value the
        kernel's dot attends once its result is multiplied by the scale."""
        shaped = _heads_axis(x)
        codes, s = quantize(shaped, self)
        # a scale past the scale format's range is inf, and a zero code times it NaN, as the
        # kernel reads it; the bound there is inf (kv_error), and the range checks say why
        with np.errstate(invalid="ignore", over="ignore"):
            read = dequantize(codes, s, self) if self.placement == "operand" else codes * s
        shape = np.shape(np.asarray(x, np.float64))
        return read.reshape(shape), kv_error(shaped, self).reshape(shape)

    def accumulated(self, x: ArrayLike) -> tuple[np.ndarray, float, np.ndarray]:
        """The accumulator placement (papers/kvcache.md, K.0 item 3) as an attention computes
        it: the codes its dot reads (float64, shaped as ``x``), the one scale it multiplies the
        dot's result by (K: into the scores' constant, V: the output), and Theorem K.1's bound
        on ``|ŝ·c - x|``.

        Raises:
            InvalidArgument: for the operand placement, or a granularity other than
                ``"tensor"`` (a scale per head or token does not factor out of the dot as
                one number).
        """
        if self.placement != "accumulator" or self.granularity != "tensor":
            msg = (
                "kv_cache: expected placement='accumulator' with granularity='tensor' (one "
                "scale multiplies the dot's result), got "
                f"placement={self.placement!r}, granularity={self.granularity!r}"
            )
            raise InvalidArgument(msg)
        shaped = _heads_axis(x)
        codes, s = quantize(shaped, self)
        shape = np.shape(np.asarray(x, np.float64))
        return codes.reshape(shape), float(np.ravel(s)[0]), kv_error(shaped, self).reshape(shape)

    @property
    def accumulator_rounding(self) -> float:
        """The relative rounding the accumulator placement adds to the dot's result (the product
        by the scale in ``scale_format``); 0 under the operand placement."""
        return self.scale_format.u if self.placement == "accumulator" else 0.0  # type: ignore[union-attr]


def _fmt(q: KVQuant, name: str) -> Format:
    f = getattr(q, name)
    assert isinstance(f, Format)
    return f


def _heads_axis(x: ArrayLike) -> np.ndarray:
    """``x`` as float64, with a heads axis in front where it has none (one head)."""
    values = np.asarray(x, np.float64)
    return values if values.ndim >= 3 else values.reshape((1,) * (3 - values.ndim) + values.shape)


def _reduce_axes(x: np.ndarray, granularity: str) -> tuple[int, ...]:
    """The axes a scale is shared over, for ``x`` shaped ``(..., heads, tokens, d)``."""
    nd = x.ndim
    return {
        "tensor": tuple(range(nd)),
        "head": (nd - 2, nd - 1),
        "token": (nd - 3, nd - 1),
        "token_head": (nd - 1,),
    }[granularity]


def _check_x(x: ArrayLike) -> np.ndarray:
    """``x`` as float64 values shaped ``(..., heads, tokens, d)``, finite."""
    try:
        values = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        msg = f"x: expected a real array, got {type(x).__name__}"
        raise InvalidArgument(msg) from None
    if values.ndim < 3:
        msg = f"x: expected a cache shaped (..., heads, tokens, d), got shape {values.shape}"
        raise InvalidArgument(msg)
    if not np.all(np.isfinite(values)):
        msg = "x: expected finite values"
        raise InvalidArgument(msg)
    return values


def scales(x: ArrayLike, q: KVQuant) -> np.ndarray:
    """The scales ``ŝ`` the kernel stores, broadcastable against ``x``: given, or
    ``fl(absmax / divisor)`` in ``scale_format`` (1 where the absmax is 0)."""
    values = _check_x(x)
    axes = _reduce_axes(values, q.granularity)
    shape = tuple(1 if i in axes else n for i, n in enumerate(values.shape))
    fs = _fmt(q, "scale_format")
    if q.scale is not None:
        given = round_to(np.asarray(q.scale, np.float64), fs)
        try:
            return np.broadcast_to(given, shape).copy()
        except ValueError:
            msg = (
                f"kv_cache.scale: expected scales broadcastable to {shape} (granularity "
                f"{q.granularity!r}), got shape {np.shape(q.scale)}"
            )
            raise InvalidArgument(msg) from None
    absmax = np.max(np.abs(values), axis=axes, keepdims=True)
    divisor = q.divisor if q.divisor is not None else q.code_max
    s = round_to(round_to(absmax, fs) / float(round_to(np.float64(divisor), fs)), fs)
    return np.where(s > 0, s, 1.0)


def quantize(x: ArrayLike, q: KVQuant) -> tuple[np.ndarray, np.ndarray]:
    """The codes and scales a kernel stores for ``x`` (float64 carriers): ``c = fl_c(x / ŝ)``,
    the quotient correctly rounded in ``scale_format``, fp8 codes saturated (``q.saturate``),
    int8 codes rounded half to even and clamped to ``[-127, 127]``."""
    values = _check_x(x)
    s = scales(values, q)
    y = round_to(values / s, _fmt(q, "scale_format"))
    top = q.code_max
    if q.format == "int8":
        return np.clip(np.rint(y), -top, top), s
    if q.saturate:
        y = np.clip(y, -top, top)
    return round_to(y, q.format), s


def dequantize(codes: ArrayLike, s: ArrayLike, q: KVQuant) -> np.ndarray:
    """``fl(ŝ·c)`` in ``dequant_format``: the operand the dot reads under the operand placement."""
    return round_to(
        np.asarray(codes, np.float64) * np.asarray(s, np.float64), _fmt(q, "dequant_format")
    )


def kv_error(x: ArrayLike, q: KVQuant) -> np.ndarray:
    """Theorem K.1: a bound on ``|x̂ - x|`` entry by entry for every kernel that stores and
    reads ``x`` as ``q`` states (the quotient correctly rounded or a product by the rounded
    reciprocal; under the accumulator placement ``x̂ = ŝ·c`` exactly, its rounding being the
    dot's, :attr:`KVQuant.accumulator_rounding`).

    Per entry, with ``y = x/ŝ`` and ``y'`` the computed quotient (``|y' - y| <= γ₂|y|`` in the
    scale format, plus its underflow), the code's error ``|c - y'|`` is the format's rounding
    (``u_c|y'| + η_c``; int8: 1/2; never more than ``|y'|``, 0 being a code) plus what
    saturation clips (``max(|y'| - max, 0)``), and
    ``|ŝc - x| = ŝ(|c - y'| + |y' - y|)``; the operand placement adds the product's rounding.
    An fp8 code that may overflow without saturation is infinite.
    """
    values = _check_x(x)
    s = scales(values, q)
    fs = _fmt(q, "scale_format")
    y = np.abs(values) / s
    gamma2 = 2 * fs.u / (1 - 2 * fs.u)
    y_hi = y * (1 + gamma2) + 2 * fs.smallest_normal  # >= |y'|
    d_quot = gamma2 * y + 2 * fs.smallest_normal  # >= |y' - y|
    top = q.code_max
    clipped = np.maximum(y_hi - top, 0.0)
    if q.format == "int8":
        d_code = np.minimum(0.5, y_hi) + clipped  # 0 is a code: |c - y'| <= |y'|
        c_hi = np.minimum(y_hi + 0.5, top)  # >= |c|
    else:
        fc = get_format(q.format)
        d_code = np.minimum(fc.u * np.minimum(y_hi, top) + fc.smallest_normal, y_hi) + clipped
        c_hi = np.minimum(y_hi * (1 + fc.u) + fc.smallest_normal, top)
        if not q.saturate:
            # without saturation, a quotient past the largest finite code rounds to NaN or inf
            d_code = np.where(y_hi >= top * (1 + fc.u), np.inf, d_code)
    err = s * (d_code + d_quot)
    if q.placement == "operand":
        fd = _fmt(q, "dequant_format")
        err = err + fd.u * s * c_hi + fd.smallest_normal
    return err * (1 + 4 * _U64)
