"""Steps 6-8 of Theorems B.1/B.2: ``dS``, ``dQ``'s couplings and the last dots
(papers/backward.md, steps 6, 6′, 6″, 6c, 3W, 7, 7′, 7″, 7‴ and 8)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from mhanum._threads import map_threads
from mhanum.bounds._result import Bound
from mhanum.bounds.backward.dp import RowD
from mhanum.bounds.backward.inputs import Context, Operands
from mhanum.bounds.backward.probabilities import Probabilities
from mhanum.bounds.backward.scope import Statement
from mhanum.bounds.backward.softcap import through_cap
from mhanum.bounds.enclosure import (
    U64,
    Enclosure,
    dot_factor,
    kbar_enclosure,
    plain_output,
    read_error,
    scaled_output,
    signed_product,
    transpose,
)
from mhanum.bounds.factors import compound, evaluation_rounding, operand_bits
from mhanum.bounds.scale import scale_rounding

__all__ = [
    "Coupling",
    "LastDot",
    "ScoreGradient",
    "couplings_step",
    "ds_step",
    "gradients_step",
    "last_dot_step",
]


@dataclasses.dataclass(frozen=True)
class ScoreGradient:
    """Step 6's enclosures: ``t = dP - D`` (``t_mid``, ``t_rad``, ``t_up >= |t|``, ``t_err``,
    its own rounding ``rho_t``); ``dS = P ∘ t`` (``ds_up >= |dS|``, ``ds_err``); ``dA`` the
    last dots of ``dq`` and ``dk`` read (``dS``, or B.7's ``dS·σ``), ``ds_mid`` its float64
    stand-in (``None`` with a soft-cap), and its rounding into ``ds_format``: ``ds_take``, the
    total ``ds_r_err``."""

    t_mid: np.ndarray
    t_rad: np.ndarray
    t_up: np.ndarray
    t_err: np.ndarray
    rho_t: np.ndarray
    ds_up: np.ndarray
    ds_err: np.ndarray
    da_up: np.ndarray
    ds_mid: np.ndarray | None
    ds_take: np.ndarray
    ds_r_err: np.ndarray


def ds_step(
    ctx: Context, pr: Probabilities, dp: Enclosure, dd: RowD, slope: Enclosure | None
) -> ScoreGradient:
    """Step 6 (papers/backward.md): ``t = dP - D`` and ``dS = P ∘ t`` with their roundings;
    B.1's step 6′ where smaller; B.7's step 6c through the soft-cap's slope; step 6″'s rounding
    into ``ds_format``, which flushes only what may be subnormal."""
    x, keep, rng, grad = ctx.x, ctx.x.keep, ctx.rng, ctx.grad
    u_g, eta_g = grad.u, grad.smallest_normal
    p_up, p_x_err = pr.p_up, dd.p_x_err
    t_mid2 = dp.mid - dd.d.mid
    t_rad2 = dp.rad + dd.d.rad + U64 * np.abs(t_mid2)
    t_up = np.abs(t_mid2) + t_rad2
    t_err = dp.err + dd.d.err
    rho_t = u_g * (t_up + t_err) + eta_g
    t_err = t_err + rho_t
    rng.check(t_up + t_err, grad, "dP - D in the gradient format", ("dq", "dk", "dbias"))
    ds_up = np.where(keep, p_up * t_up, 0.0)
    ds_err = p_x_err * t_up + p_up * t_err + p_x_err * t_err
    ds_err = ds_err + u_g * (p_up + p_x_err) * (t_up + t_err) + eta_g
    ds_err = np.where(keep, ds_err, 0.0)  # masked: P = 0 exactly, so dS = 0 exactly
    t = _Difference(t_mid2, t_rad2, t_up, t_err, rho_t)
    if not ctx.flash:
        alt = _pairs_share(ctx, pr, dp, dd, t)
        ds_err = np.fmin(ds_err, np.where(keep & ~np.isnan(alt), alt, np.where(keep, np.inf, 0.0)))
    # Step 6c: through the soft-cap, dA = fl(fl(fl(dS·ĉ)·σ̂)·r̂) for dq and dk
    da_up, da_err = ds_up, ds_err
    if slope is not None and x.cap is not None:
        da_up, da_err = through_cap(ds_up, ds_err, slope, x.cap, grad, rng)
        da_up, da_err = np.where(keep, da_up, 0.0), np.where(keep, da_err, 0.0)
    ds_mid = None if slope is not None else np.where(keep, pr.p_mid * t_mid2, 0.0)
    ds_low = None
    if ds_mid is not None:
        # |dŜ| >= |P̃t̃| - (P̄T̄ - |P̃t̃|) - err (step 8's enclosure), evaluated low: the rounding
        # into ds_format flushes nothing where that is at least its smallest normal number
        m_ds = np.abs(ds_mid)
        ds_low = (2 * m_ds - da_up - da_err) - 4 * U64 * (2 * m_ds + da_up + da_err)
    if ctx.bw.scale_at == "ds":
        ds_take = scaled_ds_step(ctx, da_up + da_err, ds_low)
    else:
        ds_take = np.where(keep, read_error(da_up + da_err, grad, ctx.dsf, ds_low), 0.0)
        rng.check(da_up + da_err, ctx.dsf, f"dS rounded to {ctx.dsf.name}", ("dq", "dk", "dbias"))
    ds_r_err = da_err + ds_take
    return ScoreGradient(*t, ds_up, ds_err, da_up, ds_mid, ds_take, ds_r_err)


def scaled_ds_step(ctx: Context, used: np.ndarray, low: np.ndarray | None) -> np.ndarray:
    """Step 6s (papers/backward.md; ``Backward.scale_at="ds"``): the dots read
    ``Â = fl_ds(fl_g(dÂ·ĉ))``, ``ĉ = fl_g(c)``, which is ``ĉ·Ã`` with ``|Ã - dÂ| <=`` the
    returned take: ``u_×|dÂ| + (η_g + read_error(|ĉ dÂ|(1 + u_×) + η_g))/|ĉ|`` for
    ``|dÂ| <= used`` (``low <= |dÂ|``, or ``None``); the dots' product by ``ĉ`` is step 8's."""
    x, keep, rng, grad = ctx.x, ctx.x.keep, ctx.rng, ctx.grad
    c_hat, u_r, u_mul = scale_rounding(x.c64, grad)
    if not (math.isfinite(c_hat) and c_hat != 0 and u_r < 1):
        rng.check(np.inf, grad, f"the scale {x.c64:.6g} rounded to {grad.name}", ("dq", "dk"))
        return np.where(keep, np.inf, 0.0)
    a = abs(c_hat)
    y_up = a * used * (1 + u_mul) + grad.smallest_normal
    y_low = None if low is None else a * low * (1 - u_mul) - grad.smallest_normal
    rng.check(y_up, grad, f"dS times the scale in {grad.name}", ("dq", "dk"))
    rng.check(y_up, ctx.dsf, f"dS·c rounded to {ctx.dsf.name}", ("dq", "dk"))
    take = u_mul * used + (grad.smallest_normal + read_error(y_up, grad, ctx.dsf, y_low)) / a
    return np.where(keep, take * (1 + 4 * U64), 0.0)


class _Difference(NamedTuple):
    """``t = dP - D``: stand-in, radius, ``>= |t|``, error, and its own rounding."""

    mid: np.ndarray
    rad: np.ndarray
    up: np.ndarray
    err: np.ndarray
    rho: np.ndarray


def _pairs_share(
    ctx: Context, pr: Probabilities, dp: Enclosure, dd: RowD, t: _Difference
) -> np.ndarray:
    """Step 6′ (B.1): ``π = λ + μ`` (step 5′) in ``dŜ_j - dS_j = λ_j t_j - P_j Σ_l t_l λ_l +
    μ_j t_j - P_j Σ_l dP_l μ_l + Y_j`` (step 7′'s ``Y``); the logits' part is ``(P_j/Z)[t_j(1 -
    2P_j)(e^{δ_j} - 1) - Σ_{l≠j} P_l (e^{δ_l} - 1)(t_j + t_l)]``."""
    keep, n, grad = ctx.x.keep, ctx.sizes[1], ctx.grad
    u_g, eta_g = grad.u, grad.smallest_normal
    p_mid, p_up, p_x_err = pr.p_mid, pr.p_up, dd.p_x_err
    assert pr.w_k is not None
    assert dd.rest_share is not None
    assert dd.d_lin is not None
    assert dd.d_rest is not None
    t_mid2, t_rad2, t_up, t_err, rho_t = t
    rest_share = dd.rest_share
    with np.errstate(over="ignore", invalid="ignore"):
        w_l = pr.w_k * (1 + 4 * U64)
        pairs = _pair_sums(w_l, np.where(keep, t_mid2, 0.0))
        pairs = pairs + t_rad2 * w_l.sum(axis=-1, keepdims=True)
        pairs = pairs + (w_l * t_rad2).sum(axis=-1, keepdims=True)
        lam_part = np.exp(pr.shift) * p_up * (t_up * np.expm1(pr.delta) + pairs)
        # μ's part μ_j t_j - P_j Σ_l dP_l μ_l: its j = l term joins the first, as
        # μ_j (t_j - P_j dP_j), enclosed from the float64 stand-ins
        a_l = dp.up * rest_share
        s_up = a_l.sum(axis=-1, keepdims=True) * (1 + evaluation_rounding(n))
        mu_part = rest_share * t_up + p_up * s_up
        own_j = np.abs(t_mid2 - p_mid * dp.mid) + t_rad2 + (p_up - p_mid) * np.abs(dp.mid)
        own_j = own_j + p_up * dp.rad + 4 * U64 * (np.abs(t_mid2) + p_mid * np.abs(dp.mid))
        pairwise = rest_share * own_j + p_up * np.maximum(s_up - a_l * (1 - 4 * U64), 0.0)
        mu_part = np.fmin(mu_part, pairwise)
        p_hat = p_up + p_x_err
        y_part = p_x_err * dd.d_lin + p_hat * (dp.err + dd.d_rest + rho_t)
        y_part = y_part + u_g * p_hat * (t_up + t_err) + eta_g
        return (lam_part + mu_part + y_part) * (1 + evaluation_rounding(n)) ** 2


Coupling = tuple[np.ndarray, np.ndarray]
"""``(rest, bound)``: a split ``â - a = x + y`` of a dot's first operand with ``|y| <= rest``
and ``|x b| <= bound`` (:class:`~mhanum.bounds.enclosure.Dot`'s ``coupled``)."""


def couplings_step(
    ctx: Context, ops: Operands, pr: Probabilities, dp: Enclosure, dd: RowD, ds: ScoreGradient
) -> list[Coupling]:
    """``dQ``'s couplings (no soft-cap): step 3W (B.1, safe softmax), step 7′ (B.1), steps 7″
    and 7‴ (B.2); the last dot of ``dq`` takes the smallest."""
    coupled: list[Coupling] = []
    if ds.ds_mid is None:  # a soft-cap: dA = dS·σ, no coupling
        return coupled
    if dd.w_read is not None:
        coupled.append(_stored_weights_coupling(ctx, ops, pr, dd, ds))
    if not ctx.flash:
        coupled.append(_coupled_textbook(ctx, ops, pr, dp, dd, ds))
    else:
        coupled.extend(_coupled_flash(ctx, ops, pr, dp, dd, ds))
    return coupled


def _stored_weights_coupling(
    ctx: Context, ops: Operands, pr: Probabilities, dd: RowD, ds: ScoreGradient
) -> Coupling:
    """Step 3W for ``dQ``: ``dŜ_j - dS_j = π_j t̂_j + P_j(t̂_j - t_j) + ρ_j`` with ``Σ_j |π_j|
    <= W' + 1`` (``π = P̂' - P``), so ``Σ_j π_j t̂_j k_j`` is at most ``(W' + 1) max_j |t̂_j|
    max_j |k_j|``."""
    keep, grad = ctx.x.keep, ctx.grad
    u_g, eta_g = grad.u, grad.smallest_normal
    p_up, p_x_err, t_up, t_err = pr.p_up, dd.p_x_err, ds.t_up, ds.t_err
    assert dd.w_read is not None
    t_hat = np.where(keep, t_up + t_err, 0.0)
    rest_w = p_up * t_err + u_g * (p_up + p_x_err) * (t_up + t_err) + eta_g
    rest_w = np.where(keep, rest_w, 0.0) + ds.ds_take
    reach = (dd.w_read + 1) * t_hat.max(axis=-1, keepdims=True) * (1 + 2 * U64)
    return rest_w, reach * ops.up["k"].max(axis=-2, keepdims=True, initial=0.0)


def _coupled_textbook(
    ctx: Context, ops: Operands, pr: Probabilities, dp: Enclosure, dd: RowD, ds: ScoreGradient
) -> Coupling:
    """Step 7′ (B.1): ``dŜ - dS = π_j t_j - P_j Σ_k dP_k π_k + rest`` (``π = P̂ - P``), whose
    first part carried through ``k`` is ``Σ_j π_j (t_j k_j - dP_j k̄)``, ``k̄ = Σ_j P_j k_j``."""
    keep, grad = ctx.x.keep, ctx.grad
    u_g, eta_g = grad.u, grad.smallest_normal
    p_up, p_x_err, t_up, t_err = pr.p_up, dd.p_x_err, ds.t_up, ds.t_err
    assert dd.d_lin is not None
    assert dd.d_rest is not None
    p_hat = p_up + p_x_err
    rest = p_x_err * dd.d_lin + p_hat * (dp.err + dd.d_rest + ds.rho_t)
    rest = rest + u_g * p_hat * (t_up + t_err)
    rest = np.where(keep, rest + eta_g, 0.0) + ds.ds_take
    bound = _coupled_dq(
        pr.p_mid, p_up, np.where(keep, p_x_err, 0.0), ds.t_mid, ds.t_rad, dp, ctx.x.k,
        ops.rad["k"],
    )  # fmt: skip
    return rest, bound


def _coupled_flash(
    ctx: Context, ops: Operands, pr: Probabilities, dp: Enclosure, dd: RowD, ds: ScoreGradient
) -> list[Coupling]:
    """Steps 7″ and 7‴ (B.2). 7″: ``D̂``'s error ``e_D`` is common to the row, so its share
    ``-P_j e_D`` of ``dŜ_j - dS_j`` is, carried through ``k``, ``-e_D k̄``. 7‴: ``P̂_j = P_j
    e^{δ_j + ν_j - ω} + a_j`` with ``ω = lse - LSE(S)`` one number per row (``|ω| <= W + E``),
    so ``π``'s share of ``Σ_j π_j t_j k_j`` through ``ω`` is ``(e^{-ω} - 1) Σ_j P_j t_j k_j``,
    ``dQ``'s own sum (step 8's signed enclosure)."""
    keep, grad, n, x = ctx.x.keep, ctx.grad, ctx.sizes[1], ctx.x
    u_g, eta_g = grad.u, grad.smallest_normal
    p_mid, p_up, p_x_err, t_up, t_err = pr.p_mid, pr.p_up, dd.p_x_err, ds.t_up, ds.t_err
    ak, rho_t = ops.up["k"], ds.rho_t
    assert ds.ds_mid is not None
    assert pr.err_lse is not None
    assert pr.own_entry is not None
    rest = p_x_err * (t_up + t_err) + p_up * (dp.err + rho_t)
    rest = rest + u_g * (p_up + p_x_err) * (t_up + t_err)
    rest = np.where(keep, rest + eta_g, 0.0) + ds.ds_take
    kbar, kbar_rad = kbar_enclosure(p_mid, p_up, x.k, ops.rad["k"])
    e_d = dd.d.err * (np.abs(kbar) + kbar_rad) * (1 + 4 * U64)
    common = pr.shift + pr.err_lse
    with np.errstate(over="ignore", invalid="ignore"):
        own_share = np.where(
            keep, (p_up * np.expm1(pr.delta + pr.own_entry) + pr.absolute) * t_up, 0.0
        )
        signed = signed_product(ds.ds_mid, ds.ds_up, x.k, ak)
        through = np.exp(common) * (own_share @ ak) + np.expm1(common) * signed
        through = through * (1 + evaluation_rounding(n)) ** 2
    rest3 = dd.p_read * t_up + p_x_err * t_err + p_up * (dp.err + rho_t)
    rest3 = rest3 + u_g * (p_up + p_x_err) * (t_up + t_err)
    rest3 = np.where(keep, rest3 + eta_g, 0.0) + ds.ds_take
    return [(rest, e_d), (rest3, e_d + np.where(np.isnan(through), np.inf, through))]


@dataclasses.dataclass(frozen=True)
class LastDot:
    """One gradient's last dot ``A B`` (step 7): the name of the gradient, ``|A| <= a_up``,
    ``|Â - A| <= a_err`` (``B`` likewise), its blocks (B.2), the operands' bits, the factor
    that multiplies it after the dot (``(f64, u64)``, its float64 value and relative error;
    ``None``: none), the stage's name, ``dq``'s couplings and the float64 midpoints of ``A``
    and ``B`` (step 8's signed enclosure), or ``None``."""

    name: str
    a_up: np.ndarray
    a_err: np.ndarray
    b_up: np.ndarray
    b_err: np.ndarray
    block: int | None
    bits: tuple[int, int]
    scaled: tuple[float, float] | None
    stage: str
    coupled: list[Coupling] | None = None
    mids: tuple[np.ndarray, np.ndarray] | None = None


def last_dot_step(ctx: Context, g: LastDot, statement: Statement) -> tuple[Bound, np.ndarray]:
    """Steps 7 and 8 (papers/backward.md): B.0 on the last dot, of one chain (B.1) or of blocks
    added in any order (B.2), then the scale (``dq``, ``dk``: ``c``, or step 2''s factor) and
    the output rounding, charged on the gradient's signed enclosure where that is smaller.
    Returns the bound and ``>= |g|`` for the exact gradient (B.6)."""
    num, rng = ctx.num, ctx.rng
    acc, out = ctx.fmt("accum"), ctx.fmt("output")
    a_up, a_err, b_up, b_err = g.a_up, g.a_err, g.b_up, g.b_err
    f, eta, _ = dot_factor(num, a_up.shape[-1], g.block if ctx.flash else None, g.bits, ctx.lam)
    from_a, from_b, accumulation = ctx.dot(a_up, a_err, b_up, b_err, f, eta, g.coupled)
    x_up = a_up @ b_up
    if g.mids is not None:  # step 8: the signed enclosure from the float64 midpoints
        signed = signed_product(g.mids[0], a_up, g.mids[1], b_up)
        x_up = np.fmin(x_up, np.where(np.isnan(signed), np.inf, signed))
    rng.operands(num, a_up + a_err, b_up + b_err, g.stage, (g.name,))
    rng.check((1 + f) * ((a_up + a_err) @ (b_up + b_err)) + eta, acc, g.stage, (g.name,))
    err = from_a + from_b + accumulation
    ev_n = 1 + evaluation_rounding(a_up.shape[-1])
    if g.scaled is not None:
        c64, u64 = g.scaled
        up = x_up * ev_n * (1 + u64 + 2 * U64) * abs(c64)
        if ctx.bw.scale_at == "ds":  # step 8s: the dot of ĉ·Ã, no product after it
            b_sum = (b_up + b_err).sum(axis=-2, keepdims=True)
            carried, own = scaled_dot_output(x_up, err, c64, u64, eta, b_sum, ctx)
        else:
            carried, own = scaled_output(x_up, err, c64, c64, u64, num)
            if ctx.bw.scale_at == "partials" and ctx.flash:  # step 8p
                own = own + scaled_partials(ctx, g, f, eta, c64)
        ratio = carried / np.where(err > 0, err, 1.0)
        y_up = abs(c64) * x_up + carried + own
    else:
        up = x_up * ev_n
        ratio, own = np.ones(1), plain_output(x_up, err, num)
        y_up = x_up + err + own
    rng.check(y_up, out, f"{g.name} rounded to the output format", (g.name,))
    terms = {"upstream": ratio * from_a, "inputs": ratio * from_b}
    terms = {**terms, "accumulation": ratio * accumulation, "output": own}
    return statement.bound(g.name, terms, rng), up


def scaled_partials(ctx: Context, g: LastDot, f: float, eta: float, c64: float) -> np.ndarray:
    """Step 8p (``Backward.scale_at="partials"``): each block's partial ``X̂_b`` is multiplied by
    ``ĉ = fl_acc(c64)`` and rounded before it is added: ``Σ_b |fl(ĉ X̂_b) - ĉ X̂_b| <=
    u_acc|ĉ| Σ_b |X̂_b| + count·η_acc``, with ``Σ_b |X̂_b| <= (1 + f)|Â_op||B̂_op| + η`` (each
    block's dot, its operands as the dot reads them). The rest of step 8 (the product of the
    sum) is charged as if it were there, which covers the sum of scaled partials."""
    acc = ctx.fmt("accum")
    c_hat, _, _ = scale_rounding(c64, acc)
    u_op, eta_op = ctx.dot.u_op, ctx.dot.eta_op
    a_op = (1 + u_op) * (g.a_up + g.a_err) + eta_op
    b_op = (1 + u_op) * (g.b_up + g.b_err) + eta_op
    n = g.a_up.shape[-1]
    count = -(-n // g.block) if g.block else 1
    parts = ((1 + f) * (a_op @ b_op) + eta) * (1 + evaluation_rounding(n))
    stage = f"{g.name}'s partials times the scale"
    ctx.rng.check(abs(c_hat) * parts * (1 + acc.u) + acc.smallest_normal, acc, stage, (g.name,))
    return acc.u * abs(c_hat) * parts * (1 + 2 * U64) + count * acc.smallest_normal


def scaled_dot_output(
    x_up: np.ndarray,
    err: np.ndarray,
    c64: float,
    u64: float,
    eta: float,
    b_sum: np.ndarray,
    ctx: Context,
) -> tuple[np.ndarray, np.ndarray]:
    """Step 8s (``Backward.scale_at="ds"``): the computed dot of ``ĉ·Ã`` (``ĉ = fl_g(c64)``,
    ``|ĉ - c| <= θ|c|``) against ``c·X``: within ``|ĉ|·err + η + η_op Σ_j |B_j|`` of ``ĉ·(Ã B)``
    (B.0's error scales with the operand, its underflows ``η`` and, in the operand format,
    ``η_op`` do not; ``b_sum >= Σ_j |B̂_j|``), and ``|ĉ - c||X|``; then the output rounding.
    Returns ``(from X's error, the constant's and the roundings' part)``."""
    acc, out = ctx.fmt("accum"), ctx.fmt("output")
    _, u_r, _ = scale_rounding(c64, ctx.grad)
    theta = compound(u64, u_r)
    a = abs(c64)
    carried = a * (1 + theta) * err
    own = theta * a * x_up + eta + ctx.dot.eta_op * b_sum * (1 + 2 * U64)
    return carried, own + read_error(a * x_up + carried + own, acc, out)


def gradients_step(
    ctx: Context,
    ops: Operands,
    pr: Probabilities,
    ds: ScoreGradient,
    coupled: list[Coupling],
    statement: Statement,
) -> tuple[dict[str, Bound], dict[str, np.ndarray]]:
    """Step 7 (papers/backward.md): ``dq = c dŜ K̂`` (with its couplings), ``dk = c dŜᵀ Q̂``,
    ``dv = P̂ᵀ Ĝ`` and ``dbias = dS`` rounded to the output format; the bounds, and ``>= |g|``
    for each exact gradient of a dot (B.6)."""
    x, keep, rng, bw = ctx.x, ctx.x.keep, ctx.rng, ctx.bw
    ak, aq, ag, e = ops.up["k"], ops.up["q"], ops.up["d_out"], ops.err
    b_ds = operand_bits(ctx.num, ctx.dsf)
    ds_mid = ds.ds_mid
    f_q, f_k = x.factors or ((x.c64, x.u64), (x.c64, x.u64))
    dots = (
        LastDot("dq", ds.da_up, ds.ds_r_err, ak, e["k"], bw.block_k, (b_ds, ops.bits["k"]),
                f_q, "dS k accumulated", coupled, None if ds_mid is None else (ds_mid, x.k)),
        LastDot("dk", transpose(ds.da_up), transpose(ds.ds_r_err), aq, e["q"], bw.block_q,
                (b_ds, ops.bits["q"]), f_k, "dSᵀ q accumulated", None,
                None if ds_mid is None else (transpose(ds_mid), x.q)),
        LastDot("dv", transpose(pr.p_up), transpose(pr.eps_pr), ag, e["d_out"], bw.block_q,
                (pr.bits_p, ops.bits["d_out"]), None, "Pᵀ d_out accumulated", None,
                (transpose(pr.p_mid), x.g)),
    )  # fmt: skip
    results: dict[str, Bound] = {}
    ups: dict[str, np.ndarray] = {}
    for g in dots:
        results[g.name], ups[g.name] = last_dot_step(ctx, g, statement)
    grad, out = ctx.grad, ctx.fmt("output")
    own_b = np.where(keep, read_error(ds.ds_up + ds.ds_err, grad, out), 0.0)
    rng.check(ds.ds_up + ds.ds_err + own_b, out, "dbias rounded to the output format", ("dbias",))
    results["dbias"] = statement.bound("dbias", {"dS": ds.ds_err, "output": own_b}, rng)
    return results, ups


PAIR_ROWS = 2**18
"""The entries of a block of rows :func:`_pair_sums` evaluates at once (about 2 MB a temporary)."""


def _pair_sums(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``>= Σ_{l ≠ j} w_l |a_j + a_l|`` along the last axis, for ``w >= 0``: the keys sorted by
    ``a`` once per row, each ``j`` split at ``a_l = -a_j`` (``O(n log n)`` per row, where the
    direct sum is ``O(n²)``), plus the float64 evaluation of the prefix sums,
    ``(4n + 16)u64 (|a_j| Σ w + Σ w|a|)`` (each partial sum is within ``γ_n`` of its terms'
    magnitudes; a few operations combine them).

    Every row is its own (sorts, prefix sums and sums along the last axis), so blocks of
    :data:`PAIR_ROWS` entries are evaluated side by side (:func:`mhanum._threads.map_threads`),
    each as it would be alone: the same bits whatever the number of threads."""
    w, a = np.broadcast_arrays(w, a)
    n = a.shape[-1]
    flat_w, flat_a = w.reshape(-1, n), a.reshape(-1, n)
    step = max(1, PAIR_ROWS // max(1, n))
    blocks = [slice(i, i + step) for i in range(0, flat_a.shape[0], step)]
    if len(blocks) <= 1:
        return _row_pair_sums(w, a)

    def block(rows: slice) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):  # (per thread, as the caller's)
            return _row_pair_sums(flat_w[rows], flat_a[rows])

    return np.concatenate(map_threads(block, blocks)).reshape(a.shape)


def _row_pair_sums(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """:func:`_pair_sums` on the rows ``w`` and ``a`` (the last axis) at once."""
    n = a.shape[-1]
    order = np.argsort(a, axis=-1, kind="stable")
    a_s = np.take_along_axis(a, order, axis=-1)
    w_s = np.take_along_axis(w, order, axis=-1)
    zero = np.zeros((*a.shape[:-1], 1))
    cw = np.concatenate([zero, np.cumsum(w_s, axis=-1)], axis=-1)
    cwa = np.concatenate([zero, np.cumsum(w_s * a_s, axis=-1)], axis=-1)
    # below[..., j]: how many keys have a_l < -a_j, from one stable sort of (-a, sorted a):
    # each -a_j is preceded by the a_l below it (a tie adds |a_j + a_l| = 0 either way). The
    # -a_j go in as -(sorted a) reversed, itself sorted, so the sort merges two sorted runs
    needle = -a_s[..., ::-1]  # needle[..., i] = -a[order[..., n - 1 - i]]
    merged = np.argsort(np.concatenate([needle, a_s], axis=-1), axis=-1, kind="stable")
    is_key = merged >= n
    ranks = np.empty(merged.shape, dtype=np.intp)
    np.put_along_axis(ranks, merged, np.cumsum(is_key, axis=-1) - is_key, axis=-1)
    below = np.empty(a.shape, dtype=np.intp)
    np.put_along_axis(below, order[..., ::-1], ranks[..., :n], axis=-1)
    w_lo = np.take_along_axis(cw, below, axis=-1)
    wa_lo = np.take_along_axis(cwa, below, axis=-1)
    w_all, wa_all = cw[..., -1:], cwa[..., -1:]
    total = a * (w_all - 2 * w_lo) + (wa_all - 2 * wa_lo)  # Σ_l w_l |a_j + a_l|
    mass = np.abs(a) * w_all + (w * np.abs(a)).sum(axis=-1, keepdims=True)
    total = np.maximum(total, 0.0) + (4 * n + 16) * U64 * mass
    # less the l = j term 2 w_j |a_j|, taken low
    return np.maximum(total - 2 * w * np.abs(a) * (1 - 4 * U64), 0.0)


def _coupled_dq(
    p_mid: np.ndarray,
    p_up: np.ndarray,
    pe: np.ndarray,
    t: np.ndarray,
    t_rad: np.ndarray,
    dp: Enclosure,
    k: np.ndarray,
    k_rad: np.ndarray | None,
) -> np.ndarray:
    """B.1 step 7': ``>= |Σ_j π_ij (t_ij k_jc - dP_ij k̄_ic)|`` for ``|π| <= pe``, the exact
    ``t = dP - D``, ``dP`` and ``k`` within their radii of the float64 stand-ins ``t``,
    ``dp.mid`` and ``k``, and ``k̄ = Σ_j P_ij k_j`` with ``|P - p_mid| <= p_up - p_mid``.
    The radii's shares are matrix products; ``Σ_j pe_ij |t_ij k_jc - dP_ij k̄_ic|`` is
    ``O(L_q L_k d)`` elementwise work, in chunks of query rows."""
    lq, n, d = p_mid.shape[-2], p_mid.shape[-1], k.shape[-1]
    outer = np.broadcast_shapes(p_mid.shape[:-2], k.shape[:-2], t.shape[:-2])
    kr = np.zeros_like(k) if k_rad is None else np.broadcast_to(k_rad, k.shape)

    def flat(a: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
        return np.broadcast_to(a, outer + tail).reshape((-1, *tail))

    p_mid, p_up, pe = (flat(a, (lq, n)) for a in (p_mid, p_up, pe))
    t, t_rad, dpm, dpr = (flat(a, (lq, n)) for a in (t, t_rad, dp.mid, dp.rad))
    k, kr = flat(k, (n, d)), flat(kr, (n, d))
    ka = np.abs(k)
    kbar, kbar_rad = kbar_enclosure(p_mid, p_up, k, kr)
    pe_t = pe * np.abs(t)
    pe_dp = (pe * np.abs(dpm)).sum(axis=-1, keepdims=True)
    pe_dpr = (pe * dpr).sum(axis=-1, keepdims=True)
    # Σ_j pe_j T_jc with T_jc = |t k - dP k̄| of the stand-ins, plus 4u64(|t k| + |dP k̄|)
    # for its float64 evaluation, plus each stand-in's radius times the other factor
    out = 4 * U64 * (pe_t @ ka + pe_dp * np.abs(kbar))
    out += (pe * t_rad) @ (ka + kr) + pe_t @ kr
    out += pe_dpr * (np.abs(kbar) + kbar_rad) + pe_dp * kbar_rad
    step = max(1, 2**22 // max(1, n * d))
    chunks = [(b, slice(i, i + step)) for b in range(k.shape[0]) for i in range(0, lq, step)]

    def chunk(task: tuple[int, slice]) -> np.ndarray:
        b, sl = task
        rows = range(lq)[sl]
        part = np.empty((len(rows), d))
        # a few rows at a time, in place: the temporaries stay in the core's cache (the same
        # operations on the same values as one pass over the chunk, so the same bits)
        sub = max(1, 2**16 // max(1, n * d))
        x, y = np.empty((sub, n, d)), np.empty((sub, n, d))
        with np.errstate(over="ignore", invalid="ignore"):  # (per thread, as the caller's)
            for i in range(0, len(rows), sub):
                r = slice(rows.start + i, rows.start + min(i + sub, len(rows)))
                xs, ys = x[: r.stop - r.start], y[: r.stop - r.start]
                np.multiply(t[b, r, :, None], k[b, None], out=xs)
                np.multiply(dpm[b, r, :, None], kbar[b, r, None, :], out=ys)
                np.abs(np.subtract(xs, ys, out=xs), out=xs)
                part[i : i + xs.shape[0]] = np.einsum("ij,ijc->ic", pe[b, r], xs)
        return part

    # the chunks of rows side by side, each as it would be alone (mhanum._threads)
    for (b, sl), part in zip(chunks, map_threads(chunk, chunks), strict=True):
        out[b, sl] += part
    return out.reshape((*outer, lq, d))
