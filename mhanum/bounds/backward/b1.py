"""Theorems B.1 (textbook) and B.2 (FlashAttention-2): componentwise bounds on the error of
every gradient of attention, step by step (papers/backward.md, steps 1-8).

:func:`attention_grad_bound` bounds ``|ĝ - g|`` for each gradient ``g`` of
:func:`mhanum.reference.attention_grad` (``dq``, ``dk``, ``dv``, ``dbias``) and ``ĝ`` the one
:func:`mhanum.emulate.backward.attention_grad` computes. :func:`gradient_bounds` runs the proof's
steps in order, each one function here or in :mod:`~mhanum.bounds.backward.probabilities`
(step 3) and :mod:`~mhanum.bounds.backward.gradients` (steps 6-8), on the enclosures of
:mod:`mhanum.bounds.enclosure`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.bounds._result import Bound
from mhanum.bounds.backward.dp import d_step, dp_step
from mhanum.bounds.backward.gradients import couplings_step, ds_step, gradients_step
from mhanum.bounds.backward.inputs import Context, Inputs, Operands, inputs, operands_step
from mhanum.bounds.backward.probabilities import probabilities_step
from mhanum.bounds.backward.scope import GradientBounds, Statement, check_scope
from mhanum.bounds.backward.softcap import softcap_step
from mhanum.bounds.enclosure import (
    GRADIENTS,
    U64,
    Enclosure,
    dot_factor,
    f64_dot,
    product_spread,
    read_error,
    transpose,
    transpose_or_none,
)
from mhanum.bounds.factors import chain, compound, evaluation_rounding, rounding_error
from mhanum.bounds.scale import scale_rounding
from mhanum.bounds.union import lam_or_probability
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward
from mhanum.problem import AttentionProblem

__all__ = ["attention_grad_bound", "gradient_bounds", "head_chains", "logits_step", "with_sink"]


def head_chains(lq: int, n: int, d: int, dv: int, flash: bool, sink: bool) -> int:
    """The rounding chains of one attention's backward (Theorem B.5), one per term of every
    sum and dot (Theorem R.6's corollary: a dot's factor needs each of its terms' chains):
    ``q kᵀ`` (``L_q n d``), the softmax's row sums (``L_q n``), ``G Vᵀ`` (``L_q n d_v``), the
    sums of ``D`` (``L_q n``, FlashAttention-2 ``L_q d_v``), ``dQ``, ``dK``, ``dV`` (``L_q n
    (2d + d_v)``) and, with a sink, ``dsink`` (``L_q``); ``n`` counts the sink's key."""
    return lq * n * (3 * d + 2 * dv + 1) + lq * (dv if flash else n) + (lq if sink else 0)


@one_blas_thread
def attention_grad_bound(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    mask: Any = None,
    *,
    bias: Any = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    lam: float | None = None,
    probability: float | None = None,
    sink: Any = None,
    softcap: float | None = None,
    known_rounding: bool = True,
) -> GradientBounds:
    """Componentwise bounds on the error of every gradient of attention (Theorems B.1, B.2).

    **Theorem B.1 (textbook) / B.2 (FlashAttention-2).** Let ``g`` be a gradient of
    ``<d_out, attention(q, k, v)>`` (exact: :func:`mhanum.reference.attention_grad`) and ``ĝ`` the
    one computed by :func:`mhanum.emulate.backward.attention_grad` with ``numerics`` and
    ``backward``, or by any kernel whose every stage rounds as they state, with the ``dQ``
    partials of B.2 added **in any order**. Under the assumptions listed in ``Bound.assumptions``,

    .. math::

        |\\hat g - g| \\le \\mathrm{total}

    entry by entry, where ``total`` is the propagation of papers/backward.md: the logits'
    error ``Δ`` (B.0 on ``q kᵀ``, the score rounding, the scale's and the bias's roundings);
    the probabilities within ``P·(e^R - 1) + A`` (``R = L + Δ_j + W``, ``W = min(max Δ,
    log Σ_k P̄_k e^{Δ_k})`` by Jensen, ``L`` the softmax's own log-ratio: exponentials, sum,
    division and the relative rounding into ``prob_format``; B.2: the stored log-sum-exp's error
    and the recomputed exponential; ``A`` the underflow allowance, with ``min(P̄, η_p)`` only
    where ``P`` may lie below ``prob_format``'s smallest normal number); ``dP``, ``D`` (textbook
    from ``dP`` and ``P``; B.2 from ``d_out`` and the forward output, whose error along each
    row of ``d_out`` is :func:`attention_bound_along`'s, Theorem A.1g), ``dP - D`` and ``dS``
    each with their rounding; and the last dots by B.0, of one chain (textbook) or of blocks
    whose results are added in any order (B.2: ``(1 + γ_B)(1 + u)^{n_b - 1} - 1``), then the
    scale and the output rounding. The textbook's ``dq`` also takes step 7': ``P̂``'s error
    kept coupled through ``D``, ``Σ_j π_j (t_j k_j - dP_j k̄)``, where that is smaller; B.2's
    ``dq`` step 7'': ``D̂``'s error is common to the row, ``e_D k̄`` through ``k``. The float64
    evaluation is widened by ``(1 + evaluation_rounding(n))^12``.

    **Theorem B.5 (probabilistic).** With ``lam=λ`` (or ``probability=P``, which solves for
    the least such ``λ``), every ``γ`` of a sum or dot chain is Theorem R.6's ``γ̃_h(λ)``:
    under the model that the rounding errors are independent and of mean zero, each chain
    stays within it with probability ``>= P(λ)``, and all of them together, by the union bound
    over the ``N = L_q L_k (3 d_k + 2 d_v + 1) + L_q L_k`` (FlashAttention-2: ``+ L_q d_v``)
    chains of each batch element, one per term of every sum and dot (``+ L_q`` with a sink),
    with probability ``>= 1 - N (1 - P(λ))`` (``Bound.probability``). The float64 evaluation,
    the forward output's bound (B.2's ``D``) and the roundings outside the chains stay
    deterministic. Tensor-core dots are refused (their model has no such factor).

    Args:
        q, k, v, d_out, mask, bias, scale, numerics, backward: as for
            :func:`mhanum.emulate.backward.attention_grad`.
        lam, probability: the probabilistic variant (Theorem B.5): ``λ > 0``, or the
            probability ``P`` in ``(0, 1)`` with which every bound holds under the model.
        sink: attention-sink logits, as for :func:`mhanum.emulate.backward.attention_grad`: the
            sink is one more key (B.1/B.2 hold with it), and ``dsink``, the sum of its column
            of ``dS`` added row after row in ``accum``, is bounded by that column's bounds, the
            sum's ``γ_{L_q - 1}`` and the output rounding.
        softcap: the logit soft-cap ``c``, as for :func:`mhanum.emulate.backward.attention_grad`
            (Theorem B.7): the capped logits' enclosure (step 2c) and ``dA = dS·σ`` through
            the computed slope ``σ̂ = fl(1 - fl(t̂²))`` (step 6c) for ``dq`` and ``dk``.
        known_rounding: B.2 (step 5) reads the forward output's error through Theorem A.1 with
            its known roundings (steps 3k, 6k and 6r of papers/attention.md, which assume the
            forward's conversions round to nearest) wherever that is smaller than A.1g's;
            ``False``: A.1g alone, for a kernel that does not opt in
            (:attr:`mhanum.testing.Kernel.known_rounding`).

    Returns:
        :class:`GradientBounds`: ``dq``, ``dk``, ``dv``, ``dbias`` (each a :class:`Bound` with
        terms ``upstream`` (the error of the matrix the last dot reads first: ``dS``, or ``P``
        for ``dv``), ``inputs`` (the other operand's rounding), ``accumulation`` and ``output``
        (scale and rounding); ``dbias``: ``dS`` and ``output``), and ``stages``.

    Raises:
        InvalidArgument: for bad inputs (named), a row that attends no key, a finite masking
            constant with a mask, the naive softmax, or numerics the backward does not model.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> q, k, v, g = (rng.standard_normal((8, 4)) for _ in range(4))
        >>> b = attention_grad_bound(q, k, v, g, numerics="fp32", backward="flash2")
        >>> b.dq.theorem, b.dq.total.shape, bool(np.max(b.dq.total) < 1e-4)
        ('B.2', (8, 4), True)
    """
    if not isinstance(known_rounding, bool):
        msg = f"known_rounding: expected True or False, got {known_rounding!r}"
        raise InvalidArgument(msg)
    num = resolve(numerics)
    bw = resolve_backward(backward)
    check_scope(num, bw, "B.2" if lam is None and probability is None else "B.5")
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, d_out=d_out
    )
    x = inputs(problem, num)
    bw.key_blocks(x.k.shape[-2])
    lq, n, d, dv_ = x.q.shape[-2], x.k.shape[-2], x.q.shape[-1], x.v.shape[-1]
    flash = bw.algorithm == "flash2"
    chains = head_chains(lq, n, d, dv_, flash, x.sink) * math.prod(x.q.shape[:-2])
    lam = lam_or_probability(lam, probability, chains, num)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        bounds, dsd = gradient_bounds(x, num, bw, lam, chains, known=known_rounding)
        if not x.sink:
            return bounds
        return with_sink(bounds, dsd, num, bw, lam)


def with_sink(
    b: GradientBounds, dsd: dict[str, np.ndarray], num: Numerics, bw: Backward, lam: Any
) -> GradientBounds:
    """The sink key's rows dropped from dk, dv and dbias, and ``dsink``'s bound added."""
    acc, out = num.format_of("accum"), num.format_of("output")
    grad, _ = bw.formats(num)
    up, err = dsd["ds_up"][..., :, -1], dsd["ds_err"][..., :, -1]
    lq = up.shape[-1]
    read = err + read_error(up + err, grad, acc)
    factor = chain(lq, "sequential", acc.u, lam, products=False)
    ev = 1 + evaluation_rounding(lq)
    carried = read.sum(axis=-1) * ev
    accumulation = factor * (up + read).sum(axis=-1) * ev + lq * acc.smallest_normal
    total_up = up.sum(axis=-1) * ev + carried + accumulation
    output = read_error(total_up, acc, out) + 0 * total_up
    total = carried + accumulation + output
    reasons = list(b.dq.reasons)
    for fmt in (acc, out):
        over = ~(total_up + output <= fmt.max_finite)
        if over.any():
            total = np.where(over, np.inf, total)
            reasons.append(
                f"dsink: values up to {float(np.max(total_up)):.4g} may overflow {fmt.name}"
            )
    dsink = dataclasses.replace(
        b.dq,
        total=total,
        terms={"dS": carried, "accumulation": accumulation, "output": output},
        reasons=tuple(reasons) if not np.isfinite(total).all() else (),
    )

    def drop(bound: Bound, rows: bool) -> Bound:
        def cut(x: Any) -> Any:
            x = np.asarray(x)
            return x[..., :-1, :] if rows else x[..., :-1]

        return dataclasses.replace(
            bound, total=cut(bound.total), terms={t: cut(x) for t, x in bound.terms.items()}
        )

    return b._replace(
        dk=drop(b.dk, True), dv=drop(b.dv, True), dbias=drop(b.dbias, False), dsink=dsink
    )


def gradient_bounds(
    x: Inputs,
    num: Numerics,
    bw: Backward,
    lam: float | None = None,
    chains: int = 0,
    *,
    known: bool = False,
) -> tuple[GradientBounds, dict[str, np.ndarray]]:
    """Theorems B.1/B.2 (B.5 with ``lam``) on the inputs ``x``, step by step: the bounds, and
    ``dS``'s enclosures: ``ds_up >= |dS|``, ``ds_err >= |dŜ - dS|`` and ``ds_used >= |dŜ|`` as
    the dots read it (Theorem B.3, the sink's gradient), and ``>= |g|`` for each exact gradient
    of a dot (``dq_up`` ..., Theorem B.6). ``known``: B.2 may read the forward's output
    through A.1 with its known roundings (steps 3k, 6k, 6r) where that is smaller."""
    ctx = Context.of(x, num, bw, lam, known=known)
    ops = operands_step(ctx)
    s, slope = logits_step(ctx, ops)
    pr = probabilities_step(ctx, s)
    dp = dp_step(ctx, ops)
    dd = d_step(ctx, ops, pr, dp)
    ds = ds_step(ctx, pr, dp, dd, slope)
    coupled = couplings_step(ctx, ops, pr, dp, dd, ds)
    lq, n, d, dv_ = ctx.sizes
    ev_all = (1 + evaluation_rounding(max(n, lq, d, dv_))) ** 12
    theorem = ("B.2" if ctx.flash else "B.1") if lam is None else "B.5"
    statement = Statement.of(theorem, lam, chains, num, ev_all)
    results, ups = gradients_step(ctx, ops, pr, ds, coupled, statement)
    keep = x.keep
    stages = {"P": pr.eps_p, "dP": np.where(keep, dp.err, 0.0), "D": dd.d.err, "dS": ds.ds_err}
    stages = {key: val * ev_all for key, val in stages.items()}
    bounds = GradientBounds(results["dq"], results["dk"], results["dv"], results["dbias"], stages)
    dsd = {"ds_up": ds.ds_up, "ds_err": ds.ds_err, "ds_used": ds.da_up + ds.ds_r_err}
    return bounds, dsd | {f"{name}_up": up for name, up in ups.items()}


def logits_step(ctx: Context, ops: Operands) -> tuple[Enclosure, Enclosure | None]:
    """Step 2 (papers/backward.md): the logits ``s = c·q kᵀ + b``, ``q kᵀ`` by B.0, read into
    the score format, times ``ĉ = fl_score(c64)``; with a soft-cap, B.7's step 2c (and the
    slope ``σ`` step 6c reads, else ``None``); then read into the softmax format."""
    x, num, rng, keep = ctx.x, ctx.num, ctx.rng, ctx.x.keep
    acc, sc, sm = ctx.fmt("accum"), ctx.fmt("score"), ctx.fmt("softmax")
    d = ctx.sizes[2]
    aq, ak, mq, mk, e, rad = ops.up["q"], ops.up["k"], ops.mag["q"], ops.mag["k"], ops.err, ops.rad
    f, eta, _ = dot_factor(num, d, None, (ops.bits["q"], ops.bits["k"]), ctx.lam)
    t_a, t_b, t_acc = ctx.dot(aq, e["q"], transpose(ak), transpose(e["k"]), f, eta)
    t_mid = x.q @ transpose(x.k)
    t_rad = f64_dot(d) * (mq @ transpose(mk)) + product_spread(
        rad["q"], transpose(ak), mq, transpose_or_none(rad["k"])
    )
    t = Enclosure(t_mid, t_rad, t_a + t_b + t_acc)
    rng.operands(num, aq + e["q"], ak + e["k"], "q kᵀ", GRADIENTS)
    rng.check(
        (1 + f) * ((aq + e["q"]) @ transpose(ak + e["k"])) + eta, acc, "q kᵀ accumulated",
        GRADIENTS,
    )  # fmt: skip
    # the unscaled scores are rounded to the score format before the scale (a small scale
    # does not save a product that overflows there)
    rng.check(t.used, sc, "q kᵀ rounded to the score format", GRADIENTS)
    t.err = t.err + read_error(t.used, acc, sc)
    if num.folds_scale:
        return _folded_logits(ctx, t), None
    c, c64 = x.c64, x.c64
    c_hat, u_r, u_mul = scale_rounding(c64, sc)
    if not math.isfinite(c_hat):  # u_r is inf: so is every error the scale enters
        rng.check(np.inf, sc, f"the scale {c64:.6g} rounded to the score format", GRADIENTS)
    theta = compound(x.u64, u_r)
    s_mid = c64 * t_mid
    s_rad = abs(c64) * t_rad * (1 + 2 * U64) + (x.u64 + 2 * U64) * np.abs(s_mid)
    s_err = abs(c) * (1 + theta) * t.err + theta * abs(c) * t.up
    s_err = s_err + u_mul * (1 + theta) * abs(c) * (t.up + t.err) + sc.smallest_normal
    slope: Enclosure | None = None
    if x.cap is not None:
        capped, slope = softcap_step(
            Enclosure(s_mid, s_rad, s_err), x.cap, num, ctx.grad, keep, rng
        )
        s_mid, s_rad, s_err = capped.mid, capped.rad, capped.err
    if x.bias is not None:
        s_mid = s_mid + x.bias
        s_rad = s_rad + U64 * np.abs(s_mid)
        s_err = s_err + rounding_error(x.bias, sc)
        s_err = s_err + sc.u * (np.abs(s_mid) + s_rad + s_err) + sc.smallest_normal
    s = Enclosure(s_mid, s_rad, s_err)
    rng.check(np.where(keep, s.used, 0.0), sc, "the logits in the score format", GRADIENTS)
    s.err = s.err + read_error(s.used, sc, sm)
    return s, slope


def _folded_logits(ctx: Context, t: Enclosure) -> Enclosure:
    """Step 2'' (B.2 with ``exp_form="exp2-folded"``, papers/backward.md): the kernel never
    forms the scaled logits. The logits the proof reads are the real numbers
    ``ŝ = t̂·c2·ln 2``, ``t̂`` the scores read into the softmax format and
    ``c2 = c·log2(e)·(1 + δ_c)``, within ``(1 + δ_c)|c|·err_t + δ_c|c||t|`` of ``s = c·t``;
    nothing is rounded here (the exponent's roundings are step 3's). R.3'': ``t̂·c2`` must
    fit the softmax format; a negative or subnormal ``c2`` makes every bound infinite, as in
    the forward (a masked key's ``-inf·c2``)."""
    x, rng, sm = ctx.x, ctx.rng, ctx.fmt("softmax")
    fold = ctx.folded()
    assert fold is not None
    if not (fold.c2_hat > 0 and fold.delta_c < 1):
        stage = f"exp2-folded: the constant c2 = {fold.c2_hat:.4g} (negative or subnormal)"
        rng.check(np.inf, sm, stage, GRADIENTS)
    t.err = t.err + read_error(t.used, ctx.fmt("score"), sm)
    rng.check(t.used * fold.c2_hat * (1 + sm.u), sm, "q kᵀ times c2 (exp2-folded)", GRADIENTS)
    c_up = abs(x.c64) * (1 + x.u64)
    s_mid = x.c64 * t.mid
    s_rad = abs(x.c64) * t.rad * (1 + 2 * U64) + (x.u64 + 2 * U64) * np.abs(s_mid)
    s_err = c_up * (1 + fold.delta_c) * t.err + fold.delta_c * c_up * t.up
    return Enclosure(s_mid, s_rad, s_err)
