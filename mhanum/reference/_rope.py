"""The exact rotation of RoPE as Arb balls, for the certified reference (papers/rope.md, P.5).

The reference depends on no implementation under test, so this module reads a
:class:`mhanum.rope.Rope` as data (its fields) and writes the rotation out itself: the inverse
frequencies of the scaling's formula with its constants as the configuration holds them (float64
numbers, converted exactly: the base, the factors, YaRN's correction range and table factor,
the dynamic base, each computed in float64 as ``transformers`` computes them), the exact angles
``θ = p·ω``, their ``cos`` and ``sin``, and the rotation, all in Arb's rigorous balls at flint's
working precision (``flint.ctx.prec``). Each ball contains the exact value and shrinks like
``2^-prec``, which is how the reference's doubling of the precision reaches its digits.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["arb_inv_freq", "arb_rotate", "arb_rotation"]


def _rational(flint: ModuleType, x: float | Fraction) -> Any:
    """A float64 constant or a rational as an Arb ball (exact for a float, ``2^-prec`` wide for
    a rational that is not dyadic)."""
    f = Fraction(x)
    return flint.arb(flint.fmpq(f.numerator, f.denominator))


def _dynamic_base(rope: Any, seq_len: int) -> float:
    """Dynamic NTK's base ``b·(f·S/M - f + 1)^(d/(d-2))``, ``S = max(seq_len, M)``, in float64
    as ``transformers`` computes it (a constant of the configuration)."""
    m, d = rope.original_max_position, rope.dim
    s = max(seq_len, m)
    return float(rope.base * ((rope.factor * s / m) - (rope.factor - 1)) ** (d / (d - 2)))


def _yarn_range(rope: Any) -> tuple[float, float]:
    """YaRN's correction range ``[low, high]`` in float64, as ``transformers`` computes it."""
    d, m = rope.dim, rope.original_max_position

    def dim_of(rotations: float) -> float:
        return (d * math.log(m / (rotations * 2 * math.pi))) / (2 * math.log(rope.base))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    return float(low), float(high)


def _table_factor(rope: Any) -> float:
    """YaRN's factor on the tables (``attention_factor``, default ``0.1 ln f + 1``), else 1."""
    if rope.scaling != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    return 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0


def _llama3(flint: ModuleType, rope: Any, w: Any) -> Any:
    """Llama 3's ``ω``: its branches by ``2π/ω`` against ``M/h`` and ``M/l``. ``2π b^(2i/d)`` is
    transcendental, never equal to those rationals, so a ball that straddles a threshold
    shrinks past it as the precision grows; meanwhile the union of the branches is taken."""
    f = _rational(flint, rope.factor)
    lf, hf = (_rational(flint, x) for x in (rope.low_freq_factor, rope.high_freq_factor))
    m = _rational(flint, rope.original_max_position)
    wavelen = 2 * flint.arb.pi() / w
    low_edge, high_edge = m / hf, m / lf
    s = (m / wavelen - lf) / (hf - lf)
    branches = []
    if not wavelen >= low_edge:  # possibly below M/h: the high frequencies are kept
        branches.append(w)
    if not wavelen <= high_edge:  # possibly above M/l: the low frequencies are divided by f
        branches.append(w / f)
    if not (wavelen < low_edge or wavelen > high_edge):  # possibly between: smoothed
        branches.append((1 - s) * w / f + s * w)
    out = branches[0]
    for other in branches[1:]:
        out = out.union(other)
    return out


def arb_inv_freq(rope: Any, seq_len: int, flint: ModuleType) -> list[Any]:
    """The exact ``ω_i`` of the scaling's formula as Arb balls: ``b^(-2i/d)`` (``linear``
    divides by ``f``, YaRN blends ``ω`` and ``ω/f`` over its correction range, Llama 3 divides
    the low frequencies by ``f`` and smooths between, dynamic NTK raises the base for
    ``seq_len`` positions)."""
    d = rope.dim
    base = _dynamic_base(rope, seq_len) if rope.scaling == "dynamic" else rope.base
    f = _rational(flint, rope.factor)
    omega = [_rational(flint, base) ** _rational(flint, Fraction(-2 * i, d)) for i in range(d // 2)]
    if rope.scaling == "linear":
        return [w / f for w in omega]
    if rope.scaling == "yarn":
        low, high = (Fraction(x) for x in _yarn_range(rope))
        out = []
        for i, w in enumerate(omega):
            ramp = min(max((i - low) / (high - low), Fraction(0)), Fraction(1))
            keep = _rational(flint, 1 - ramp)
            out.append(w / f * (1 - keep) + w * keep)
        return out
    if rope.scaling == "llama3":
        return [_llama3(flint, rope, w) for w in omega]
    return omega


def _pairs(rope: Any, j: int) -> tuple[int, int, int]:
    """A rotated entry's partner, the sign of its sine term and its frequency: half-split
    (``x_j`` with ``x_{j+d/2}``) or interleaved (``x_{2i}`` with ``x_{2i+1}``)."""
    half = rope.dim // 2
    if rope.layout == "half":
        return (j + half, -1, j) if j < half else (j - half, 1, j - half)
    return j ^ 1, (-1 if j % 2 == 0 else 1), j // 2


def arb_rotate(
    balls: np.ndarray, positions: np.ndarray, rope: Any, flint: ModuleType
) -> np.ndarray:
    """The exact rotation of Arb balls ``(..., L, d_head)`` (an object array of ``arb``) at their
    rows' ``positions`` (checked int64, ``L`` of them): each result contains the rotation of
    every point of its balls; the entries past ``rope.dim`` pass unchanged."""
    omega = arb_inv_freq(rope, int(positions.max()) + 1, flint)
    k = _rational(flint, _table_factor(rope))
    tables = [
        [(k * c, k * s) for s, c in ((flint.arb(int(t)) * w).sin_cos() for w in omega)]
        for t in positions
    ]
    pairs = [_pairs(rope, j) for j in range(rope.dim)]
    out = balls.copy()
    for index in np.ndindex(balls.shape[:-1]):
        row, trig = balls[index], tables[index[-1]]
        for j, (partner, sign, i) in enumerate(pairs):
            c, s = trig[i]
            first, second = row[j] * c, row[partner] * s
            out[(*index, j)] = first - second if sign < 0 else first + second
    return out


def arb_rotation(x: np.ndarray, positions: np.ndarray, rope: Any, flint: ModuleType) -> np.ndarray:
    """The exact rotation of the float64 array ``x`` (``(..., L, d_head)``) as an object array
    of Arb balls (:func:`arb_rotate` of its exact balls).

    Examples:
        >>> import flint, numpy as np
        >>> from mhanum.rope import Rope
        >>> ball = arb_rotation(np.array([[1.0, 0.0]]), np.array([3]), Rope(dim=2), flint)[0, 1]
        >>> ball.overlaps(flint.arb(3).sin())  # ω_0 = 1: (cos 3, sin 3)
        True
    """
    balls = np.empty(x.shape, dtype=object)
    for index, t in np.ndenumerate(x):
        balls[index] = flint.arb(float(t))
    return arb_rotate(balls, positions, rope, flint)
