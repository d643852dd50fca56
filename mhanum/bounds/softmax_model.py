"""The model of the softmax format's arithmetic that every softmax theorem shares, and the a
posteriori pieces the row bounds of :mod:`mhanum.bounds.softmax` are built from.

The model (``papers/softmax.md`` §0) is stated in :mod:`mhanum.bounds.softmax`: correctly rounded
``+ - *`` in the softmax format ``F``, ``exp`` within ``ε_exp`` and division within ``ε_div``, an
absolute underflow error per rounding (flush to zero in float32, bfloat16 and float64, gradual in
float16), no overflow, and the summation constant ``γ_h`` of the order's tree. :class:`Model`
holds its constants for one :class:`~mhanum.Numerics`; the functions here are the steps that
every row of Theorems S.1–S.3 and S.5 takes: the error of the exponential's argument
(:func:`rounded_difference`, :func:`base2_charge`, :func:`lifted`), the exact softmax
(:func:`exact_softmax`), and the quotient's enclosure (:func:`row_bound`,
:func:`first_order_terms`). All of it is evaluated in float64 (long double for the exact softmax),
its own rounding charged.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mhanum.bounds.factors import compound, division_error, summation_gamma
from mhanum.formats import Format, representable, round_to
from mhanum.numerics import Numerics

__all__ = [
    "EVAL_RANGE",
    "EVAL_SLACK",
    "UNEVALUABLE",
    "Model",
    "base2_charge",
    "exact_softmax",
    "first_order_terms",
    "lifted",
    "past_evaluation_range",
    "rounded_difference",
    "row_bound",
    "times",
]

# The formats whose subnormals XLA's CPU backend flushes to zero (bfloat16 is carried in float32).
_FLUSHING = ("float32", "bfloat16", "float64")
# Slack for evaluating the bound itself in float64 from a long-double softmax.
EVAL_SLACK = 1.0 + 2.0**-40
EVAL_RANGE = 2.0**1021  # a quarter of float64's largest finite value
UNEVALUABLE = (
    "logits beyond 2^1021 in magnitude (float64 formats only): the differences and sums that "
    "the bound is evaluated with in float64 may overflow it"
)


def times(weight: Any, rel: Any, log_weight: Any, log_factor: Any) -> np.ndarray:
    """``weight·rel`` for a weight ``w = e^(log_weight) >= 0`` and a relative error
    ``rel = e^(log_factor) - 1 >= 0``, never NaN.

    Where ``rel`` fits float64 it is the product. Where it overflows (an argument error past
    709, so an argument at least ``709/u`` below the row's maximum: ``w`` has underflowed, and
    ``0·inf`` would read NaN) it is the upper bound ``e^(log_weight + log_factor)``, its
    exponent rounded up by ``2^-51`` of the magnitudes it sums (float64 evaluation), plus the
    smallest subnormal: an exponential of a shifted logit that overflowed the format to
    ``-inf`` (computed as 0) is covered, as its argument's upper enclosure stays valid.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        fits = np.isfinite(rel)
        direct = np.asarray(weight, np.float64) * np.where(fits, rel, 0.0)
        top = log_weight + log_factor
        top = top + 2.0**-51 * (np.abs(log_weight) + np.abs(log_factor))
        spaced = np.where(np.isneginf(log_weight), 0.0, np.exp(top) + 2.0**-1074)
    return np.where(fits, direct, spaced)


class Model:
    """The error constants of the softmax format under ``numerics`` (``papers/softmax.md`` §0):
    ``u``, ``eps_exp``, ``eps_div``, the underflow terms ``eta_exp``, ``eta_div``, ``eta`` and
    ``arg_flush``, the summation order, and the exp2 forms' ``rel2`` and ``lift``."""

    def __init__(self, num: Numerics) -> None:
        fmt = num.format_of("softmax")
        self.fmt: Format = fmt
        self.u = fmt.u
        self.eps_exp = 2 * num.exp_ulps * fmt.u
        self.eps_div = division_error(num.div_ulps, fmt.u)
        tiny = fmt.smallest_normal
        self.flushes = fmt.name in _FLUSHING
        if self.flushes:
            self.eta_exp = tiny * (1 + self.eps_exp)
            self.eta_div = tiny * (1 + self.eps_div)
            self.eta = tiny * (1 + self.u)
            # an argument x - m read with denormals-as-zero and flushed: 2 inputs and 1 result
            self.arg_flush = 3 * tiny
        else:
            self.eta_exp = self.eps_exp * tiny
            self.eta_div = self.eps_div * tiny
            self.eta = self.u * tiny
            self.arg_flush = 0.0
        self.order = num.summation
        self.unit = num.order
        self.kind = num.summation_kind
        # the exp2 forms (scale 1 in the softmax alone): x = fl(x̂·L̂), L̂ = fl(log2 e), a
        # relative rel2 of each logit in natural units; differences rounded in base 2
        self.base2 = num.exp2
        self.rel2 = compound(2.0**-53, self.u, self.u) if self.base2 else 0.0
        # prob_offset k (exp2-folded, online): every exponent lifted by k, in natural units
        self.lift = num.prob_offset * math.log(2.0)

    def gamma(self, n: int) -> float:
        return summation_gamma(n, self.order, self.u)

    def sum_abs(self, n: int) -> float:
        """Absolute underflow error of a sum of ``n`` terms (``2η`` per rounding, generously)."""
        return 2 * self.unit.roundings(n) * self.eta

    def sum_eta(self, n: int, inv_s: float) -> float:
        """:meth:`sum_abs` in the units of ``S`` (``inv_s = 1/S``, ``inf`` where every
        exponential underflows); 0 for a sum that rounds nothing (not ``0·inf``)."""
        return self.sum_abs(n) * inv_s if self.sum_abs(n) else 0.0

    def exp_rel(self, sigma: np.ndarray) -> np.ndarray:
        """``e^σ (1 + ε_exp) - 1``: relative error of ``exp`` of an argument off by ``<= σ``
        (``inf`` past float64's range)."""
        with np.errstate(over="ignore"):
            return np.expm1(sigma) + self.eps_exp * np.exp(sigma)

    def log_exp_factor(self, sigma: Any, rel: Any) -> Any:
        """``log(1 + rel)`` for ``rel = exp_rel(σ)``, as ``σ + log(1 + ε_exp)`` where ``rel``
        overflows float64 (an argument off by more than 709: finite in log space)."""
        with np.errstate(over="ignore"):
            return np.where(np.isfinite(rel), np.log1p(rel), sigma + math.log1p(self.eps_exp))


def rounded_difference(a: np.ndarray, b: np.ndarray, model: Model) -> np.ndarray:
    """A bound on ``|fl(a - b) - (a - b)|`` in the softmax format, a posteriori.

    The float64 difference is checked to be exact by TwoSum; an exact difference that the
    format represents is computed without error. Otherwise the a priori ``u|a - b|``; also
    where the difference overflows the format (to ``-inf`` for ``a <= b``, its exponential 0):
    the upper side of the argument stays within it, and ``u|a - b| >= u·max_finite > ln 2``
    makes the relative error of the exponential at least 1, so the lower side holds too.
    """
    d = a - b
    if model.base2:  # rounded in base 2: no exactness shortcut
        return model.u * (1 + model.rel2) * np.abs(d) * (1 + 2.0**-50) + model.arg_flush
    bv = d - a
    err = (a - (d - bv)) + (-b - bv)
    exact = (err == 0) & np.isfinite(d)
    rep = exact & representable(np.where(exact, d, 0.0), model.fmt)
    error = np.where(exact, np.abs(round_to(np.where(exact, d, 0.0), model.fmt) - d), 0.0)
    apriori = model.u * np.abs(d) * (1 + 2.0**-50)
    out = np.where(rep, 0.0, np.where(exact & np.isfinite(error), error, apriori))
    return out + model.arg_flush


def base2_charge(xr: np.ndarray, finite: np.ndarray, model: Model) -> np.ndarray:
    """The exp2 forms' argument error beyond the subtraction (papers/softmax.md, §4): each
    logit's conversion ``fl(x̂_j·L̂)`` and the shift's, ``rel2(|x̂_j| + R)`` with ``R`` the row's
    largest ``|x̂|``, and an underflow ``2^emin`` for each (0 for the natural ``exp``)."""
    if not model.base2:
        return np.zeros_like(xr)
    r = float(np.max(np.abs(xr[finite]))) if finite.any() else 0.0
    tiny = 2 * model.fmt.smallest_normal
    return (
        np.where(finite, model.rel2 * (np.abs(xr) + r) * (1 + 2.0**-50) + tiny, 0.0)
        + lifted(r, model)[0]
    )


def lifted(r: float, model: Model) -> tuple[float, float]:
    """``prob_offset = k`` (papers/softmax.md, §3'): the exponent's extra error, natural units,
    and the largest computed exponent ``A``; ``(0, 0)`` without a lift.

    The shift is ``fl(M - k)`` with ``|M| <= (1 + ρ)R``: one more rounding, ``u(|M| + k ln 2)``,
    and the argument, up to ``k`` larger, is rounded on that much more, ``u(1 + ρ)k ln 2``.
    ``fl(t·c2) <= M`` for every key of the block, so the argument is at most
    ``(k ln 2 + u(|M| + k ln 2) + η)(1 + u)``.
    """
    if not model.lift:
        return 0.0, 0.0
    u, tiny = model.u, model.fmt.smallest_normal
    shift = u * ((1 + model.rel2) * r + model.lift) * (1 + 2.0**-50) + tiny
    charge = shift + u * (1 + model.rel2) * model.lift * (1 + 2.0**-50)
    return charge, (model.lift + shift) * (1 + u) * (1 + 2.0**-50)


def exact_softmax(t: np.ndarray) -> tuple[np.ndarray, float, float]:
    """``p`` (in long double), ``log S`` with ``S = Σ e^t``, and a bound on ``p``'s relative error.

    ``t`` are the shifted logits (``-inf`` allowed; ``max t = 0`` where the logits are already
    in the softmax format, otherwise off 0 by their rounding into it): shifted once more by
    their maximum, in long double. The relative error counts the span of the ``t`` whose
    exponentials are normal in long double; below, ``p_i`` is smaller than long double's
    smallest normal (``S >= 1`` in the shifted units), far below every ``η`` the bounds add (at
    least ``2^-1074`` of float64's arithmetic).
    """
    ld = np.longdouble
    tl = t.astype(ld)
    top = np.max(tl)
    tl = tl - top
    e = np.exp(tl)
    s = e.sum()
    p = e / s
    finite = np.isfinite(tl) & (tl >= np.log(np.finfo(ld).tiny))
    span = float(np.max(np.abs(tl[finite]))) if finite.any() else 0.0
    rel = (t.size + 8 + 2 * span) * float(np.finfo(ld).eps)
    return p, float(top + np.log(s)), rel


def row_bound(
    p: np.ndarray,
    p_rel: float,
    excess: np.ndarray,
    eta_num: np.ndarray,
    den_lo: float,
    den_hi: float,
    model: Model,
) -> np.ndarray:
    """Combine numerator and denominator enclosures into the componentwise error bound.

    With ``ê_i ∈ [e_i(1 - a_i) - ηe, e_i(1 + a_i) + ηe]`` and ``ŝ ∈ [S(1 - Λ), S(1 + M)]``
    (``den_lo = Λ``, ``den_hi = M``; the absolute parts already divided by ``S``), the quotient
    rounded with ``ε_div`` and ``η_div``::

        p̂_i - p_i <= (p_i a_i (1 + ε) + p_i (ε + Λ))/(1 - Λ) + ηe/S (1 + ε)/(1 - Λ) + η_div
        p_i - p̂_i <= min((p_i a_i + p_i (ε + M))/(1 + M) + ηe/S/(1 + M), p_i) + η_div

    (``p̂_i >= 0``). ``excess`` is ``p_i(1 + p_rel)·a_i`` from :func:`times`.
    """
    eps = model.eps_div
    if den_lo >= 1 or not math.isfinite(den_lo) or not math.isfinite(den_hi):
        return np.full(p.shape, math.inf)
    pu = p.astype(np.float64) * (1 + p_rel)
    up = (excess * (1 + eps) + pu * (eps + den_lo)) / (1 - den_lo)
    up = up + eta_num * (1 + eps) / (1 - den_lo)
    down = (excess + pu * (eps + den_hi)) / (1 + den_hi) + eta_num / (1 + den_hi)
    return (np.maximum(up, np.minimum(down, pu)) + model.eta_div) * EVAL_SLACK


def first_order_terms(
    p: np.ndarray, sigma: np.ndarray, model: Model, gamma: float
) -> dict[str, np.ndarray]:
    """The first-order terms of the componentwise bound (``papers/softmax.md``, Theorems
    S.1–S.3), each a multiple of ``p_i``: ``shift`` ``(σ_i + Σ_j p_j σ_j)p_i`` (the errors
    ``sigma`` of the exponentials' arguments), ``exp`` ``2ε_exp p_i``, ``sum`` ``γ p_i`` (the
    summation constant ``gamma``) and ``division`` ``ε_div p_i``; 0 where ``p_i = 0``."""
    pf = p.astype(np.float64)
    w_sigma = float(np.sum(pf * sigma))

    def times_p(c: Any) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return np.where(pf > 0, pf * c, 0.0)

    return {
        "shift": times_p(sigma + w_sigma),
        "exp": times_p(2 * model.eps_exp),
        "sum": times_p(gamma),
        "division": times_p(model.eps_div),
    }


def past_evaluation_range(xs: np.ndarray, xr: np.ndarray) -> bool:
    """Whether a row reaches past ``2^1021``: differences of two logits, and sums of four
    magnitudes, may then overflow the float64 the bound is evaluated in (only a float64 score
    or softmax format holds such logits)."""
    finite = np.isfinite(xr)
    return bool(
        finite.any() and max(np.max(np.abs(xr[finite])), np.max(np.abs(xs[finite]))) > EVAL_RANGE
    )
