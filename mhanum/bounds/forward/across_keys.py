"""Theorem A.3' (papers/attention.md): the ``Q Kᵀ`` dots' roundings as one martingale across the
keys, for the probabilistic bound."""

from __future__ import annotations

import math

import numpy as np

from mhanum.bounds.factors import F64_DOT, evaluation_rounding, unit_eta, unit_factor
from mhanum.bounds.forward.logits import Constant, Dots, Logits
from mhanum.bounds.forward.one_martingale import Increments
from mhanum.bounds.forward.operands import Operands
from mhanum.bounds.forward.stage import Head, Setting, StoredSplit, Values
from mhanum.numerics import Numerics

__all__ = [
    "across_splits",
    "dot_increments",
    "logits_increments",
    "stored_split",
]


def across_splits(
    lg: Logits, dots: Dots, ops: Operands, const: Constant, live: np.ndarray, head: Head,
    setting: Setting,
) -> list[tuple[np.ndarray, np.ndarray]] | None:  # fmt: skip
    """Theorem A.3': the splits ``(b, δ')`` of the logits' errors that step 4's logits term
    may replace by the martingale across the keys (:func:`logits_increments`); ``None``
    outside its scope (deterministic, split or tensor-core dots, a finite masking constant,
    exp2, a soft-cap).

    A dot's error is ``Σ_k δ_k T_k`` over its roundings: at most ``d_k`` of products and
    ``d_k - 1`` of sums (each twice in the native order of a format XLA may carry in
    float32), in any order; the later roundings of the logit (``1 + θ``, the bias's) and the
    dots' underflow stay deterministic. Without a bias and with the scale on the scores, the
    roundings of each key's score (``Q Kᵀ`` into the score format, then its product by the
    scale) may join the martingale: ``ŝ_j = c(1 + δ_c)(1 + δ_s)(1 + δ_mul)·t̂_j``, the
    increments ``c·t̂_j·δ_s`` and ``c·t̂_j·δ_mul`` with ``|t̂_j| <= T_j``, the rest of ``θ``
    (``δ_c``, common to the row, and the products of ``δ``s) deterministic.
    """
    split = _dot_split(lg, dots, ops, const, head, setting)
    if split is None:
        return None
    b_dot, rest, scores = split
    across = [(b_dot, np.where(live, np.maximum(rest, 0.0), 0.0))]
    if scores is not None:
        b_s, moved_s = scores
        rest_score = np.where(live, np.maximum(rest - moved_s, 0.0), 0.0)
        across.append((np.sqrt(b_dot**2 + b_s**2), rest_score))
    return across


def _dot_split(
    lg: Logits, dots: Dots, ops: Operands, const: Constant, head: Head, setting: Setting
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None] | None:
    """A.3''s first split ``(b, δ')`` (the dots' roundings in the martingale), and where the
    scores' roundings may join it (no bias, the scale on the scores) their increments' bound
    ``|c|(u_s² + u_mul²)^½ T_j`` and their part ``|c|(u_s + u_mul) T_j`` of ``δ'_j``, with
    ``T_j >= |t̂_j|``; ``None`` outside A.3''s scope."""
    num, lam, scale = setting.num, setting.lam, setting.scale
    if not (
        lam is not None
        and num.dot_kind == "ieee"
        and head.masked is None
        and not num.exp2
        and not setting.softcap
    ):
        return None
    d_k = ops.q_op.shape[-1]
    u_a = num.format_of("accum").u
    g_det = unit_factor(num, d_k, None, bits=ops.bits_qk)
    twice = _rounded_twice(num)
    b_dot = (
        abs(scale)
        * u_a
        * dot_increments(ops.q_op, ops.k_op, dots.t, dots.operands, dots.qk_op, g_det, twice)
    )
    k_b = (1 + const.theta) * lg.bias_factor
    rest = (
        lg.delta
        - lg.sources["qk_dot"]
        + abs(scale) * k_b * unit_eta(num, d_k)
        + abs(scale) * (k_b - 1) * g_det * dots.qk_op
    )
    if head.bias is not None or num.scale != "scores":
        return b_dot, rest, None
    t_hat = np.abs(dots.t) + dots.operands + g_det * dots.qk_op + unit_eta(num, d_k)
    u_s = num.format_of("score").u
    scores = (math.hypot(u_s, const.u_mul) * t_hat, (u_s + const.u_mul) * t_hat)
    return b_dot, rest, (abs(scale) * scores[0], abs(scale) * scores[1])


def _rounded_twice(num: Numerics) -> int:
    """2 where each of a dot's roundings may be two (the native order of a format XLA may carry
    in float32), else 1."""
    return 2 if num.order.carried and num.format_of("accum").u > 2.0**-24 else 1


def stored_split(
    lg: Logits, dots: Dots, ops: Operands, const: Constant, live: np.ndarray, head: Head,
    setting: Setting,
) -> StoredSplit | None:  # fmt: skip
    """Theorem A.3‴ (papers/attention.md) at the logits: the projections' relative roundings
    ``μ`` move ``ε_j`` by ``c(μ_q·k_j + q·μ_kj)`` to first order, with coefficients of the
    exact target's; that part (and the scores' roundings, where A.3''s second split takes
    them) leaves ``δ'_j`` for the martingale through the output projection. ``None`` outside
    A.3''s scope or without ``head.stored``. The operand part of ``δ_j`` is ``|c|(1 + θ)(e_q|k|
    + |q|e_k + e_q e_k)`` with ``e >= |μ| + ρ``, so ``δ'_j`` less ``|c|(μ̄_q|k| + |q|μ̄_k)``
    (``μ̄``: ``head.stored.moved``) still bounds the rest."""
    st = head.stored
    split = None if st is None else _dot_split(lg, dots, ops, const, head, setting)
    if split is None or st is None:
        return None
    b_dot, rest, scores = split
    c = abs(setting.scale)
    (m_q, m_k, _), (s_q, s_k, _) = st.moved, st.sigma
    moved = c * (m_q @ ops.k_abs.T + ops.q_abs @ m_k.T)
    w_k = c * c * ((ops.q_abs * ops.q_abs) @ (s_k * s_k).T)
    w_s = np.zeros_like(w_k)
    if scores is not None:
        moved = moved + scores[1]
        w_s = scores[0] ** 2
    rest = np.where(live, np.maximum(rest - moved, 0.0), 0.0)
    moved, w_k, w_s = (np.where(live, x, 0.0) for x in (moved, w_k, w_s))
    # |Σ_k δ_k T_k| <= Σ_k b_k <= K^½ (Σ_k b_k²)^½ over the dot's K increments (Cauchy-Schwarz)
    count = _rounded_twice(setting.num) * (2 * ops.q_op.shape[-1] - 1)
    dot_det = np.where(live, math.sqrt(count) * b_dot, 0.0)
    return StoredSplit(b_dot, rest, moved, w_k, w_s, c * c * s_q * s_q, head.k, st, dot_det)


def dot_increments(
    q_op: np.ndarray,
    k_op: np.ndarray,
    t: np.ndarray,
    operands: np.ndarray,
    qk_op: np.ndarray,
    g_det: float,
    twice: int,
) -> np.ndarray:
    """``(Σ_k T̄_k²)^½`` over one QKᵀ dot's roundings ``fl(T_k) = T_k(1 + δ_k)``, any order.

    A product's ``|T| <= (1 + u)|q̂_t k̂_t|``; a sum's value is the exact sum of a subset of
    the products, which lies in ``[-N, P]`` (``P``, ``N`` the sums of the positive and of the
    negative products, ``max(P, N) = (Σ|q̂_t k̂_t| + |q̂·k̂|)/2``), plus its operands' errors,
    at most ``g·Σ|q̂||k̂|``, times ``(1 + u)`` for a second rounding (papers/attention.md,
    A.3'); ``|q̂·k̂| <= |t| + operands`` and float64's error of ``t``. Each is also at most the
    cruder ``(1 + g)Σ|q̂||k̂|``, and the smaller is taken. ``1 + u <= 1 + g``.
    """
    d_k = q_op.shape[-1]
    exact = np.abs(t) + operands + F64_DOT * (d_k + 2) * qk_op
    subset = 0.5 * (qk_op + exact)
    sums = math.sqrt(d_k - 1) * (1 + g_det) * np.minimum(qk_op, subset + g_det * qk_op)
    # (Σ_t q_t² k_t²)^½ with the rows scaled to at most 1 first, and the root-sum-square as a
    # hypot, so that no square overflows where the values themselves do not
    rows_q = q_op.max(axis=-1, keepdims=True, initial=0.0)
    rows_k = k_op.max(axis=-1, keepdims=True, initial=0.0)
    rows_q, rows_k = np.where(rows_q > 0, rows_q, 1.0), np.where(rows_k > 0, rows_k, 1.0)
    unit_q, unit_k = q_op / rows_q, k_op / rows_k
    products = np.sqrt((unit_q * unit_q) @ (unit_k * unit_k).T) * rows_q * rows_k.T
    return math.sqrt(twice) * np.hypot((1 + g_det) * products, sums)


def logits_increments(
    p: np.ndarray,
    delta: np.ndarray,
    values: Values,
    live: np.ndarray,
    per_key: np.ndarray,
    across: tuple[np.ndarray, np.ndarray],
    second_order: bool = True,
) -> Increments:
    """Theorem A.3' (papers/attention.md): the logits term in martingale form.

    ``Σ_j (p̃_j - p_j) v_j = (1/Z) Σ_j p_j (ε_j + r_j)(v_j - o)`` with ``Z >= e^{-max δ}`` and
    ``|r_j| <= e^{δ_j} - 1 - δ_j``. The dots' part of ``ε_j`` is ``Σ_k δ_k T_k`` over their
    roundings, a martingale whose increments ``p_j (v_j - o) δ_k T_k`` are bounded by
    ``p_j |v_j - o| b_j``: by Azuma-Hoeffding ``|Σ| <= λ (Σ_j (p_j (v_j - o) b_j)²)^½`` but with
    probability ``2 exp(-λ²/2)`` per output (``spread``, divided by ``Z``: ``divided =
    e^{max δ}``). The rest of ``ε_j`` is at most ``δ'_j``, and ``Σ_j (p̃_j - p_j)(v̂_j - v_j)``
    at most the per-key deviations times ``v_abs - |v|`` (``fixed``). ``second_order=False``
    leaves out the part of the ``r_j`` (the caller bounds it: Theorem A.3‴). The cancellation
    in ``Σ_j (p_j b_j)² (v_j - o)²`` is charged ``2^-49`` and twice the float64 sums' rounding
    of its absolute terms.
    """
    ev_rel = evaluation_rounding(p.shape[-1])  # float64 sums over the keys
    b, rest = across
    v, v_abs = values.v, values.v_abs
    pl = np.where(live, np.nan_to_num(p), 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        o = pl @ v
        w = (pl * b) ** 2
        w_v2, w_v, w_0 = w @ (v * v), w @ v, w.sum(axis=-1, keepdims=True)
        var = w_v2 - 2 * o * w_v + o * o * w_0  # Σ_j (p_j b_j)² (v_j - o)², cancellation below
        slack = (2.0**-49 + 2 * ev_rel) * (w_v2 + 2 * np.abs(o) * (w @ np.abs(v)) + o * o * w_0)
        spread = np.sqrt(np.maximum(var + slack, 0.0))
        d = np.where(live, delta, 0.0)
        second = np.expm1(d) - d  # |e^ε - 1 - ε| for |ε| <= δ
        spread_v = np.abs(v)
        det = (pl * rest) @ spread_v + np.abs(o) * (pl * rest).sum(axis=-1, keepdims=True)
        if second_order:
            det = det + (pl * second) @ spread_v + np.abs(o) * (pl * second).sum(-1, keepdims=True)
        z_inv = np.exp(d.max(axis=-1, keepdims=True))
        used = per_key @ (v_abs - np.abs(v))
        factor = 1 + ev_rel
        return Increments((z_inv * det + used) * factor, spread * factor, z_inv * factor)
