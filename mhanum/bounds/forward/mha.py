"""Theorem A.2 (papers/attention.md): multi-head attention, its projections (step (a)), the heads
as Theorem A.1 with computed operands (step (b), :func:`head_output_bound`), and the output
projection (steps (c), (c') and (c''))."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.bounds._result import Bound
from mhanum.bounds.factors import evaluation_rounding, operand_error, rounding_error
from mhanum.bounds.forward.across_heads import across_heads, gather, head_sum, merge_heads, shared
from mhanum.bounds.forward.along import along_rows
from mhanum.bounds.forward.evaluation import certified_difference, quiet
from mhanum.bounds.forward.head import HeadResult, evaluate_heads, evaluate_rows
from mhanum.bounds.forward.keys import DEAD, dead_rows, keep_and_bias, with_dead_rows
from mhanum.bounds.forward.operands import read_by_the_dot
from mhanum.bounds.forward.result import Events, check_scope, head_reasons, result, split_count
from mhanum.bounds.forward.stage import (
    ALONG,
    PLAIN,
    PROJECTED,
    SOFTMAX_PROJECTED,
    STORED_PARTS,
    UNSHAPED,
    Head,
    Projection,
    Setting,
    Stored,
)
from mhanum.bounds.forward.stored import stored_scope
from mhanum.bounds.projections import Linear, linear, linear_overflow
from mhanum.bounds.union import lams_for
from mhanum.formats import round_to
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams
from mhanum.problem import MHAProblem
from mhanum.rope import check_holds, reference_rope, rope_error, rotation_spread

__all__ = ["head_output_bound", "merge_heads", "mha_bound", "split_heads"]

_INPUT_ROUNDING = ("auto", "exact", "bounded")
_EXACT_LOGITS = 2**20  # "auto": the reference's cost, logits per call
_EXACT_ROTATED_LOGITS = 2**12  # with a rope the reference runs in Arb balls


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """``(..., L, H·d)`` to ``(..., H, L, d)``."""
    return np.swapaxes(x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads), -2, -3)


@one_blas_thread
def head_output_bound(
    operands: tuple[np.ndarray, np.ndarray, np.ndarray],
    keep: np.ndarray,
    bias: np.ndarray | None,
    setting: Setting,
    errors: tuple[np.ndarray, np.ndarray, np.ndarray],
    given: tuple[np.ndarray, np.ndarray, np.ndarray],
    along: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...], np.ndarray | None]:
    """Theorem A.1 for heads whose operands are themselves computed (A.2, step (b)).

    ``operands = (q, k, v)`` ``(..., L, d)`` (any batch of heads) stand in for the exact operands
    within ``given``; the computed ones the kernel reads are within ``errors`` of the exact ones;
    ``keep`` ``(..., Lq, Lk)`` marks the attended keys (every row attends one), ``bias`` is
    finite where ``keep``; ``setting`` how every head is computed (its numerics, scale and
    soft-cap, as for :func:`attention_bound`); ``along = (g, ḡ)``
    (``(..., Lq, d_v)``), Theorem A.1g's directions (:func:`attention_bound_along`). Returns
    ``(err, o, o_given, reasons, along)``: ``|Ô - O*| <= err`` (``inf`` where a stage may
    overflow, with the reasons), the float64 output ``o``, ``|o - O*| <= o_given`` and
    ``(..., Lq)`` bounds on ``|Σ_c g*_c (Ô_c - O*_c)|`` (``None`` without ``along``).
    """
    q, k, v = operands
    batch = keep.shape[:-2]
    rows = q.shape[-2]
    err = np.zeros((*batch, rows, v.shape[-1]))
    out, out_given = np.zeros_like(err), np.zeros_like(err)
    rows_along = None if along is None else np.zeros((*batch, rows))
    reasons: list[Any] = []
    for i in np.ndindex(*batch):
        with quiet():
            head = Head(
                q[i], k[i], v[i], keep[i], (errors[0][i], errors[1][i], errors[2][i]),
                bias=None if bias is None else bias[i],
                given=(given[0][i], given[1][i], given[2][i]),
                along=None if along is None else (along[0][i], along[1][i]),
            )  # fmt: skip
            terms, o, o_given, parts, ranges = evaluate_rows(head, setting)
            total = np.sum(list(terms.values()), axis=0)
            for name in ("overflow", "vacuous"):
                hit = ranges.where.get(name)
                if hit is not None:
                    total = np.where(hit, np.inf, total)
            total = np.where(np.isnan(total), np.inf, total)
            if along is not None and rows_along is not None:
                rows_along[i] = along_rows(along[1][i], total, parts.get(ALONG))
        err[i], out[i], out_given[i] = total, o, o_given
        reasons.append(ranges)
    return err, out, out_given, tuple(dict.fromkeys(head_reasons(reasons))), rows_along


_DOT_WEIGHTS = ("wq", "wk", "wv", "wo")  # read by the projections' dots (the biases are added)


def _rounded_inputs(
    x_q: Any,
    x_kv: Any,
    params: MHAParams,
    num: Numerics,
    how: str,
    scale: Any,
    heads: Any,
    rotated: bool = False,
) -> tuple[np.ndarray, np.ndarray, MHAParams] | None:
    """The inputs and weights rounded into ``numerics.input``, where A.2 takes their rounding
    exactly (``input_rounding``), and those the projections' dots read (not the biases) into
    the operand format where the value read is known (step 1k,
    :func:`~mhanum.bounds.forward.operands.read_by_the_dot`); ``None`` where it bounds it
    instead: nothing rounds, a custom scale (the reference's is ``1/sqrt(d_k)``), a rounded
    value that is not finite, or (auto) more than ``2^20`` logits (``2^12`` with a rope, whose
    reference runs in Arb balls).
    Checks nothing else: the bound's own checks follow."""
    if scale is not None:
        return None
    fmt = num.format_of("input")
    try:
        xs = [np.asarray(x, np.float64) for x in (x_q, x_kv)]
        if min(x.ndim for x in xs) < 2:
            return None
        weights = {
            f.name: np.asarray(getattr(params, f.name), np.float64)
            for f in dataclasses.fields(params)
            if getattr(params, f.name) is not None
        }
        outer = np.broadcast_shapes(xs[0].shape[:-2], xs[1].shape[:-2])
        logits = math.prod(outer) * xs[0].shape[-2] * xs[1].shape[-2] * int(heads)
    except (TypeError, ValueError):
        return None  # the bound's checks name the argument
    if how == "auto" and logits > (_EXACT_ROTATED_LOGITS if rotated else _EXACT_LOGITS):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        rx = [round_to(x, fmt).astype(np.float64) for x in xs]
        rw = {n: round_to(a, fmt).astype(np.float64) for n, a in weights.items()}
    values = [*rx, *rw.values()]
    if not all(np.isfinite(a).all() for a in values):
        return None
    # step 1k: the inputs and weights the projections' dots read, through their operand format
    rx = [read_by_the_dot(x, num) for x in rx]
    rw = {n: read_by_the_dot(a, num) if n in _DOT_WEIGHTS else a for n, a in rw.items()}
    values = [*rx, *rw.values()]
    originals = [*xs, *weights.values()]
    if all(np.array_equal(a, b) for a, b in zip(values, originals, strict=True)):
        return None
    return rx[0], rx[1], dataclasses.replace(params, **rw)


def _rounding_effect(
    given: tuple[Any, Any, MHAParams],
    rounded: tuple[np.ndarray, np.ndarray, MHAParams],
    heads: int,
    options: dict[str, Any],
) -> np.ndarray:
    """``|y(x̂, ŵ) - y(x, w)|``, bounded above: two certified references, each the exact
    value rounded to float64 (within ``2^-53`` relative, and 0 only where it is exactly),
    their difference and its rounding; 0 on a fully masked row (the bound is inf there)."""
    from mhanum import reference  # the certified exact values (no attention of mhanum's)

    ys = [
        reference.multi_head_attention(x, x_kv, p, heads, fully_masked="zero", **options)
        for x, x_kv, p in (rounded, given)
    ]
    return certified_difference(ys[0], ys[1])


def _projected_values(v: np.ndarray, given: Any, wo: np.ndarray, num: Numerics) -> Projection:
    """A.2 (c') and (c''): one head's values ``v`` (float64, off the exact ones by at most
    ``given``) through its rows ``wo`` of the output projection's weights as rounded to the
    input format, read through the operand format (``ŵ_op``): ``B_jm >= |v*_j·ŵ_op,m - c_m|``
    with ``c_m`` the median over the keys of ``v_j·ŵ_m`` (any constant will do for the logits:
    the deviations of the probabilities sum to zero), and ``|v*_j·ŵ_op,m|`` bounded alike."""
    u_op, eta_op = operand_error(num)
    vw = v @ wo
    centre = np.median(vw, axis=0, keepdims=True)
    v_abs, w_abs = np.abs(v), np.abs(wo)
    slope = (1 + u_op) * w_abs + eta_op
    # the float64 product's rounding, the values' own error and the operand rounding of ŵ
    spread = evaluation_rounding(v.shape[-1]) * v_abs + np.broadcast_to(given, v.shape)
    extra = spread @ slope
    if u_op or eta_op:
        extra = extra + v_abs @ (u_op * w_abs + eta_op)
    centred = np.abs(vw - centre) * (1 + 2.0**-51) + extra
    return Projection(centred, slope, np.abs(vw) * (1 + 2.0**-51) + extra, wo)


def _through_projection(
    term: np.ndarray, linear: np.ndarray, projected: np.ndarray, ev: float
) -> np.ndarray:
    """A.2 (c') and (c''): a head term ``κ t|ŵ|`` of step (c) (the logits' or the softmax's),
    with its linear part ``Σ_l t_l|ŵ_lm|`` (``linear``) replaced where the heads' bound through
    the signed weights (``projected``, :func:`through_weights.through_weights`) is smaller:
    ``term - (linear - projected)``, the factor ``κ >= 1`` kept on the rest. ``ev`` is the
    float64 evaluation's relative rounding of both."""
    with np.errstate(invalid="ignore", over="ignore"):
        gain = np.where(
            np.isfinite(linear) & np.isfinite(projected),
            np.fmax(linear * (1 - ev) - projected * (1 + ev), 0.0),
            0.0,
        )
        return np.where(gain > 0, (term - gain) * (1 + 2.0**-51), term)


@one_blas_thread
def mha_bound(
    x_q: Any,
    x_kv: Any,
    params: MHAParams,
    num_heads: int,
    *,
    mask: Any = None,
    bias: Any = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    lam: float | None = None,
    probability: float | None = None,
    num_kv_heads: int | None = None,
    sink: Any = None,
    softcap: float | None = None,
    input_rounding: str = "auto",
    rope: Any = None,
    positions: Any = None,
    known_rounding: bool = True,
) -> Bound:
    """Theorem A.2: a componentwise bound on ``|multi_head_attention(...) − exact|``.

    The exact value is ``mhanum.reference.multi_head_attention`` of the given (float64) inputs and
    weights. The bound composes three steps (papers/attention.md, Theorem A.2):

    (a) each projection ``y = x w + b``, computed as ``fl_st(fl_a(fl_a(x̂ ŵ) + b̂))`` with the
    inputs and weights rounded to ``numerics.input`` and the dot in ``numerics.summation``:

    .. math::

        |\\hat y - y| \\le u_{st}|y| + (1 + u_{st})\big[(1 + u_a)\big(E_{xw} + |\\hat b - b|\big)
          + u_a|y| + \\eta_a\big] + \\eta_{st},\\quad
        E_{xw} \\le e_x|w| + |x|e_w + e_x e_w + G_d(u_a)(|x| + e_x)(|w| + e_w) + 2d\\eta_a;

    (b) Theorem A.1 for every head, with its operands off the exact projections by the bounds of
    (a) (A.1, step 1) and a term ``evaluation`` for the float64 stand-ins of the exact ones;

    (c) the output projection as in (a), with the per-head outputs off by the totals of (b);
    (c') the logits term of (b) through the weights: the probabilities' deviations sum to zero,
    so their part of the output is ``Σ_j (p̃_j - p_j)(v_j ŵ_o - c)``, at most
    ``Σ_j L_j|v_j ŵ_o - c|`` (``L`` step 4's deviations) where that is smaller than (c)'s.

    With ``input_rounding="exact"`` the rounding of the inputs and weights into
    ``numerics.input`` is not bounded but computed: the bound is A.2 for the rounded inputs
    and weights (what the computation reads, exactly) plus the term ``input_rounding``,
    ``|y(x̂, ŵ) - y(x, w)|`` of two certified references (each within ``2^-53`` relative).
    Where the dots round their operands into an operand format (``tf32``), the inputs and the
    weight matrices are taken as the projections' dots read them, where that value is known
    (step 1k of papers/attention.md). That costs two evaluations of
    :func:`mhanum.reference.multi_head_attention`; the default ``"auto"`` takes it where
    something rounds and there are at most ``2^20`` logits, ``"bounded"`` never.

    The terms are those of A.1 propagated through the output projection
    (``attention.logits``, ``attention.softmax``, ...) and ``output_projection``, the error of
    (c) with exact per-head outputs. The q/k/v projection errors act through ``attention.logits``
    (q, k) and ``attention.operands`` (v).

    Assumptions: those of Theorem A.1 (round to nearest with an absolute underflow term per
    rounding, ``exp`` and division within ``numerics.exp_ulps``/``div_ulps`` ulps, sums in the
    numerics' order with the factors of Theorem S.0, no overflow, ``n·u < 1``) and its scope
    (as :func:`attention_bound`: masks with ``-inf`` or a finite constant, scale anywhere).

    Args:
        x_q: query input ``(..., Lq, d_q)``.
        x_kv: key/value input ``(..., Lk, d_kv)``.
        params: the weights (float64 values; their rounding into ``numerics.input`` is included).
        num_heads: number of heads.
        num_kv_heads: grouped-query attention, as in :func:`mhanum.multi_head_attention`.
        sink: attention sinks, one per head, as in :func:`mhanum.multi_head_attention`; the
            sink's key and value are exact zeros after the projections.
        softcap: the logit soft-cap of every head, as in :func:`attention_bound` (step 3c).
        rope: a :class:`mhanum.rope.Rope`: every head's projected queries and keys are rotated
            as it states and stored again (as :func:`mhanum.multi_head_attention` computes);
            the exact value is then that of the exactly rotated exact projections
            (``reference.multi_head_attention(..., rope=)``), and step (b) takes the rotated
            operands' errors of Corollary P.6 (papers/rope.md).
        positions: with ``rope``, the queries' and keys' positions (see
            :meth:`mhanum.rope.Rope.positions_for`).
        mask: optional boolean mask broadcastable to ``(..., H, Lq, Lk)``, True = attend, or a
            :class:`mhanum.masks.Band`.
        bias: optional additive bias broadcastable to ``(..., H, Lq, Lk)``.
        numerics: a :class:`Numerics` or preset name.
        scale: the logit scale; default ``1/sqrt(d_k)``.
        lam: the probabilistic variant, as for :func:`attention_bound` (the projections' chains
            are counted in ``Bound.probability``); where it is smaller, Theorem A.3‴ bounds the
            terms ``attention.logits``, ``attention.operands`` and
            ``attention.probability_rounding`` together: the projections', the attention's
            reads of them into an operand format (TF32), the scores' and the probabilities'
            roundings as one martingale per output entry through the output projection's
            weights (IEEE dots, the scale on the scores, no rotation or split-KV; one more
            event per output entry, and one per head's row for its normaliser).
        probability: instead of ``lam``, the probability the bound should state, as for
            :func:`attention_bound`. Where Theorem A.3‴ applies, its per-entry and per-row
            events take a ``λ`` of their own, solved on a tenth of the failure probability
            (:func:`mhanum.bounds.union.lam_split`); ``Bound.lam`` is the chains' (Theorem
            A.3's), solved on the rest.
        input_rounding: ``"auto"``, ``"exact"`` or ``"bounded"``: how the rounding of the
            inputs and weights into ``numerics.input`` is charged (above). ``"exact"`` needs
            the default scale and falls back to ``"bounded"`` where a rounded value is not
            finite (the range check then says so).
        known_rounding: step 6r in every head, as for :func:`attention_bound` (the heads'
            logits term goes through the output projection, step (c'), so step 6k is not
            taken); ``False``: the classic steps 4-6.

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has the output's shape ``(..., Lq, d_out)``.

    Raises:
        InvalidArgument: outside the theorem's scope (as :func:`attention_bound`) or for inputs
            that do not fit the parameters.

    References:
        higham2002 (§3.1); blanchard2021; papers/attention.md Theorems A.1 and A.2.
    """
    num = resolve(numerics)
    if not isinstance(known_rounding, bool):
        msg = f"known_rounding: expected True or False, got {known_rounding!r}"
        raise InvalidArgument(msg)
    if input_rounding not in _INPUT_ROUNDING:
        msg = f"input_rounding: expected one of {_INPUT_ROUNDING}, got {input_rounding!r}"
        raise InvalidArgument(msg)
    if not isinstance(params, MHAParams):
        msg = f"params: expected an MHAParams, got {type(params).__name__}"
        raise InvalidArgument(msg)
    options = {"mask": mask, "bias": bias, "num_kv_heads": num_kv_heads, "sink": sink}
    options |= {"softcap": softcap, "rope": rope, "positions": positions}
    if input_rounding != "bounded":
        rounded = _rounded_inputs(
            x_q, x_kv, params, num, input_rounding, scale, num_heads, rope is not None
        )
        if rounded is not None:
            inner = mha_bound(
                *rounded, num_heads, numerics=num, lam=lam, probability=probability,
                input_rounding="bounded", known_rounding=known_rounding, **options,
            )  # fmt: skip
            effect = _rounding_effect((x_q, x_kv, params), rounded, num_heads, options)
            terms = {**inner.terms, "input_rounding": effect}
            return dataclasses.replace(inner, total=inner.total + effect, terms=terms)
    p = MHAProblem.of(x_q, x_kv, params, num_heads, scale=scale, **options)
    return _mha_bound(p, num, lam, probability, known=known_rounding)


def _mha_bound(
    p: MHAProblem, num: Numerics, lam: float | None, probability: float | None, *, known: bool
) -> Bound:
    """:func:`mha_bound` of the problem ``p``, its inputs' rounding bounded (step (a));
    ``known``: step 6r allowed."""
    check_scope(num)
    num.check_problem(p)
    params, heads, outer = p.params, p.num_heads, p.batch
    mask, bias, scores = p.mask, p.bias, p.scores
    rows, keys = scores[-2:]
    if p.sink is not None:
        mask, bias, scores = masks.head_sinks(mask, bias, p.sink, scores)
        outer, keys = tuple(scores[:-3]), keys + 1
    d_v = params.v_width // heads
    chains = math.prod(outer) * (
        heads
        * rows
        * (keys * (params.qk_width // heads + 1 + d_v) + 3 * d_v)  # A.3', A.3'', A.3e
        * split_count(num, keys)
        + rows * params.qk_width * params.d_q
        + keys * (params.qk_width + params.v_width) * params.d_kv
        + rows * params.d_out * params.v_width
    )
    across_heads = (lam is not None or probability is not None) and stored_scope(p, num)
    # Theorem A.3‴: one more event per output entry, and per head's row
    entries = math.prod(outer) * rows * (params.d_out + heads) if across_heads else 0
    lam, lam_e, failure = lams_for(lam, probability, (chains, entries), num)
    chains += entries
    keep, masked, b, replaced = keep_and_bias(mask, bias, (*outer, heads, rows, keys), num)
    dead = dead_rows(keep, masked)
    keep = with_dead_rows(keep, dead)
    w: dict[str, Any] = {
        f.name: None if getattr(params, f.name) is None else np.asarray(getattr(params, f.name))
        for f in dataclasses.fields(params)
    }
    w = {name: None if a is None else a.astype(np.float64) for name, a in w.items()}
    proj, bad_rows, reasons, last = _projections(p, w, outer, num, lam)
    if p.rope is not None:
        proj = _rotated_projections(p, proj, num)
    stored = None
    if across_heads and all(x is not None for x in last.values()):
        stored = _read_by_the_attention(last, proj, num)
    results = _heads(p, num, (lam, lam_e), proj, (keep, b, masked, replaced, w, stored), known)
    shape = (*outer, heads, rows, d_v)
    ev = evaluation_rounding(max(params.v_width, keys))
    group = heads // (p.num_kv_heads or heads)
    terms, logits, bad_out = _output_projection(
        results, shape, w, num, (lam, group, lam_e), reasons, ev
    )
    full = terms["output_projection"].shape
    head_bad = {
        n: gather(results, lambda r, n=n: r[4].where.get(n, np.zeros(r[4].shape, bool)), shape)
        for n in ("overflow", "vacuous")
    }
    overflow = np.broadcast_to(bad_rows | head_bad["overflow"].any(axis=-1, keepdims=True), full)
    overflow = overflow | bad_out
    vacuous = np.broadcast_to(head_bad["vacuous"].any(axis=-1, keepdims=True), full)
    dead_out = np.broadcast_to(dead.any(axis=-3), full)  # any head's row reaches the output row
    if dead_out.any():
        reasons.append(DEAD)
    for n, hit in (("overflow", overflow), ("vacuous", vacuous), ("fully_masked", dead_out)):
        if hit.any():
            terms[n] = np.where(hit, np.inf, 0.0)
    total = sum(terms.values())
    reasons = list(dict.fromkeys(reasons))
    return result(
        total, terms, "A.2", num, Events(lam, chains, failure), {"attention.logits": logits},
        tuple(reasons),
    )  # fmt: skip


def _projections(
    p: MHAProblem, w: dict[str, Any], outer: tuple[int, ...], num: Numerics, lam: float | None
) -> tuple[dict[str, tuple[Any, Any, Any]], np.ndarray, list[str], dict[str, Any]]:
    """Step (a): each projection ``y = x w + b`` per head, ``(y, e, g)``: the float64 value,
    the bound on the computed one's error against the exact one (the inputs' rounding
    included) and the float64 value's own (``given``). R.7: rows of the output that an
    overflow may reach (a query row: that row; a key or value anywhere: every row of the batch
    element), and why. Last, per head, the bound on the relative part of each entry's last
    rounding into the storage format (Theorem A.3‴)."""
    heads, rows = p.num_heads, p.scores[-2]
    xs = {"x_q": np.asarray(p.x_q, np.float64), "x_kv": np.asarray(p.x_kv, np.float64)}
    fmt_in, storage = num.format_of("input"), num.storage_format
    proj, last = {}, {}
    bad_rows = np.zeros((*outer, rows, 1), bool)
    reasons: list[str] = []
    for name, x, wn, bn in (
        ("q", "x_q", "wq", "bq"),
        ("k", "x_kv", "wk", "bk"),
        ("v", "x_kv", "wv", "bv"),
    ):
        x64 = np.broadcast_to(xs[x], (*outer, *xs[x].shape[-2:]))
        lin = linear(x64, np.zeros_like(x64), w[wn], w[bn], num, storage, lam, x_exact=True)
        e_in = rounding_error(x64, fmt_in)
        used = lin.error(e_in)
        bad_in = np.asarray(~(np.abs(x64) + e_in <= fmt_in.max_finite))
        bad, why = linear_overflow(lin, x64, e_in, w[wn], w[bn], num, storage, f"{name} projection")
        if bad_in.any():
            why = [f"{x}: values may overflow the input format {fmt_in.name}", *why]
            bad = bad | bad_in.any(axis=-1, keepdims=True)
        reasons += why
        hit = np.asarray(np.asarray(bad).any(axis=-1, keepdims=True))
        if name != "q":
            hit = np.broadcast_to(hit.any(axis=-2, keepdims=True), bad_rows.shape)
        bad_rows = bad_rows | hit
        proj[name] = (
            split_heads(lin.y, heads),
            split_heads(used + lin.given, heads),
            split_heads(lin.given, heads),
        )
        split = lin.roundings(e_in)
        parts = None if split is None else tuple(split_heads(x, heads) for x in split)
        if p.sink is not None and name != "q":  # the sink's key and value: exact zeros
            proj[name] = tuple(masks.zero_key(x) for x in proj[name])
            parts = None if parts is None else tuple(masks.zero_key(x) for x in parts)
        last[name] = parts
    return proj, bad_rows, reasons, last


def _read_by_the_attention(
    last: dict[str, Any], proj: dict[str, tuple[Any, Any, Any]], num: Numerics
) -> dict[str, Any]:
    """Theorem A.3‴ (papers/attention.md): the attention's dots read the stored ``q̂``, ``k̂``,
    ``v̂`` into their operand format (TF32), ``fl_op(x̂) = x̂(1 + δ)`` with ``|δ| <= u_op`` in its
    normal range: one more relative rounding per entry, of size at most ``u_op(|y| + e) >=
    u_op|x̂|`` (``(y, e, g)`` of step (a)), added to each entry's ``moved`` and, in quadrature,
    to its ``sigma``. The read's underflow ``η_op`` stays in the rest (A.1's step 1 charges
    ``e + u_op(|y| + e) + η_op``). Unchanged without an operand format."""
    u_op = operand_error(num)[0]
    if not u_op:
        return last
    out = {}
    for name, (moved, sigma) in last.items():
        y, e, _ = proj[name]
        with quiet():
            read = u_op * (np.abs(y) + e)
            out[name] = (moved + read, np.hypot(sigma, read))
    return out


def _rotated_projections(
    p: MHAProblem, proj: dict[str, tuple[Any, Any, Any]], num: Numerics
) -> dict[str, tuple[Any, Any, Any]]:
    """Corollary P.6 (papers/rope.md): every head's projected ``q`` and ``k``, ``(y, e, g)`` of
    step (a), rotated. The bound is evaluated on the float64 rotation ``R64(y)`` (Lemma P.3,
    within ``g_R`` of ``R(y)``); the kernel's rotation of its projection ``ŷ`` (within ``e`` of
    ``y``, held in the storage format) is within ``P.1(|y| + e) + spread(e) + g_R`` of it, and
    the stand-in within ``g_R + spread(g)`` of the exact rotation of the exact projection
    (``spread``: :func:`mhanum.rope.rotation_spread`); then one rounding into the storage
    format where the rotation's is wider. A sink's key (exact zeros, after the rotation in
    the kernel) is rotated here at position 0, which only adds P.1's constant."""
    rope, positions = p.rope, p.positions
    assert rope is not None
    assert positions is not None
    storage = num.storage_format
    check_holds(rope, storage, "the projections' storage format")
    rot = rope.format("rotation")
    stored = rot.precision > storage.precision or rot.emin < storage.emin
    keys = positions[1] if p.sink is None else np.append(positions[1], 0)  # the sink's: 0
    out = dict(proj)
    for name, pos in (("q", positions[0]), ("k", keys)):
        y, e, g = proj[name]
        with np.errstate(over="ignore", invalid="ignore"):
            y_rot, g_rot = reference_rope(y, pos, rope)
            e_rot = (
                rope_error(np.abs(y) + e, pos, rope, held=False) + rotation_spread(e, rope) + g_rot
            )
            if stored:  # R: a rotated value that may overflow the storage format: inf
                e_rot = e_rot + storage.u * (np.abs(y_rot) + e_rot) + storage.smallest_normal
                e_rot = np.where(np.abs(y_rot) + e_rot <= storage.max_finite, e_rot, np.inf)
        out[name] = (y_rot, e_rot, g_rot + rotation_spread(g, rope))
    return out


def _heads(
    p: MHAProblem,
    num: Numerics,
    lams: tuple[float | None, float | None],
    proj: dict[str, tuple[Any, Any, Any]],
    keys: tuple[Any, ...],
    known: bool = True,
) -> dict[tuple[int, ...], HeadResult]:
    """Step (b): Theorem A.1 for every head, its operands the projections of step (a) (their
    errors as A.1's step 1 takes them, the float64 values' own as ``given``), with step (c')'s
    values through the output projection's weights as the kernel reads them. ``keys``: the
    attended keys, the bias, the masked and replaced logits, the weights and, for Theorem
    A.3‴, the projections' relative roundings (``None``: not taken)."""
    keep, b, masked, replaced, w, last = keys
    lam, lam_e = lams
    heads = p.num_heads
    c = p.scale_value(num.scale)
    d_v = p.params.v_width // heads
    wo_hat = round_to(w["wo"], num.format_of("input")).astype(np.float64)  # as the kernel reads
    setting = Setting(num, c, p.scale is None, lam, p.softcap, known_rounding=known)
    built = {}
    for i in np.ndindex(*keep.shape[:-3], heads):
        (q, eq, gq), (k, ek, gk), (v, ev, gv) = (proj[n] for n in "qkv")
        cols = slice(i[-1] * d_v, (i[-1] + 1) * d_v)
        with quiet():
            project = None
            if num.kv_splits is None:
                project = _projected_values(v[i], gv[i], wo_hat[cols], num)
            built[i] = Head(
                q[i], k[i], v[i], keep[i], (eq[i], ek[i], ev[i]),
                bias=None if b is None else b[i], given=(gq[i], gk[i], gv[i]),
                masked=None if masked is None else masked[i],
                replaced=None if replaced is None else replaced[i], project=project,
                stored=None if last is None else Stored(
                    (last["q"][0][i], last["k"][0][i], last["v"][0][i]),
                    (last["q"][1][i], last["k"][1][i], last["v"][1][i]),
                    wo_hat[cols], lam_e,
                ),
            )  # fmt: skip
    # every head's chunks of rows side by side (each evaluated as it would be alone)
    return dict(zip(built, evaluate_heads(list(built.values()), setting), strict=True))


def _output_projection(
    results: dict[Any, HeadResult],
    shape: tuple[int, ...],
    w: dict[str, Any],
    num: Numerics,
    lam_group: tuple[float | None, int, float | None],
    reasons: list[str],
    ev: float,
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Steps (c), (c') and (c''): the heads' terms through the output projection, and its own
    error (``output_projection``); the logits and the softmax terms through the weights with
    their signs (steps (c') and (c''), where smaller); then Theorem A.3‴ where the heads carry
    its parts (``lam_group``: ``lam``, the query heads per key/value head and the ``λ`` of
    A.3‴'s per-entry events). Returns the terms, the logits term's parts and the outputs the
    projection may overflow; adds the heads' and the projection's reasons to ``reasons``.
    ``ev``: the float64 evaluation's relative rounding of steps (c') and (c'')'s sums."""
    lam, group, lam_e = lam_group
    names = sorted({name for r in results.values() for name in r[0]})
    head_terms = {
        n: gather(results, lambda r, n=n: r[0].get(n, np.zeros_like(r[1])), shape) for n in names
    }
    sources = sorted({n for r in results.values() for n in r[3]} - {PLAIN, *UNSHAPED})
    head_parts = {
        n: gather(results, lambda r, n=n: r[3].get(n, np.zeros_like(r[1])), shape) for n in sources
    }
    o, o_given = gather(results, lambda r: r[1], shape), gather(results, lambda r: r[2], shape)
    f_o = num.format_of("output")
    out = linear(o, o_given, w["wo"], w["bo"], num, f_o, lam)
    reasons += head_reasons(r[4] for r in results.values())
    o_err = np.sum(list(head_terms.values()), axis=0)
    bad_out, why = linear_overflow(out, o, o_err, w["wo"], w["bo"], num, f_o, "output projection")
    reasons += why
    terms = {f"attention.{n}": out.kappa * (t @ out.slope) for n, t in head_terms.items()}
    logits = {n: out.kappa * (t @ out.slope) for n, t in head_parts.items()}
    if num.kv_splits is None and "logits" in head_terms:
        kept = _through_projection(
            terms["attention.logits"],
            head_terms["logits"] @ out.slope,
            head_sum(results, PROJECTED, shape),
            ev,
        )
        logits = shared(logits, terms["attention.logits"], kept)
        terms["attention.logits"] = kept
    if num.kv_splits is None and "softmax" in head_terms:  # step (c'')
        terms["attention.softmax"] = _through_projection(
            terms["attention.softmax"],
            head_terms["softmax"] @ out.slope,
            head_sum(results, SOFTMAX_PROJECTED, shape),
            ev,
        )
    terms["output_projection"] = out.fixed
    if lam is not None and all(STORED_PARTS[0] in r[3] for r in results.values()):
        read = _read_by_the_projection(o, o_given, w["wo"], out, num)
        own = _projection_roundings(out, o_err)
        across_heads(terms, logits, (results, shape, out, (read, own)), lam_e or lam, group)
    return terms, logits, bad_out


def _projection_roundings(out: Linear, o_err: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Theorem A.3‴: the output projection's own relative roundings (its dot's, its bias's and
    the storage's, :meth:`Linear.roundings`) as increments of the layer's martingale. They come
    last, and each is a rounding times a partial sum fixed by the roundings before it, at most
    A.2 (a)'s ``T_r`` at the head outputs' error ``o_err``. Returns what ``output_projection``
    keeps (the rest: the weights' and the read's rounding, the underflows, where the value
    stored may be below the normal range at that error) and the increments' squared sum
    ``σ²``; ``None`` where A.2 (a) has no such split (a tensor-core dot, a compensated sum).
    Entries whose charge or ``σ`` is not finite keep the whole charge and add nothing."""
    r = out.rounded
    if r is None:
        return None
    with quiet():
        e = o_err @ out.slope
        before = r.before[0] + r.before[1] * e  # E_2 at the heads' error
        low = np.abs(out.y) - out.given - before < r.eta_last[0]
        rest = (r.rest[0] + np.where(low, r.eta_last[1], 0.0)) * (1 + 2.0**-50)
        sigma = r.sigma[0] + r.sigma[1] * e
        var = sigma * sigma * (1 + 2.0**-50)
        usable = np.isfinite(out.fixed) & np.isfinite(var) & (rest < out.fixed)
    return np.where(usable, rest, out.fixed), np.where(usable, var, 0.0)


def _read_by_the_projection(
    o: np.ndarray, o_given: np.ndarray, wo: np.ndarray, out: Any, num: Numerics
) -> tuple[np.ndarray, np.ndarray] | None:
    """Theorem A.3‴: the output projection's read of the head outputs into its operand format,
    ``fl_op(ô_l) = ô_l(1 + δ_l)``, is ``δ_l o*_l ŵ_lm`` (a martingale increment, at most
    ``u_op x̄_l |w̃_lm|`` with ``x̄ = |o| + g >= |o*|``) plus ``δ_l(ô_l - o*_l)ŵ_lm``, which A.2 (a)
    charges in its factor ``κ``. Returns the first part's deterministic charge in
    ``output_projection`` (``u_op x̄|w|``, less: A.2 (a) charges it as ``e_0|w|``) and its
    increments' squared sum ``u_op² x̄²|w̃|²``; ``None`` without an operand format."""
    u_op = operand_error(num)[0]
    if not u_op:
        return None
    x_bar = np.abs(o) + o_given
    with quiet():
        charged = u_op * (x_bar @ np.abs(wo)) * (1 - 2.0**-40)
        var = u_op * u_op * ((x_bar * x_bar) @ (out.slope * out.slope)) * (1 + 2.0**-40)
    return charged, var
