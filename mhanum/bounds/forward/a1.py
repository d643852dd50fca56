"""Theorem A.1 (papers/attention.md): a posteriori componentwise bound on the error of
``mhanum.attention``, and Theorem A.1g, its error along a direction per query row.

:func:`attention_bound` evaluates Theorem A.1 on the given inputs and returns its total and its
terms (logits, softmax, probability rounding, operand rounding, ``P V``, output, and ``mask``
for the leakage of a finite masking constant), so that a user sees which source dominates. It
covers the configurations the theorem covers and refuses the others with
:class:`~mhanum.InvalidArgument` rather than answer outside its hypotheses: masks applied with
``-inf`` (a fully-masked row gets an infinite bound, with the reason) or a finite constant
(``fill`` or ``add``; a fully-masked row is then compared with the leaky problem's own value, and
a masked logit that overflows to ``-inf`` drops its key where that is certain), a bias that stays finite in the score format,
a score format no wider than the softmax format, and for the online softmax an accumulation
format no wider than the softmax format. The scale may sit on the scores, on ``q`` or on ``q``
and ``k``. Every sum and dot enters through the factor of its summation order (Theorem S.0: the
height of the summation tree, or Kahan's constant). The proof's steps are the stages of
:mod:`mhanum.bounds.forward.head`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.bounds._result import Bound
from mhanum.bounds.factors import rounding_error
from mhanum.bounds.forward.along import along_rows, directions
from mhanum.bounds.forward.evaluation import certified_difference, quiet
from mhanum.bounds.forward.head import HeadResult, evaluate_heads
from mhanum.bounds.forward.keys import DEAD, dead_rows, keep_and_bias, with_dead_rows
from mhanum.bounds.forward.operands import read_by_the_dot
from mhanum.bounds.forward.result import (
    Events,
    check_scope,
    head_reasons,
    result,
    split_count,
    stack,
)
from mhanum.bounds.forward.stage import ALONG, PLAIN, Head, Setting
from mhanum.bounds.union import lams_for
from mhanum.formats import round_to
from mhanum.numerics import Numerics, resolve
from mhanum.problem import AttentionProblem
from mhanum.rope import reference_rope, rope_error

__all__ = ["EVALUATION_OVERFLOW", "attention_bound", "attention_bound_along"]


@one_blas_thread
def attention_bound(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    bias: Any = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    lam: float | None = None,
    probability: float | None = None,
    sink: Any = None,
    softcap: float | None = None,
    descale: Any = None,
    rope: Any = None,
    positions: Any = None,
    kv_cache: Any = None,
    known_rounding: bool = True,
    input_rounding: str = "bounded",
) -> Bound:
    """Theorem A.1: a componentwise bound on ``|attention(q, k, v, mask, numerics) − exact|``.

    The exact value is the attention of the given (float64) inputs with the exact scale
    (``mhanum.reference.attention``). With ``t = q·k``, ``s = scale·t`` and ``p = softmax(s)``:

    .. math::

        |\\hat o - o| \\le \\underbrace{(e^{2\\Delta} - 1)\\,p\\,|V|}_{\\text{logits}}
          + \\underbrace{\\mathrm{dev}_{\\mathrm{softmax}}\\,|V|}_{\\text{softmax}}
          + \\dots + \\underbrace{\\gamma_{n}(u_a)\\,\\hat p\\,|V|}_{PV}
          + \\underbrace{u_o |o| + \\eta_o}_{\\text{output}},

    (``η_o`` only where the value rounded may lie below the output format's normal range),
    where ``Δ_i = max_j |ŝ_ij − s_ij|`` is bounded from the dot factor of ``d_k`` terms times
    ``|q|·|k|``, the scale and bias roundings, and the softmax deviation follows Blanchard, Higham
    & Higham (2021) made rigorous, with the online rescalings counted (papers/attention.md gives
    every term and the proof). The logit term is evaluated per key (Lemma 4: ``p̃_j = p_j
    e^{δ_j}/Σ_l p_l e^{δ_l}``), which is at most ``(e^{2Δ}-1)p``, and the softmax sum's error is
    the ``p̃``-weighted mean of the keys' exponential errors.

    A finite masking constant ``M`` (``numerics.mask_value``) makes the computed output that of
    the *leaky problem* (masked logits ``M`` or ``s + M``, step 3'); the term ``mask`` bounds its
    distance ``Σ_{masked j} p^L_j(|v_j| + |o|)`` to the exact masked attention. A fully-masked
    row's target is the leaky problem's value: the mean of ``v`` (``fill``,
    ``reference.attention(..., fully_masked="uniform")``) or the unmasked attention (``add``).

    Assumptions: round-to-nearest with an absolute underflow term ``2^emin`` per rounding (so
    XLA's flush-to-zero is covered); ``exp`` within ``numerics.exp_ulps`` ulps and division within
    ``numerics.div_ulps`` ulps of the softmax format (division: relative
    ``(1 + u)^(2·div_ulps) - 1``); ``n·u < 1``. *No overflow* is not assumed but proved on the
    given values, stage by stage (papers/attention.md, section R): the stored operands, their
    reads into the operand and accumulation formats, ``Q Kᵀ``, the scale, the bias, the read
    into the softmax format, the sums of the softmax and of ``P V`` and the output. Entries that
    a stage which may overflow reaches get an infinite bound (term ``overflow``), as do rows
    whose computed softmax sum may be off by 100% (term ``vacuous``) unless the softmax is safe;
    ``Bound.reasons`` says why, one sentence per cause, and ``str(bound)`` shows it. Large
    logits are not refused: the float64 evaluation's own error is part of the bound (step 0).
    With the safe softmax, step W bounds the output whatever the logit errors: ``|ô - o| <=
    |ô| + |o|``, ``|ô|`` from the computed weights' sum alone, replaces the terms of an entry
    where it is smaller (term ``magnitudes``, papers/attention.md).

    Args:
        q, k, v: 2-D or batched inputs as for :func:`mhanum.attention` (float64 values; if they
            are not values of ``numerics.input`` their rounding is included).
        mask: optional boolean mask (True = attend), applied as ``numerics`` says (``mask_mode``,
            ``mask_value``), or a :class:`mhanum.masks.Band` (causal, sliding window).
        bias: optional additive float bias broadcastable to ``(..., Lq, Lk)``; ``-inf`` entries
            exclude keys. Its rounding into the score format is included.
        numerics: a :class:`Numerics` or preset name.
        scale: the logit scale; default ``1/sqrt(d_k)``.
        lam: if given, the probabilistic variant: every sum and dot factor ``γ_h`` becomes
            Higham & Mary's ``γ̃_h(λ) = exp(λ√h·u + hu²/(1-u)) - 1`` (Theorem R.6), and
            ``Bound.probability`` is ``1 - N·2exp(-λ²(1-u)²/2)`` for the ``N`` product chains
            (union bound). Exp, division and single roundings stay deterministic. The
            independence of the rounding errors is a model: on inputs whose roundings all go
            one way (sums of equal values just above half an ulp) the error is ``~h·u`` and
            exceeds this bound (papers/attention.md, A.3); use ``lam=None`` for adversarial or
            structured data.
        probability: instead of ``lam``, the probability the bound should state: the
            union bound over this call's events, with the three per-entry martingale events
            of A.3', A.3'' and A.3e a class of their own (a tenth of ``1 - probability``,
            their own ``λ``; :func:`mhanum.bounds.union.lams_for`, which keeps one ``λ``
            where that split would not lower the entries') and the product chains the rest
            (``Bound.lam`` holds the chains' ``λ``), so ``Bound.probability >=
            probability``. At most one of ``lam`` and ``probability``.
        sink: optional attention-sink logits, one per batch element or head (broadcast
            against the batch dimensions): ``e^σ`` joins every row's normaliser, as one more
            key with value 0 that no mask excludes (:func:`mhanum.masks.with_sink`); the
            bound is the theorem's for that key, whose score is exactly 0 and bias ``σ``.
        softcap: optional logit soft-cap ``c > 0`` (``c·tanh(s/c)`` before the bias, as in
            :func:`mhanum.attention`): step 3c carries each logit's error through ``tanh``
            (by at most ``sinh(w)/(cosh(s/c)·cosh(||s/c| - w|))`` for an argument off by ``w``:
            errors in scores far beyond the cap are squashed) and charges the division by the
            cap, ``tanh`` (``numerics.tanh_ulps``) and the product by the cap (the logits
            source ``softcap`` of ``Bound.parts``).
        descale: fp8 descaling ``(d_q, d_k, d_v)`` as FlashAttention-3 applies it (see
            :func:`mhanum.attention`): the exact attention is that of ``d_q q``, ``d_k k``,
            ``d_v v``. The bound is Theorem A.1 of the scores' constant ``scale·d_q·d_k`` (charged
            as up to three roundings of its format, however the kernel forms it), with its output
            left in the format the last division or dot leaves it, then times ``d_v`` and
            rounded twice (term ``descale``; papers/attention.md, step 7'').
        rope: a :class:`mhanum.rope.Rope`: the kernel rotates ``q`` and ``k`` (its inputs,
            values of ``rope.rotation_format``) before the scores. The exact attention is that
            of the exactly rotated inputs; Theorem P.1 bounds the rotated entries' errors,
            which enter as the operands' (step 1), and the float64 rotation the bound is
            evaluated on is charged as a perturbation of the target (Lemma P.3, term
            ``evaluation``).
        positions: with ``rope``, the queries' and keys' positions (see
            :class:`mhanum.problem.AttentionProblem`).
        kv_cache: a :class:`mhanum.kvcache.KVQuant` the kernel stores ``k`` and ``v`` in, or
            the pair ``(k's, v's)``: the exact attention is that of the given ``k`` and ``v``.
            Operand placement: Theorem K.1 bounds the entries read back, which enter as the
            operands' errors (step 1), with their rounding into the input format where it is
            narrower; with ``rope`` the kernel caches its rotated keys (Corollary K.3, given
            scales). Accumulator placement (one scale per tensor): the attention of the codes
            with the scales as an fp8 descale (Corollary K.2, papers/kvcache.md).
        known_rounding: steps 6k and 6r (papers/attention.md), which assume the
            probabilities' rounding into their format is to nearest, as kernels' conversions
            are. Where they are stored in a coarser format than the softmax computes them in
            (``bf16-fp32acc``, half-precision kernels), the value the kernel rounds is
            enclosed to within much less than the format's spacing, so the rounded value is
            known for most keys and its rounding enters with its sign: step 6r charges the
            term ``probability_rounding`` so (online too), and step 6k (not online) bounds the
            terms ``logits``, ``softmax``, ``probability_rounding`` and ``operands`` together
            as the term ``known_probabilities``, in the entries where that is smaller. Step
            3k adds the scores: rounded into a coarser format than the dot accumulates them
            in (``bf16-fp32acc``, ``fp16-fp32acc``), each is known where its enclosure lies
            within one rounding interval, and steps 6k and 6r read the probabilities of
            those scores. ``False``: the classic steps 3-6 (Theorem A.5' takes them apart).
        input_rounding: ``"bounded"`` (default), ``"exact"`` or ``"auto"``: how the rounding of
            ``q``, ``k``, ``v`` into ``numerics.input`` (to nearest, as the kernel reads
            float64 inputs) is charged. ``"bounded"``: by step 1, as an error of the operands.
            ``"exact"``: A.1 is applied to the rounded inputs, and the rounding's effect on the
            exact attention, ``|o(q̂, k̂, v̂) - o(q, k, v)|``, is computed by two certified
            references and added as the term ``input_rounding`` (as ``mha_bound`` does). It is
            the same quantity, signs kept, and so much smaller where the inputs are not values
            of the input format. Where a dot rounds its operands into an operand format
            (``tf32``, ``dot="bf16x1"``), the inputs it reads directly are taken as it reads
            them too, wherever that value is known (step 1k; not at a tie of the operand
            format, nor below its smallest normal number), and their rounding joins the term
            ``input_rounding``. ``"auto"``: exact up to ``2^20`` logits, else bounded. Not
            with ``rope``, ``kv_cache`` or ``descale`` (bounded there).

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has the output's shape, ``inf`` exactly
        where ``Bound.reasons`` says.

    Raises:
        InvalidArgument: outside the theorem's scope (a score format wider than the softmax
            format, a finite bias that overflows it to inf or NaN, a masking constant that
            becomes NaN in the score format), or for shapes, dtypes or values that do not fit.
            A fully-masked row under ``-inf`` and masked logits that may overflow the score or
            softmax format are not refused: the rows they reach are infinite, with the reason.

    References:
        blanchard2021; higham2002 (§3.1); papers/attention.md Theorem A.1.
    """
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, descale=descale,
        rope=rope, positions=positions, kv_cache=kv_cache,
    )  # fmt: skip
    if not isinstance(known_rounding, bool):
        msg = f"known_rounding: expected True or False, got {known_rounding!r}"
        raise InvalidArgument(msg)
    rounded = _rounded_inputs(problem, resolve(numerics), input_rounding)
    if rounded is not None:
        inner = attention_bound(
            *rounded, mask, bias=bias, numerics=numerics, scale=scale, lam=lam,
            probability=probability, sink=sink, softcap=softcap, known_rounding=known_rounding,
        )  # fmt: skip
        options = {"mask": mask, "bias": bias, "scale": scale, "sink": sink, "softcap": softcap}
        effect = _rounding_effect((q, k, v), rounded, options)
        terms = {**inner.terms, "input_rounding": effect}
        return dataclasses.replace(inner, total=inner.total + effect, terms=terms)
    bound, _ = _attention_bound(
        problem, resolve(numerics), lam, probability, None, known=known_rounding
    )
    return bound


@one_blas_thread
def attention_bound_along(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    mask: Any = None,
    *,
    g_error: Any = None,
    bias: Any = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    sink: Any = None,
    softcap: float | None = None,
) -> tuple[Bound, np.ndarray]:
    """Theorem A.1g: Theorem A.1's bound, and a bound on the output's error along ``g``,
    ``|Σ_c g_ic (ô_ic − o_ic)|`` for every query row ``i``.

    ``g`` is one direction per query row, of the output's shape, for instance the gradient of
    a loss with respect to the attention's output, whose first-order change is then
    ``Σ_c g_ic (ô_ic − o_ic)``; FlashAttention-2's backward reads it as ``D = rowsum(g ∘ ô)``.
    The entrywise bound gives ``Σ_c |g_ic| total_ic``. A.1g keeps two of its brackets coupled
    over the keys instead of over the output's columns: the logits' share
    ``Σ_j (p̃_j − p_j) ṽ_j`` of the output's error, whose weights sum to zero, is at most
    ``Σ_j L_j |g·ṽ_j − c_i|`` along ``g`` (``L`` step 4's per-key deviations, ``c_i`` the row's
    median of ``g·v_j``), and the roundings ``r_j`` of the probabilities into the probability
    and operand formats (safe and naive softmax) at most ``Σ_j |r_j| |g·ṽ_j|``; every other
    term is carried entrywise, as is the output rounding's share of these two. Where the
    ``g·v_j`` cancel (``|g·v_j| ≪ Σ_c |g_c||v_jc|``, as for random directions), this is several
    times below ``Σ_c |g_ic| total_ic``, which it never exceeds beyond that sum's float64 rounding
    (the smaller of the two is returned).

    Assumptions, range checks and reasons are Theorem A.1's (:func:`attention_bound`, which
    this calls with ``lam=None``: the bound is deterministic); a row with an infinite entry
    along a nonzero ``g`` gets ``inf`` (``Bound.reasons`` says why), as does a row whose bound
    along ``g`` exceeds float64's largest finite number. A float64 product or sum that
    underflows is charged ``2^-1074`` each. Split-KV numerics (``kv_splits``) carry the
    entrywise form only.

    Args:
        q, k, v, mask, bias, numerics, scale, sink, softcap: as for :func:`attention_bound`.
        g: the directions, float64, broadcastable to the output's shape ``(..., Lq, d_v)``.
        g_error: optional bound on ``|g − g*|`` for the exact directions ``g*`` (a computed
            gradient, say), broadcastable likewise; default 0.

    Returns:
        ``(bound, along)``: A.1's :class:`~mhanum.bounds.Bound`, and ``along`` of shape
        ``(..., Lq)``, ``>= |Σ_c g*_ic (ô_ic − o_ic)|``.

    Example:
        >>> import numpy as np
        >>> from mhanum.bounds import attention_bound_along
        >>> rng = np.random.default_rng(0)
        >>> q, k, v, g = (rng.standard_normal((16, 8)) for _ in range(4))
        >>> b, along = attention_bound_along(q, k, v, g, numerics="bf16-fp32acc")
        >>> along.shape, bool((along <= (np.abs(g) * b.total).sum(-1)).all())
        ((16,), True)

    References:
        papers/attention.md Theorem A.1g.
    """
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap
    )
    bound, along = _attention_bound(problem, resolve(numerics), None, None, (g, g_error))
    assert along is not None
    return bound, along


EVALUATION_OVERFLOW = (
    "the bound's float64 evaluation overflows: the terms of values near float64's largest "
    "finite number (a product of the logits' magnitude by a unit roundoff, an exponential of "
    "it) exceed it, so those entries are infinite"
)
_INPUT_ROUNDING = ("bounded", "exact", "auto")
_EXACT_LOGITS = 2**20  # "auto": the two certified references up to this many logits


def _rounded_inputs(
    p: AttentionProblem, num: Numerics, how: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``q``, ``k``, ``v`` rounded into ``numerics.input`` where A.1 takes their rounding
    exactly (``input_rounding``), and into the operand format where a dot reads them through
    it and the value read is known (step 1k, :func:`read_by_the_dot`); ``None`` where step 1
    bounds it: nothing rounds, a rounded value is not finite, a rotation, a cache or a descale
    stands between the inputs and the dots, or (``"auto"``) more than ``2^20`` logits."""
    if how not in _INPUT_ROUNDING:
        msg = f"input_rounding: expected one of {_INPUT_ROUNDING}, got {how!r}"
        raise InvalidArgument(msg)
    if how == "bounded" or p.rope is not None or p.kv_cache is not None or p.descale:
        return None
    q, k, v = (np.asarray(x, np.float64) for x in (p.q, p.k, p.v))
    if how == "auto" and math.prod(p.batch) * q.shape[-2] * k.shape[-2] > _EXACT_LOGITS:
        return None
    fmt = num.format_of("input")
    with np.errstate(over="ignore", invalid="ignore"):
        qr, kr, vr = (round_to(x, fmt).astype(np.float64) for x in (q, k, v))
    if not all(np.isfinite(x).all() for x in (qr, kr, vr)):
        return None
    # step 1k: the operands a dot reads directly, through its operand format (not a scaled one)
    if num.scale == "scores":
        qr = read_by_the_dot(qr, num)
    if num.scale != "qk":
        kr = read_by_the_dot(kr, num)
    vr = read_by_the_dot(vr, num)
    if all(np.array_equal(a, b) for a, b in zip((qr, kr, vr), (q, k, v), strict=True)):
        return None
    return qr, kr, vr


def _rounding_effect(
    given: tuple[Any, Any, Any], rounded: tuple[np.ndarray, ...], options: dict[str, Any]
) -> np.ndarray:
    """``|o(q̂, k̂, v̂) - o(q, k, v)|``, bounded above: two certified references, each the exact
    value rounded to float64 (within ``2^-53`` relative), their difference and its rounding;
    0 on a fully masked row (the bound is infinite there)."""
    from mhanum import reference  # the certified exact values (no attention of mhanum's)

    outs = [reference.attention(*x, fully_masked="zero", **options) for x in (rounded, given)]
    return certified_difference(outs[0], outs[1])


def _attention_bound(
    p: AttentionProblem,
    num: Numerics,
    lam: float | None,
    probability: float | None,
    direction: tuple[Any, Any] | None,
    *,
    known: bool = True,
) -> tuple[Bound, np.ndarray | None]:
    """:func:`attention_bound` of the problem ``p``; with ``direction = (g, g_error)``, also
    A.1g's per-row bound (:func:`attention_bound_along`); ``known``: step 6k allowed."""
    check_scope(num)
    num.check_problem(p)
    q, k, v = (np.asarray(x, np.float64) for x in (p.q, p.k, p.v))
    mask, bias, batch = p.mask, p.bias, p.batch
    if p.sink is not None:
        b64 = None if bias is None else np.asarray(bias, np.float64)
        k, v, mask, bias = masks.with_sink(q, k, v, mask, b64, p.sink)
        batch = k.shape[:-2]
    rows, keys = q.shape[-2], k.shape[-2]
    keep, masked, b, replaced = keep_and_bias(mask, bias, (*batch, rows, keys), num)
    dead = dead_rows(keep, masked)
    keep = with_dead_rows(keep, dead)  # evaluated as unmasked, then infinite with the reason
    # every chain's event, and a class of their own: three martingale events per output
    # entry (A.3', A.3'', A.3e), with a λ of their own under probability= (Theorem A.3)
    splits = math.prod(batch) * rows * split_count(num, keys)
    counts = (splits * keys * (q.shape[-1] + 1 + v.shape[-1]), splits * 3 * v.shape[-1])
    lam, lam_e, failure = lams_for(lam, probability, counts, num)
    qb, kb, vb = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    out_shape = (*batch, rows, v.shape[-1])
    gb = gu = None
    if direction is not None:
        gb, gu = directions(direction, out_shape)
    fmt_in = num.format_of("input")
    errors = tuple(rounding_error(x, fmt_in) for x in (qb, kb, vb))
    moved: tuple[Any, Any, Any] | None = None  # the stand-ins' distances to the exact q, k, v
    num_y = num if p.descale is None else num.replace(output_format=num.descale_format.name)
    if p.rope is not None:
        qb, kb, errors, rotated = _rotated(p, qb, kb, errors, fmt_in)
        moved = (*rotated, 0.0)
    acc = p.accumulated()
    if acc is not None:
        # K.0 item 3: the dots read the codes, within K.1's errors of the quotients x/ŝ (step
        # 1), and the scales are the fp8 descale (1, ŝ_k, ŝ_v) of the output rounded first
        def batched(x: np.ndarray) -> np.ndarray:
            return np.broadcast_to(x, (*batch, *x.shape[-2:]))

        kb, vb = (batched(x) for x in acc.quotients)
        errors = (
            errors[0],
            *(
                batched(e) + rounding_error(batched(c), fmt_in)
                for e, c in zip(acc.errors, acc.codes, strict=True)
            ),
        )
        moved = (0.0, batched(acc.given[0]), batched(acc.given[1]))
        p, num_y = dataclasses.replace(p, descale=acc.descale), num
    elif p.kv_cache is not None:
        k_cache, v_cache = p.kv_cache
        if p.rope is None:
            e_k = _cached(k_cache, kb, fmt_in)
        else:
            # Corollary K.3: the kernel caches its rotated keys, within e_k of the float64
            # rotation; with given scales K.1 grows with |x|, so it is taken at |k| + e_k
            e_k = errors[1] + _cached(k_cache, np.abs(kb) + errors[1], fmt_in)
        errors = (errors[0], e_k, _cached(v_cache, vb, fmt_in))
    along = None if gb is None or gu is None or p.descale else (gb, gu)
    stacked = (qb, kb, vb, keep, b, masked, replaced, errors, along, moved)
    heads = _heads(p, (num, num_y), (lam, lam_e), stacked, known)
    coupled = [h[3].pop(ALONG, None) for h in heads]
    if p.descale is not None:
        heads = [_descaled(h, p.descale[2], num, num_y) for h in heads]
    terms = stack([{**h[0], **h[4].terms()} for h in heads], out_shape)
    parts = stack([h[3] for h in heads], out_shape)
    plain = parts.pop(PLAIN)
    all_parts = {
        "logits": parts,
        "output": {"rounding": plain, "to_nearest": terms["output"] - plain},
    }
    reasons = head_reasons(h[4] for h in heads)
    if dead.any():
        terms["fully_masked"] = np.broadcast_to(np.where(dead, np.inf, 0.0), out_shape)
        reasons = (*reasons, DEAD)
    total = sum(terms.values())
    if not reasons and not np.all(np.isfinite(np.asarray(total))):
        reasons = (EVALUATION_OVERFLOW,)
    theorem = "A.1" if num.kv_splits is None else "A.6"
    bound = result(
        total, terms, theorem, num, Events(lam, sum(counts), failure), all_parts, reasons
    )
    if gu is None:
        return bound, None
    present = [c for c in coupled if c is not None]
    adjust = None
    if len(present) == len(coupled):
        adjust = np.stack(present).reshape((*out_shape[:-1], 1))
    with quiet():
        return bound, along_rows(gu, bound.total, adjust)


def _heads(
    p: AttentionProblem,
    nums: tuple[Numerics, Numerics],
    lams: tuple[float | None, float | None],
    stacked: tuple[Any, ...],
    known: bool = True,
) -> list[HeadResult]:
    """Theorem A.1 for every head of the batch: ``stacked`` holds ``q, k, v, keep, bias,
    masked, replaced``, the inputs' roundings, A.1g's directions and the float64 stand-ins'
    distances to the exact inputs (``moved``), each with the batch dimensions in front
    (``None`` where absent). ``nums``: the numerics, and those of the output before an fp8
    descale multiplies it (step 7''; the numerics themselves without one), whose constant is
    then charged (:func:`_constant_given`). ``lams``: the chains' ``λ`` and the per-entry
    martingales' (A.3; ``None``: certain)."""
    qb, kb, vb, keep, b, masked, replaced, errors, along, moved = stacked
    num, num_y = nums
    factors = p.descale
    c = p.scale_value(num.scale)
    if factors is not None:
        c = c * factors[0] * factors[1]  # the loose constant charges its float64 roundings too
    setting = Setting(
        num_y, c, p.scale is None and factors is None, lams[0], p.softcap, factors is not None,
        known, lams[1],
    )  # fmt: skip
    heads = [
        Head(
            qb[i],
            kb[i],
            vb[i],
            keep[i],
            (errors[0][i], errors[1][i], errors[2][i]),
            bias=None if b is None else b[i],
            given=_given(
                None if factors is None else _constant_given(qb[i], kb[i], vb[i], p.scale),
                None if moved is None else tuple(_at(g, i) for g in moved),
            ),
            masked=None if masked is None else masked[i],
            replaced=None if replaced is None else replaced[i],
            along=None if along is None else (along[0][i], along[1][i]),
        )
        for i in np.ndindex(*keep.shape[:-2])
    ]
    return evaluate_heads(heads, setting)


def _at(x: Any, i: tuple[int, ...]) -> Any:
    """``x[i]`` for an array with the batch dimensions in front, ``x`` for a number."""
    return x[i] if isinstance(x, np.ndarray) else x


def _rotated(
    p: AttentionProblem, q: np.ndarray, k: np.ndarray, errors: tuple[Any, ...], fmt_in: Any
) -> tuple[np.ndarray, np.ndarray, tuple[Any, ...], tuple[np.ndarray, np.ndarray]]:
    """RoPE (papers/rope.md): the float64 rotations the bound is evaluated on (Lemma P.3), the
    operands' errors against them (Theorem P.1, the rotation's distance to its float64 stand-in,
    and a rounding into the input format where it is narrower than the rotation's), and the
    stand-ins' distances to the exact rotations (the target's perturbation, ``given``)."""
    rope = p.rope
    assert rope is not None
    assert p.positions is not None
    out = []
    for x, pos in ((q, p.positions[0]), (k, p.positions[1])):
        x64, g = reference_rope(x, pos, rope)
        e = rope_error(x, pos, rope) + g
        if (
            fmt_in.precision < rope.format("rotation").precision
            or fmt_in.emin > rope.format("rotation").emin
        ):
            e = e + fmt_in.u * (np.abs(x64) + e) + fmt_in.smallest_normal
            e = np.where(np.abs(x64) + e <= fmt_in.max_finite, e, np.inf)  # R: may overflow
        out.append((x64, e, g))
    (q64, e_q, g_q), (k64, e_k, g_k) = out
    return q64, k64, (e_q, e_k, errors[2]), (g_q, g_k)


def _cached(cache: Any, x: np.ndarray, fmt_in: Any) -> np.ndarray:
    """Theorem K.1 (papers/kvcache.md): the entries a quantized cache gives back, within
    ``e`` of the exact ``x``; then read into the input format where it is narrower than the
    cache's dequantization format (one more rounding of a value at most ``|x| + e``)."""
    e = cache.read(x)[1]
    fd = cache.dequant_format
    if fmt_in.precision < fd.precision or fmt_in.emin > fd.emin:
        e = e + fmt_in.u * (np.abs(x) + e) + fmt_in.smallest_normal
    return e


def _given(*parts: tuple[Any, Any, Any] | None) -> tuple[Any, Any, Any] | None:
    """The stand-ins' distances to the exact inputs, summed over their sources."""
    present = [x for x in parts if x is not None]
    if not present:
        return None
    return tuple(sum(x[j] for x in present) for j in range(3))


def _constant_given(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: Any) -> tuple[Any, ...]:
    """The float64 product ``scale·d_q·d_k`` is off the exact one by two roundings (four with
    the irrational default scale): an error of the exact logits, carried as one of q's."""
    rel = (6 if scale is None else 3) * 2.0**-53
    return rel * np.abs(q), np.zeros_like(k), np.zeros_like(v)


def _descaled(head: Any, d_v: float, num: Numerics, num_y: Numerics) -> Any:
    """Step 7'' (papers/attention.md): one head's A.1 (output ``y`` left in ``num_y``'s output
    format, ``|y - o| <= A``) carried through ``z = fl_y(y·d_v)`` and ``fl_o(z)``:
    ``|fl_o(z) - d_v o| <= (1 + u_o)((1 + u_y)|d_v|A + u_y|d_v o| + η_y) + u_o|d_v o| + η_o``."""
    terms, o, o_error, parts, ranges = head
    f_y, f_o = num_y.format_of("output"), num.format_of("output")
    u_y, u_o = f_y.u, f_o.u
    grow = (1 + u_o) * (1 + u_y) * abs(d_v)
    scaled = {name: grow * x for name, x in terms.items()}
    d_o = abs(d_v) * (np.abs(o) + o_error)
    scaled["descale"] = (
        (1 + u_o) * (u_y * d_o + f_y.smallest_normal) + u_o * d_o + f_o.smallest_normal
    )
    upper = d_o + abs(d_v) * sum(terms.values()) * (1 + u_y)
    ranges.check(upper, f_y, f"the output times d_v = {d_v:.4g}", entries=True)
    ranges.check(upper * (1 + u_y), f_o, "the descaled output", entries=True)
    parts = {name: grow * x for name, x in parts.items()}
    return scaled, d_v * o, abs(d_v) * o_error, parts, ranges
