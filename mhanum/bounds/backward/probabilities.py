"""Step 3 of Theorems B.1/B.2: the probabilities the backward reads, enclosed from the logits'
(papers/backward.md, steps 3, 3′ and 3W)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from mhanum.bounds.backward.inputs import Context
from mhanum.bounds.enclosure import U64, Enclosure, flush_floor, log_radius
from mhanum.bounds.factors import (
    chain,
    compound,
    division_error,
    evaluation_rounding,
    exp_and_sum_factors,
    operand_bits,
    safe_weight_sums,
)
from mhanum.numerics import Numerics

__all__ = ["Probabilities", "probabilities_step", "row_max", "stored_weights"]


def row_max(a: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The largest entry of each row over the attended keys (a column)."""
    return np.where(keep, a, 0.0).max(axis=-1, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Probabilities:
    """Step 3's enclosures (componentwise, 0 on masked keys): ``p_mid`` the float64 softmax of
    the logits' stand-ins, ``p_up >= P``; ``eps_p >= |P̂ - P|`` and ``p_used_up >= |P̂|`` for
    the probabilities ``dP``'s steps read, ``eps_pr`` for those ``dV`` reads; and what later
    steps read of the derivation: the logits' error ``delta``, ``shift`` (``W``), the
    underflow allowance ``absolute``, the operand bits of ``P``; B.1: ``w_k`` (step 6′),
    ``mu_k`` (step 5′), ``whole`` (step W); B.2: the log-sum-exp's error ``err_lse`` and the
    entry's own ``own_entry`` (step 7‴)."""

    p_mid: np.ndarray
    p_up: np.ndarray
    eps_p: np.ndarray
    p_used_up: np.ndarray
    eps_pr: np.ndarray
    delta: np.ndarray
    shift: np.ndarray
    absolute: np.ndarray
    bits_p: int
    w_k: np.ndarray | None = None
    mu_k: np.ndarray | None = None
    whole: tuple[np.ndarray, np.ndarray] | None = None
    err_lse: np.ndarray | None = None
    own_entry: np.ndarray | None = None


class _Softmax(NamedTuple):
    """The float64 softmax of the logits' stand-ins: ``p_mid``, ``p_up >= P``, the row maxima
    ``m_mid``, ``arg = |s̃ - m̃|``, the log-ratio ``omega`` and the attended keys."""

    p_mid: np.ndarray
    p_up: np.ndarray
    m_mid: np.ndarray
    arg: np.ndarray
    omega: np.ndarray
    keep: np.ndarray


def _exact_softmax(s: Enclosure, keep: np.ndarray, n: int) -> _Softmax:
    """Step 3: ``P`` within ``e^{±ω}`` of the float64 softmax of the logits' stand-ins (masked
    keys are exactly 0 in the computation and exactly)."""
    live = np.where(keep, s.mid, -np.inf)
    m_mid = live.max(axis=-1, keepdims=True)
    centred = np.where(keep, s.mid - m_mid, -np.inf)
    p_mid = np.exp(centred)
    ell = p_mid.sum(axis=-1, keepdims=True)
    p_mid = p_mid / ell
    arg = np.where(keep, np.abs(s.mid - m_mid), 0.0)
    omega = (
        s.rad + row_max(s.rad, keep) + U64 * (arg + row_max(arg, keep)) + 4 * U64
        + chain(n, "sequential", U64, None, products=False) + 2 * U64
    )  # fmt: skip
    p_up = np.where(keep, p_mid * np.exp(omega), 0.0)
    return _Softmax(p_mid, p_up, m_mid, arg, omega, keep)


@dataclasses.dataclass(frozen=True)
class _Rounding:
    """The softmax's own log-ratio ``own`` and underflow allowance ``absolute``; B.1: the
    division's error and the relative rounding into ``prob_format``; B.2: the stored
    log-sum-exp's error and the entry's own share (step 7‴)."""

    own: np.ndarray
    absolute: np.ndarray
    eps_div: float = 0.0
    u_p: float = 0.0
    err_lse: np.ndarray | None = None
    own_entry: np.ndarray | None = None


def _textbook_rounding(
    ctx: Context, xs: np.ndarray, x_max: np.ndarray, g_sum: float, ell_low: np.ndarray
) -> _Rounding:
    """B.1's ``L``: the exponentials, the row sum, the division and the relative rounding into
    ``prob_format``; the flushed terms' allowance (``inf`` where the row sum may underflow)."""
    sm, prob, n = ctx.fmt("softmax"), ctx.fmt("prob"), ctx.sizes[1]
    eta_m = sm.smallest_normal
    eps_div = division_error(ctx.num.div_ulps, sm.u)
    u_p = prob.u if prob.precision < sm.precision else 0.0
    own = (
        log_radius(np.expm1(xs)) + log_radius(np.expm1(x_max)) + log_radius(eps_div)
        + log_radius(g_sum) + log_radius(u_p)
    )  # fmt: skip
    flushed = (n + 1) * eta_m * (1 + g_sum) / np.maximum(ell_low, 0)
    absolute = (flushed * (1 + eps_div) + eta_m) * (1 + u_p)
    absolute = np.where(ell_low > 0, absolute, np.inf)
    if not (ell_low > 0).all():
        ctx.rng.reasons.append("the softmax's row sum may underflow: its lower bound is not > 0")
    return _Rounding(own, absolute, eps_div, u_p)


def _fold(ctx: Context, s: Enclosure, keep: np.ndarray) -> np.ndarray | float:
    """Step 3'' of the forward (papers/attention.md) for the forward's exponentials under
    ``exp2-folded``: ``fl(fl(t̂·c2) - fl(m̂·c2))`` against ``ŝ_j - m̂·c2·ln 2``, the product's
    and the shift's roundings, ``u_m(1 + δ_c)(|ŝ_j| + R_i) + 2η_m`` in natural units (``R_i``
    the row's largest ``|ŝ|``); 0 for the exp form."""
    fold = ctx.folded()
    if fold is None:
        return 0.0
    sm = ctx.fmt("softmax")
    s_abs = np.where(keep, s.used, 0.0)
    r_row = row_max(s_abs, keep)
    return np.where(keep, sm.u * (1 + fold.delta_c) * (s_abs + r_row) + 2 * sm.smallest_normal, 0.0)


def _lse_rounding(
    ctx: Context, soft: _Softmax, s: Enclosure, x_max: np.ndarray, g_sum: float
) -> _Rounding:
    """B.2: the stored log-sum-exp ``lse = fl(m̂ + fl(log ℓ̂))`` against ``LSE(ŝ) = m̂ + log
    ℓ(ŝ)``, then ``ŝ - lse``'s rounding and the recomputed exponential's. Folded (step 3f):
    ``lse = fl(fl(m̂·ĉ) + fl(log ℓ̂))`` of the raw maximum ``m̂`` against ``LSE(ŝ) =
    m̂·c2·ln 2 + log ℓ(ŝ)``, and the recomputation ``exp2(fl(fl(t̂·c2) - fl(lse·L̂)))``."""
    sm, n = ctx.fmt("softmax"), ctx.sizes[1]
    u_m, eta_m = sm.u, sm.smallest_normal
    spread = s.err + s.rad
    eps_e = math.expm1(2 * ctx.num.exp_ulps * math.log1p(u_m))
    r_ell = np.expm1(x_max) * (1 + g_sum) + g_sum + n * eta_m * (1 + g_sum)
    lam_ell = log_radius(r_ell)
    eps_log = eps_e
    log_up = math.log(n) + lam_ell
    fold = ctx.folded()
    if fold is None:
        lse_up = np.abs(soft.m_mid) + row_max(spread, soft.keep) + log_up
        err_lse = lam_ell + eps_log * log_up + eta_m + u_m * lse_up + eta_m
    else:
        # |m̂·c| <= R/(1 - δ_c) (ŝ = t̂·c(1 + δ_c)); fl(m̂·ĉ) within u_m of m̂·ĉ, and
        # |m̂·ĉ - m̂·c2·ln 2| <= |m̂·c|(θ_c + δ_c)
        r_row = row_max(np.where(soft.keep, s.used, 0.0), soft.keep)
        mc = r_row / (1 - fold.delta_c)
        shift = u_m * mc * (1 + fold.theta_c) + eta_m + mc * (fold.theta_c + fold.delta_c)
        # |fl(m̂·ĉ) + fl(log ℓ̂)| before the sum's rounding, then the stored lse after it
        lse_up = mc * (1 + fold.theta_c) * (1 + u_m) + log_up * (1 + eps_log) + 2 * eta_m
        err_lse = lam_ell + eps_log * log_up + eta_m + shift + u_m * lse_up + eta_m
        lse_up = lse_up * (1 + u_m) + eta_m
    gap2 = soft.arg + math.log(n) + spread + row_max(spread, soft.keep) + err_lse
    own_entry = u_m * gap2 + eta_m + log_radius(eps_e)  # ŝ - lse's rounding, exp's
    if fold is not None:
        # fl(t̂·c2) = ŝ(1 + δ1)/ln 2, fl(lse·L̂) = lse(1 + θ_L)(1 + δ2)/ln 2, each with an
        # underflow: (1 + u_m)(u_m|ŝ| + ((1 + θ_L)(1 + u_m) - 1)|lse| + 2η_m) more
        u_lse = compound(fold.theta_l, u_m)
        s_up = np.where(soft.keep, s.used, 0.0)
        own_entry = own_entry + (1 + u_m) * (u_m * s_up + u_lse * lse_up + 2 * eta_m)
    own = err_lse + own_entry
    absolute = eta_m * np.ones_like(x_max)
    return _Rounding(own, absolute, err_lse=err_lse, own_entry=own_entry)


def _logits_share(
    soft: _Softmax,
    delta: np.ndarray,
    shift: np.ndarray,
    rounding: _Rounding,
    absolute: np.ndarray,
    n: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 3′ (B.1): ``(|P̂ - P| split, w_k, mu_k)``. The logits' share ``λ_j = (P_j/Z)[(1 -
    P_j)(e^{δ_j} - 1) - Σ_{l≠j} P_l (e^{δ_l} - 1)]`` (``|log Z| <= W``) keeps the ``1 - P_j``
    that ``e^{Δ_j + W} - 1`` loses on a probable key; the softmax's own share ``μ`` as in step
    5′."""
    keep, p_up = soft.keep, soft.p_up
    with np.errstate(over="ignore", invalid="ignore"):
        w_k = np.where(keep, p_up * np.expm1(delta), 0.0)  # >= P_k |e^{δ_k} - 1|
        others = w_k.sum(axis=-1, keepdims=True) * (1 + evaluation_rounding(n)) - w_k
        p_lo = np.where(keep, soft.p_mid * np.exp(-soft.omega), 0.0)
        lam_k = p_up * (np.maximum(1 - p_lo, 0.0) * np.expm1(delta) + np.maximum(others, 0.0))
        # >= |μ_k| = |P̂_k - p_k(Ŝ)| (steps 5′, 6′ add P̂'s reading into the gradient format)
        mu_k = np.where(keep, p_up * np.exp(delta + shift) * np.expm1(rounding.own) + absolute, 0.0)
        split_p = (np.exp(shift) * lam_k + mu_k) * (1 + 8 * U64)
        split_p = np.where(keep & ~np.isnan(split_p), split_p, np.where(keep, np.inf, 0.0))
    return split_p, w_k, mu_k


def probabilities_step(ctx: Context, s: Enclosure) -> Probabilities:
    """Step 3 (papers/backward.md): the probabilities within ``P·(e^R - 1) + A``, ``R = L +
    Δ_j + W`` (``W`` by Jensen, ``L`` the softmax's own log-ratio, B.2's from the stored
    log-sum-exp), ``A`` the underflow allowance (``min(P̄, η_p)`` only where ``P`` may lie
    below ``prob_format``'s smallest normal number); B.1's steps 3′ and W where smaller; B.2's
    rounding of the recomputed ``P`` into ``prob_format`` for ``dV``."""
    num, keep, flash = ctx.num, ctx.x.keep, ctx.flash
    n = ctx.sizes[1]
    sm, prob = ctx.fmt("softmax"), ctx.fmt("prob")
    soft = _exact_softmax(s, keep, n)
    p_mid, p_up = soft.p_mid, soft.p_up
    delta = s.err  # |ŝ - s| (the computed logits against the exact ones)
    spread = s.err + s.rad
    gap = soft.arg + spread + row_max(spread, keep)  # |ŝ_j - m̂| <= gap
    u_m, eta_m = sm.u, sm.smallest_normal
    bits_p, bits_in = operand_bits(num, prob), operand_bits(num, ctx.fmt("input"))
    fold = _fold(ctx, s, keep)
    xs, _, g_sum, _, _ = exp_and_sum_factors(num, n, gap + fold, ctx.lam, (bits_p, bits_in))
    xs = np.broadcast_to(np.asarray(xs, np.float64), gap.shape) + fold
    x_max = row_max(xs, keep)
    eps_e = math.expm1(2 * num.exp_ulps * math.log1p(u_m))
    ell_low = np.exp(-x_max) * (1 - g_sum) - n * eta_m * (1 + g_sum)
    if not flash:
        rounding = _textbook_rounding(ctx, xs, x_max, g_sum, ell_low)
    else:
        rounding = _lse_rounding(ctx, soft, s, x_max, g_sum)
    absolute = rounding.absolute
    shift = _shift(p_up, delta, keep, row_max(delta, keep))
    big_r = rounding.own + delta + shift
    # P̂ before its rounding into prob_format is at least p_low, which flushes (§0) only where
    # that may lie below prob_format's smallest normal number
    p_low = p_mid * np.exp(-soft.omega - big_r) - absolute
    normal_p = p_low >= prob.smallest_normal
    if not flash:
        below = np.minimum(p_up * np.exp(big_r) + absolute, flush_floor(sm, prob))
        absolute = absolute + np.where(normal_p, 0.0, below)
    with np.errstate(over="ignore", invalid="ignore"):
        eps_p = np.where(keep, p_up * np.expm1(big_r) + absolute, 0.0)
        p_used_up = np.where(keep, p_up * np.exp(big_r) + absolute, 0.0)
    w_k = mu_k = whole = None
    if not flash:
        split_p, w_k, mu_k = _logits_share(soft, delta, shift, rounding, absolute, n)
        eps_p = np.fmin(eps_p, split_p)
        p_used_up = np.fmin(p_used_up, np.where(keep, p_up + eps_p, 0.0))
    if not flash and num.softmax_kind == "safe":
        # Step W (papers/backward.md): the stored P̂ of a safe softmax, whatever the logit errors
        weights = (eps_e, rounding.eps_div, rounding.u_p)
        whole = stored_weights(keep, n, gap, (bits_p, bits_in), weights, num)
        p_used_up = np.fmin(p_used_up, np.where(keep, whole[0], 0.0))
        eps_p = np.fmin(eps_p, np.where(keep, np.maximum(whole[0], p_up), 0.0))
    eps_pr = eps_p
    if flash:  # FlashAttention-2 rounds its recomputed P to the probability format for dV
        u_pr = prob.u if prob.precision < sm.precision else 0.0
        flush_pr = np.where(normal_p, 0.0, np.minimum(p_used_up, flush_floor(sm, prob)))
        eps_pr = eps_p + np.where(keep, u_pr * p_used_up + flush_pr, 0.0)
    return Probabilities(
        p_mid, p_up, eps_p, p_used_up, eps_pr, delta, shift, absolute, bits_p,
        w_k, mu_k, whole, rounding.err_lse, rounding.own_entry,
    )  # fmt: skip


def _shift(p_up: np.ndarray, delta: np.ndarray, keep: np.ndarray, top: np.ndarray) -> np.ndarray:
    """B.1 step 3's ``W_i >= |log Σ_k p_k e^{δ_k}|`` for logit errors ``|δ_k| <= Δ_k`` and the
    exact softmax ``p`` of the row: ``min(max_k Δ_k, log Σ_k p̄_k e^{Δ_k})`` with ``p̄ >= p``
    (papers/backward.md, step 3), evaluated upward in float64 (``top`` is ``max_k Δ_k``)."""
    n = delta.shape[-1]
    with np.errstate(over="ignore", invalid="ignore"):
        lse = np.where(keep, p_up * np.exp(delta), 0.0).sum(axis=-1, keepdims=True)
        w = np.log(lse) * (1 + 4 * U64) + (n + 4) * U64
    return np.where(np.isfinite(w) & (w < top), np.maximum(w, 0.0), top)


def stored_weights(
    keep: np.ndarray,
    n: int,
    gap: np.ndarray,
    bits: tuple[int, int],
    weights: tuple[float, float, float],
    num: Numerics,
) -> tuple[np.ndarray, np.ndarray]:
    """Step W of B.1: ``(P̂ᵐᵃˣ, W)`` with ``P̂_ij <= P̂ᵐᵃˣ_i`` and ``Σ_j P̂_ij <= W_i`` for the
    probabilities a safe softmax stores, whatever the logit errors (papers/attention.md, Lemma
    W: every computed exponential is at most ``1 + ε_e``, the row maximum's is 1, so the
    computed row sum is at least ``1 - T_0``; deterministic, so beside B.5's terms too).
    ``weights``: the exponential's, the division's and the rounding into ``prob_format``'s
    relative errors ``(ε_e, ε_div, u_p)``."""
    eps_e, eps_div, u_p = weights
    sm, prob = num.format_of("softmax"), num.format_of("prob")
    g_sum = exp_and_sum_factors(num, n, gap, None, bits)[2]
    n_live = keep.sum(axis=-1, keepdims=True)
    inv, row = safe_weight_sums(n_live, g_sum, eps_div, sm)
    entry = (inv * (1 + eps_e) + sm.smallest_normal) * (1 + u_p) + prob.smallest_normal
    return entry, row * (1 + u_p) + n_live * prob.smallest_normal
