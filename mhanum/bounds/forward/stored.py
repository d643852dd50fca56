"""Theorem A.3‴ (papers/attention.md): multi-head attention under A.3's model, the projections'
relative roundings (their dots', biases' and storage's) and the scores' as one martingale per
entry of the layer's output, through the output projection's weights with their signs.

A head's share (:func:`stored_parts`) is evaluated with its softmax stage, on its chunk of
query rows; :func:`mhanum.bounds.forward.mha` adds the heads' shares and takes the bound
where it is smaller than A.2's terms ``attention.logits`` and ``attention.operands``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mhanum.bounds.factors import evaluation_rounding
from mhanum.bounds.forward.across_keys import logits_increments
from mhanum.bounds.forward.one_martingale import Increments
from mhanum.bounds.forward.stage import (
    STORED_DOTS,
    STORED_PARTS,
    STORED_PV,
    Enclosure,
    RoundingKeys,
    StoredSplit,
    Values,
)
from mhanum.numerics import Numerics
from mhanum.problem import MHAProblem

__all__ = [
    "EXACT_QUERIES",
    "Rounding",
    "normaliser",
    "queries_exactly",
    "spread",
    "stored_parts",
    "stored_pv",
    "stored_scope",
]

# the queries' coefficients are formed where a chunk has at most this many (rows·keys·d_k·d_out
# products); Cauchy-Schwarz's bound otherwise
EXACT_QUERIES = 2**28


def stored_scope(p: MHAProblem, num: Numerics) -> bool:
    """Whether Theorem A.3‴ applies to the layer ``p`` (with ``lam``): A.3''s scope (IEEE dots,
    no exp2, no soft-cap; a finite masking constant leaves its heads out), the scale on the
    scores, no rotation and no split-KV. A dot's read of its operands into an operand format
    (TF32) is a relative rounding like the storage's: its increments join the martingale."""
    return (
        num.dot_kind == "ieee"
        and not num.exp2
        and p.softcap is None
        and p.rope is None
        and num.kv_splits is None
        and num.scale == "scores"
    )


def spread(
    w: np.ndarray, z: np.ndarray, z_err: np.ndarray, centre: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """``(Σ_j w_ij (z*_jm - c*_im)²)^½`` bounded above, for ``w >= 0``, float64 values ``z``
    within ``z_err`` of ``z*`` and a centre ``c = centre[0]`` within ``centre[1]`` of ``c*``.

    By Minkowski's inequality it is at most ``(Σ w (z - c)²)^½ + (Σ w)^½ (max_j z_err_j + |c -
    c*|)``; the first is formed as ``w z² - 2c (w z) + c² Σ w``, with a slack for its
    cancellation and the float64 sums' rounding of the absolute terms (``Σ w|z| <= (Σ w ·
    Σ w z²)^½``)."""
    c, c_err = centre
    ev = 2 * evaluation_rounding(w.shape[-1]) + 2.0**-49
    w_sum = w.sum(axis=-1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        w_z2, w_z = w @ (z * z), w @ z
        square = w_z2 - 2 * c * w_z + c * c * w_sum
        slack = ev * (w_z2 + 2 * np.abs(c) * np.sqrt(w_sum * w_z2) + c * c * w_sum)
        first = np.sqrt(np.maximum(square + slack, 0.0))
        err = z_err.max(axis=0, initial=0.0) + c_err
        return (first + np.sqrt(w_sum) * err) * (1 + ev)


def stored_parts(
    enc: Enclosure,
    values: Values,
    weights: tuple[np.ndarray, np.ndarray],
    rounding: Rounding,
    terms: dict[str, np.ndarray],
    scale_out: float,
    lam: float,
) -> dict[str, np.ndarray]:
    """One head's share of Theorem A.3‴ for its rows (``enc.stored`` set).

    ``weights``: the exact target's probabilities ``p`` and step 4's per-key deviations;
    ``rounding`` the probabilities' roundings and the values' errors (:class:`Rounding`),
    ``terms`` the head's terms, ``scale_out`` the head output's rounding factor. A.1 splits
    the output's error as ``Σ_j (p̃_j - p_j) ṽ_j + Σ_j (p̂_j - p̃_j) ṽ_j + Σ_j (p̂''_j - p̂_j)
    ṽ_j + Σ_j p_j (ṽ_j - v_j)`` (logits, softmax, rounding, operands; ``ṽ`` the values as
    read) and the rest. With A.3''s identity ``Σ_j (p̃_j - p_j) v_j = (1/Z) Σ_j p_j (ε_j +
    r_j)(v_j - o)`` and ``ε_j`` = the moved roundings ``+`` the dots' ``+`` a rest at most
    ``δ'_j``, it returns (:data:`STORED_PARTS`) bounds on the head's terms ``logits``,
    ``operands`` and ``probability_rounding`` together:

    * ``rest`` ``(rows, d_v)``: the dots' martingale of A.3' and the deviations times the
      values' errors, ``p (v̄ - |v| - μ̄_v)`` (the values' rest), and the probabilities' term
      where A.3'' does not apply;
    * ``first`` ``(rows, d_v)``: a bound on the head's output error but ``rest``;
    * ``var_q``, ``var_kv`` ``(rows, d_out)``: the sums of the squared bounds on the martingale
      increments through the weights ``ŵ``, the queries' and scores' (this head's own) and
      the keys' and values' (shared by a group of heads);
    * ``second`` ``(rows, d_out)``: the rest through ``ŵ`` with its signs, ``Σ_j p_j x_j
      (z_jm - ō_m)`` (``z = v ŵ``): ``(1/Z - 1)`` on the moved roundings, ``1/Z`` on ``δ'``
      and ``r``; the head's output rounding through ``|ŵ|``.
    """
    st = enc.stored
    assert st is not None
    p, per_key = weights
    live, v, w = enc.live, values.v, st.stored.w
    ev = evaluation_rounding(p.shape[-1])
    pl = np.where(live, np.nan_to_num(p), 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        split = (st.b, np.zeros_like(st.rest))
        dots_form = logits_increments(p, enc.delta, values, live, per_key, split, False)
        dots, used = dots_form.bound(lam), dots_form.fixed
        mu_v = pl @ st.stored.moved[2]  # >= |Σ_j p_j μ_vj| (A.1's split: p_j (ṽ_j - v_j))
        d = np.where(live, enc.delta, 0.0)
        # per key: the moved roundings' part of ε_j, and δ'_j + (e^δ - 1 - δ) >= |ε' + r_j|
        moved, other = pl * st.moved, pl * (st.rest + np.expm1(d) - d)
        lam_row = lam if st.stored.lam is None else st.stored.lam  # (a per-row event)
        z_inv = 1 + normaliser(pl, st, other, (d, ev, lam_row))  # 1/Z, and |1/Z - 1| + 1, at most
        o = pl @ v
        unsigned = _deviation(moved + other, np.abs(v), np.abs(o))
        first = z_inv * scale_out * unsigned + scale_out * mu_v
        z = v @ w
        z_err = evaluation_rounding(v.shape[-1]) * (np.abs(v) @ np.abs(w))
        o_bar = pl @ z
        through = (z, z_err, o_bar, pl @ z_err + ev * (pl @ np.abs(z)))
        var_q, var_kv = _variances(pl, st, through, ev)
        z_abs, o_abs = np.abs(z) + z_err, np.abs(o_bar) + through[3]
        w_abs = np.abs(w)
        second = (
            (z_inv - 1) * _deviation(moved, z_abs, o_abs)
            + z_inv * _deviation(other, z_abs, o_abs)
            + z_inv * (scale_out - 1) * (unsigned @ w_abs)
            + (scale_out - 1) * (mu_v @ w_abs)
        )
        # A.1's values' part Σ_j p_j (ṽ_j - v_j): its moved roundings in the martingale
        values_rest = pl @ np.maximum(rounding.v_extra - st.stored.moved[2], 0.0)
        z_read = z_abs + rounding.v_extra @ w_abs  # >= |ṽ_j ŵ_m|, the values as read
        more = _probabilities_through(rounding, terms["probability_rounding"], z_read)
        rest = scale_out * (dots + values_rest) + more[0]
        first = first + scale_out * more[1]
        var_q = var_q + more[2]
        second = second + more[3] + (scale_out - 1) * (more[1] @ w_abs)
        signed_rest = scale_out * (used + values_rest) + more[0]
        dot_parts = _dots_through((pl, st), (signed_rest, z_inv, scale_out), through, (v, o), w_abs)
    up = 1 + 4 * ev
    parts = (rest * up, first * up, var_q * up * up, var_kv * up * up, second * up)
    ups = (up, up * up, up, up)
    return {
        **dict(zip(STORED_PARTS, parts, strict=True)),
        **{n: x * f for n, x, f in zip(STORED_DOTS, dot_parts, ups, strict=True)},
    }


def normaliser(
    p: np.ndarray, st: StoredSplit, other: np.ndarray, rest: tuple[np.ndarray, float, float]
) -> np.ndarray:
    """Theorem A.3‴, the normaliser: a bound on ``|1/Z - 1|`` per row, ``Z = Σ_j p_j e^{ε_j}``.

    ``e^{max δ} - 1`` always; and, on one more event per row, ``ζ/(1 - ζ)`` where ``ζ < 1/2``:
    ``Z - 1 = Σ_j p_j (e^{ε_j} - 1)`` is ``M_Z = Σ_j p_j (ε^dot_j + ε^μ_j)``, the dots' and the
    moved roundings' first-order part, a martingale in the order of A.3‴ with increments
    ``c δ T_t κ_t`` (the queries', ``κ = Σ_j p_j k_j``), ``p_j`` times the keys', the scores'
    and the dots' (``w_k``, ``w_s``, ``b_j²`` per key), plus ``Σ_j p_j (ε'_j + r_j)``, within
    ``other``'s sum: ``ζ = λ V_Z^½ + Σ_j other_j`` and the float64 weights' sum off 1.
    ``rest = (δ, ev, λ)``: the logits' deterministic bounds, the float64 sums' relative
    rounding and ``λ``."""
    d, ev, lam = rest
    certain = np.expm1(d.max(axis=-1, keepdims=True))
    kappa = np.abs(p @ st.k) + 2 * ev * (p @ np.abs(st.k))
    pp = p * p
    var = (st.c2_sig_q * kappa * kappa).sum(axis=-1, keepdims=True) + (
        pp * (st.w_k + st.w_s + st.b * st.b)
    ).sum(axis=-1, keepdims=True)
    off_one = (np.abs(1 - p.sum(axis=-1, keepdims=True)) + 8 * ev) * (1 + certain)
    zeta = (lam * np.sqrt(var * (1 + 8 * ev)) + other.sum(axis=-1, keepdims=True) + off_one) * (
        1 + 8 * ev
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        probable = np.where(zeta < 0.5, zeta / (1 - zeta) * (1 + 4 * ev), np.inf)
    return np.fmin(certain, probable)


def _dots_through(
    weights: tuple[np.ndarray, StoredSplit],
    factors: tuple[np.ndarray, np.ndarray, float],
    through: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    values: tuple[np.ndarray, np.ndarray],
    w_abs: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """The ``QKᵀ`` dots' part of the logits' error (A.3') through ``ŵ`` with its signs: the
    second form of the head's rest (:data:`STORED_DOTS`). The first, ``rest``, takes the dots'
    martingale through ``|ŵ|`` on its own event per head output entry; ``signed_rest`` is
    ``rest`` without it. Through ``ŵ`` the part is ``(1/Z) M_m`` with ``M_m = Σ_j p_j ε^dot_j
    (z_jm - ō_m)``, a martingale whose increments ``p_j (z_jm - ō_m) δ_k T_k`` are bounded by
    ``p_j |z_jm - ō_m| b_jk`` (``dots_var >= Σ_j p_j² b_j² (z*_jm - ō*_m)²``, :func:`spread`),
    plus ``(1/Z - 1) M_m``, at most ``(e^{max δ} - 1) Σ_j p_j D_j |z_jm - ō_m|`` with ``D_j >=
    |ε^dot_j|`` (``dot_det``). The head output's rounding ``θ_l`` on ``(1/Z) Σ_j p_j ε^dot_j
    (v_jl - o_l)`` adds that part's bound ``F`` (``dots_first``) times ``scale_out - 1``
    through ``|ŵ|`` (``dots_second``, with the ``(1/Z - 1)`` part). ``weights``: the exact
    target's ``p`` (0 off the live keys) and the head's split; ``factors``: ``signed_rest``,
    ``e^{max δ}`` and ``scale_out``; ``values``: ``v`` and ``o``."""
    (pl, st), (signed_rest, z_inv, scale_out) = weights, factors
    z, z_err, o_bar, o_err = through
    v, o = values
    with np.errstate(over="ignore", invalid="ignore"):
        b_w = pl * st.b
        var = spread(b_w * b_w, z, z_err, (o_bar, o_err)) ** 2
        d_w = pl * st.dot_det
        unsigned = _deviation(d_w, np.abs(v), np.abs(o))
        z_abs, o_abs = np.abs(z) + z_err, np.abs(o_bar) + o_err
        second = (z_inv - 1) * _deviation(d_w, z_abs, o_abs) + z_inv * (scale_out - 1) * (
            unsigned @ w_abs
        )
        return signed_rest, var, second, z_inv * scale_out * unsigned


def stored_pv(form: Increments, scale_out: float, keys: int) -> dict[str, np.ndarray]:
    """One head's ``P·V`` roundings for Theorem A.3‴ (papers/attention.md, "P·V's roundings"),
    from their martingale form (R.8', already carried through the head output's rounding:
    ``form.scaled(scale_out)``, ``divided`` 1). The ``P·V`` part of head output ``l``'s error is
    ``M_l + F_l`` before that rounding (``M_l`` the martingale of the dot's roundings, its
    increments' squared bounds summing to at most ``spread_l²`` and ``|M_l| <= det_l`` with
    probability 1; ``|F_l| <= fixed_l``), and ``(M_l + F_l)(1 + δ_l)`` after it, ``|δ_l| <=
    scale_out - 1``. Through the output projection's weights ``ŵ``, ``Σ_l M_l ŵ_lm`` is a
    martingale of the same increments times the fixed ``ŵ_lm`` (they join the layer's, one
    event per output entry), and the rest is at most ``Σ_l (fixed_l + (scale_out - 1)(det_l +
    fixed_l))|ŵ_lm|``. Returns, per head output entry (:data:`STORED_PV`): ``spread²``
    (``pv_var``), ``det + fixed`` (``pv_first``, a bound on the part with probability 1) and
    ``fixed + (scale_out - 1) det`` (``pv_second``, the rest), each for the scaled form, which
    is larger; ``keys`` sizes the float64 evaluation's margin."""
    up = 1 + 4 * evaluation_rounding(keys)
    with np.errstate(over="ignore", invalid="ignore"):
        spread_sq = form.spread * form.spread
        first = form.det + form.fixed
        second = form.fixed + (scale_out - 1) * form.det
    shape = np.shape(form.spread)
    parts = (spread_sq * up * up, first * up, second * up)
    return {n: np.broadcast_to(x, shape) for n, x in zip(STORED_PV, parts, strict=True)}


@dataclasses.dataclass(frozen=True)
class Rounding:
    """A head's probabilities' roundings (step 6): A.3''s keys (``keys``: the bounds on
    ``|p̂_j|`` of the keys in their formats' normal ranges, ``u_p² + u_op²(1 + u_p)²``, those
    keys and what each keeps deterministic; ``None`` where A.3'' does not apply), the per-key
    charges ``each >= |p̂''_j - p̂_j|``, their products with ``v̄`` (``prob_v``, per output
    column) and the values' errors as read, ``v_extra >= |ṽ_j - v_j|`` (step 1)."""

    keys: RoundingKeys | None
    each: np.ndarray
    prob_v: np.ndarray
    v_extra: np.ndarray


def _probabilities_through(
    rounding: Rounding, term: np.ndarray, z_read: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A.1's probabilities' part ``Σ_j (p̂''_j - p̂_j) ṽ_j`` through ``ŵ`` before the head's
    output rounding, as ``(rest, part, var, second)``: for A.3''s keys ``(δ_p + δ_op(1 +
    δ_p)) p̂_j ṽ_j ŵ`` (increments whose coefficients precede them: the logits' side and the
    values' roundings), at most ``c2^½ p̄_j |ṽ_j ŵ_m|`` (``var``), another key's charge times
    ``|ṽ_j ŵ_m|`` (``second``); ``part`` bounds it per column. Without A.3''s keys, the
    head's term ``term`` as it is (``rest``)."""
    if rounding.keys is None:
        zero = np.zeros(())
        return term, np.zeros_like(term), zero, zero
    w_keys, c2, normal, eta_conv = rounding.keys
    kept = np.where(normal, eta_conv, rounding.each)
    var = c2 * ((w_keys * w_keys) @ (z_read * z_read))
    return np.zeros(()), rounding.prob_v, var, kept @ z_read


def _deviation(weights: np.ndarray, x_abs: np.ndarray, c_abs: np.ndarray) -> np.ndarray:
    """``Σ_j w_j |x_j - c| <= w x̄ + c̄ Σ w`` for ``w >= 0``, ``|x| <= x̄`` and ``|c| <= c̄``."""
    return weights @ x_abs + c_abs * weights.sum(axis=-1, keepdims=True)


def queries_exactly(
    p: np.ndarray,
    k: np.ndarray,
    c2_sig_q: np.ndarray,
    through: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> np.ndarray:
    """``(Σ_t c²σ_q,t² α_tm²)^½`` with the queries' coefficients ``α_tm = Σ_j p_j k_jt (z*_jm -
    ō*_m)`` formed (``rows·d_k·d_out`` of them) instead of Cauchy-Schwarz's bound: the float64
    ``α = p(k z) - κ ō`` is within ``2γ(Σ_j p_j|k_jt||z_jm| + Σ_j p_j|k_jt| |ō_m|) + Σ_j p_j|k_jt|
    (ζ_jm + ω_m)`` of the exact one (``Σ p|k||z| <= (p k²)^½ (p z²)^½``), added by Minkowski."""
    z, z_err, o_bar, o_err = through
    kappa, k_abs = p @ k, p @ np.abs(k)
    alpha = np.einsum("ij,jt,jm->itm", p, k, z, optimize=True) - kappa[..., None] * o_bar[:, None]
    gamma = 2 * evaluation_rounding(p.shape[-1] + 2)
    magnitude = np.sqrt(p @ (k * k))[..., None] * np.sqrt(p @ (z * z))[:, None]
    error = gamma * (magnitude + k_abs[..., None] * np.abs(o_bar)[:, None])
    error = error + k_abs[..., None] * (z_err.max(axis=0) + o_err)[:, None]
    weights = c2_sig_q[..., None]
    return (
        np.sqrt((weights * alpha * alpha).sum(axis=-2))
        + np.sqrt((weights * error * error).sum(axis=-2))
    ) * (1 + gamma)


def _variances(
    p: np.ndarray,
    st: StoredSplit,
    through: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ev: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The squared increments' sums through ``ŵ`` (``z = v ŵ``, ``ō = p z``):

    * queries: ``c μ_q,t Σ_j p_j k_jt (z_j - ō)``, by Cauchy-Schwarz (``Σ_j p_j (z_j - ō) = 0``
      up to ``1 - Σ p``) at most ``c μ_q,t (Var_p k_t Var_p z)^½ + c μ_q,t |κ_t| |ō| ε``;
    * scores and keys: ``p_j (z_j - ō)`` times ``w_s`` and ``w_k`` (per key);
    * values: ``p_j μ_v,jl ŵ_lm`` (A.1's split: the exact target's weights on ``ṽ - v``).
    """
    stored = st.stored
    w, k = stored.w, st.k
    z, z_err, o_bar, o_err = through
    sigma_z = spread(p, z, z_err, (o_bar, o_err))
    kappa = p @ k
    sigma_k = spread(p, k, np.zeros_like(k), (kappa, np.zeros_like(kappa)))
    not_one = np.abs(1 - p.sum(axis=-1, keepdims=True)) + ev
    q_part = np.sqrt((st.c2_sig_q * sigma_k * sigma_k).sum(axis=-1, keepdims=True)) * sigma_z
    q_part = (
        q_part
        + np.sqrt((st.c2_sig_q * kappa * kappa).sum(axis=-1, keepdims=True))
        * (np.abs(o_bar) + o_err)
        * not_one
    )
    if p.size * k.shape[-1] * z.shape[-1] <= EXACT_QUERIES:
        q_part = np.fmin(q_part, queries_exactly(p, k, st.c2_sig_q, through))
    s_part = spread(p * p * st.w_s, z, z_err, (o_bar, o_err))
    k_part = spread(p * p * st.w_k, z, z_err, (o_bar, o_err))
    sig_v = stored.sigma[2]
    v_part = (p * p) @ ((sig_v * sig_v) @ (w * w))
    return q_part * q_part + s_part * s_part, k_part * k_part + v_part * (1 + ev)
