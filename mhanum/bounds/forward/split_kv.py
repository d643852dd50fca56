"""Theorem A.6 (papers/attention.md): split-KV ("flash-decoding"), each split steps 4-7 on its
own keys, merged by the splits' computed log-sum-exps."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum.bounds.factors import compound, evaluation_rounding, gamma
from mhanum.bounds.forward.evaluation import times_expm1
from mhanum.bounds.forward.extremes import extremes
from mhanum.bounds.forward.ranges import Ranges
from mhanum.bounds.forward.softmax_pv import softmax_pv
from mhanum.bounds.forward.stage import PLAIN, WHOLE, Context, Enclosure, Values
from mhanum.units import Naive

__all__ = ["split_pv"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Split:
    """One split's terms (``0`` in a row it does not attend) and their sum ``bound``, its
    float64 output and that output's evaluation error, its exact log-sum-exp ``lse``, the
    computed one's distance ``eps`` from it, and the rows it attends."""

    terms: dict[str, Any]
    bound: Any
    out: tuple[Any, Any]
    lse: Any
    eps: Any
    some: Any


def _split(enc: Enclosure, values: Values, ctx: Context, cut: slice, lse_scale: float) -> _Split:
    """One split ``σ``: steps 4-7 on its keys with its output in ``accum`` (``B_σ``, against
    its exact attention ``o_σ``), and its computed log-sum-exp's distance ``ε_σ`` to the exact
    one: the logits' ``max δ``, the row sum's ``-log(1 - T)``, the ``log`` and the addition
    (and ``lse_scale`` on the split's largest ``|ŝ|``). Its range flags are kept for the rows
    it attends."""
    num, ranges = ctx.num, ctx.ranges
    fm = num.format_of("softmax")
    u_m, eta_m = fm.u, fm.smallest_normal
    eps_e = 2 * num.exp_ulps * u_m  # exp and log within exp_ulps ulps
    ev_rel = evaluation_rounding(enc.s.shape[-1])
    part = num.replace(output_format=num.accum, kv_splits=None)
    mine_enc, mine_values = enc.keys(cut), values.keys(cut)
    s, delta, ls, v = mine_enc.s, mine_enc.delta, mine_enc.live, mine_values.v
    some = ls.any(axis=-1, keepdims=True)
    mine = Ranges(*ranges.shape)  # this split's flags, kept only for rows it attends
    terms, p_s, t_s, _ = softmax_pv(
        mine_enc, mine_values, dataclasses.replace(ctx, num=part, ranges=mine, known=False)
    )
    ranges.merge(mine, some)  # a split a row does not attend is exact (lse -inf, o 0)
    terms.pop(PLAIN)
    terms.pop(WHOLE, None)
    terms = {name: np.where(some, x, 0.0) for name, x in terms.items()}
    p_s = np.where(ls, p_s, 0.0)
    out = (p_s @ v, ev_rel * (p_s @ np.abs(v)))
    # the split's exact log-sum-exp (float64 logits) and the computed one's distance ε_σ
    with np.errstate(invalid="ignore", divide="ignore"):
        m_s = np.where(ls, s, -np.inf).max(axis=-1, keepdims=True)
        m0 = np.where(np.isfinite(m_s), m_s, 0.0)
        lse_s = m0 + np.log(np.where(ls, np.exp(s - m0), 0.0).sum(-1, keepdims=True))
        tau = -np.log1p(-np.minimum(t_s, 1.0))
    d_s = np.where(ls, delta, 0.0).max(axis=-1, keepdims=True)
    keys = np.maximum(ls.sum(axis=-1, keepdims=True), 1)
    lse_abs = np.where(some, np.abs(lse_s), 0.0)
    log_l = lse_abs + d_s + tau if isinstance(num.softmax_algorithm, Naive) else np.log(keys) + tau
    err_log = eps_e * log_l + eta_m
    mag = lse_abs + d_s + tau + err_log  # >= |m̂ + fl(log ℓ̂)|
    # the float64 lse: n + 2 relative roundings of the sum of exps, then log and add
    eval64 = (keys + 4) * 2.0**-52 + 2.0**-51 * (lse_abs + np.log(keys) + 1)
    shift = 0.0
    if lse_scale:
        top_s = np.where(ls, np.abs(s) + delta, 0.0).max(axis=-1, keepdims=True)
        shift = lse_scale * top_s + eta_m
        mag = mag + shift
    eps = np.where(some, d_s + tau + err_log + u_m * mag + eta_m + eval64 + shift, 0.0)
    ranges.check(np.where(some, mag * (1 + u_m) + eta_m, 0.0), fm, "split-KV: a split's lse")
    lse = np.where(some, lse_s, -np.inf)
    return _Split(terms, sum(terms.values()), out, lse, eps, some)


def _merge(splits: list[_Split], ctx: Context) -> tuple[Any, Any, Any, Any]:
    """The merge weights ``π̂_σ = softmax(lse)_σ`` of the computed log-sum-exps lie in the box of
    Lemma 4 around the exact weights ``π_σ``; the merge's own roundings (``exp``, ``log``, the
    sum ``W`` of ``r`` weights, the subtractions) move each ``α̂_σ`` by at most ``A_σ``.
    Returns ``π̂⁺``, ``π̂⁻``, ``A`` and ``r``, the splits each row attends."""
    num, ranges = ctx.num, ctx.ranges
    fm = num.format_of("softmax")
    u_m, eta_m = fm.u, fm.smallest_normal
    eps_e = 2 * num.exp_ulps * u_m
    big_l, big_e, on = (
        np.concatenate(x, axis=-1)
        for x in ([s.lse for s in splits], [s.eps for s in splits], [s.some for s in splits])
    )
    r = on.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        m_l = np.where(on, big_l, -np.inf).max(axis=-1, keepdims=True)
        sc = np.where(on, big_l - np.where(np.isfinite(m_l), m_l, 0.0), -np.inf)
    _, pi_hi, pi_lo, _ = extremes(sc, big_e, on)
    e_max = np.where(on, big_e, 0.0).max(axis=-1, keepdims=True)
    # The merge: W = Σ fl(exp(fl(lse_σ - M))) is within τ_W of Σ e^{lse_σ - M} >= 1
    gap = np.where(on, np.abs(sc) + big_e + e_max, 0.0)  # >= |lse_σ - M|
    grow = np.where(on, times_expm1(pi_hi, math.log1p(eps_e) + u_m * gap + eta_m), 0.0)
    tau1 = grow.sum(axis=-1, keepdims=True) + r * eta_m
    tau_w = compound(gamma(max(len(splits) - 1, 0), u_m), tau1)
    ranges.flag(tau_w >= 1, "split-KV: the merge's sum of weights may be off by 100%", "vacuous")
    tau_w = np.minimum(tau_w, 0.5)
    log_w = np.log(np.maximum(r, 1)) + np.log1p(tau_w)  # >= log Ŵ >= 0
    m_abs = np.abs(np.where(np.isfinite(m_l), m_l, 0.0)) + e_max
    big_k = (
        -np.log1p(-tau_w)
        + eps_e * log_w
        + eta_m
        + u_m * (m_abs + log_w * (1 + eps_e) + eta_m)
        + eta_m
    )  # >= |Λ̂ - log Σ e^{lse_σ}|
    with np.errstate(invalid="ignore"):
        lse_all = np.where(np.isfinite(m_l), m_l, 0.0) + np.log(
            np.where(on, np.exp(sc), 0.0).sum(axis=-1, keepdims=True)
        )
        b = np.where(on, np.abs(big_l - lse_all) + big_e + e_max + big_k, 0.0)
    moved = np.where(
        on, times_expm1(pi_hi, math.log1p(eps_e) + big_k + u_m * b + eta_m) + eta_m, 0.0
    )  # >= |α̂_σ - π̂_σ|
    return pi_hi, pi_lo, moved, r


def split_pv(
    enc: Enclosure, values: Values, ctx: Context, lse_scale: float = 0.0
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Theorem A.6 (papers/attention.md): :func:`~mhanum.bounds.forward.softmax_pv.softmax_pv` under split-KV.

    Each split ``σ`` is steps 4-7 on its own keys with its output in ``accum`` (``B_σ``, against
    its exact attention ``o_σ``); its computed log-sum-exp is within ``ε_σ`` of the exact one
    (the logits' ``max δ``, the row sum's ``-log(1 - T)``, the ``log`` and the addition); the
    merge weights ``π̂_σ = softmax(lse)_σ`` of the computed log-sum-exps lie in the box of
    Lemma 4 around the exact weights ``π_σ``, and the merge's own roundings (``exp``, ``log``,
    the sum ``W`` of ``r`` weights, the subtractions, ``Σ α_σ o_σ`` in ``accum``) move each
    ``α̂_σ`` by at most ``A_σ``. Then, with ``Σ π̂ = Σ π = 1``,

        |ô - o| <= Σ π̂⁺ B_σ + Σ (π̂⁺ - π̂⁻)|o_σ - o| + Σ A_σ|ô_σ| + γ_r Σ α̂_σ|ô_σ| + output.

    The per-split terms keep their names (weighted by ``π̂⁺``); ``split_lse`` and
    ``split_merge`` are the second and the next two. Returns the terms, the row's
    probabilities and (unused) zeros for the row sum's error. ``lse_scale`` (the folded exp2)
    is the relative difference between a split's lse factor ``fl(m·ĉ)`` and its exponents'
    scale, charged on the split's largest ``|ŝ|``.
    """
    num, s, live, v = ctx.num, enc.s, enc.live, values.v
    ev_rel = evaluation_rounding(s.shape[-1])  # float64 sums over the keys
    n = s.shape[-1]
    size = num.kv_split_size(n)
    cuts = [slice(a, min(a + size, n)) for a in range(0, n, size)]
    fa, fo = num.format_of("accum"), num.format_of("output")
    with np.errstate(invalid="ignore"):
        top = np.where(live, s, -np.inf).max(axis=-1, keepdims=True)
        p = np.where(live, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    p = p / np.where(p.sum(axis=-1, keepdims=True) > 0, p.sum(axis=-1, keepdims=True), 1.0)
    o = p @ v
    ev = ev_rel * (p @ np.abs(v))
    splits = [_split(enc, values, ctx, cut, lse_scale) for cut in cuts]
    pi_hi, pi_lo, moved, r = _merge(splits, ctx)
    # Assemble
    names = splits[0].terms.keys()
    terms = {
        name: sum(pi_hi[:, [i]] * t.terms[name] for i, t in enumerate(splits)) for name in names
    }
    spread = np.zeros_like(o)
    weights = np.zeros_like(o)
    merge_w = np.zeros_like(o)
    for i, split in enumerate(splits):
        (o_s, ev_s), b_s = split.out, split.bound
        o_hat = np.abs(o_s) + ev_s + b_s  # >= |ô_σ|
        spread = spread + (pi_hi[:, [i]] - pi_lo[:, [i]]) * (np.abs(o_s - o) + ev_s + ev)
        merge_w = merge_w + moved[:, [i]] * o_hat
        weights = weights + (pi_hi[:, [i]] + moved[:, [i]]) * o_hat
    terms["split_lse"] = spread
    # r products and r - 1 additions in F_a, and α̂ read into F_a (a rounding where F_m is wider)
    terms["split_merge"] = (
        merge_w + gamma(len(cuts) + 1, fa.u) * weights + 2 * r * fa.smallest_normal
    )
    inside = fo.precision >= fa.precision and fo.emin <= fa.emin and fo.emax >= fa.emax
    upper = np.abs(o) + ev + sum(terms.values())
    ctx.ranges.check(upper, fa, "split-KV: the merged output accumulated", entries=True)
    if not inside:
        # the merged value x rounded into F_o: |x| >= |o| - ε - E; η_o only where x may be
        # below F_o's normal range (step 7)
        with np.errstate(invalid="ignore"):
            low = np.abs(o) - ev - sum(terms.values())
            eta = np.where(low >= fo.smallest_normal, 0.0, fo.smallest_normal)
        terms["output"] = terms["output"] + fo.u * upper + eta
    terms[PLAIN] = terms["output"]
    return terms, p, np.zeros_like(r, dtype=np.float64)
