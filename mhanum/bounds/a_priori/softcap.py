"""Theorem B.9 (a) (papers/backward.md) at its worst over the admissible inputs: the soft-capped
logits of Theorem A.4, shared with the backward bounds."""

from __future__ import annotations

import fractions
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from mhanum.bounds.a_priori.sizes import Logits, Range
from mhanum.formats import Format, get_format, round_to
from mhanum.numerics import Numerics

__all__ = [
    "CapRoundings",
    "CappedLogits",
    "cap_constant",
    "cap_roundings",
    "capped",
    "evaluated_constants",
    "softcap_a_priori",
]

_Z_SECH2 = 0.45  # >= max_z z·sech²(z) = 0.4477 (at z = 0.772)


class CappedLogits(NamedTuple):
    """Theorem B.9 (a): the soft-capped logits at their worst over the admissible inputs."""

    reach: float  # >= |a| = c|tanh(s/c)|
    delta: float  # >= |â - a|
    tau: float  # >= |tanh(s/c)|
    e_tau: float  # >= |t̂ - tanh(s/c)|
    t_used: float  # >= |t̂|


def cap_constant(value: float, fmt: Format) -> tuple[float, float]:
    """``(v̂, e)`` with ``e >= |v̂ - value|`` for ``value`` rounded into ``fmt`` (a subnormal
    constant may be read as zero: then ``e >= |value|``; one past the format's range rounds to
    ``inf``, and so is ``e``)."""
    hat = float(round_to(value, fmt))
    if not math.isfinite(hat):
        return hat, math.inf
    err = float(abs(fractions.Fraction(hat) - fractions.Fraction(value))) * (1 + 2.0**-52)
    if hat < fmt.smallest_normal:
        err = max(err, abs(value) * (1 + 2.0**-52))
    return hat, err


class CapRoundings(NamedTuple):
    """The constants and unit roundings of a soft-cap ``c·tanh(s/c)`` in the score format.

    ``fs`` the score format (``u_s``, ``eta_s``); ``carrier`` the float32 or float64 format tanh
    is evaluated in, ``u_t``, ``eta_t`` its relative error (``tanh_ulps``) and underflow; ``c_hat``, ``e_c`` the cap
    rounded into ``fs`` and its error; ``r_hat``, ``e_r`` its reciprocal's, ``e_r`` also covering
    ``fl(1/fl(c))``; ``finite``: both constants finite and positive in ``fs``.
    """

    fs: Format
    carrier: Format
    u_s: float
    eta_s: float
    u_t: float
    eta_t: float
    c_hat: float
    e_c: float
    r_hat: float
    e_r: float
    finite: bool


def cap_roundings(cap: float, num: Numerics) -> CapRoundings:
    """:class:`CapRoundings` of ``cap`` under ``num`` (Theorems B.7 and B.9)."""
    fs = num.format_of("score")
    u_s, eta_s = fs.u, fs.smallest_normal
    carrier = fs if fs.name in ("float32", "float64") else get_format("float32")
    u_t, eta_t = 2 * num.tanh_ulps * carrier.u, carrier.smallest_normal
    c_hat, e_c = cap_constant(cap, fs)
    r_hat, e_r = cap_constant(1.0 / cap, fs)
    e_r = max(e_r, (2 * u_s + 2 * u_s * u_s) / cap * (1 + 2.0**-50))  # fl(1/fl(c)) as well
    finite = math.isfinite(c_hat) and math.isfinite(r_hat) and c_hat > 0 and r_hat > 0
    return CapRoundings(fs, carrier, u_s, eta_s, u_t, eta_t, c_hat, e_c, r_hat, e_r, finite)


_LARGEST_FLOAT64 = 1.7976931348623157e308


def evaluated_constants(rounded: CapRoundings, cap: float) -> tuple[float, float, float, float]:
    """``(ĉ, e_c, r̂, e_r)`` a step evaluates its enclosures on: ``rounded``'s where both
    constants fit the score format. Where one does not, the step has flagged every entry
    infinite, and evaluates on stand-ins that keep its arithmetic finite: ``cap``, its float64
    reciprocal (the largest finite float64 where that overflows, as it does below
    ``2^-1024``) and no errors; nothing evaluated on them reaches a finite bound.

    >>> from mhanum import Numerics
    >>> evaluated_constants(cap_roundings(1e-320, Numerics.preset("fp32")), 1e-320)[2:]
    (1.7976931348623157e+308, 0.0)
    """
    if rounded.finite:
        return rounded.c_hat, rounded.e_c, rounded.r_hat, rounded.e_r
    with np.errstate(over="ignore"):
        reciprocal = float(np.float64(1.0) / np.float64(cap))
    return cap, 0.0, min(reciprocal, _LARGEST_FLOAT64), 0.0


def softcap_a_priori(
    s_up: float,
    delta: float,
    cap: float,
    num: Numerics,
    check: Callable[[float, Format, str], None],
) -> CappedLogits:
    """Theorem B.9 (a) (papers/backward.md): scaled scores ``|s| <= s_up`` computed within
    ``delta``, capped as the kernel does, ``â = fl_s(ĉ·fl_s(T(fl_s(ŝ·r̂))))``.

    ``x̂ - s/c = e_a + e_r`` with ``|e_a| <= w_a = δ r̂(1 + u_s) + η_s`` (the scores' error) and
    ``|e_r| <= w_r|s/c|``, ``w_r = c|r̂ - 1/c| + u_s c r̂`` (the reciprocal's and the product's
    roundings). ``tanh`` is 1-Lipschitz with range ``(-1, 1)`` and ``y·sech²(y(1 - w_r) - w_a)
    <= (w_a + 0.45)/(1 - w_r)``, so ``|tanh x̂ - tanh(s/c)| <= min(min(w_a, 2) +
    w_r·min(s_up/c, (w_a + 0.45)/(1 - w_r)), 2)`` whatever the norms; ``|a| <= c·tanh(s_up/c)
    <= min(c, s_up)``. ``check(upper, format, stage)`` is called on the
    stages that may overflow."""
    rounded = cap_roundings(cap, num)
    fs, carrier, u_s, eta_s, u_t, eta_t = rounded[:6]
    if not rounded.finite:
        check(math.inf, fs, f"softcap: the cap {cap:g} or its reciprocal in {fs.name}")
    c_hat, e_c, r_hat, e_r = evaluated_constants(rounded, cap)
    s_hat = s_up + delta  # >= |ŝ|
    check(s_hat * r_hat * (1 + u_s) + eta_s, fs, f"the scores times 1/softcap = {r_hat:.4g}")
    # x̂ - s/c = e_a + e_r: |e_a| <= w_a (the scores' error), |e_r| <= w_r|s/c| (the roundings)
    w_a = delta * r_hat * (1 + u_s) + eta_s
    w_r = cap * e_r + u_s * cap * r_hat
    y_up = s_up / cap * (1 + 2.0**-52)
    relative = w_r * y_up
    if w_r < 1:  # |y|·sech²(|y|(1 - w_r) - w_a) <= (w_a + max z·sech² z)/(1 - w_r)
        relative = min(relative, w_r * (w_a + _Z_SECH2) / (1 - w_r))
    spread = min(min(w_a, 2.0) + relative, 2.0)  # >= |tanh x̂ - tanh(s/c)|
    tau = min(1.0, math.tanh(y_up) * (1 + 2.0**-50))
    t_x = min(1.0, tau + spread)  # >= |tanh x̂|
    e_t = u_t * t_x + eta_t
    t_top = t_x + e_t  # >= |T(x̂)|
    if carrier.name != fs.name:
        e_t = e_t + u_s * t_top + eta_s
        t_top = t_top * (1 + u_s) + eta_s
    e_tau = spread + e_t
    t_used = min(tau + e_tau, t_top)
    a_err = e_c * t_used + cap * e_tau + u_s * c_hat * t_used + eta_s
    check(c_hat * t_used * (1 + u_s) + eta_s, fs, "the capped logits")
    return CappedLogits(cap * tau * (1 + 2.0**-50), a_err, tau, e_tau, t_used)


def capped(logits: Logits, cap: float, num: Numerics, rng: Range) -> Logits:
    """A.4's logits soft-capped (Theorem B.9 (a)): the computed capped logits within ``Δ_c`` of
    ``c·tanh(s̃/c)`` (the stand-in logits ``s̃`` within ``Δ``, ``|s̃| <= ρ``), read again into
    the softmax format; the stand-ins' own errors carried through ``tanh`` (1-Lipschitz,
    range 2)."""
    soft = num.format_of("softmax")
    capped = softcap_a_priori(logits.reach, logits.delta, cap, num, rng.check)
    delta = capped.delta
    if soft.smallest_normal > num.format_of("score").smallest_normal:
        delta += soft.smallest_normal
    return Logits(delta, capped.reach, min(logits.eps64, 2 * cap), min(logits.moved, 2 * cap))
