"""Steps 4 and 5 of Theorems B.1/B.2: ``dP = d_out vᵀ`` and the row vector ``D``
(papers/backward.md, steps 4, 5, 5′ and W)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mhanum.bounds.backward.inputs import Context, Operands
from mhanum.bounds.backward.probabilities import Probabilities, row_max
from mhanum.bounds.enclosure import (
    U64,
    Enclosure,
    dot_factor,
    f64_dot,
    product_spread,
    read_error,
    transpose,
    transpose_or_none,
)
from mhanum.bounds.factors import chain, evaluation_rounding, operand_bits
from mhanum.bounds.forward import attention_bound, attention_bound_along
from mhanum.bounds.forward.known_rounding import coarser_probabilities

__all__ = ["RowD", "d_step", "dp_step"]


def dp_step(ctx: Context, ops: Operands) -> Enclosure:
    """Step 4 (papers/backward.md): ``dP = d_out vᵀ`` by B.0, rounded to ``dp_format`` where
    the backward names one (step 4r), and read into the gradient format."""
    x, num, rng = ctx.x, ctx.num, ctx.rng
    acc, grad, dv_ = ctx.fmt("accum"), ctx.grad, ctx.sizes[3]
    ag, av, mg, mv, e, rad = (
        ops.up["d_out"],
        ops.up["v"],
        ops.mag["d_out"],
        ops.mag["v"],
        ops.err,
        ops.rad,
    )
    bits_in = operand_bits(num, ctx.fmt("input"))
    f, eta, _ = dot_factor(num, dv_, None, (bits_in, bits_in), ctx.lam)
    dp_a, dp_b, dp_acc = ctx.dot(ag, e["d_out"], transpose(av), transpose(e["v"]), f, eta)
    dp_rad = f64_dot(dv_) * (mg @ transpose(mv)) + product_spread(
        rad["d_out"], transpose(av), mg, transpose_or_none(rad["v"])
    )
    dp = Enclosure(x.g @ transpose(x.v), dp_rad, dp_a + dp_b + dp_acc)
    rng.operands(num, ag + e["d_out"], av + e["v"], "d_out vᵀ", ("dq", "dk", "dbias"))
    rng.check((1 + f) * ((ag + e["d_out"]) @ transpose(av + e["v"])) + eta, acc,
              "d_out vᵀ accumulated", ("dq", "dk", "dbias"))  # fmt: skip
    src = acc
    dpf = ctx.bw.dp_rounding()
    if dpf is not None:  # step 4r: the dot's result rounded to dp_format, then read on
        dp.err = dp.err + read_error(dp.used, acc, dpf)
        rng.check(dp.used, dpf, f"dP rounded to {dpf.name}", ("dq", "dk", "dbias"))
        src = dpf
    dp.err = dp.err + read_error(dp.used, src, grad)
    rng.check(dp.used, grad, "dP in the gradient format", ("dq", "dk", "dbias"))
    return dp


@dataclasses.dataclass(frozen=True)
class RowD:
    """Step 5's ``D`` (one number per row) and what ``dS``'s steps read of it: ``p_x_err >=
    |P̂' - P|`` for ``P̂'`` the probabilities read into the gradient format, ``p_read`` that
    reading's error; B.1: ``d_lin >= |Σ_k dP_k π_k|``, the rest ``d_rest``, the softmax's own
    share ``rest_share`` (step 5′) and step W's row sum ``w_read`` (or ``None``)."""

    d: Enclosure
    p_x_err: np.ndarray
    p_read: np.ndarray | float
    d_lin: np.ndarray | None = None
    d_rest: np.ndarray | None = None
    rest_share: np.ndarray | None = None
    w_read: np.ndarray | None = None


def d_step(ctx: Context, ops: Operands, pr: Probabilities, dp: Enclosure) -> RowD:
    """Step 5 (papers/backward.md): ``D``, textbook ``rowsum(dP ∘ P)`` (B.1, steps 5′ and W),
    FlashAttention-2 ``rowsum(d_out ∘ O)`` (B.2, the forward output by Theorem A.1g)."""
    if ctx.flash:
        return _d_flash(ctx, ops, pr)
    return _d_textbook(ctx, pr, dp)


def _d_textbook(ctx: Context, pr: Probabilities, dp: Enclosure) -> RowD:
    """B.1's ``D = Σ_j dP_ij P_ij``, step 5′'s split and step W's stored weights."""
    keep, n, grad = ctx.x.keep, ctx.sizes[1], ctx.grad
    u_g, eta_g = grad.u, grad.smallest_normal
    p_mid, p_up, delta, shift = pr.p_mid, pr.p_up, pr.delta, pr.shift
    assert pr.mu_k is not None  # B.1's step 3′
    p_read = read_error(pr.p_used_up, ctx.fmt("prob"), grad)  # P̂ read into the gradient format
    pe = pr.eps_p + p_read
    g_d = chain(n, ctx.num.summation, u_g, ctx.lam, products=True)
    d_mid = (dp.mid * p_mid).sum(axis=-1, keepdims=True)
    d_rad = (dp.rad * p_up + np.abs(dp.mid) * (p_up - p_mid)).sum(axis=-1, keepdims=True)
    d_rad = d_rad + f64_dot(n) * (np.abs(dp.mid) * p_mid).sum(axis=-1, keepdims=True)
    d_rest = (dp.err * (p_up + pe)).sum(axis=-1, keepdims=True)
    d_rest = d_rest + g_d * (dp.used * (p_up + pe)).sum(axis=-1, keepdims=True) + 2 * n * eta_g
    d_lin = (dp.up * pe).sum(axis=-1, keepdims=True)  # >= |Σ_k dP_k π_k|
    # Step 5': π = (p(Ŝ) - P) + (P̂' - p(Ŝ)). The logits' share sums to 0 over the row, so
    # Σ_k dP_k (p_k(Ŝ) - P_k) = Σ_k t_k P_k (e^{δ_k} - 1) / Σ_l P_l e^{δ_l} (t = dP - D,
    # Σ_k t_k P_k = 0), at most e^W Σ_k |t_k| P̄_k (e^{Δ_k} - 1); the rest keeps |dP|
    t_abs = (np.abs(dp.mid - d_mid) + dp.rad + d_rad) * (1 + 4 * U64)  # >= |t|
    with np.errstate(over="ignore", invalid="ignore"):
        logits_share = np.where(keep, p_up * np.expm1(delta), 0.0)
        centred = np.exp(shift) * (t_abs * logits_share).sum(axis=-1, keepdims=True)
        rest_share = pr.mu_k + p_read
        split = centred + (dp.up * rest_share).sum(axis=-1, keepdims=True)
    d_lin = np.fmin(d_lin, np.where(np.isnan(split), np.inf, split))
    d_upper = (dp.used * (p_up + pe)).sum(axis=-1, keepdims=True) * (1 + g_d)
    w_read = None
    if pr.whole is not None:
        # step W: Σ_k |P̂'_k - P_k||a_k| <= max_k |a_k|(W' + 1), Σ_k P̂'_k |a_k| <= max|a| W'
        # (P̂' = P̂ read into the gradient format, W' its row sum's bound)
        w_read = pr.whole[1] * (1 + u_g) + n * eta_g
        d_lin = np.fmin(d_lin, row_max(dp.up, keep) * (w_read + 1))
        d_rest = np.fmin(
            d_rest,
            (row_max(dp.err, keep) + g_d * row_max(dp.used, keep)) * w_read + 2 * n * eta_g,
        )
        d_upper = np.fmin(d_upper, row_max(dp.used, keep) * w_read * (1 + g_d) + 2 * n * eta_g)
    d_err = d_rest + d_lin
    ctx.rng.check(d_upper, grad, "D in the gradient format", ("dq", "dk", "dbias"))
    return RowD(Enclosure(d_mid, d_rad, d_err), pe, p_read, d_lin, d_rest, rest_share, w_read)


def _forward_error(ctx: Context, ops: Operands) -> tuple[np.ndarray, np.ndarray]:
    """B.2's forward output ``Ô``: ``(|Ô - O|, its error along d_out, row by row)``, by
    Theorem A.1g on the inputs, or as the caller (B.6) gives them; the reasons recorded."""
    x, num = ctx.x, ctx.num
    if x.forward is None:
        # Theorem A.1g: the forward output's error along the exact d_out, row by row
        q, k = (x.q, x.k) if x.scaled is None else (x.scaled.q, x.scaled.k)
        fwd, along = attention_bound_along(
            q, k, x.v, x.g, None if x.keep.all() else x.keep, g_error=ops.rad["d_out"],
            bias=x.bias, scale=x.scale, numerics=num, softcap=x.cap,
        )  # fmt: skip
        eps_o, why = np.asarray(fwd.total, np.float64), fwd.reasons
        o_along = along[..., None]
        if ctx.known and coarser_probabilities(num):
            # A.1 with the known roundings (steps 3k, 6k, 6r), which A.1g cannot take apart,
            # wherever it is smaller: entrywise, and along d_out through |G|
            known = attention_bound(
                q, k, x.v, None if x.keep.all() else x.keep, bias=x.bias, scale=x.scale,
                numerics=num, softcap=x.cap,
            )  # fmt: skip
            eps_o = np.fmin(eps_o, np.asarray(known.total, np.float64))
            o_along = np.fmin(o_along, _along_entrywise(ctx, ops, eps_o))
    else:
        eps_o, why, given_along = x.forward
        o_along = _along_entrywise(ctx, ops, eps_o)
        if given_along is not None:
            o_along = np.fmin(o_along, given_along[..., None])
    ctx.rng.reasons.extend(f"forward: {r}" for r in why)
    return eps_o, o_along


def _along_entrywise(ctx: Context, ops: Operands, eps_o: np.ndarray) -> np.ndarray:
    """``Σ_c |G_c| ε_O,c`` per row, rounded up: the forward error along ``d_out`` from its
    entrywise bound."""
    return (ops.up["d_out"] * eps_o).sum(axis=-1, keepdims=True) * (
        1 + evaluation_rounding(ctx.sizes[3])
    )


def _d_flash(ctx: Context, ops: Operands, pr: Probabilities) -> RowD:
    """B.2's ``D = Σ_c G_ic O_ic`` from ``d_out`` and the forward output ``Ô``."""
    x, n, dv_, grad = ctx.x, ctx.sizes[1], ctx.sizes[3], ctx.grad
    fin, out = ctx.fmt("input"), ctx.fmt("output")
    u_g, eta_g = grad.u, grad.smallest_normal
    ag, av, mg, mv, e, rad = (
        ops.up["d_out"],
        ops.up["v"],
        ops.mag["d_out"],
        ops.mag["v"],
        ops.err,
        ops.rad,
    )
    p_mid, p_up = pr.p_mid, pr.p_up
    eps_o, o_along = _forward_error(ctx, ops)
    o_mid = p_mid @ x.v
    o_rad = (
        (p_up - p_mid) @ av + f64_dot(n) * (p_mid @ mv) + product_spread(None, av, p_mid, rad["v"])
    )
    o_up = np.abs(o_mid) + o_rad
    eg = e["d_out"] + read_error(ag + e["d_out"], fin, grad)
    o_take = read_error(o_up + eps_o, out, grad)  # Ô read into the gradient format
    eo = eps_o + o_take
    g_d = chain(dv_, ctx.num.summation, u_g, ctx.lam, products=True)
    d_mid = (x.g * o_mid).sum(axis=-1, keepdims=True)
    d_rad = ag * o_rad + (0.0 if rad["d_out"] is None else rad["d_out"] * np.abs(o_mid))
    d_rad = d_rad.sum(axis=-1, keepdims=True)
    d_rad = d_rad + f64_dot(dv_) * (mg * np.abs(o_mid)).sum(axis=-1, keepdims=True)
    d_err = (eg * (o_up + eo) + ag * o_take).sum(axis=-1, keepdims=True) + o_along
    d_err = d_err + g_d * ((ag + eg) * (o_up + eo)).sum(axis=-1, keepdims=True) + 2 * dv_ * eta_g
    d_upper = ((ag + eg) * (o_up + eo)).sum(axis=-1, keepdims=True) * (1 + g_d)
    p_read = read_error(pr.p_used_up, ctx.fmt("softmax"), grad)  # P̂ read into the gradient format
    ctx.rng.check(d_upper, grad, "D in the gradient format", ("dq", "dk", "dbias"))
    return RowD(Enclosure(d_mid, d_rad, d_err), pr.eps_p + p_read, p_read)
