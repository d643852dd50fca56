"""Exact arithmetic on single values of a format: rounding, sums, and the ordered list of values.

The masking claims (``papers/masking.md``, Theorems M.1–M.7) reason about one constant of a
format at a time: where it rounds, what ``fl_F(s + c)`` is, its neighbours, and the bisection of
Theorem M.7 over the ordered values of ``F``. A format's finite values are indexed by their
*ordinal*: ``0`` for zero, ``±1`` for the smallest subnormals, consecutive values consecutive
integers, the sign that of the value.
"""

from __future__ import annotations

import math

from mhanum.formats import Format, round_to, ulp

__all__ = ["fl", "fl_sum", "from_ordinal", "neighbour_gaps", "ordinal", "round_down"]


def fl(x: float, fmt: Format) -> float:
    """``fl_F(x)``: ``x`` rounded to nearest (ties to even) in ``fmt``, as a float64.

    Examples:
        >>> from mhanum.formats import get_format
        >>> fl(1e9, get_format("float16"))
        inf
    """
    return float(round_to(x, fmt))


def fl_sum(a: float, b: float, fmt: Format) -> float:
    """``fl_F(a + b)`` for values ``a``, ``b`` of ``F``: exact for ``F`` float64, and for narrower
    formats the float64 sum rounded again, which is innocuous (``53 >= 2p + 2``)."""
    return fl(a + b, fmt)


def ordinal(x: float, fmt: Format) -> int:
    """The signed index of a finite value of ``fmt`` in the ordered list of its values.

    Examples:
        >>> from mhanum.formats import get_format
        >>> f = get_format("float16")
        >>> ordinal(f.smallest_subnormal, f), ordinal(-1.0, f), from_ordinal(ordinal(-1.0, f), f)
        (1, -15360, -1.0)
    """
    a = abs(x)
    half = 1 << (fmt.precision - 1)
    if a < fmt.smallest_normal:
        index = int(a / fmt.smallest_subnormal)
    else:
        e = math.frexp(a)[1] - 1
        index = (e - fmt.emin + 1) * half + int(math.ldexp(a, fmt.precision - 1 - e)) - half
    return -index if x < 0 else index


def from_ordinal(i: int, fmt: Format) -> float:
    """The value of ``fmt`` whose :func:`ordinal` is ``i``."""
    half = 1 << (fmt.precision - 1)
    a = abs(i)
    if a < half:
        v = math.ldexp(float(a), fmt.emin - fmt.precision + 1)
    else:
        e = fmt.emin + a // half - 1
        v = math.ldexp(float(half + a % half), e - fmt.precision + 1)
    return -v if i < 0 else v


def round_down(b: float, fmt: Format) -> float:
    """The largest value of ``fmt`` that is ``<= b`` (``b >= 0``)."""
    if b >= fmt.max_finite:
        return fmt.max_finite
    r = fl(b, fmt)
    return r if r <= b else from_ordinal(ordinal(r, fmt) - 1, fmt)


def neighbour_gaps(c: float, fmt: Format) -> tuple[float, float]:
    """Distances from a finite ``c`` to its neighbours toward zero and away from zero (the
    largest finite value's gap away from zero is its ulp)."""
    i = ordinal(c, fmt)
    step = -1 if c < 0 else 1
    toward = abs(c - from_ordinal(i - step, fmt)) if i != 0 else fmt.smallest_subnormal
    if abs(i) < ordinal(fmt.max_finite, fmt):
        away = abs(from_ordinal(i + (step if i != 0 else -1), fmt) - c)
    else:
        away = float(ulp(c, fmt))
    return toward, away
