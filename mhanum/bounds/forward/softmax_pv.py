"""Steps 4-7 of Theorem A.1 (papers/attention.md): the softmax of logits known to within ``δ``,
its probabilities rounded, ``P·V`` and the output's last rounding, each a function."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum._types import NumpyArray
from mhanum.bounds.factors import (
    compound,
    conversion_eta,
    evaluation_rounding,
    exp_and_sum_factors,
    operand_error,
    operand_error_of,
    safe_weight_sums,
    step_w_output,
)
from mhanum.bounds.forward.across_keys import logits_increments
from mhanum.bounds.forward.along import along_term
from mhanum.bounds.forward.evaluation import (
    dot,
    logsumexp,
    on,
    quiet,
    times_expm1,
    weighted_expm1,
)
from mhanum.bounds.forward.extremes import PerKey, direct_rows, per_key
from mhanum.bounds.forward.known_rounding import (
    kernel_weights,
    known_roundings,
    online_row_sum,
    online_weights_lower_end,
    rounded_range,
    row_factor_known,
    underflow_charge,
    weights_before_rounding,
)
from mhanum.bounds.forward.last_rounding import nearest_output, read_by_the_output
from mhanum.bounds.forward.one_martingale import (
    GROUPS,
    Increments,
    one_martingale_step,
    replace_group,
    rounding_martingale,
    row_sum_martingale,
)
from mhanum.bounds.forward.pv_dot import pv_one_signed
from mhanum.bounds.forward.stage import (
    ALONG,
    KNOWN,
    PLAIN,
    WHOLE,
    Context,
    Enclosure,
    RoundingKeys,
    Values,
)
from mhanum.bounds.forward.stored import Rounding, stored_parts, stored_pv
from mhanum.bounds.forward.through_weights import Through, through_weights
from mhanum.units import Naive, Online, Safe

__all__ = ["softmax_pv"]


@dataclasses.dataclass(frozen=True, eq=False)
class _RowSum:
    """Step 5 (and W): the exponentials' and sums' factors, the row sum's error ``t_safe``
    (0 in a vacuous row), ``per_sum >= 1/(S(1 - T))`` and step W's bound ``whole``; ``T =
    (1 + t_exp)(1 + g_sum) - 1 + under``, ``t_exp`` the exponentials' part and ``under`` the
    additions' underflow (Theorem A.3e's row sum)."""

    x: Any
    blocks: int
    g_sum: Any
    g_pv: Any
    eta_pv: Any
    lift: float
    vacuous: Any
    sound: Any
    t_safe: Any
    per_sum: Any
    whole: tuple[Any, Any] | None
    rescued: Any
    t_exp: Any
    under: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Weights:
    """Steps 5' and 6: the computed weights' deviations ``soft`` (with ``eta_soft``), their
    relative part ``rel``, the roundings ``prob`` and ``operand_p``, the bound ``p_hat_hi`` on
    the weights as ``P·V`` reads them, A.3'''s keys (``rounding_keys``), the enclosure
    ``[a_j, b_j]`` of the value the kernel rounds into ``F_p`` (``before``) and Lemma 6k's
    ``[A_j, B_j]`` (``rounded``), where later steps read them."""

    soft: Any
    eta_soft: Any
    rel: Any
    prob: Any
    operand_p: Any
    p_hat_hi: Any
    rounding_keys: RoundingKeys | None
    before: tuple[NumpyArray, NumpyArray] | None = None
    rounded: tuple[NumpyArray, NumpyArray] | None = None


def _row_sum(enc: Enclosure, values: Values, ctx: Context, pk: PerKey) -> _RowSum:
    """Step 5: ``|ŝ_j - m| <= G_j`` for the computed maximum ``m`` in ``[lo, hi]`` (safe,
    online), the exponentials' relative errors ``R_j = e^{x_j} - 1`` and the computed row sum's
    relative error ``T``; step W and the naive softmax's flags (:func:`_vacuous_rows`)."""
    num, live, sc, delta = ctx.num, enc.live, pk.sc, enc.delta
    n = enc.s.shape[-1]
    eta_m = num.format_of("softmax").smallest_normal
    lo = on(live, sc - delta, -np.inf).max(axis=-1, keepdims=True)
    hi = on(live, sc + delta, -np.inf).max(axis=-1, keepdims=True)
    gap = on(live, np.maximum(hi - sc + delta, np.abs(sc + delta - lo)), 0.0)
    if enc.fold is not None:
        gap = gap + enc.fold
    x, blocks, g_sum, g_pv, eta_pv = exp_and_sum_factors(num, n, gap, ctx.lam, values.bits_pv)
    # prob_offset k: the unnormalised weights and their sums carry 2^k (the division cancels
    # it), so every absolute underflow against them shrinks by 2^-k and every range grows by 2^k
    lift = 2.0**num.prob_offset
    x = np.broadcast_to(x, enc.s.shape)
    with np.errstate(invalid="ignore"):
        if isinstance(num.softmax_algorithm, Naive):
            log_s_lo = pk.top + pk.log_sum_lo
        else:
            log_s_lo = np.maximum(0.0, pk.log_sum_lo - np.where(np.isfinite(hi), hi, 0.0))
    # R_j = e^{x_j} - 1: the relative error of the computed (rescaled) exponential of key j.
    x = on(live, x, 0.0)
    with np.errstate(over="ignore"):
        r_mean = weighted_expm1(pk.hi, x, live)
        r_max = np.expm1(x.max(axis=-1, keepdims=True))
    r_bar = np.minimum(r_mean, r_max)
    with np.errstate(over="ignore"):
        underflow = n * eta_m * np.exp(-log_s_lo) / lift
        t_sum = compound(r_bar + underflow, g_sum) + underflow
    vacuous = ~np.isfinite(t_sum) | (t_sum >= 1)
    whole, rescued = _step_w(enc, values, ctx, gap, (g_sum, g_pv, eta_pv), vacuous)
    vacuous = _vacuous_rows(enc, ctx, pk, hi, vacuous & ~rescued) | vacuous
    sound = ~vacuous
    t_safe = on(sound, t_sum, 0.0)
    per_sum = np.exp(on(sound, -log_s_lo, 0.0)) / (1 - t_safe)
    return _RowSum(
        x, blocks, g_sum, g_pv, eta_pv, lift, vacuous, sound, t_safe, per_sum, whole, rescued,
        on(sound, r_bar + underflow, 0.0), on(sound, underflow, 0.0),
    )  # fmt: skip


def _step_w(
    enc: Enclosure,
    values: Values,
    ctx: Context,
    gap: Any,
    factors: tuple[Any, Any, Any],
    vacuous: Any,
) -> tuple[tuple[Any, Any] | None, Any]:
    """Step W: the safe softmax's output is bounded whatever the logit errors; a row whose
    row sum step 5 cannot bound keeps that bound alone (its softmax term infinite). Returns
    ``(P·V, output)`` bounds (``None`` unless safe) and the rows so rescued; R.5's check of
    the row sum of the computed exponentials."""
    num, live = ctx.num, enc.live
    n = enc.s.shape[-1]
    fm = num.format_of("softmax")
    if not isinstance(num.softmax_algorithm, Safe):  # (prob_offset is online only)
        return None, False
    # (deterministic: it holds with probability 1, so also beside A.3's terms)
    if ctx.lam is not None:
        factors = exp_and_sum_factors(num, n, gap, None, values.bits_pv)[2:]
    g_w, g_pv_w, eta_pv_w = factors
    n_live = live.sum(axis=-1, keepdims=True)
    _, row = safe_weight_sums(n_live, g_w, ctx.u_div, fm)
    whole = step_w_output(row, n_live, n, values.abs_max, values.abs_sum, g_pv_w, eta_pv_w, num)
    rescued = vacuous & np.isfinite(whole[1]).all(axis=-1, keepdims=True)
    # R.5: the row sum of the computed exponentials, each at most 1 + ε_e (Lemma W), in
    # F_m (a pairwise sum of 2^16 float16 ones reaches inf; the output is then 0)
    e_top = 1 + 2 * num.exp_ulps * fm.u
    sum_upper = n_live * e_top * (1 + g_w) + n_live * fm.smallest_normal
    ctx.ranges.check(sum_upper, fm, "the softmax's row sum", rows="q")
    return whole, rescued


def _vacuous_rows(enc: Enclosure, ctx: Context, pk: PerKey, hi: Any, flagged: Any) -> Any:
    """The rows step 5 cannot bound (``flagged``, term ``vacuous``) and, for the naive softmax,
    those where exp or the row sum may overflow, or the row sum's reciprocal flush to zero:
    XLA divides by the row sum as a product with its reciprocal, which flushes to zero once the
    sum exceeds ``2^-emin`` of its carrier (papers/attention.md, step 5)."""
    ctx.ranges.flag(
        flagged,
        "softmax: the computed row sum may be off by 100% (its error factor T >= 1)",
        "vacuous",
    )
    if not isinstance(ctx.num.softmax_algorithm, Naive):
        return False
    fm = ctx.num.format_of("softmax")
    top = pk.top
    log_sum = top + logsumexp(pk.sc + enc.delta) + math.log(2)
    carrier_emin = -1022 if fm.name == "float64" else -126  # the reciprocal's format
    flush = log_sum >= -carrier_emin * math.log(2) - 1
    over = (top + hi >= math.log(fm.max_finite) - 1) | (log_sum >= math.log(fm.max_finite))
    ctx.ranges.flag(
        over,
        f"naive softmax: exp of an unshifted logit or the row sum may overflow {fm.name} "
        f"(largest finite {fm.max_finite:.6g})",
        "vacuous",
    )
    ctx.ranges.flag(
        flush & ~over,
        "naive softmax: the row sum may exceed 2^-emin of the reciprocal's format, which "
        "then flushes to zero",
        "vacuous",
    )
    return flush | over


def _probabilities(enc: Enclosure, ctx: Context, pk: PerKey, rs: _RowSum) -> _Weights:
    """Steps 5' and 6: the computed weights and their roundings into the probability format
    and the dot's operand format.

    ``p̂_j = p̃_j(1 + ρ_j)(1 + ε_j)/(1 + τ)`` with the row sum's error ``τ`` common to the row,
    so its share of ``Σ_j (p̂_j - p̃_j) v_j`` is at most ``T/(1 - T)·|Σ_j p̃_j ṽ_j|``, not
    ``T/(1 - T)·Σ_j p̃_j |ṽ_j|``. Online there is no per-key division: the output's one
    division is charged in the output's factor and term. Step 6: an absolute
    ``min(p̂_j, η_p)`` only where ``p̂_j`` may lie below F_p's smallest normal number (0 is a
    candidate of the rounding there; ``u_p·η_p`` under gradual underflow).
    """
    num, lam, u_div = ctx.num, ctx.lam, ctx.u_div
    ev_rel = evaluation_rounding(enc.s.shape[-1])  # float64 sums over the keys
    f_p = num.format_of("prob")
    u_p, eta_p = f_p.u, f_p.smallest_normal
    eta_under = underflow_charge(num)  # below η_p: a flush, or half the subnormal spacing
    eta_m = num.format_of("softmax").smallest_normal
    u_op, eta_op = operand_error_of(num, f_p)
    eta_op = eta_op + conversion_eta(num, num.operand_rounding or f_p)
    online = isinstance(num.softmax_algorithm, Online)
    y = rs.x + math.log1p(u_div) - np.log1p(-rs.t_safe)
    soft = on(rs.sound, times_expm1(pk.hi, y), 0.0)  # vacuous rows: flagged
    eta_soft = eta_m * (1 + u_div) * rs.per_sum / rs.lift + eta_m
    soft += eta_soft
    rel = on(rs.sound, times_expm1(pk.hi, rs.x + math.log1p(0.0 if online else u_div)), 0.0)
    p_hat_hi = pk.hi + soft
    before = None
    if eta_op or known_roundings(ctx):
        before = weights_before_rounding(enc, ctx, pk, rs.x, soft)
        if enc.kernel is not None and not online:
            before = kernel_weights(enc, enc.kernel, rs.sound, (y, eta_soft), before)
    rounding_keys: RoundingKeys | None = None
    online_keys = None
    if online:
        # a flush below F_p's smallest normal number only where the unnormalised weight may
        # lie below it (not lifted: a_j is the unlifted weight's); looked at where that
        # number is not negligible (float16, fp8: every key keeps it elsewhere)
        may_flush: float | NumpyArray = eta_under
        if not num.prob_offset and (before is not None or eta_p >= 2.0**-30):
            lowest = online_weights_lower_end(enc, ctx, pk, rs.x) if before is None else before[0]
            may_flush = np.where(lowest >= eta_p, 0.0, eta_under)
        absolute = (may_flush + rs.blocks * eta_m) * rs.per_sum / rs.lift
        prob = u_p * p_hat_hi + absolute
        if lam is not None and num.dot_kind == "ieee" and not u_op:
            online_keys = (np.where(enc.live, p_hat_hi, 0.0), absolute)
    else:
        p_hat_lo = pk.lo * (1 - ev_rel) - soft
        normal_p = p_hat_lo >= eta_p
        prob = u_p * p_hat_hi
        if not normal_p.all():  # (x + 0 = x: no pass where every p̂_j is normal)
            prob += np.where(normal_p, 0.0, np.minimum(p_hat_hi, eta_under))
        if lam is not None and num.dot_kind == "ieee":
            # Theorem A.3'' (papers/attention.md): the relative roundings of p̂_j into F_p and
            # the operand format, keys in their normal ranges, as one martingale per output
            # entry with increments at most u·p̂_j·v̄_j; the other keys stay deterministic.
            op_fmt = num.operand_rounding
            normal = enc.live & normal_p
            if op_fmt is not None:
                normal = normal & (p_hat_lo * (1 - u_p) >= op_fmt.smallest_normal)
            eta_conv = eta_op - (op_fmt.smallest_normal if op_fmt is not None else 0.0)
            rounding_keys = (
                np.where(normal, p_hat_hi, 0.0),
                u_p**2 + (u_op * (1 + u_p)) ** 2,
                normal,
                eta_conv,
            )
    p_hat_hi += prob  # (in place: p_hat_hi is this function's own array)
    operand_p = u_op * p_hat_hi + _read_flush(ctx, pk, rs, soft, (before, eta_op))
    p_hat_hi += operand_p
    if online_keys is not None:
        # Theorem A.3'', online: the unnormalised weights' relative roundings into F_p, with the
        # rescalings and the division they share with the unrounded ones as coefficients; each
        # key keeps its absolute parts (a flush, in F_p or in the dot's read) deterministic
        w_keys, absolute = online_keys
        rounding_keys = (w_keys, u_p**2, enc.live, absolute + operand_p)
    rounded = None
    if before is not None and known_roundings(ctx):
        with quiet():
            rounded = rounded_range(num, before)
    return _Weights(soft, eta_soft, rel, prob, operand_p, p_hat_hi, rounding_keys, before, rounded)


def _read_flush(
    ctx: Context,
    pk: PerKey,
    rs: _RowSum,
    soft: NumpyArray,
    read: tuple[tuple[NumpyArray, NumpyArray] | None, float],
) -> NumpyArray | float:
    """Step 6, the dot's read of the rounded weights: a flush below the operand (or
    accumulation) format's smallest normal number ``η_op`` moves a weight by at most ``η_op``
    (online: divided by the row sum later, ``per_sum``), and only a weight that may lie below
    it: where the value the kernel rounds into ``F_p`` is at least ``a_j`` with ``a_j(1 - u_p)
    >= η_op`` (:func:`~mhanum.bounds.forward.known_rounding.weights_before_rounding`; rounding
    to nearest keeps it there), the read costs nothing. ``read``: that enclosure and
    ``η_op``."""
    before, eta_op = read
    if not eta_op or before is None:
        return 0.0
    num = ctx.num
    with quiet():
        may = ~(before[0] * (1 - num.format_of("prob").u) >= eta_op)
        if isinstance(num.softmax_algorithm, Online):
            return np.where(may, eta_op * np.maximum(rs.per_sum / rs.lift, 1.0), 0.0)
        return np.where(may, np.minimum(pk.hi + soft, eta_op), 0.0)


def _pv_ranges(
    enc: Enclosure, values: Values, ctx: Context, rs: _RowSum, w: _Weights, p_hat_v: Any
) -> Any:
    """R.5: the sums, and the ``P·V`` unit's underflow with its anchor; returns that
    underflow. Online: every rescaled exponential is at most ``(1 + ε_e)(1 + u_m)`` per block,
    so the running sum is below ``n·growth·(1 + g)`` and every partial ``P·V`` sum below
    ``growth·(1 + g_pv)·Σ_j |v_j|``; safe and naive: the ``P·V`` partial sums stay below
    ``(1 + g_pv)·p̂|v| + η``."""
    num, ranges, v_abs = ctx.num, ctx.ranges, values.v_abs
    n = enc.s.shape[-1]
    online = isinstance(num.softmax_algorithm, Online)
    fm, fa, f_p = (num.format_of(r) for r in ("softmax", "accum", "prob"))
    u_op, _ = operand_error(num)
    eta_pv = rs.eta_pv
    if values.anchor:
        # the P·V unit reads p̂ (online: unnormalised weights <= 1, divided by the sum later)
        weights = n if online else w.p_hat_hi.sum(axis=-1, keepdims=True)
        anchor = values.anchor
        eta_pv = eta_pv + rs.g_pv * anchor * (weights + values.abs_sum + n * anchor)
    rows_live = enc.live.any(axis=-1, keepdims=True)
    if not online:
        pv_upper = (1 + rs.g_pv) * (
            p_hat_v if rs.sound.all() else np.where(rs.sound, w.p_hat_hi, 0.0) @ v_abs
        )
        pv_upper = pv_upper + eta_pv
        if rs.whole is not None:
            pv_upper = np.fmin(pv_upper, rs.whole[0])
        ranges.check(pv_upper, fa, "P·V accumulated", entries=True)
        return eta_pv
    eps_e = 2 * num.exp_ulps * fm.u
    growth = ((1 + eps_e) * (1 + fm.u) * (1 + fa.u) ** 2) ** (rs.blocks + 1)
    # prob_offset: a computed exponential is at most e^lift_arg·(1 + ε_e), more than 2^k
    # where fl(fl(m·c2) - k) rounds (|m·c2| past 2^p·k)
    with np.errstate(over="ignore"):
        lift_hi = rs.lift if enc.lift_arg is None else np.exp(enc.lift_arg)
    ranges.check(
        np.where(
            rows_live,
            lift_hi * n * growth * (1 + rs.g_sum) + n * rs.blocks * fm.smallest_normal,
            0.0,
        ),
        fm,
        "online softmax: the running sum",
    )
    if num.prob_offset:
        # the lifted weights in the probability format, then the dot's operand format
        lifted = np.where(rows_live, lift_hi * growth * (1 + f_p.u), 0.0)
        for fmt in (f_p, num.operand_rounding):
            if fmt is not None:
                ranges.check(
                    lifted * (1 + u_op),
                    fmt,
                    f"the exponentials lifted by 2^{num.prob_offset} (prob_offset)",
                )
    acc_upper = lift_hi * growth * (1 + f_p.u) * (1 + rs.g_pv) * values.abs_sum + eta_pv
    for fmt in (fa, fm):
        ranges.check(
            np.where(rows_live, acc_upper, 0.0),
            fmt,
            "online softmax: the unnormalised P·V accumulator",
            entries=True,
        )
    return eta_pv


@dataclasses.dataclass(frozen=True, eq=False)
class _Output:
    """The float64 output ``o = p v`` (``pl``: ``p`` on the live keys), ``p|v|``, its
    evaluation error ``ev``, the values' errors ``v_extra`` and their centred bound ``v_dev``."""

    pl: Any
    o: Any
    pv_abs: Any
    ev: Any
    v_extra: Any
    v_dev: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Charges:
    """What step 7's terms charge: the per-key deviations ``logits`` and their product
    ``logits_v`` with the centred values, the weights, the softmax term, the last division's
    ``u_last``, the ``P·V`` factor ``g_row`` and underflow ``eta_pv``, ``p̂|v|``, and step
    5''s form without the row sum's common part with ``Õ >= |õ|`` (``common``)."""

    logits: Any
    logits_v: Any
    w: _Weights
    soft_term: Any
    u_last: Any
    g_row: Any
    eta_pv: Any
    p_hat_v: Any
    common: tuple[Any, Any]


def _output(enc: Enclosure, values: Values, pk: PerKey) -> _Output:
    """The float64 output of the logits ``s`` and ``|ṽ_j - c|`` (:attr:`Values.deviation`)."""
    v, ev_rel = values.v, evaluation_rounding(enc.s.shape[-1])
    pl = on(enc.live, pk.p, 0.0)
    with np.errstate(invalid="ignore"):
        o = pl @ v
    pv_abs = pl @ values.abs_v
    return _Output(pl, o, pv_abs, ev_rel * pv_abs, values.extra, values.deviation)


def _charges(
    values: Values,
    ctx: Context,
    pk: PerKey,
    rs: _RowSum,
    w: _Weights,
    out: _Output,
    pv: tuple[Any, Any],
) -> _Charges:
    """Step 4, centred: ``Σ_j (p̃_j - p_j) = 0``, so the logits' part of the output is
    ``Σ_j (p̃_j - p_j)(v_j - c)`` for the keys' median ``c``, at most ``Σ_j L_j |v_j - c|``;
    step 5''s softmax term, at most ``Σ_j soft_j |ṽ_j|``. ``pv``: ``P·V``'s underflow and
    ``p̂|v|``."""
    v_abs, ev_rel = values.v_abs, evaluation_rounding(pk.p.shape[-1])
    with np.errstate(over="ignore", invalid="ignore"):
        # |Σ_j p̃_j ṽ_j| <= |o| + Σ_j |p̃_j - p_j| |v_j - c| + Σ_j p_j (v̄_j - |v_j|)
        logits_v = pk.logits @ out.v_dev
        o_tilde = (
            np.abs(out.o) + out.ev + logits_v + dot(out.pl, out.v_extra, values.extra_any)
        ) * (1 + ev_rel)
        o_tilde = np.minimum(o_tilde, pk.hi @ v_abs)
        inv = 1 / (1 - rs.t_safe)
        apart = (w.rel @ v_abs) * inv + w.eta_soft * values.abs_sum
        soft_term = apart + rs.t_safe * inv * o_tilde
    common = (apart, o_tilde)
    soft_term = np.fmin(soft_term, w.soft @ v_abs)
    eta_pv, p_hat_v = pv
    return _Charges(pk.logits, logits_v, w, soft_term, ctx.u_div, rs.g_pv, eta_pv, p_hat_v, common)


def _one_key_rows(
    enc: Enclosure, values: Values, ctx: Context, ch: _Charges, out: _Output
) -> _Charges:
    """A row with one live key: ``ŝ_j - m = 0`` exactly, ``exp(0) = 1`` (assumption E of
    M.5), the sum is 1 and ``1/1 = 1``, so ``p̂_j = 1``, and ``P·V`` sums the one exact
    product ``1·v_j`` with zeros (a split dot still drops ``v_j``'s last piece: its factor
    stays). Not with ``prob_offset``: the one key's weight is ``exp2(k)``, which XLA need not
    return exactly."""
    num, live = ctx.num, enc.live
    single = live.sum(axis=-1, keepdims=True) == 1
    if not (not isinstance(num.softmax_algorithm, Naive) and single.any() and not num.prob_offset):
        return ch
    w = ch.w
    logits, soft, prob, operand_p = (
        np.where(single, 0.0, x) for x in (ch.logits, w.soft, w.prob, w.operand_p)
    )
    rounding_keys = w.rounding_keys
    if rounding_keys is not None:
        w_keys, c2, normal, eta_conv = rounding_keys
        rounding_keys = (np.where(single, 0.0, w_keys), c2, normal & ~single, eta_conv)
    p_hat_hi = np.where(single, np.where(live, 1.0, 0.0), w.p_hat_hi)
    w = dataclasses.replace(
        w, soft=soft, prob=prob, operand_p=operand_p, p_hat_hi=p_hat_hi, rounding_keys=rounding_keys
    )
    eta_pv, g_row = ch.eta_pv, ch.g_row
    if num.dot_kind != "split":
        eta_pv = np.where(single, 0.0, eta_pv)
        g_row = np.where(single, 0.0, g_row)
    # the factors changed on the one-key rows
    return _Charges(
        logits,
        logits @ out.v_dev,
        w,
        np.where(single, 0.0, ch.soft_term),
        np.where(single, 0.0, ctx.u_div),  # acc / 1
        g_row,
        eta_pv,
        p_hat_hi @ values.v_abs,
        (np.where(single, 0.0, ch.common[0]), np.where(single, 0.0, ch.common[1])),
    )


def _terms(
    values: Values, ctx: Context, rs: _RowSum, ch: _Charges, out: _Output, scale_out: Any
) -> tuple[dict[str, Any], Any, Increments | None]:
    """Step 7: the terms (each carried through the output's rounding, ``scale_out``), the
    product ``operand_p·|v|``, and with ``lam`` ``P·V``'s martingale form (R.8', Theorem
    A.3e)."""
    num, v_abs, w = ctx.num, values.v_abs, ch.w
    online = isinstance(num.softmax_algorithm, Online)
    f_o, eta_m = num.format_of("output"), num.format_of("softmax").smallest_normal
    u_o = f_o.u
    u_op, eta_op = operand_error_of(num, num.format_of("prob"))
    eta_op = eta_op + conversion_eta(num, num.operand_rounding or num.format_of("prob"))
    prob_v = w.prob @ v_abs
    # (no product where the operand format reads p̂ exactly: operand_p is 0 then)
    op_v = w.operand_p @ v_abs if u_op or np.any(eta_op) else np.zeros_like(prob_v)
    pv_under = ch.eta_pv * rs.per_sum / rs.lift if online else ch.eta_pv
    pv, form = ch.g_row * ch.p_hat_v + pv_under, None
    if rs.blocks <= 1 and num.kv_splits is None:  # or R.8's, through the one-signed total
        # (online on one block: the dot of the unnormalised weights, divided by ℓ̂ after)
        read, output = (ch.p_hat_v, v_abs), (out.o, out.ev, out.pl, out.v_extra)
        dev = ch.logits + w.soft + w.prob + w.operand_p
        per = rs.per_sum / rs.lift if online else 1.0
        r8, form = pv_one_signed(num, values.bits_pv, read, output, dev, ctx.lam, per)
        pv = np.fmin(pv, r8)
    o_abs = np.abs(out.o)
    terms = {
        "logits": scale_out * ch.logits_v,
        "softmax": scale_out * ch.soft_term,
        "probability_rounding": scale_out * prob_v,
        "operands": scale_out * (op_v + dot(w.p_hat_hi, out.v_extra, values.extra_any)),
        "pv": scale_out * pv,
        # (the output's underflow, η_o, where the value rounded may be below F_o's normal
        # range: added by softmax_pv once the other terms bound that value)
        "output": u_o * o_abs + ((1 + u_o) * (ch.u_last * o_abs + eta_m) if online else 0.0),
    }
    return terms, op_v, None if form is None else form.scaled(scale_out)


def _rounding_martingale(
    terms: dict[str, Any], values: Values, ctx: Context, ch: _Charges, out: _Output, scale: float
) -> Increments | None:
    """Theorem A.3'' (papers/attention.md): where the martingale of the keys' relative
    roundings into the probability and operand formats is smaller, it replaces the two terms
    (the choice depends on the inputs only: one event per entry); ``scale`` is the output's
    factor. Returns the martingale form for Theorem A.3e. Updates ``terms``."""
    w, lam_e = ch.w, ctx.lam_e
    if w.rounding_keys is None or lam_e is None:
        return None
    rest = dot(w.p_hat_hi, out.v_extra, values.extra_any)
    form = rounding_martingale(w.rounding_keys, (w.prob, w.operand_p), values.v_abs, rest)
    form = form.scaled(scale)
    replace_group(terms, GROUPS["rounding"], form.bound(lam_e))
    return form


def _relative_roundings(
    enc: Enclosure, values: Values, ctx: Context, pk: PerKey, rs: _RowSum, w: _Weights
) -> NumpyArray | None:
    """Step 6r (papers/attention.md): the probabilities' roundings into ``F_p`` with their
    signs, a bound on what the term ``probability_rounding`` bounds, or ``None`` where it does
    not apply.

    The kernel rounds a value ``y_j`` in ``[a_j, b_j]``
    (:func:`~mhanum.bounds.forward.known_rounding.weights_before_rounding`) to
    ``fl_p(y_j) = y_j(1 + κ_j)``; by Lemma 6k ``fl_p(y_j)`` lies in ``[A_j, B_j]`` (the nearest
    values to the neighbours of ``a_j`` and ``b_j``; 0 below the smallest normal number), so
    ``κ_j`` lies in ``[A_j/b_j - 1, B_j/a_j - 1]``, centre ``κ̄_j``, radius ``r_j``. The
    weights' share of the output is ``Σ_j κ_j ŵ_j ṽ_j`` with ``ŵ_j`` the kernel's weight before
    the rounding, within ``L_j + soft_j`` of ``p_j``, and ``ṽ_j`` within ``v̄_j - |v_j|`` of
    ``v_j``; so it is at most ``|Σ_j κ̄_j p_j v_j| + Σ_j (|κ̄_j|(L_j + soft_j) + r_j ŵ_j)|v_j|
    + Σ_j (|κ̄_j| + r_j) ŵ_j (v̄_j - |v_j|)``. A key is taken so where ``r_j <=
    u_p/4`` and ``|κ̄_j| <= 2u_p`` (a choice on the inputs alone); the others keep step 6's
    charge. Online, the rescalings' conversions keep theirs (``K η_m`` per key)."""
    num = ctx.num
    if w.before is None or w.rounded is None:
        return None
    f_p = num.format_of("prob")
    online = isinstance(num.softmax_algorithm, Online)
    ev_rel = evaluation_rounding(enc.s.shape[-1])
    with quiet():
        a, b = w.before
        low, high = w.rounded
        k_lo, k_hi = low / b - 1, high / a - 1
        centre, radius = (k_lo + k_hi) / 2, (k_hi - k_lo) / 2
        radius = radius + (np.abs(centre) + radius) * 2.0**-50
        known = enc.live & (a > 0) & (radius <= f_p.u / 4) & (np.abs(centre) <= 2 * f_p.u)
        centre, radius = on(known, centre, 0.0), on(known, radius, 0.0)
        signed = np.abs((centre * pk.p) @ values.v) * (1 + 2.0**-52)
        weight_hi = pk.hi + w.soft
        spread = (2 * ev_rel * np.abs(centre) * pk.p + np.abs(centre) * (pk.logits + w.soft)
                  + radius * weight_hi + np.where(known, 0.0, w.prob)) @ values.v_abs  # fmt: skip
        # the known keys' roundings read ṽ, within v̄ - |v| of v (0 for values read exactly)
        read = dot((np.abs(centre) + radius) * weight_hi, values.extra)
        charge = (signed + spread + read) * (1 + ev_rel)
        if online:
            eta_m = num.format_of("softmax").smallest_normal
            charge = charge + rs.blocks * eta_m * rs.per_sum / rs.lift * values.abs_sum
    return np.where(rs.sound, charge, np.inf)


_WEIGHTS = ("logits", "softmax", "probability_rounding", "operands")


def _known_probabilities(
    terms: dict[str, Any],
    enc: Enclosure,
    values: Values,
    ctx: Context,
    pk: PerKey,
    rs: _RowSum,
    w: _Weights,
    out: _Output,
) -> None:
    """Step 6k (papers/attention.md): the rounded probabilities, known where their enclosure
    lies within one rounding interval of the probability format.

    The kernel's probability before its rounding into ``F_p`` lies in ``[a_j, b_j] =
    [lo_j(1 - ε) - soft_j, hi_j + soft_j]`` (steps 4 and 5, ``ε`` the float64 evaluation's). Rounding to nearest is monotone for every tie
    rule, and a flush to zero is too, so ``fl_p`` of it lies in ``[A_j, B_j]``, ``A_j`` the
    nearest value to a number just below ``a_j`` (0 where ``a_j`` may lie below the smallest
    normal number) and ``B_j`` the nearest to one just above ``b_j``: one value of ``F_p``
    where no rounding boundary lies between ``a_j`` and ``b_j``, which is the common case when
    the probabilities are computed in a finer format than they are stored in. With ``c_j =
    (A_j + B_j)/2`` and ``ρ_j = (B_j - A_j)/2``, ``|Σ_j fl_p(p̂_j) ṽ_j - o| <= |Σ_j c_j v_j - o|
    + Σ_j ρ_j |v_j| + Σ_j B_j |ṽ_j - v_j|``: the probabilities' roundings enter with their
    signs, as the kernel makes them. This bounds the output's weights terms (logits, softmax,
    probability rounding, operands) at once; where it is smaller, it replaces them as the
    term ``known_probabilities``. Taken where the dot reads ``fl_p(p̂_j)`` exactly (no operand
    rounding, or an operand format that holds every value of ``F_p``; a flush on the read,
    below the operand or accumulation format's smallest normal number, is one more way down
    to 0 and sets ``A_j = 0`` there); not under A.1g or A.2 (c') (``project``, ``along``),
    which take the logits term apart. Online, for rows of one block (``n <= B``) with masked
    keys at weight 0: the kernel divides ``Σ_j fl_p(ê_j) ṽ_j`` by its row sum ``l̂``, in
    ``[l_lo, l_hi]`` (:func:`~mhanum.bounds.forward.known_rounding.online_row_sum`), and
    ``c·v/l - o`` is monotone in ``l``, so ``|Σ_j c_j v_j/l̂ - o|`` is at most its larger value
    at the two ends; the radii and the values' errors over ``l_lo``. Updates ``terms``.
    """
    num = ctx.num
    online = isinstance(num.softmax_algorithm, Online)
    if w.rounded is None or w.before is None:
        return
    # online: one block, and masked keys weigh 0 exactly (a -inf mask, or none masked)
    if online and (rs.blocks != 1 or not (num.mask_value == -math.inf or enc.live.all())):
        return
    ev_rel = evaluation_rounding(enc.s.shape[-1])
    with quiet():
        low, high = w.rounded
        low, high = on(enc.live, low, 0.0), on(enc.live, high, 0.0)
        centre, radius = (low + high) / 2, (high - low) / 2
        c_v = centre @ values.v
        spread = (radius + ev_rel * centre) @ values.v_abs + dot(
            high, out.v_extra, values.extra_any
        )
        if online:  # one block: Σ_j fl_p(ê_j) ṽ_j / l̂, l̂ in [l_lo, l_hi] (step 6k, online)
            eta_m = num.format_of("softmax").smallest_normal
            l_lo, l_hi = online_row_sum(w.before, enc.live, rs.g_sum, eta_m)
            shift = np.maximum(np.abs(c_v / l_lo - out.o), np.abs(c_v / l_hi - out.o))
            shift = shift + np.abs(c_v / l_lo) * 2.0**-51
            known = (shift + spread / l_lo + out.ev) * (1 + ev_rel)
            known = np.where(l_lo > 0, known * (1 + ctx.u_div), np.inf)
        else:  # and with the row's common factor cut into pieces, where that is taken
            known = (np.abs(c_v - out.o) * (1 + 2.0**-52) + spread + out.ev) * (1 + ev_rel)
            row = (rs.x, rs.t_safe, w.eta_soft), values, (out.o, out.ev, out.v_extra)
            common = row_factor_known(enc, ctx, *row, high > low)
            known = known if common is None else np.minimum(known, common)
        known = np.where(rs.sound, known * (1 + num.format_of("output").u), np.inf)
        choose = known < sum(terms[name] for name in _WEIGHTS)
    for name in _WEIGHTS:
        terms[name] = np.where(choose, 0.0, terms[name])
    terms[KNOWN] = np.where(choose, known, 0.0)


def softmax_pv(
    enc: Enclosure,
    values: Values,
    ctx: Context,
    project: Through | None = None,
    along: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """Steps 4-7 of A.1 (papers/attention.md) for logits ``enc.s`` off by at most ``enc.delta``.

    ``fold`` (``exp_form="exp2-folded"``) is charged on ``gap + fold`` (step 5). ``across``
    (Theorem A.3', with ``lam``) lists splits ``(b, δ')`` of the logits' errors: the roundings
    in a martingale across the keys (increments bounded by ``b_ij``), and the rest of each
    logit's error, at most ``δ'_ij``; the logits term is then the smallest of step 4's and
    A.3''s for each split. The choice, entry by entry, depends on the inputs only, not on the
    roundings, so each entry's bound is still one event. ``lift_arg`` (``prob_offset = k``)
    is each row's largest argument of a lifted exponential, which the ranges of step R.5
    take. ``project`` (A.2, steps (c') and (c''), the head's :class:`Through`): the terms then
    carry the bounds on ``|Σ_l e_l ŵ_lm|`` for the logits' and the softmax's parts ``e`` of
    the output's error (:func:`through_weights`). ``along`` (Theorem A.1g, deterministic only) is
    ``(g, ḡ)``, one direction per query row with ``ḡ >= |g*|`` for the exact one: the terms
    then carry, per row, the coupled bound on ``|Σ_c g*_c (ô_c - o_c)|`` less its entrywise
    form ``Σ_c ḡ_c (terms)_c`` (``ALONG``).

    Returns the terms (against the exact attention of these logits), its probabilities, the
    computed row sum's relative error ``T`` (step 5; ``inf`` in a vacuous row), and ``(p v,
    p|v|)`` where ``p`` was evaluated directly on every row (else ``None``); rows whose
    softmax sum may be off by 100%, or (naive) may overflow or flush its reciprocal, and
    sums that may overflow their format are recorded in ``ctx.ranges``. Everything is
    evaluated on the logits shifted by the row maximum, so the float64 evaluation does not
    lose accuracy with the logits' magnitude.
    """
    num, lam, lam_e = ctx.num, ctx.lam, ctx.lam_e
    online = isinstance(num.softmax_algorithm, Online)
    pk = per_key(enc)
    rs = _row_sum(enc, values, ctx, pk)
    w = _probabilities(enc, ctx, pk, rs)
    p_hat_v = w.p_hat_hi @ values.v_abs  # (taken once, while its factors hold)
    eta_pv = _pv_ranges(enc, values, ctx, rs, w, p_hat_v)
    out = _output(enc, values, pk)
    ch = _charges(values, ctx, pk, rs, w, out, (eta_pv, p_hat_v))
    ch = _one_key_rows(enc, values, ctx, ch, out)
    scale_out = (1 + num.format_of("output").u) * ((1 + ctx.u_div) if online else 1.0)
    terms, op_v, pv_form = _terms(values, ctx, rs, ch, out, scale_out)
    rounding = _rounding_martingale(terms, values, ctx, ch, out, scale_out)
    row_sum = None
    if lam is not None and rs.blocks <= 1:  # Theorem A.3e's row sum
        row = (rs.t_safe, rs.g_sum, rs.t_exp, rs.under, rs.sound)
        row_sum = row_sum_martingale(num, enc.live, ch.common, row, scale_out)
    forms: dict[str, list[Increments]] = {
        "pv": [] if pv_form is None else [pv_form],
        "logits": [],
        "rounding": [] if rounding is None else [rounding],
        "softmax": [] if row_sum is None else [row_sum],
    }
    if enc.across is not None and lam_e is not None:
        # the output's rounding carries this error as it carries the others (scale_out)
        kept = terms["logits"]
        for split in enc.across:
            inc = logits_increments(pk.p, enc.delta, values, enc.live, ch.logits, split)
            forms["logits"].append(inc.scaled(scale_out))
            kept = np.fmin(kept, forms["logits"][-1].bound(lam_e))
        terms["logits"] = np.where(np.isnan(terms["logits"]), np.nan, kept)
    # (A.1g's coupled bound reads step 6's charge: it keeps it)
    classic = along is not None or not ctx.known
    relative = None if classic else _relative_roundings(enc, values, ctx, pk, rs, ch.w)
    if relative is not None:
        # step 6r replaces step 6's charge (or the martingale's, shared with the operands)
        kept = scale_out * (op_v + dot(ch.w.p_hat_hi, out.v_extra, values.extra_any))
        swap = scale_out * relative + kept < terms["probability_rounding"] + terms["operands"]
        terms["probability_rounding"] = np.where(
            swap, scale_out * relative, terms["probability_rounding"]
        )
        terms["operands"] = np.where(swap, kept, terms["operands"])
    if project is None and along is None:
        _known_probabilities(terms, enc, values, ctx, pk, rs, ch.w, out)
        if lam_e is not None and enc.stored is None:  # Theorem A.3e: one martingale per entry
            one_martingale_step(terms, forms, lam_e)
    read = read_by_the_output(terms, num, (out.o, out.ev), ch.u_last)
    nearest = nearest_output(num, (out.o, out.ev), read)
    # the last rounding's plain bound (u_o|o|, η_o where the value it reads may be below F_o's
    # normal range, and the online division's), which bounds |fl(x) - x| by itself: Theorem
    # A.5' (shared logits) needs it; removed by the head
    terms["output"] = terms["output"] + read[2]
    terms[PLAIN] = terms["output"]
    terms["output"] = np.fmin(terms["output"], nearest)
    # p = e/Σe on every row (the direct evaluation) is the exact softmax of these logits
    # evaluated as the head evaluates it: its products with v and |v| are the head's
    direct = (out.o, out.pv_abs) if direct_rows(enc.delta, enc.live).all() else None
    if along is not None and lam is None:
        # (online: the logits' bracket only)
        rounding = np.zeros_like(ch.w.prob) if online else ch.w.prob + ch.w.operand_p
        terms[ALONG] = along_term(along, values, ch.logits, rounding, ch.logits_v)
    if rs.whole is not None:
        terms[WHOLE] = rs.whole[1]
        if np.any(rs.rescued):
            terms["softmax"] = np.where(rs.rescued, np.inf, terms["softmax"])
    if project is not None:
        # A.2 (c'), (c''): the logits' and the softmax's parts of the output through the
        # projection with the weights' signs
        w = ch.w
        softmax = (w.rel, w.soft, w.eta_soft, ch.soft_term, pk.hi)
        output = (out.o, out.pl, out.ev, out.v_extra)
        terms.update(
            through_weights(
                project, (ch.logits, ch.logits_v), softmax, rs.t_safe, output, scale_out
            )
        )
    if enc.stored is not None and lam is not None:  # Theorem A.3‴ (A.2's share of this head)
        each = ch.w.prob + ch.w.operand_p
        rnd = Rounding(ch.w.rounding_keys, each, each @ values.v_abs, out.v_extra)
        weights = (pk.p, ch.logits)
        terms.update(stored_parts(enc, values, weights, rnd, terms, scale_out, lam))
        if pv_form is not None:  # (its P·V roundings may join the martingale as well)
            terms.update(stored_pv(pv_form, scale_out, enc.s.shape[-1]))
    return terms, pk.p, np.where(rs.vacuous, np.inf, rs.t_safe), direct
