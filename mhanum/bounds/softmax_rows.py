"""One row of each softmax theorem, on the model of :mod:`mhanum.bounds.softmax_model`.

:func:`mhanum.bounds.softmax.softmax_bound` bounds each row of logits with one function here:
:func:`naive_or_safe_row` (Theorems S.1 and S.2) or :func:`online_row` (Theorem S.3: the
recursion over blocks of keys, its rescalings and the final quotient, one step each), after
checking that the row's exponentials and sums stay finite (:func:`online_sum_upper`,
:func:`scaled_maxima_fit`); :func:`mhanum.bounds.softmax.lse_bound` bounds each row with
:func:`lse_row` (Theorem S.5). Each takes the logits ``xs`` and their rounding ``xr`` into the
softmax format; the derivations are in ``papers/softmax.md``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum.bounds.factors import compound
from mhanum.bounds.softmax_model import (
    EVAL_SLACK,
    Model,
    base2_charge,
    exact_softmax,
    first_order_terms,
    lifted,
    past_evaluation_range,
    rounded_difference,
    row_bound,
    times,
)

__all__ = [
    "lse_row",
    "naive_or_safe_row",
    "online_row",
    "online_sum_upper",
    "scaled_maxima_fit",
]


def naive_or_safe_row(xs: np.ndarray, xr: np.ndarray, model: Model, safe: bool) -> tuple[Any, ...]:
    """One row of the naive (Theorem S.1) or safe (Theorem S.2, ``safe``) softmax,
    ``papers/softmax.md`` §1-2: (total, first-order terms, underflow)."""
    n = xs.size
    finite = np.isfinite(xr)
    xs, xr = np.where(finite, xs, 0.0), np.where(finite, xr, 0.0)
    m = float(np.max(xr[finite]))
    t = np.where(finite, xs - m, -np.inf)
    p, log_s, p_rel = exact_softmax(t)
    sigma = np.where(finite, np.abs(xr - xs), 0.0)
    if safe:
        sigma = sigma + np.where(finite, rounded_difference(xr, np.full_like(xr, m), model), 0.0)
        sigma = sigma + base2_charge(xr, finite, model)
    elif model.flushes:
        sigma = sigma + np.where(finite, model.fmt.smallest_normal, 0.0)
    a = np.where(finite, model.exp_rel(sigma), 0.0)
    log_p = t - log_s + math.log1p(p_rel)
    excess = times(p * (1 + p_rel), a, log_p, model.log_exp_factor(sigma, a))
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
    total = row_bound(p, p_rel, excess, eta_num, den_lo, den_hi, model)
    terms = first_order_terms(p, sigma, model, gamma)
    pf = p.astype(np.float64)
    with np.errstate(invalid="ignore"):  # 1/S = inf where every exponential underflows
        underflow = eta_num + np.where(pf > 0, (n * eta_e + sum_eta) * pf, 0.0) + model.eta_div
    return total, terms, underflow


def online_row(xs: np.ndarray, xr: np.ndarray, model: Model, block: int) -> tuple[Any, ...]:
    """One row of the online softmax (Theorem S.3): the recursion of ``papers/softmax.md`` §3
    (:func:`_recursion`), then the quotient (:func:`_online_quotient`); (total, first-order
    terms with ``rescaling``, underflow)."""
    finite = np.isfinite(xr)
    xs, xr = np.where(finite, xs, 0.0), np.where(finite, xr, 0.0)
    base2 = base2_charge(xr, finite, model)
    recursion = _recursion(xr, finite, base2, model, block)
    return _online_quotient(xs, xr, finite, base2, recursion, model, model.gamma(block))


@dataclasses.dataclass(frozen=True, eq=False)
class _Recursion:
    """The online recursion run to its end (``papers/softmax.md`` §3): per term ``log(1 + Φ_j)``
    (``log_phi``; ``Φ_j`` the relative error bound of the term in ``d̂_K``), the part of it due
    to the rescalings (``rescale_log``), the absolute error ``psi`` of ``d̂_K`` in the units of
    the last shift, and that shift ``m`` (the row's maximum)."""

    log_phi: np.ndarray
    rescale_log: np.ndarray
    psi: float
    m: float


def _recursion(
    xr: np.ndarray, finite: np.ndarray, base2: np.ndarray, model: Model, block: int
) -> _Recursion:
    """Theorem S.3's recursion over the blocks of ``block`` keys: at each block whose running
    maximum is known, the earlier sum is rescaled (:func:`_rescaling_factor`) and the block's
    sum added, each rounding charged to the terms it touches."""
    n = xr.size
    n_blocks = -(-n // block)
    gamma_b = model.gamma(block)
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
            step, c_hi = _rescaling_factor(m_prev, m_new, model)
            done = np.arange(n) < k * block
            d_old_hi = _earlier_sum_upper(xr, finite, done, log_phi, m_prev)
            log_phi = np.where(done, log_phi + step, log_phi)
            rescale_log = np.where(done, rescale_log + step, rescale_log)
            psi = (model.eta_exp * d_old_hi + psi * c_hi) * (1 + u) + model.eta
        if fin.any():
            sig = rounded_difference(blk[fin], np.full(int(fin.sum()), m_new), model)
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
    return _Recursion(log_phi, rescale_log, psi, m_prev)


def _rescaling_factor(m_prev: float, m_new: float, model: Model) -> tuple[float, float]:
    """One rescaling of Theorem S.3, ``ĉ = exp(fl(m_prev - m_new))``: the log of its relative
    error factor on every earlier term, the rescaled product's and the addition's roundings
    included, and an upper bound on ``ĉ`` (``e^gap (1 + κ) + η_exp``, in log space where ``κ``
    overflows)."""
    sig_c = float(rounded_difference(np.array([m_prev]), np.array([m_new]), model)[0])
    if model.base2:  # exp2-folded rounds fl(m - m') and its product by c2
        sig_c = sig_c * (2 + model.u)
    kappa = model.exp_rel(np.array(sig_c))
    step = float(model.log_exp_factor(sig_c, kappa)) + 2 * math.log1p(model.u)
    gap = m_prev - m_new  # e^gap (1 + κ): in log space where κ overflows
    c_hat = times(math.exp(gap), kappa, gap, model.log_exp_factor(sig_c, kappa))
    return step, math.exp(gap) + float(c_hat) + model.eta_exp


def _earlier_sum_upper(
    xr: np.ndarray, finite: np.ndarray, done: np.ndarray, log_phi: np.ndarray, m_prev: float
) -> float:
    """``D_{k-1}^hi``: an upper bound on the running sum of the keys ``done``, in the units of
    ``m_prev``, before the rescaling (each term ``e^(x̂_j - m_prev)`` within ``Φ_j``)."""
    shifted_old = np.where(done & finite, xr - m_prev, -np.inf)
    old_phi = np.where(done, log_phi, 0.0)
    old = np.exp(shifted_old)
    with np.errstate(over="ignore"):
        old_rel = np.expm1(old_phi)
    return float(np.sum(old + times(old, old_rel, shifted_old, old_phi)))


def _online_quotient(
    xs: np.ndarray,
    xr: np.ndarray,
    finite: np.ndarray,
    base2: np.ndarray,
    recursion: _Recursion,
    model: Model,
    gamma_b: float,
) -> tuple[Any, ...]:
    """The end of Theorem S.3: the row sum ``d̂_K`` within ``Φ`` and ``ψ`` of the recursion, each
    numerator within the error of its exponential's argument against the final maximum, and the
    quotient (:func:`~mhanum.bounds.softmax_model.row_bound`)."""
    log_phi, psi, m = recursion.log_phi, recursion.psi, recursion.m
    t = np.where(finite, xs - m, -np.inf)
    p, log_s, p_rel = exact_softmax(t)
    pf = p.astype(np.float64)
    with np.errstate(over="ignore"):  # inf where the rounding into the format is past 709
        inv_s = float(np.exp(np.float64(-log_s)))
    sigma = np.where(finite, np.abs(xr - xs), 0.0)
    sigma = sigma + np.where(finite, rounded_difference(xr, np.full_like(xr, m), model), 0.0)
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
    weighted = float(np.sum(times(pf * (1 + p_rel), term_rel, log_p, log_term)))
    den_hi = weighted + psi * inv_s
    den_lo = den_hi
    eta_num = np.where(finite, model.eta_exp * inv_s, 0.0)
    excess = times(pf * (1 + p_rel), a, log_p, model.log_exp_factor(sigma, a))
    total = row_bound(p, p_rel, excess, eta_num, den_lo, den_hi, model)
    terms = first_order_terms(p, sigma, model, gamma_b)
    with np.errstate(over="ignore", invalid="ignore"):
        rescaling = pf * float(np.sum(np.where(pf > 0, pf * np.expm1(recursion.rescale_log), 0.0)))
        underflow = eta_num + np.where(pf > 0, psi * inv_s * pf, 0.0) + model.eta_div
    rescaling = np.where(pf > 0, rescaling, 0.0)
    return total, {**terms, "rescaling": rescaling}, underflow


def online_sum_upper(xr: np.ndarray, model: Model, block: int) -> float:
    """An enclosure of every exponential and running sum of the online softmax on ``xr``: each
    exponential at most ``e^A(1 + ε_exp)`` (``A = 0`` without a lift), a block's sum within its
    ``γ``, and each of the ``K`` rescalings and additions ``(1 + ε_exp)(1 + u)²`` more."""
    finite = np.isfinite(xr)
    r = float(np.max(np.abs(xr[finite]))) if finite.any() else 0.0
    n, blocks = xr.size, -(-xr.size // block)
    growth = ((1 + model.eps_exp) * (1 + model.u) ** 2) ** blocks
    with np.errstate(over="ignore"):
        top = float(np.exp(lifted(r, model)[1])) if model.lift else 1.0  # inf past float64
        return n * top * (1 + model.eps_exp) * (1 + model.gamma(block)) * growth


def scaled_maxima_fit(xr: np.ndarray, model: Model, block: int | None) -> bool:
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


def lse_row(xs: np.ndarray, xr: np.ndarray, model: Model, shifted: bool, eps_log: float) -> Any:
    """One row of Theorem S.5: (total, terms) for the basic or shifted log-sum-exp."""
    if past_evaluation_range(xs, xr):
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
        sigma = rounded_difference(xr, np.full_like(xr, a), model)
        s_prime = float(np.sum(np.where(others, e, 0)))
        rel = np.where(others, model.exp_rel(sigma), 0.0)
        n_sum = max(n - 1, 1)
        gamma = model.gamma(n_sum)
        fits = np.isfinite(rel)
        far = times(0.0, rel, np.where(others, t, -np.inf), model.log_exp_factor(sigma, rel))
        dev = float(np.sum(np.where(others & fits, e, 0) * np.where(fits, rel, 0)) + np.sum(far))
        delta_s = (s_prime + dev) * gamma + dev + (n - 1) * model.eta_exp * (1 + gamma)
        delta_s = (delta_s + model.sum_abs(n_sum)) * EVAL_SLACK
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
        ell = max(math.log1p(m_up), -math.log1p(-lam)) * EVAL_SLACK
        total = inputs + ell + eps_log * (abs(y) + inputs + ell)
        terms = {"input": inputs, "sum": ell, "log": eps_log * (abs(y) + inputs + ell)}
    return total * EVAL_SLACK, terms
