"""Rounding-error bounds for the softmax stage (naive, safe and online), and for logit perturbations.

The bounds are *a posteriori* in the logits: they take the logits ``x`` the softmax is applied to
and bound, componentwise, the error of :func:`mhanum.softmax` on exactly those logits. They are
rigorous (no ``O(u^2)`` dropped) and include underflow. Their derivations are in
``papers/softmax.md``; the first-order forms reduce to Blanchard, Higham & Higham (2021),
Theorems 3.3 and 4.3, and the online bound (Theorem S.3) is new.

Model of the arithmetic in the softmax format ``F`` (unit roundoff ``u = 2^-p``, smallest normal
``2^emin``), shared by every theorem here:

* ``+ - *`` are correctly rounded (round to nearest): ``fl(a op b) = (a op b)(1 + δ) + η``,
  ``|δ| <= u``;
* ``exp`` has relative error ``<= ε_exp = 2·exp_ulps·u`` (an ulp is at most ``2u`` relative) and
  division ``<= ε_div = (1 + u)^(2·div_ulps) - 1`` (:func:`division_error`; XLA divides by a
  broadcast row sum as a product with its correctly rounded reciprocal, two roundings:
  ``div_ulps = 1``, the default);
* underflow: XLA's CPU backend flushes float32, bfloat16 (carried in float32) and float64
  subnormals to zero (inputs and results), so each rounding carries an absolute error
  ``η <= 2^emin (1 + ε)``; float16 (carried in float32) underflows gradually, ``η <= ε·2^emin``;
* no overflow (a bound that cannot exclude it is ``inf``);
* a sum of ``N`` nonnegative terms in the order ``numerics.summation`` has relative error at most
  ``γ_h`` with ``h`` the height of its tree (sequential and native ``N - 1``, pairwise
  ``⌈log2 N⌉``, ``blocked(b)`` ``(b - 1) + (⌈N/b⌉ - 1)``), Kahan the constant of Theorem R.4
  (papers/summation.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.factors import compound, division_error, summation_gamma
from mhanum.formats import Format, representable, round_to
from mhanum.numerics import Numerics, resolve

__all__ = ["division_error", "logit_perturbation", "lse_bound", "softmax_bound", "summation_gamma"]

_SOURCE = "blanchard-higham-higham-2021"
_ASSUMPTIONS = (
    "round to nearest in the softmax format",
    "exp within numerics.exp_ulps ulps, division within numerics.div_ulps ulps",
    "underflow: an absolute error 2^emin (flush to zero) or eps*2^emin (gradual) per rounding",
    "no overflow (the bound is inf where overflow is not excluded)",
    "logits representable in the score format",
)
_FLUSHING = ("float32", "bfloat16", "float64")
# Slack for evaluating the bound itself in float64 from a long-double softmax.
_EVAL_SLACK = 1.0 + 2.0**-40


def _times(weight: Any, rel: Any, log_weight: Any, log_factor: Any) -> np.ndarray:
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


class _Model:
    """The error constants of the softmax format under ``numerics``."""

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


def _rounded_difference(a: np.ndarray, b: np.ndarray, model: _Model) -> np.ndarray:
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


def _base2_charge(xr: np.ndarray, finite: np.ndarray, model: _Model) -> np.ndarray:
    """The exp2 forms' argument error beyond the subtraction (papers/softmax.md, §4): each
    logit's conversion ``fl(x̂_j·L̂)`` and the shift's, ``rel2(|x̂_j| + R)`` with ``R`` the row's
    largest ``|x̂|``, and an underflow ``2^emin`` for each (0 for the natural ``exp``)."""
    if not model.base2:
        return np.zeros_like(xr)
    r = float(np.max(np.abs(xr[finite]))) if finite.any() else 0.0
    tiny = 2 * model.fmt.smallest_normal
    return (
        np.where(finite, model.rel2 * (np.abs(xr) + r) * (1 + 2.0**-50) + tiny, 0.0)
        + _lifted(r, model)[0]
    )


def _lifted(r: float, model: _Model) -> tuple[float, float]:
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


def _exact_softmax(t: np.ndarray) -> tuple[np.ndarray, float, float]:
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


def _row_bound(
    p: np.ndarray,
    p_rel: float,
    excess: np.ndarray,
    eta_num: np.ndarray,
    den_lo: float,
    den_hi: float,
    model: _Model,
) -> np.ndarray:
    """Combine numerator and denominator enclosures into the componentwise error bound.

    With ``ê_i ∈ [e_i(1 - a_i) - ηe, e_i(1 + a_i) + ηe]`` and ``ŝ ∈ [S(1 - Λ), S(1 + M)]``
    (``den_lo = Λ``, ``den_hi = M``; the absolute parts already divided by ``S``), the quotient
    rounded with ``ε_div`` and ``η_div``::

        p̂_i - p_i <= (p_i a_i (1 + ε) + p_i (ε + Λ))/(1 - Λ) + ηe/S (1 + ε)/(1 - Λ) + η_div
        p_i - p̂_i <= min((p_i a_i + p_i (ε + M))/(1 + M) + ηe/S/(1 + M), p_i) + η_div

    (``p̂_i >= 0``). ``excess`` is ``p_i(1 + p_rel)·a_i`` from :func:`_times`.
    """
    eps = model.eps_div
    if den_lo >= 1 or not math.isfinite(den_lo) or not math.isfinite(den_hi):
        return np.full(p.shape, math.inf)
    pu = p.astype(np.float64) * (1 + p_rel)
    up = (excess * (1 + eps) + pu * (eps + den_lo)) / (1 - den_lo)
    up = up + eta_num * (1 + eps) / (1 - den_lo)
    down = (excess + pu * (eps + den_hi)) / (1 + den_hi) + eta_num / (1 + den_hi)
    return (np.maximum(up, np.minimum(down, pu)) + model.eta_div) * _EVAL_SLACK


def _first_order_terms(
    p: np.ndarray, sigma: np.ndarray, model: _Model, gamma: float
) -> dict[str, np.ndarray]:
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


def _naive_or_safe(xs: np.ndarray, xr: np.ndarray, model: _Model, safe: bool) -> tuple[Any, ...]:
    """One row of the naive or safe softmax: (total, first-order terms, underflow)."""
    n = xs.size
    finite = np.isfinite(xr)
    xs, xr = np.where(finite, xs, 0.0), np.where(finite, xr, 0.0)
    m = float(np.max(xr[finite]))
    t = np.where(finite, xs - m, -np.inf)
    p, log_s, p_rel = _exact_softmax(t)
    sigma = np.where(finite, np.abs(xr - xs), 0.0)
    if safe:
        sigma = sigma + np.where(finite, _rounded_difference(xr, np.full_like(xr, m), model), 0.0)
        sigma = sigma + _base2_charge(xr, finite, model)
    elif model.flushes:
        sigma = sigma + np.where(finite, model.fmt.smallest_normal, 0.0)
    a = np.where(finite, model.exp_rel(sigma), 0.0)
    log_p = t - log_s + math.log1p(p_rel)
    excess = _times(p * (1 + p_rel), a, log_p, model.log_exp_factor(sigma, a))
    shift = 0.0 if safe else m
    with np.errstate(over="ignore"):
        inv_s = float(np.exp(np.float64(-log_s - shift)))  # 1/S in the units of the exps
    eta_e = model.eta_exp * inv_s
    gamma = model.gamma(n)
    weighted = float(np.sum(excess))
    in_sum = weighted + n * eta_e
    sum_eta = model.sum_eta(n, inv_s)
    den_hi = in_sum + gamma + in_sum * gamma + sum_eta
    den_lo = in_sum + gamma * (1 + in_sum) + sum_eta
    log_top = m + max(float(np.max(model.log_exp_factor(sigma, a))), log_s + math.log1p(den_hi))
    carrier_emin = -1022 if model.fmt.name == "float64" else -126  # XLA's carrier: f64 or f32
    reciprocal_flush = -carrier_emin * math.log(2) - 1
    if not safe and (log_top >= math.log(model.fmt.max_finite) or log_top >= reciprocal_flush):
        # exp(x) or the sum may overflow, or the sum may exceed 2^-emin / e: XLA divides by a
        # broadcast row sum as a product with its reciprocal, which is then subnormal and
        # flushed to zero, so every probability of the row becomes 0 (papers/softmax.md S.1).
        den_lo = math.inf
    eta_num = np.where(finite, eta_e, 0.0)
    total = _row_bound(p, p_rel, excess, eta_num, den_lo, den_hi, model)
    terms = _first_order_terms(p, sigma, model, gamma)
    pf = p.astype(np.float64)
    with np.errstate(invalid="ignore"):  # 1/S = inf where every exponential underflows
        underflow = eta_num + np.where(pf > 0, (n * eta_e + sum_eta) * pf, 0.0) + model.eta_div
    return total, terms, underflow


def _online(xs: np.ndarray, xr: np.ndarray, model: _Model, block: int) -> tuple[Any, ...]:
    """One row of the online softmax (Theorem S.3): the recursion of ``papers/softmax.md`` §3."""
    n = xs.size
    finite = np.isfinite(xr)
    xs, xr = np.where(finite, xs, 0.0), np.where(finite, xr, 0.0)
    n_blocks = -(-n // block)
    gamma_b = model.gamma(block)
    base2 = _base2_charge(xr, finite, model)
    u = model.u
    # Per-term log(1 + Φ_j), j already summed; Φ the relative error bound of the term in d̂_k.
    log_phi = np.zeros(n)
    rescale_log = np.zeros(n)  # the part of log_phi due to rescalings
    psi = 0.0  # absolute error of d̂_k, in the units of the shift m_k
    m_prev = -math.inf
    started = False
    for k in range(n_blocks):
        sl = slice(k * block, min((k + 1) * block, n))
        blk = xr[sl]
        fin = finite[sl]
        m_new = max(m_prev, float(np.max(blk[fin]))) if fin.any() else m_prev
        if started:
            # ĉ = exp(fl(m_prev - m_new)); d̂·ĉ rounded, then the block sum added, rounded.
            sig_c = float(_rounded_difference(np.array([m_prev]), np.array([m_new]), model)[0])
            if model.base2:  # exp2-folded rounds fl(m - m') and its product by c2
                sig_c = sig_c * (2 + model.u)
            kappa = model.exp_rel(np.array(sig_c))
            step = float(model.log_exp_factor(sig_c, kappa)) + 2 * math.log1p(u)
            done = np.arange(n) < k * block
            # D_{k-1}^hi, in the units of m_prev, before this rescaling
            shifted_old = np.where(done & finite, xr - m_prev, -np.inf)
            old_phi = np.where(done, log_phi, 0.0)
            old = np.exp(shifted_old)
            with np.errstate(over="ignore"):
                old_rel = np.expm1(old_phi)
            d_old_hi = float(np.sum(old + _times(old, old_rel, shifted_old, old_phi)))
            log_phi = np.where(done, log_phi + step, log_phi)
            rescale_log = np.where(done, rescale_log + step, rescale_log)
            gap = m_prev - m_new  # e^gap (1 + κ): in log space where κ overflows
            c_hat = _times(math.exp(gap), kappa, gap, model.log_exp_factor(sig_c, kappa))
            c_hi = math.exp(gap) + float(c_hat) + model.eta_exp
            psi = (model.eta_exp * d_old_hi + psi * c_hi) * (1 + u) + model.eta
        if fin.any():
            sig = _rounded_difference(blk[fin], np.full(int(fin.sum()), m_new), model)
            sig = sig + base2[sl][fin]
            idx = np.arange(sl.start, sl.stop)[fin]
            log_phi[idx] = model.log_exp_factor(sig, model.exp_rel(sig)) + math.log1p(gamma_b)
            psi_block = block * model.eta_exp * (1 + gamma_b) + model.sum_abs(block)
            if started:
                log_phi[idx] += math.log1p(u)
                psi = (psi + psi_block) * (1 + u) + model.eta
            else:
                psi = psi + psi_block
            started = True
        m_prev = m_new
    m = m_prev
    t = np.where(finite, xs - m, -np.inf)
    p, log_s, p_rel = _exact_softmax(t)
    pf = p.astype(np.float64)
    with np.errstate(over="ignore"):  # inf where the rounding into the format is past 709
        inv_s = float(np.exp(np.float64(-log_s)))
    sigma = np.where(finite, np.abs(xr - xs), 0.0)
    sigma = sigma + np.where(finite, _rounded_difference(xr, np.full_like(xr, m), model), 0.0)
    sigma = sigma + base2
    a = np.where(finite, model.exp_rel(sigma), 0.0)
    with np.errstate(over="ignore"):
        phi = np.where(finite, np.expm1(log_phi), 0.0)
    # the shifted logits relative to m_K: x̂_j - m against x_j - m is the input rounding; Φ
    # already holds the subtraction and exp errors against x̂_j - m_k.
    with np.errstate(over="ignore"):  # an input rounding past 709: inf, then log space
        input_rel = np.where(finite, np.expm1(np.abs(xr - xs)), 0.0)
    log_p = t - log_s + math.log1p(p_rel)
    with np.errstate(over="ignore", invalid="ignore"):
        term_rel = np.where(finite, compound(phi, input_rel), 0.0)
    log_term = np.where(finite, log_phi + np.abs(xr - xs), 0.0)
    weighted = float(np.sum(_times(pf * (1 + p_rel), term_rel, log_p, log_term)))
    den_hi = weighted + psi * inv_s
    den_lo = den_hi
    eta_num = np.where(finite, model.eta_exp * inv_s, 0.0)
    excess = _times(pf * (1 + p_rel), a, log_p, model.log_exp_factor(sigma, a))
    total = _row_bound(p, p_rel, excess, eta_num, den_lo, den_hi, model)
    terms = _first_order_terms(p, sigma, model, gamma_b)
    with np.errstate(over="ignore", invalid="ignore"):
        rescaling = pf * float(np.sum(np.where(pf > 0, pf * np.expm1(rescale_log), 0.0)))
        underflow = eta_num + np.where(pf > 0, psi * inv_s * pf, 0.0) + model.eta_div
    rescaling = np.where(pf > 0, rescaling, 0.0)
    return total, {**terms, "rescaling": rescaling}, underflow


def _online_sum_upper(xr: np.ndarray, model: _Model, block: int) -> float:
    """An enclosure of every exponential and running sum of the online softmax on ``xr``: each
    exponential at most ``e^A(1 + ε_exp)`` (``A = 0`` without a lift), a block's sum within its
    ``γ``, and each of the ``K`` rescalings and additions ``(1 + ε_exp)(1 + u)²`` more."""
    finite = np.isfinite(xr)
    r = float(np.max(np.abs(xr[finite]))) if finite.any() else 0.0
    n, blocks = xr.size, -(-xr.size // block)
    growth = ((1 + model.eps_exp) * (1 + model.u) ** 2) ** blocks
    with np.errstate(over="ignore"):
        top = float(np.exp(_lifted(r, model)[1])) if model.lift else 1.0  # inf past float64
        return n * top * (1 + model.eps_exp) * (1 + model.gamma(block)) * growth


_EVAL_RANGE = 2.0**1021  # a quarter of float64's largest finite value
_UNEVALUABLE = (
    "logits beyond 2^1021 in magnitude (float64 formats only): the differences and sums that "
    "the bound is evaluated with in float64 may overflow it"
)


def _past_evaluation_range(xs: np.ndarray, xr: np.ndarray) -> bool:
    """Whether a row reaches past ``2^1021``: differences of two logits, and sums of four
    magnitudes, may then overflow the float64 the bound is evaluated in (only a float64 score
    or softmax format holds such logits)."""
    finite = np.isfinite(xr)
    return bool(
        finite.any() and max(np.max(np.abs(xr[finite])), np.max(np.abs(xs[finite]))) > _EVAL_RANGE
    )


def _scaled_maxima_fit(xr: np.ndarray, model: _Model, block: int | None) -> bool:
    """The exp2 forms compute ``fl(m·L̂)`` (less ``k``, ``prob_offset``) for the row's maximum,
    or (online) every running maximum: whether each provably stays finite. Past the range
    it is ``±inf``, and the maximum's own argument ``inf - inf`` is NaN."""
    finite = np.isfinite(xr)
    if block is None:
        tops = xr[finite].max(keepdims=True)
    else:
        pad = -(-xr.size // block) * block - xr.size
        blocks = np.pad(np.where(finite, xr, -np.inf), (0, pad), constant_values=-np.inf)
        running = np.maximum.accumulate(blocks.reshape(-1, block).max(axis=1))
        tops = running[np.isfinite(running)]
    top = float(np.max(np.abs(tops))) * math.log2(math.e) * (1 + model.rel2) * (1 + 2.0**-50)
    return (top + model.lift / math.log(2.0)) * (1 + model.u) <= model.fmt.max_finite


def _logits(x: Any, num: Numerics) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as err:
        msg = f"x: expected a real array of logits, got {type(x).__name__}"
        raise InvalidArgument(msg) from err
    if arr.dtype.kind not in "fiu" and not str(arr.dtype).startswith(("bfloat", "float")):
        msg = f"x: expected a real array of logits, got dtype {arr.dtype}"
        raise InvalidArgument(msg)
    arr = arr.astype(np.float64)
    if arr.ndim < 1 or arr.shape[-1] < 1:
        msg = f"x: expected shape (..., n) with n >= 1, got {arr.shape}"
        raise InvalidArgument(msg)
    if np.isnan(arr).any() or np.isposinf(arr).any():
        msg = "x: expected finite logits (-inf allowed), got NaN or +inf"
        raise InvalidArgument(msg)
    if not np.isfinite(arr).any(axis=-1).all():
        msg = "x: expected at least one finite logit per row, got a row of -inf"
        raise InvalidArgument(msg)
    score = num.format_of("score")
    if not representable(arr, score).all():
        msg = f"x: expected logits representable in the score format {score.name}; round them"
        raise InvalidArgument(msg)
    return arr


def softmax_bound(x: Any, numerics: Numerics | str | None = None) -> Bound:
    """Componentwise bound on the error of :func:`mhanum.softmax` for the logits ``x``.

    **Theorem S.1 (naive), S.2 (safe), S.3 (online).** Let ``x`` be logits in the score format,
    ``x̂ = fl_F(x)`` in the softmax format ``F``, ``p = softmax(x)`` exactly and ``p̂`` the result
    of ``mhanum.softmax(x, numerics=numerics)``. Under the model of this module (round to
    nearest, ``ε_exp``, ``ε_div``, the summation ``γ``, underflow terms, no overflow),

    .. math::

        |\\hat p_i - p_i| \\le \\mathrm{total}_i,

    where ``total`` is the rigorous a posteriori bound of ``papers/softmax.md`` (§1-3). To first
    order in ``u``, with ``σ_j`` the error of the exp argument (``σ_j = |x̂_j - x_j|`` naive;
    ``+ u|x̂_j - x̂_max|`` or 0 when the difference is exact, safe and online) and ``γ`` the
    summation constant over ``n`` terms (over ``B`` terms for online):

    .. math::

        \\frac{|\\hat p_i - p_i|}{p_i} \\le \\sigma_i + \\sum_j p_j\\sigma_j
            + 2\\varepsilon_{\\exp} + \\gamma + \\varepsilon_{\\div}
            \\;\\Big[ + \\sum_j p_j \\Big(u + \\sum_{l = k(j)+1}^{K} (\\sigma_{c,l}
            + \\varepsilon_{\\exp} + 2u)\\Big) \\Big]_{\\text{online}} + O(u^2)
            + \\text{underflow}

    with ``K = ⌈n/B⌉`` blocks, ``k(j)`` the block of ``j``, ``σ_j <= u(m_{k(j)} - x̂_j)`` for the
    in-block terms and ``σ_{c,l} <= u(m_l - m_{l-1})`` the error of the argument of the ``l``-th
    rescaling factor (the ``u`` is the rounding of adding a block sum to the rescaled total). With ``exp_ulps = div_ulps =
    1/2`` and sequential summation: naive ``(n + 2)u`` (within BHH Thm 3.3's ``(n + 3)u``), safe
    ``(n + 2 + 2(x_max - x_min))u`` (BHH Thm 4.3, here componentwise), online
    ``(B + 3 + 2(x_max - x_min) + 3(⌈n/B⌉ - 1))u`` at most (Theorem S.3; ``B + 2 + ...`` for
    one block): each term is rescaled at most ``⌈n/B⌉ - 1`` times, and the arguments of the
    rescalings telescope to at most ``x_max - x_j``.

    Args:
        x: logits ``(..., n)``, each representable in ``numerics``' score format; ``-inf``
            entries (masked) are allowed, at least one finite per row.
        numerics: a :class:`mhanum.Numerics` or a preset name.

    Returns:
        A :class:`Bound` shaped like ``x``: ``total`` and the terms ``shift``, ``exp``, ``sum``,
        ``division``, ``underflow``, ``rescaling`` (online), ``second_order`` (the rest of the
        rigorous total). ``inf`` where overflow or total underflow of the naive sum cannot be
        excluded, or (online) an exponential or the running sum may overflow: with
        ``prob_offset = k`` they are lifted by ``2^k`` and more where the shift
        ``fl(fl(m·c2) - k)`` rounds (papers/softmax.md, §3').

    Raises:
        InvalidArgument: for a bad ``numerics``, NaN/+inf or a row of ``-inf`` in ``x``, or
            logits not representable in the score format.

    Examples:
        >>> b = softmax_bound([0.0, 1.0, 2.0], "fp32")
        >>> bool((b.total < 10 * 2.0**-24).all())
        True

    References:
        Blanchard, Higham & Higham, IMA J. Numer. Anal. 41(4), 2021, Thms 3.3, 4.3;
        Milakov & Gimelshein, arXiv:1805.02867 (the online algorithm); papers/softmax.md.
    """
    num = resolve(numerics)
    arr = _logits(x, num)
    model = _Model(num)
    rounded = round_to(arr, model.fmt)
    if np.isinf(rounded[np.isfinite(arr)]).any():
        msg = f"x: expected logits within the range of the softmax format {model.fmt.name}"
        raise InvalidArgument(msg)
    rows_x = arr.reshape(-1, arr.shape[-1])
    rows_r = rounded.reshape(-1, arr.shape[-1])
    kind = num.softmax_kind
    totals, unders = [], []
    terms: dict[str, list[np.ndarray]] = {}
    # an overflow of (online) the sums or (exp2 forms) a maximum times log2 e; a row infinite
    # otherwise
    over, scaled_over, vacuous = False, False, False
    block = num.softmax_block
    unevaluable = False  # a float64 row past a quarter of float64's range
    for xs, xr in zip(rows_x, rows_r, strict=True):
        if _past_evaluation_range(xs, xr):
            infinite = np.full(xr.shape, np.inf)
            names = ("shift", "exp", "sum", "division") + ("rescaling",) * (kind == "online")
            total, t, under = infinite, dict.fromkeys(names, infinite), infinite
            unevaluable = True
        else:
            if kind == "online":
                assert block is not None
                total, t, under = _online(xs, xr, model, block)
            else:
                total, t, under = _naive_or_safe(xs, xr, model, safe=kind == "safe")
            if model.base2 and kind != "naive" and not _scaled_maxima_fit(xr, model, block):
                total, scaled_over = np.full_like(total, np.inf), True
            elif kind == "online" and not (
                _online_sum_upper(xr, model, block or 1) <= model.fmt.max_finite
            ):
                total, over = np.full_like(total, np.inf), True
            else:
                vacuous |= not np.isfinite(total).all()
        totals.append(total)
        unders.append(under)
        for name, value in t.items():
            terms.setdefault(name, []).append(value)
    total_arr = np.stack(totals).reshape(arr.shape)
    out = {name: np.stack(v).reshape(arr.shape) for name, v in terms.items()}
    out["underflow"] = np.stack(unders).reshape(arr.shape)
    with np.errstate(invalid="ignore"):
        rest = total_arr - sum(out.values())
    out["second_order"] = np.where(np.isfinite(rest), np.maximum(rest, 0.0), 0.0)
    label = {"naive": "S.1", "safe": "S.2", "online": "S.3"}[kind]
    reasons: tuple[str, ...] = ()
    if vacuous:
        why = (
            f"exp of an unshifted logit or the row sum may overflow {model.fmt.name}, or the sum "
            "exceed 2^-emin of the reciprocal's format (flushed to zero), or the computed sum "
            "be off by 100%"
            if kind == "naive"
            else "the computed row sum may be off by 100% (its error factor reaches 1)"
        )
        reasons = (f"{kind} softmax: {why}",)
    if unevaluable:
        reasons = (*reasons, _UNEVALUABLE)
    if scaled_over:
        why = (
            f"{kind} softmax ({num.exp_form}): a row's (running) maximum times log2 e may "
            f"overflow {model.fmt.name} (largest finite {model.fmt.max_finite:.6g}), and "
            "inf - inf is NaN"
        )
        reasons = (*reasons, why)
    if over:
        lifted = f" (exponentials lifted by 2^{num.prob_offset}, prob_offset)" * bool(model.lift)
        why = (
            f"online softmax: an exponential or the running sum{lifted} may overflow "
            f"{model.fmt.name} (largest finite {model.fmt.max_finite:.6g})"
        )
        reasons = (*reasons, why)
    return Bound(
        reasons=reasons,
        total=total_arr,
        terms=out,
        theorem=f"papers/softmax.md Theorem {label}",
        assumptions=_ASSUMPTIONS,
        source=_SOURCE if kind != "online" else None,
    )


def _lse_row(xs: np.ndarray, xr: np.ndarray, model: _Model, shifted: bool, eps_log: float) -> Any:
    """One row of Theorem S.5: (total, terms) for the basic or shifted log-sum-exp."""
    if _past_evaluation_range(xs, xr):
        names = ("input", "sum", "log") + ("add",) * shifted
        return math.inf, dict.fromkeys(names, math.inf)
    finite = np.isfinite(xr)
    xs, xr = np.where(finite, xs, 0.0), np.where(finite, xr, 0.0)
    n = int(finite.sum())
    inputs = float(np.max(np.abs(xr - xs)[finite]))
    k = int(np.flatnonzero(finite)[np.argmax(xr[finite])])
    a = float(xr[k])
    t = np.where(finite, xr - a, -np.inf)  # LSE of the rounded logits x̂ from here on
    e = np.exp(t.astype(np.longdouble))
    if shifted:
        others = finite & (np.arange(xr.size) != k)
        sigma = _rounded_difference(xr, np.full_like(xr, a), model)
        s_prime = float(np.sum(np.where(others, e, 0)))
        rel = np.where(others, model.exp_rel(sigma), 0.0)
        n_sum = max(n - 1, 1)
        gamma = model.gamma(n_sum)
        fits = np.isfinite(rel)
        far = _times(0.0, rel, np.where(others, t, -np.inf), model.log_exp_factor(sigma, rel))
        dev = float(np.sum(np.where(others & fits, e, 0) * np.where(fits, rel, 0)) + np.sum(far))
        delta_s = (s_prime + dev) * gamma + dev + (n - 1) * model.eta_exp * (1 + gamma)
        delta_s = (delta_s + model.sum_abs(n_sum)) * _EVAL_SLACK
        ell = delta_s / (1 + max(s_prime * (1 - 1e-15) - delta_s, 0.0))
        b = math.log1p(s_prime)
        b_err = ell + eps_log * (b + ell) + model.eta
        y = a + b
        total = inputs + b_err * (1 + model.u) + model.u * (abs(y) + inputs) + model.eta
        terms = {"input": inputs, "sum": ell, "log": eps_log * (b + ell), "add": model.u * abs(y)}
    else:
        sigma = np.where(finite, model.fmt.smallest_normal if model.flushes else 0.0, 0.0)
        rel = np.where(finite, model.exp_rel(sigma), 0.0)
        s_rel = float(np.sum(e))
        log_s = float(np.log(e.sum()))
        with np.errstate(over="ignore"):
            inv_s = float(np.exp(np.float64(-log_s - a)))
        gamma = model.gamma(n)
        in_sum = float(np.sum(e * rel)) / s_rel + n * model.eta_exp * inv_s
        sum_eta = model.sum_eta(n, inv_s)
        m_up = in_sum + gamma + in_sum * gamma + sum_eta
        lam = in_sum + gamma * (1 + in_sum) + sum_eta
        y = a + log_s
        top = a + max(math.log1p(float(np.max(rel))), log_s + math.log1p(m_up))
        if not (lam < 1 and top < math.log(model.fmt.max_finite)):  # NaN: infinite
            return math.inf, {"input": inputs, "sum": math.inf, "log": math.inf}
        ell = max(math.log1p(m_up), -math.log1p(-lam)) * _EVAL_SLACK
        total = inputs + ell + eps_log * (abs(y) + inputs + ell)
        terms = {"input": inputs, "sum": ell, "log": eps_log * (abs(y) + inputs + ell)}
    return total * _EVAL_SLACK, terms


def lse_bound(
    x: Any,
    numerics: Numerics | str | None = None,
    *,
    algorithm: str = "shifted",
    log_ulps: float = 0.5,
) -> Bound:
    """Absolute bound on the error of the log-sum-exp ``y = log Σ exp(x_i)`` (Theorem S.5).

    **Theorem S.5.** The algorithms are those of Blanchard, Higham & Higham (2021), run in the
    softmax format ``F`` of ``numerics`` with its summation order (mhanum has no log-sum-exp of
    its own; ``papers/reproduce_bhh2021.py`` runs them): ``basic`` (Alg. 3.1)
    ``ŷ = fl(log fl(Σ fl(exp x̂_i)))``; ``shifted`` (Alg. 4.1) ``a = max x̂ = x̂_k``,
    ``ŝ = fl(Σ_{i≠k} fl(exp fl(x̂_i - a)))``, ``ŷ = fl(a + fl(log1p ŝ))``. With ``log``/``log1p``
    within ``log_ulps`` ulps (``ε_log = 2·log_ulps·u``), the model of this module and
    ``x̂ = fl_F(x)`` with ``δ = max|x̂ - x|``:

    .. math::

        \\text{basic: } |\\hat y - y| \\le \\delta + \\ell + \\varepsilon_{\\log}(|y| + \\delta
            + \\ell), \\qquad \\ell = \\max(\\log(1+M), -\\log(1-\\Lambda)),

        \\text{shifted: } |\\hat y - y| \\le \\delta + (1+u)\\big(\\ell' + \\varepsilon_{\\log}(b
            + \\ell') + \\eta\\big) + u(|y| + \\delta) + \\eta, \\qquad
            \\ell' = \\frac{\\Delta s}{1 + \\max(s - \\Delta s, 0)},

    with ``[1 - Λ, 1 + M]`` the relative enclosure of the computed sum (Theorem S.1),
    ``s = Σ_{i≠k} e^{x̂_i - a}``, ``b = log1p(s)`` and ``Δs`` the bound on ``|ŝ - s|``. To first
    order and with exact rounding these are BHH Thm 3.2, ``|ŷ - y|/|y| <= (1 + (n + 1)/|y|)u``
    up to the sum's constant, and Thm 4.2, ``|ŷ - y|/|y| <= |(y + n - x_min)/y| u``-like (``ℓ'``
    is at most ``(n - 1 + ...)u·s/(1+s)``). Proof in ``papers/softmax.md`` §5.

    Args:
        x: logits ``(..., n)`` representable in the score format (``-inf`` allowed, one finite
            per row).
        numerics: a :class:`mhanum.Numerics` or a preset name (its softmax format, summation
            order, ``exp_ulps``).
        algorithm: ``"basic"`` or ``"shifted"``.
        log_ulps: assumed accuracy of ``log`` and ``log1p`` in ulps of ``F``.

    Returns:
        A :class:`Bound` with ``total`` shaped ``x.shape[:-1]`` (``inf`` where the basic
        algorithm may overflow or its sum underflow entirely, with the reason in ``reasons``)
        and terms ``input``, ``sum``, ``log`` (and ``add`` for shifted).

    Raises:
        InvalidArgument: as :func:`softmax_bound`, for an unknown ``algorithm`` or a bad
            ``log_ulps``.
    """
    if algorithm not in ("basic", "shifted"):
        msg = f"algorithm: expected 'basic' or 'shifted', got {algorithm!r}"
        raise InvalidArgument(msg)
    if (
        isinstance(log_ulps, bool)
        or not isinstance(log_ulps, (int, float))
        or not (math.isfinite(log_ulps) and log_ulps >= 0)
    ):
        msg = f"log_ulps: expected a finite number >= 0, got {log_ulps!r}"
        raise InvalidArgument(msg)
    num = resolve(numerics)
    arr = _logits(x, num)
    model = _Model(num)
    rounded = round_to(arr, model.fmt)
    if np.isinf(rounded[np.isfinite(arr)]).any():
        msg = f"x: expected logits within the range of the softmax format {model.fmt.name}"
        raise InvalidArgument(msg)
    eps_log = 2 * log_ulps * model.u
    rows_x, rows_r = arr.reshape(-1, arr.shape[-1]), rounded.reshape(-1, arr.shape[-1])
    rows = [
        _lse_row(xs, xr, model, algorithm == "shifted", eps_log)
        for xs, xr in zip(rows_x, rows_r, strict=True)
    ]
    shape = arr.shape[:-1]
    names = rows[0][1].keys()
    total = np.array([r[0] for r in rows]).reshape(shape)
    reasons: tuple[str, ...] = ()
    if not np.isfinite(total).all():
        why = (
            "an exponential or the sum may overflow, or every exponential underflow (log 0)"
            if algorithm == "basic"
            else "the sum's error may exceed the sum"
        )
        reasons = (f"{algorithm} log-sum-exp in {model.fmt.name}: {why}",)
        if any(_past_evaluation_range(*r) for r in zip(rows_x, rows_r, strict=True)):
            reasons = (*reasons, _UNEVALUABLE)
    return Bound(
        reasons=reasons,
        total=total,
        terms={k: np.array([r[1][k] for r in rows]).reshape(shape) for k in names},
        theorem="papers/softmax.md Theorem S.5",
        assumptions=(*_ASSUMPTIONS, "log and log1p within log_ulps ulps"),
        source=_SOURCE,
    )


def logit_perturbation(delta: Any, probabilities: Any = None) -> Bound:
    """How much a perturbation of the logits moves the softmax (Theorem S.4).

    **Theorem S.4.** For logits ``s`` and ``s + Δs`` with ``p = softmax(s)``,
    ``p̃ = softmax(s + Δs)``:

    .. math::

        |\\log \\tilde p_i - \\log p_i| \\le |\\Delta s_i| + \\|\\Delta s\\|_\\infty
            \\le 2\\|\\Delta s\\|_\\infty, \\qquad
        |\\tilde p_i - p_i| \\le \\big(e^{|\\Delta s_i| + \\|\\Delta s\\|_\\infty} - 1\\big) p_i
            \\le \\big(e^{2\\|\\Delta s\\|_\\infty} - 1\\big) p_i .

    Exact (no rounding): it bounds the effect of earlier errors (scores, masks, the logits'
    rounding) on the softmax. Proof in ``papers/softmax.md`` §4.

    Args:
        delta: the perturbation ``Δs`` (``(..., n)``; the row's ``∞``-norm is taken over the last
            axis) or a nonnegative scalar ``‖Δs‖∞``.
        probabilities: ``p``, broadcastable with ``delta``; if given the bound is absolute, else
            relative (a factor of ``p_i``).

    Returns:
        A :class:`Bound` with ``total`` the bound on ``|p̃_i - p_i|`` (or on ``|p̃_i/p_i - 1|``)
        and the term ``log_p`` (the bound on ``|Δ log p_i|``).

    Raises:
        InvalidArgument: for a non-finite or negative scalar, NaN in ``delta``, or probabilities
            outside ``[0, 1]``.

    Examples:
        >>> float(logit_perturbation(0.5).terms["log_p"])
        1.0
    """
    d = np.asarray(delta, dtype=np.float64) if _is_real(delta) else None
    if d is None or np.isnan(d).any() or np.isinf(d).any():
        msg = f"delta: expected a finite real array or number, got {delta!r}"
        raise InvalidArgument(msg)
    if d.ndim == 0:
        if d < 0:
            msg = f"delta: expected a norm >= 0 when a scalar, got {float(d)}"
            raise InvalidArgument(msg)
        log_p = 2 * d
    else:
        log_p = np.abs(d) + np.max(np.abs(d), axis=-1, keepdims=True)
    rel = np.expm1(log_p)
    total = rel
    if probabilities is not None:
        p = np.asarray(probabilities, dtype=np.float64) if _is_real(probabilities) else None
        if p is None or np.isnan(p).any() or (p < 0).any() or (p > 1).any():
            msg = f"probabilities: expected values in [0, 1], got {probabilities!r}"
            raise InvalidArgument(msg)
        try:
            total = rel * p
        except ValueError as err:
            msg = (
                f"probabilities: expected a shape broadcastable with delta {d.shape}, got {p.shape}"
            )
            raise InvalidArgument(msg) from err
    return Bound(
        total=total,
        terms={"log_p": log_p},
        theorem="papers/softmax.md Theorem S.4",
        assumptions=("exact arithmetic: the perturbation is the only error",),
    )


def _is_real(x: Any) -> bool:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError):
        return False
    return arr.dtype.kind in "fiu" and arr.dtype != np.bool_
