"""Double-double ball arithmetic on numpy arrays, for the fast certified reference.

A *ball* is a center ``hi + lo`` (a normalized double-double: ``hi = fl(hi + lo)``, so
``|lo| <= u |hi|`` with ``u = 2**-53``) and a radius ``rad`` (a float64 array, ``None`` for 0):
the exact value ``x`` satisfies ``|x - (hi + lo)| <= rad`` componentwise. Every operation here
returns a ball that encloses the exact result of the operation on the enclosed values. The
error bounds are the lemmas of ``papers/reference.md``; the constants below are named after them.

All arithmetic is float64 with round-to-nearest, vectorised. Overflow is not an error: it makes a
center or a radius ``inf`` or ``NaN``, which propagates to the result and is reported as not
certified. Underflow is covered by the absolute term :data:`ETA` added to every radius.

Nothing here knows about attention; :mod:`mhanum.reference._fastref` composes these operations.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ETA",
    "Ball",
    "U",
    "add",
    "constant",
    "exp",
    "gradual_underflow",
    "matmul",
    "mul",
    "reciprocal",
    "up",
]

U = 2.0**-53
# Absolute error allowed to one operation for underflow (Lemma 1); far above 2**-1074 per op.
ETA = 2.0**-1060
# Relative error bounds of the double-double operations (Lemmas 2 and 3).
EPS_ADD = 4 * U * U
EPS_MUL = 9 * U * U
EPS_INV = 16 * U * U
_SPLITTER = 134217729.0  # 2**27 + 1, Dekker's splitting constant
# Normalized truncation error the Ozaki-style splitting of matmul aims below (Lemma 4).
_MATMUL_TRUNCATION = 2.0**-100


class Ball(NamedTuple):
    """An enclosure ``|x - (hi + lo)| <= rad``; ``rad`` ``None`` means the center is exact."""

    hi: np.ndarray
    lo: np.ndarray
    rad: np.ndarray | None


def up(r: np.ndarray | float) -> np.ndarray:
    """An upper bound of the exact value of a radius expression computed in float64.

    Valid for an expression of nonnegative terms with at most 8 roundings (Lemma 1): the computed
    value ``r`` is at least ``exact * (1 - u)**8 - 8 * 2**-1075``, and the two roundings here
    leave at least ``r (1 + 2**-49) + ETA / 2``.
    """
    return np.asarray(r) * (1 + 2.0**-48) + ETA


def gradual_underflow() -> bool:
    """Whether numpy float64 arithmetic keeps subnormals (no flush-to-zero, no denormals-are-zero).

    The bounds here assume it (Lemma 1); a library loaded into the process can switch it off.
    """
    tiny = np.array([2.0**-1022, 5e-324])
    halved, kept = tiny / 2.0, tiny * 1.0
    return bool(halved[0] == 2.0**-1023 and kept[1] == 5e-324)


def constant(value: Fraction, shape: tuple[int, ...] = ()) -> Ball:
    """A rational constant as a ball (the double-double nearest to it and the exact remainder)."""
    hi = float(value)
    rest = value - Fraction(hi)
    lo = float(rest)
    err = abs(rest - Fraction(lo))
    rad = None if err == 0 else np.full(shape, float(err) * (1 + 2.0**-40) + ETA)
    return Ball(np.full(shape, hi), np.full(shape, lo), rad)


# --- error-free transformations -----------------------------------------------------------------


def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``s + e = a + b`` exactly with ``s = fl(a + b)`` (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def fast_two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``s + e = a + b`` exactly, if ``a = 0`` or the exponent of ``a`` is at least that of ``b``."""
    s = a + b
    return s, b - (s - a)


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = _SPLITTER * a
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``p + e = a * b`` exactly (Dekker), barring underflow and ``|a|, |b| >= 2**995``."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


# --- double-double operations on centers ---------------------------------------------------------


def _add(xh: np.ndarray, xl: np.ndarray, yh: np.ndarray, yl: np.ndarray) -> tuple[np.ndarray, ...]:
    """AccurateDWPlusDW (Joldes, Muller and Popescu, Algorithm 6); Lemma 2."""
    sh, sl = two_sum(xh, yh)
    th, tl = two_sum(xl, yl)
    vh, vl = fast_two_sum(sh, sl + th)
    return fast_two_sum(vh, tl + vl)


def _mul(xh: np.ndarray, xl: np.ndarray, yh: np.ndarray, yl: np.ndarray) -> tuple[np.ndarray, ...]:
    """DWTimesDW1 (Joldes, Muller and Popescu, Algorithm 10); Lemma 3."""
    ch, cl1 = two_prod(xh, yh)
    return fast_two_sum(ch, cl1 + (xh * yl + xl * yh))


# --- ball operations ----------------------------------------------------------------------------


def _magnitude(x: Ball) -> np.ndarray:
    """An upper bound of ``|hi + lo|`` that needs no rounding up (``|lo| <= u |hi|``)."""
    return np.abs(x.hi) * (1 + 2.0**-52)


def add(x: Ball, y: Ball) -> Ball:
    """``x + y`` (Lemma 2): radius ``rx + ry + eps_add |z| + eta``."""
    zh, zl = _add(x.hi, x.lo, y.hi, y.lo)
    rad = EPS_ADD * _magnitude(Ball(zh, zl, None)) * (1 + 2.0**-40)
    for r in (x.rad, y.rad):
        if r is not None:
            rad = rad + r
    return Ball(zh, zl, up(rad))


def mul(x: Ball, y: Ball) -> Ball:
    """``x * y`` (Lemma 3): radius ``|x| ry + |y| rx + rx ry + eps_mul |xy| + eta``."""
    zh, zl = _mul(x.hi, x.lo, y.hi, y.lo)
    rad = EPS_MUL * _magnitude(Ball(zh, zl, None)) * (1 + 2.0**-40)
    if y.rad is not None:
        rad = rad + _magnitude(x) * y.rad
    if x.rad is not None:
        rad = rad + _magnitude(y) * x.rad
        if y.rad is not None:
            rad = rad + x.rad * y.rad
    return Ball(zh, zl, up(rad))


def reciprocal(z: Ball) -> Ball:
    """``1 / z`` for ``z`` whose lower end is positive (Lemma 5); ``inf`` radius otherwise.

    ``y = fl(1/zh)`` is refined by one Newton step ``y + y (1 - z y)``, the residual formed with
    an exact product; the remaining relative error is at most ``16 u**2``.
    """
    y = 1.0 / z.hi
    p, e = two_prod(z.hi, y)
    residual = ((1.0 - p) - e) - z.lo * y
    hi, lo = fast_two_sum(y, y * residual)
    low = z.hi * (1 - 2.0**-50) - (0.0 if z.rad is None else z.rad)
    size = np.abs(hi) * (1 + 2.0**-50)
    rad = EPS_INV * size * (1 + 2.0**-40)
    if z.rad is not None:
        rad = rad + size * z.rad / low
    rad = np.where(low > 0, up(rad), np.inf)
    return Ball(hi, lo, rad)


# --- exp ----------------------------------------------------------------------------------------


def _ln2_fraction(bits: int) -> tuple[Fraction, Fraction]:
    """``(low, width)``: ``low <= ln 2 <= low + width`` from ``ln 2 = sum_k 1/(k 2**k)``."""
    terms = bits + 8
    total = sum(((1 << (bits + 8)) >> k) // k for k in range(1, terms + 1))
    # Each floor loses less than 1 unit; the tail sum_{k>terms} 1/(k 2^k) < 2**-terms.
    return Fraction(total, 1 << (bits + 8)), Fraction(terms + 2, 1 << (bits + 8))


_EXP_TABLE_BITS = 10
_EXP_N = 1 << _EXP_TABLE_BITS
# |r| after the reduction must be below this (ln 2 / 2048 < 3.39e-4) for the polynomial bound.
_EXP_R_MAX = 2.0**-11
# Relative error of the table, the polynomial and the final product together (Lemma 6).
EPS_EXP = 2.0**-96
# Below this argument exp(x) < 2**-995 is replaced by 0 with that radius.
_EXP_UNDERFLOW = -690.0


def _exp_fixed(x: int, bits: int) -> int:
    """``floor``-style Taylor sum of ``exp(x 2**-bits)`` in units of ``2**-bits``, ``0 <= x < 2**bits``.

    Each term ``t_i = floor(t_(i-1) x / (i 2**bits))`` is low by less than ``i`` units, so the sum
    of the ``M = 80`` terms is low by less than ``M**2`` units plus the tail, below one unit.
    """
    term, total = 1 << bits, 1 << bits
    for i in range(1, 81):
        term = (term * x >> bits) // i
        total += term
    return total


@functools.cache
def _exp_constants() -> dict[str, Any]:
    """``C = ln2 / 1024`` in three pieces, and the table ``2**(j/1024)`` as double-doubles.

    The table is ``exp(j ln2/1024)`` summed in 240-bit fixed point from a lower bound of ``ln 2``;
    the result is low by less than ``2**-220`` (Lemma 6), far below the double-double rounding.
    """
    bits = 240
    low, width = _ln2_fraction(bits)
    c = low / _EXP_N
    pieces = []
    for size in (32, 32, 53):
        mant, ex = math.frexp(float(c))
        head = math.ldexp(math.floor(math.ldexp(mant, size)), ex - size)
        pieces.append(head)
        c -= Fraction(head)
    c_err = float(abs(c) + width / _EXP_N) * 2
    table_hi, table_lo = np.empty(_EXP_N), np.empty(_EXP_N)
    ln2_fixed = math.floor(low * (1 << bits))
    for j in range(_EXP_N):
        value = Fraction(_exp_fixed(j * ln2_fixed // _EXP_N, bits), 1 << bits)
        table_hi[j] = float(value)
        table_lo[j] = float(value - Fraction(table_hi[j]))
    return {
        "c1": pieces[0],
        "c2": pieces[1],
        "c3": pieces[2],
        "c_err": c_err,
        "inv_c": float(_EXP_N / low),
        "table_hi": table_hi,
        "table_lo": table_lo,
    }


# Float64 Taylor coefficients 1/i! for i = 4..8 (the tail, Lemma 6) and 1/6 as a double-double.
_TAIL = [1.0 / math.factorial(i) for i in range(8, 3, -1)]
_SIXTH = constant(Fraction(1, 6))


def exp(x: Ball) -> Ball:
    """``exp(x)`` for ``x <= 1`` (Lemma 6): table of ``2**(j/1024)`` and a degree-8 polynomial.

    ``x = (1024 m + j) ln2/1024 + r`` with ``|r| <= 2**-11``; ``exp(r)`` is a Taylor polynomial
    whose terms of degree ``>= 4`` are summed in float64 and the others in double-double. Where
    ``x <= -690`` (including its radius) the result is 0 with radius ``2**-995``.
    """
    const = _exp_constants()
    xh, xl = x.hi, x.lo
    rx = np.zeros_like(xh) if x.rad is None else x.rad
    k = np.where(np.abs(xh) < 1000, np.rint(xh * const["inv_c"]), 0.0)
    s, e1 = two_sum(xh, -k * const["c1"])
    s, e2 = two_sum(s, -k * const["c2"])
    kc3 = k * const["c3"]
    t = ((e1 + e2) + xl) - kc3
    rh, rl = two_sum(s, t)
    # |r_computed - (x_center - k ln2/N)|: four roundings in t, and the error of C1 + C2 + C3.
    r_err = up(
        5 * U * (np.abs(e1) + np.abs(e2) + np.abs(xl) + np.abs(kc3)) + np.abs(k) * const["c_err"]
    )
    tail = np.full_like(rh, _TAIL[0])
    for coefficient in _TAIL[1:]:
        tail = tail * rh + coefficient
    r = Ball(rh, rl, None)
    y = _mul_center(r, Ball(tail, np.zeros_like(tail), None))
    y = _add_center(y, _SIXTH)
    for coefficient in (0.5, 1.0, 1.0):
        y = _add_center(_mul_center(r, y), Ball(np.asarray(coefficient), np.asarray(0.0), None))
    m = np.floor(k / _EXP_N)
    j = (k - m * _EXP_N).astype(np.int64) % _EXP_N
    eh, el = _mul(const["table_hi"][j], const["table_lo"][j], y.hi, y.lo)
    m_int = np.clip(m, -1100, 1100).astype(np.int64)
    eh, el = np.ldexp(eh, m_int), np.ldexp(el, m_int)
    # Relative error: reduction (e^{r_err} - 1 <= r_err (1 + r_err)), EPS_EXP; input radius.
    spread = r_err + rx
    rel = spread * (1 + spread) + EPS_EXP
    rad = up(np.abs(eh) * (1 + 2.0**-40) * rel + 2 * ETA)
    bad = ~(np.abs(rh) + np.abs(rl) <= _EXP_R_MAX) | ~(spread <= 0.5) | (xh > 1)
    rad = np.where(bad, np.inf, rad)
    underflow = xh + np.abs(xl) + rx <= _EXP_UNDERFLOW
    zero = np.zeros_like(eh)
    return Ball(
        np.where(underflow, zero, eh),
        np.where(underflow, zero, el),
        np.where(underflow, 2.0**-995, rad),
    )


def _mul_center(x: Ball, y: Ball) -> Ball:
    zh, zl = _mul(x.hi, x.lo, y.hi, y.lo)
    return Ball(zh, zl, None)


def _add_center(x: Ball, y: Ball) -> Ball:
    zh, zl = _add(x.hi, x.lo, y.hi, y.lo)
    return Ball(zh, zl, None)


# --- matmul -------------------------------------------------------------------------------------


def _row_exponents(a: np.ndarray, axis: int) -> np.ndarray:
    """``e`` with ``max |a| < 2**e`` along ``axis`` (0 for an all-zero line), kept as an axis."""
    return np.frexp(np.abs(a).max(axis=axis, keepdims=True))[1].astype(np.int64)


def _digits(a: np.ndarray, exponents: np.ndarray, beta: int, count: int) -> list[np.ndarray]:
    """Signed digits ``d_s`` (integer-valued floats) of ``a / 2**e`` in base ``2**beta``.

    ``a / 2**e = sum_s d_s 2**(-s beta) + R`` with ``|d_1| <= 2**beta``, ``|d_s| <= 2**(beta-1)``
    and ``|R| <= 2**(-count beta - 1)``. Elements below ``2**(e-1000)`` are taken as zero: they
    are part of ``R``. The list stops early where the remainder is exactly zero: the digits
    left out are zeros (float32 inputs have about two of ``beta = 20..22`` bits).
    """
    mant, ex = np.frexp(a)
    shift = ex.astype(np.int64) - exponents
    y = np.where(shift < -1000, 0.0, np.ldexp(mant, np.maximum(shift, -1000)))
    digits = []
    radix = float(1 << beta)
    for _ in range(count):
        y = y * radix
        d = np.rint(y)
        y = y - d
        digits.append(d)
        if not y.any():
            break
    return digits


def upper_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An upper bound of ``a @ b`` for nonnegative float64 ``a``, ``b`` (Lemma 1).

    In any summation order the computed product is at least ``(1 - u)**n`` times the exact one,
    less ``n 2**-1075`` for underflow.
    """
    n = a.shape[-1]
    factor = 1 + math.ldexp(1.0, max(n, 2).bit_length() - 52)
    return up(np.matmul(a, b) * factor + math.ldexp(n, -1074))


def ball_matmul(a: Ball, b: Ball) -> Ball:
    """``a @ b`` of balls (Lemma 5).

    The product of the high parts by :func:`matmul`; the cross terms ``ah @ bl + al @ bh`` by one
    float64 product, whose rounding error is at most ``gamma_2n`` times the product of the
    magnitudes; ``al @ bl`` and the radii bounded by
    ``(|al| + ra) @ (|bl| + rb) + |ah| @ rb + ra @ |bh|``. Parts that are zero are skipped.
    """
    center = matmul(a.hi, b.hi)
    a_lo, b_lo = bool(a.lo.any()), bool(b.lo.any())
    n = a.hi.shape[-1]
    left: list[np.ndarray] = []
    right: list[np.ndarray] = []
    if b_lo:
        left.append(a.hi)
        right.append(b.lo)
    if a_lo:
        left.append(a.lo)
        right.append(b.hi)
    bound_left: list[np.ndarray] = []
    bound_right: list[np.ndarray] = []
    ra, rb = a.rad, b.rad
    if (a_lo or ra is not None) and (b_lo or rb is not None):
        bound_left.append(np.abs(a.lo) + (0.0 if ra is None else ra))
        bound_right.append(np.abs(b.lo) + (0.0 if rb is None else rb))
    if rb is not None:
        bound_left.append(np.abs(a.hi))
        bound_right.append(rb)
    if ra is not None:
        bound_left.append(ra)
        bound_right.append(np.abs(b.hi))
    rad = np.zeros(center.hi.shape)
    if bound_left:
        rad = upper_matmul(np.concatenate(bound_left, -1), np.concatenate(bound_right, -2))
    if not left:
        assert center.rad is not None
        return Ball(center.hi, center.lo, up(center.rad + rad))
    cross = np.matmul(np.concatenate(left, -1), np.concatenate(right, -2))
    magnitude = upper_matmul(
        np.concatenate([np.abs(x) for x in left], -1),
        np.concatenate([np.abs(x) for x in right], -2),
    )
    gamma = 2 * n * U / (1 - 2 * n * U) * (1 + 2.0**-40)  # gamma_2n, rounded up
    rad = up(rad + gamma * magnitude + math.ldexp(2 * n, -1074))
    return add(center, Ball(cross, np.zeros_like(cross), rad))


def _digit_plan(n: int) -> tuple[int, int]:
    """The fewest digits ``S`` (and their size ``beta``) with truncation below ``2**-100``."""
    count = 2
    while True:
        beta = (53 - (n * count - 1).bit_length()) // 2
        if math.ldexp((2 * count + 2) * n, -count * beta) <= _MATMUL_TRUNCATION:
            return count, beta
        count += 1


def _weight_piece(
    da: list[np.ndarray], db: list[np.ndarray], weight: int, beta: int
) -> np.ndarray | None:
    """``2**(-weight beta) sum_{s+t=weight} D^A_s D^B_t`` as one exact product (Lemma 4), the
    pairs whose digits :func:`_digits` left out (zeros) skipped; ``None`` where none is left,
    which happens only above the last weight with a pair, so the pieces summed are the same."""
    pairs = [(s, weight - 2 - s) for s in range(weight - 1)]
    pairs = [(s, t) for s, t in pairs if s < len(da) and t < len(db)]
    if not pairs:
        return None
    left = np.concatenate([da[s] for s, _ in pairs], axis=-1)
    right = np.concatenate([db[t] for _, t in pairs], axis=-2)
    return np.ldexp(np.matmul(left, right), -weight * beta)


def matmul(a: np.ndarray, b: np.ndarray) -> Ball:
    """``a @ b`` of float64 arrays as a ball of radius about ``n 2**-110`` of ``max|a| max|b|``.

    Ozaki-style splitting (Lemma 4): rows of ``a`` and columns of ``b`` are scaled by powers of two
    to below 1 and split into ``S`` digits of ``beta`` bits (``S beta`` near 110-120) with ``S n 2**(2 beta) <= 2**53``,
    so that each sum of digit products of one weight is exact in float64 in any summation order;
    the ``S`` weights ``2..S+1`` are accumulated in double-double (Lemma 1), the products of higher
    weight and the remainders are bounded.
    """
    n = a.shape[-1]
    count, beta = _digit_plan(n)
    ea = _row_exponents(a, -1)
    eb = _row_exponents(b, -2)
    da = _digits(a, ea, beta, count)
    db = _digits(b, eb, beta, count)
    weights = (_weight_piece(da, db, weight, beta) for weight in range(2, count + 2))
    pieces = [piece for piece in weights if piece is not None]
    s, c = pieces[0], np.zeros_like(pieces[0])
    for piece in pieces[1:]:
        s, e = two_sum(s, piece)
        c = c + e
    hi, lo = two_sum(s, c)
    # Truncation (2S + 2) n 2**(-S beta); accumulation 2 (S-2) (S-1) u**2 (|hi| + 2.1 n 2**-beta),
    # since every partial sum is at most |hi + lo| plus the pieces of weight >= 3 (Lemma 4).
    truncation = math.ldexp((2 * count + 2) * n, -count * beta)
    accumulation = 2 * (count - 2) * (count - 1) * U * U
    pieces_below = 2.1 * math.ldexp(n, -beta)
    scale = ea + eb
    rad = up(truncation + accumulation * (np.abs(hi) * (1 + 2.0**-50) + pieces_below))
    rad = np.ldexp(rad, scale)
    hi, lo = np.ldexp(hi, scale), np.ldexp(lo, scale)
    return Ball(hi, lo, up(rad + 2 * ETA))
