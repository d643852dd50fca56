"""Exact arithmetic on arrays of dyadic rationals, for :mod:`mhanum.reference`.

Every binary floating-point number is a dyadic rational ``m * 2**e``, so sums and products of the
inputs of attention are dyadic rationals too and can be computed without any rounding. This module
holds the two array representations the reference computes with and the operations on them:

* :class:`Dyadic`: an exact array with one exponent, ``ints * 2**exp`` (``ints`` an object array of
  Python integers). Inputs, weights, projections and scores are exact ``Dyadic`` arrays.
* :class:`Floating`: an array with one exponent per element, ``man * 2**exp``. Probabilities and
  everything computed from them live here, because ``exp(-1000)`` and ``1`` can sit in one row.

Products of integer matrices are computed without a Python-level loop per multiply-add, by
Ozaki-style splitting: each integer matrix is split (sign and magnitude) into digit matrices of
``beta`` bits with ``n * 2**(2*beta) <= 2**53`` for inner dimension ``n``, so every product of two
digit matrices is an integer matrix below ``2**53`` in magnitude whatever the summation order, and
``numpy.matmul`` on float64 computes it exactly. The digit products are gathered by digit weight in
int64 and recombined with shifts on Python integers.

A row of a :class:`Floating` matrix of rounded numbers (probabilities) is multiplied in fixed point
relative to its largest entry (:func:`rows_matmul`). Entries too small for the fixed-point window
(the *tail*) are dropped only where a bound proves their contribution below ``2**-prec`` of the
result; elsewhere the element is summed exactly, term by term (:func:`sum_exact`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import mpmath

__all__ = [
    "Dyadic",
    "Floating",
    "add",
    "concatenate",
    "matmul",
    "mpf_pair",
    "round_shift",
    "rows_matmul",
    "sum_exact",
    "to_float64",
]

_FLOAT64_MANTISSA_BITS = 53
# Products of digit matrices are below 2**53, so 1024 of them add up in int64 without overflow.
_INT64_TERMS = 1 << (63 - _FLOAT64_MANTISSA_BITS)
# Fixed-point bits kept below a row's largest entry, beyond the working precision.
_WINDOW_GUARD_BITS = 48
# ldexp exponents are clamped here: a value of 2**1000 or more has no bits below 2**947.
_LDEXP_CLAMP = 1000
# Relative size, beyond the working precision, below which sum_exact drops the remaining terms.
_SUM_GUARD_BITS = 8

_bit_length = np.frompyfunc(lambda n: int(n).bit_length(), 1, 1)


def round_shift(man: int, shift: int) -> int:
    """``man * 2**shift`` rounded to the nearest integer (halfway cases upward)."""
    if shift >= 0:
        return man << shift
    return (man + (1 << (-shift - 1))) >> -shift


_round_shift_array = np.frompyfunc(round_shift, 2, 1)


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    """An object array of Python integer zeros."""
    return np.zeros(shape, dtype=np.int64).astype(object)


class Dyadic:
    """An exact array ``ints * 2**exp`` with one exponent for the whole array.

    Built from float64 values (:meth:`from_float64`), a ``Dyadic`` keeps them and splits them into
    digits with float operations only; its integers are made when first needed.

    Args:
        exp: the exponent shared by all elements.
        ints: object array of Python integers, or ``None`` when ``floats`` is given.
        floats: float64 array equal to ``ints * 2**exp`` exactly, or ``None``.
    """

    def __init__(
        self, exp: int, *, ints: np.ndarray | None = None, floats: np.ndarray | None = None
    ) -> None:
        self.exp = exp
        self._floats = floats
        self._ints = ints
        self._digits: dict[int, list[np.ndarray]] = {}

    @classmethod
    def from_float64(cls, x: np.ndarray) -> Dyadic:
        """The exact value of a finite float64 array, with the coarsest common exponent."""
        x = np.asarray(x, dtype=np.float64)
        mant, ex = np.frexp(x)
        ints53 = np.ldexp(mant, _FLOAT64_MANTISSA_BITS).astype(np.int64)
        lowest = np.log2((ints53 & -ints53)[ints53 != 0].astype(np.float64)).astype(np.int64)
        lsb = ex[ints53 != 0] - _FLOAT64_MANTISSA_BITS + lowest
        exp = int(lsb.min()) if lsb.size else 0
        return cls(exp, floats=x)

    @property
    def ints(self) -> np.ndarray:
        """The integers ``value * 2**-exp`` (object array of Python ints), made on first use."""
        if self._ints is None:
            self._ints = self._ints_from_floats()
        return self._ints

    def _ints_from_floats(self) -> np.ndarray:
        assert self._floats is not None
        mant, ex = np.frexp(self._floats)
        ints53 = np.ldexp(mant, _FLOAT64_MANTISSA_BITS).astype(np.int64)
        shift = ex.astype(np.int64) - _FLOAT64_MANTISSA_BITS - self.exp
        right = np.where(ints53 == 0, 0, np.maximum(-shift, 0))
        left = np.where(ints53 == 0, 0, np.maximum(shift, 0))
        return (ints53 >> right).astype(object) << left.astype(object)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the array."""
        source = self._floats if self._floats is not None else self.ints
        return tuple(source.shape)

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> Dyadic:
        """Apply a shape operation (reshape, transpose, indexing) to the elements."""
        if self._floats is not None:
            return Dyadic(self.exp, floats=fn(self._floats))
        return Dyadic(self.exp, ints=fn(self.ints))

    def bit_length(self) -> int:
        """Bits of the largest integer magnitude (0 for an all-zero or empty array)."""
        if self._floats is not None:
            nonzero = self._floats[self._floats != 0]
            if not nonzero.size:
                return 0
            return int(np.frexp(np.abs(nonzero).max())[1]) - self.exp
        if not self.ints.size:
            return 0
        return int(np.abs(self.ints).max()).bit_length()

    def digits(self, beta: int) -> list[np.ndarray]:
        """Signed base-``2**beta`` digits as float64 arrays, least significant first."""
        if beta not in self._digits:
            count = -(-self.bit_length() // beta)
            if self._floats is not None:
                self._digits[beta] = _float_digits(self._floats, self.exp, beta, count)
            else:
                self._digits[beta] = _int_digits(self.ints, beta, count)
        return self._digits[beta]

    def abs_max(self, axis: int) -> np.ndarray:
        """Largest integer magnitude along ``axis`` (object array of Python ints)."""
        return np.abs(self.ints).max(axis=axis, initial=0)


def _float_digits(x: np.ndarray, exp: int, beta: int, count: int) -> list[np.ndarray]:
    """Digits of ``x * 2**-exp`` computed in float64 (exact: floor, fmod and ldexp are exact)."""
    mant, ex = np.frexp(np.abs(x))
    radix = float(1 << beta)
    digits = []
    for index in range(count):
        shift = np.minimum(ex.astype(np.int64) - exp - beta * index, _LDEXP_CLAMP)
        digit = np.fmod(np.floor(np.ldexp(mant, shift)), radix)
        digits.append(np.copysign(digit, x))
    return digits


def _int_digits(ints: np.ndarray, beta: int, count: int) -> list[np.ndarray]:
    """Digits of an object array of integers, peeled off in int64 chunks of whole digits."""
    negative = ints < 0
    magnitude = np.abs(ints)
    per_chunk = 62 // beta
    chunk_mask = (1 << (beta * per_chunk)) - 1
    digit_mask = (1 << beta) - 1
    digits: list[np.ndarray] = []
    while len(digits) < count:
        chunk = (magnitude & chunk_mask).astype(np.int64)
        magnitude = magnitude >> (beta * per_chunk)
        for index in range(min(per_chunk, count - len(digits))):
            digit = ((chunk >> (beta * index)) & digit_mask).astype(np.float64)
            digits.append(np.where(negative, -digit, digit))
    return digits


def _digit_bits(n: int) -> int:
    """Digit size ``beta`` with ``n * 2**(2*beta) <= 2**53`` for inner dimension ``n``."""
    return (_FLOAT64_MANTISSA_BITS - max(n - 1, 0).bit_length()) // 2


def matmul(a: Dyadic, b: Dyadic) -> Dyadic:
    """The exact product ``a @ b`` (``numpy.matmul`` broadcasting of leading dimensions)."""
    beta = _digit_bits(a.shape[-1])
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    a_digits, b_digits = a.digits(beta), b.digits(beta)
    total = _zeros(shape)
    for start in range(0, len(b_digits) if a_digits else 0, _INT64_TERMS):
        block = _digit_products(a_digits, b_digits[start : start + _INT64_TERMS], shape)
        total = total + (_horner(block, beta) << (beta * start))
    return Dyadic(a.exp + b.exp, ints=total)


def _digit_products(
    a_digits: list[np.ndarray], b_digits: list[np.ndarray], shape: tuple[int, ...]
) -> list[np.ndarray]:
    """Sums of digit-matrix products by digit weight ``i + j``, in int64 (at most 1024 terms)."""
    by_weight = [np.zeros(shape, dtype=np.int64) for _ in range(len(a_digits) + len(b_digits) - 1)]
    stacked = np.stack(a_digits)
    for j, b_digit in enumerate(b_digits):
        products = _stacked_matmul(stacked, b_digit).astype(np.int64)
        for i, product in enumerate(products):
            by_weight[i + j] += product
    return by_weight


def _stacked_matmul(stacked: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``stacked[i] @ b`` for every ``i``; one BLAS call when ``b`` is a matrix."""
    if b.ndim == 2:
        flat = stacked.reshape(-1, b.shape[0]) @ b
        return flat.reshape((*stacked.shape[:-1], b.shape[1]))
    return np.matmul(stacked, b)


def _horner(by_weight: list[np.ndarray], beta: int) -> np.ndarray:
    """``sum_s by_weight[s] * 2**(beta*s)`` as Python integers (``by_weight`` not empty)."""
    total = by_weight[-1].astype(object)
    for part in reversed(by_weight[:-1]):
        total = (total << beta) + part.astype(object)
    return total


def add(a: Dyadic, b: Dyadic) -> Dyadic:
    """The exact sum ``a + b`` (numpy broadcasting)."""
    exp = min(a.exp, b.exp)
    return Dyadic(exp, ints=(a.ints << (a.exp - exp)) + (b.ints << (b.exp - exp)))


def concatenate(arrays: list[Dyadic], axis: int) -> Dyadic:
    """The arrays joined along ``axis`` (shapes as for ``numpy.concatenate``)."""
    exp = min(a.exp for a in arrays)
    return Dyadic(exp, ints=np.concatenate([a.ints << (a.exp - exp) for a in arrays], axis=axis))


class Floating:
    """An exact array with one exponent per element, ``man * 2**exp`` (object arrays).

    Args:
        man: object array of Python integers.
        exp: object array of Python integers, the same shape as ``man``.
    """

    def __init__(self, man: np.ndarray, exp: np.ndarray) -> None:
        self.man = man
        self.exp = exp

    @classmethod
    def from_float64(cls, x: np.ndarray) -> Floating:
        """The exact elementwise value of a finite float64 array."""
        mant, ex = np.frexp(np.asarray(x, dtype=np.float64))
        man = np.ldexp(mant, _FLOAT64_MANTISSA_BITS).astype(np.int64).astype(object)
        return cls(man, (ex.astype(np.int64) - _FLOAT64_MANTISSA_BITS).astype(object))

    @classmethod
    def from_mpf(cls, values: np.ndarray) -> Floating:
        """The exact values of an object array of mpf numbers (finite)."""
        man = np.empty(values.shape, dtype=object)
        exp = np.empty(values.shape, dtype=object)
        for index, value in np.ndenumerate(values):
            man[index], exp[index] = mpf_pair(value)
        return cls(man, exp)

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> Floating:
        """Apply a shape operation (reshape, transpose, broadcast, indexing) to the elements."""
        return Floating(fn(self.man), fn(self.exp))

    def pair(self, index: int | tuple[int, ...]) -> tuple[int, int]:
        """The element at ``index`` as ``(man, exp)``."""
        return self.man[index], self.exp[index]


def rows_matmul(x: Floating, w: Dyadic, *, prec: int) -> Floating:
    """``x @ w`` to a relative error of about ``2**-prec`` per element, for any magnitudes in ``x``.

    Each row of ``x`` is rounded to fixed point with ``prec + 48`` bits below its largest entry and
    multiplied exactly. Meant for an ``x`` of rounded numbers (probabilities at the working
    precision), whose rounding again adds an error that shrinks as ``prec`` grows; exact values
    that can cancel later must not go through it. The entries below the window (the tail)
    contribute less than ``count * 2**lsb * max|w|`` to an output element; where that bound is not
    below ``2**-prec`` of the computed element (heavy cancellation), the element is summed exactly.

    Args:
        x: ``(..., m, n)``.
        w: ``(..., n, c)``, leading dimensions broadcastable with those of ``x``.
        prec: working precision in bits.

    Returns:
        ``(..., m, c)``: the product.
    """
    fixed, lsb, tail = _fixed_rows(x, prec + _WINDOW_GUARD_BITS)
    product = matmul(Dyadic(0, ints=fixed), w).ints
    exp = np.broadcast_to((lsb + w.exp)[..., None], product.shape).astype(object)
    if tail.any():
        bound = (tail[..., None] * w.abs_max(axis=-2)[..., None, :]) << prec
        for index in zip(*np.nonzero(np.abs(product) < bound), strict=True):
            product[index], exp[index] = _exact_element(x, w, index, prec)
    return Floating(product, exp)


def _fixed_rows(x: Floating, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round each row to multiples of ``2**lsb``, ``lsb`` being ``bits`` below the row's top bit.

    Returns:
        ``(ints, lsb, tail)``: the rounded integers (entries below ``2**lsb`` set to zero), the
        exponent ``lsb`` of each row, and the number of nonzero entries so dropped in each row.
    """
    nonzero = x.man != 0
    if not nonzero.any():
        return _zeros(x.man.shape), _zeros(x.man.shape[:-1]), np.zeros(x.man.shape[:-1], int)
    top = x.exp + _bit_length(x.man)
    floor = min(top[nonzero]) - bits - 1
    top = np.where(nonzero, top, floor)
    lsb = top.max(axis=-1) - bits
    window = nonzero & (top > lsb[..., None])
    shift = np.where(window, x.exp - lsb[..., None], 0)
    ints = np.asarray(_round_shift_array(np.where(window, x.man, 0), shift))
    tail = np.asarray((nonzero & ~window).sum(axis=-1))
    return ints, lsb, tail


def _exact_element(x: Floating, w: Dyadic, index: tuple[int, ...], prec: int) -> tuple[int, int]:
    """Element ``index`` of ``x @ w`` (batch dimensions broadcast), summed exactly term by term."""
    *batch, row, col = index
    batch_shape = np.broadcast_shapes(x.man.shape[:-2], w.shape[:-2])
    x_row = x.map(lambda a: np.broadcast_to(a, batch_shape + a.shape[-2:])[(*batch, row)])
    w_col = np.broadcast_to(w.ints, batch_shape + w.shape[-2:])[tuple(batch)][:, col]
    terms = (
        (man * w_man, exp + w.exp)
        for man, exp, w_man in zip(x_row.man, x_row.exp, w_col, strict=True)
    )
    return sum_exact(terms, prec)


def sum_exact(terms: Iterable[tuple[int, int]], prec: int | None = None) -> tuple[int, int]:
    """The exact sum of dyadic terms ``man * 2**exp``, or within a relative ``2**-(prec+8)``.

    The terms are added exactly in decreasing order of magnitude. With ``prec`` given, once the
    terms left could not change the sum by ``2**-(prec+8)`` of itself (each is smaller than the
    current one, so they total less than ``count * 2**top``), they are dropped; this bounds the
    work when magnitudes differ by astronomically many bits (``exp(-1e30)`` next to 1). The terms
    added are summed exactly, so cancellation among the large ones never loses the small ones.
    (``mpmath.fsum`` and ``mpmath.fdot`` drop a term more than ``2*prec`` bits below the running
    sum even if the sum later cancels: ``fsum([1, 2**-1000, -1])`` is 0 at 100 and at 200 bits.)

    Args:
        terms: pairs ``(man, exp)`` of Python integers.
        prec: working precision in bits, or ``None`` for an exact sum.

    Returns:
        ``(man, exp)`` of the sum.
    """
    ordered = sorted(
        ((man, exp, exp + abs(man).bit_length()) for man, exp in terms if man),
        key=lambda term: term[2],
        reverse=True,
    )
    total, total_exp = 0, 0
    for index, (man, exp, top) in enumerate(ordered):
        if not total:
            total, total_exp = man, exp
            continue
        if prec is not None:
            left = (len(ordered) - index).bit_length()
            if top + left <= total_exp + abs(total).bit_length() - prec - _SUM_GUARD_BITS - 1:
                break
        if exp >= total_exp:
            total += man << (exp - total_exp)
        else:
            total, total_exp = (total << (total_exp - exp)) + man, exp
    return total, total_exp


def mpf_pair(x: mpmath.mpf) -> tuple[int, int]:
    """A finite mpf as an exact pair ``(man, exp)`` with a signed mantissa.

    (``mpf.man_exp`` returns the magnitude of the mantissa: the sign is dropped.)
    """
    man, exp = x.man_exp
    return (-int(man) if x < 0 else int(man)), int(exp)


def to_float64(man: int, exp: int) -> float:
    """``man * 2**exp`` correctly rounded to float64 (nearest, ties to even; ``inf`` past the range).

    Python's integer true division rounds correctly, subnormals included; ``float(mpf)`` rounds to
    53 bits first and so rounds twice in the subnormal range.
    """
    if not man:
        return 0.0
    top = exp + abs(man).bit_length()
    sign = 1.0 if man > 0 else -1.0  # math.copysign(x, man) fails for a man past the float range
    if top > 1025:
        return math.copysign(math.inf, sign)
    if top < -1075:
        return math.copysign(0.0, sign)
    try:
        return float(man << exp) if exp >= 0 else man / (1 << -exp)
    except OverflowError:
        return math.copysign(math.inf, sign)
