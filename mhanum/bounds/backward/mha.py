"""Theorems B.6 and B.8: componentwise bounds on the error of every gradient of multi-head
attention, grouped-query layers included, and their probabilistic variant (papers/backward.md).

:func:`mha_grad_bound` composes, each step from the enclosures of the one before: (a) the
forward projections, (b) ``dO``, (c) every head's backward by B.1/B.2 and the groups' sums,
(d) the inputs' and the parameters' gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.bounds._result import Bound
from mhanum.bounds.backward.b1 import gradient_bounds, head_chains, with_sink
from mhanum.bounds.backward.inputs import Inputs, inputs
from mhanum.bounds.backward.scope import (
    GradientBounds,
    Statement,
    check_scope,
    check_scores_placement,
)
from mhanum.bounds.enclosure import (
    U64,
    Dot,
    Enclosure,
    Ranges,
    dot_factor,
    f64_dot,
    read_error,
)
from mhanum.bounds.factors import chain, compound, evaluation_rounding, operand_bits, rounding_error
from mhanum.bounds.forward import head_output_bound, merge_heads, split_heads
from mhanum.bounds.forward.stage import Setting
from mhanum.bounds.projections import linear, linear_overflow
from mhanum.bounds.scale import is_power_of_four
from mhanum.bounds.union import lam_or_probability
from mhanum.formats import Format
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward
from mhanum.problem import AttentionProblem, MHAProblem

__all__ = ["MHAGradientBounds", "mha_grad_bound"]


class MHAGradientBounds(NamedTuple):
    """The bounds of one multi-head backward pass (Theorem B.6), one :class:`Bound` per
    gradient of :class:`mhanum.gradients.MHAGradients`: ``dx_q``, ``dx_kv``, ``params`` (a dict
    from the parameter's name, ``"wq"`` ... ``"bo"``, to its gradient's bound; the layer's
    biases only) and ``dbias`` ``(..., H, Lq, Lk)``."""

    dx_q: Bound
    dx_kv: Bound
    params: dict[str, Bound]
    dbias: Bound
    dsink: Bound | None = None


@one_blas_thread
def mha_grad_bound(
    x_q: Any,
    x_kv: Any,
    params: Any,
    num_heads: int,
    d_out: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    sink: Any = None,
    softcap: float | None = None,
    num_kv_heads: int | None = None,
    lam: float | None = None,
    probability: float | None = None,
) -> MHAGradientBounds:
    """Componentwise bounds on the error of every gradient of multi-head attention (Theorems B.6,
    B.8).

    **Theorem B.6.** Let ``g`` be a gradient of ``<d_out, multi_head_attention(x_q, x_kv,
    params, H)>`` (exact: :func:`mhanum.reference.mha_grad`) and ``ĝ`` the one
    :func:`mhanum.emulate.backward.mha_grad` computes with ``numerics`` and ``backward``, or any
    kernel that rounds as they state (``dQ``'s partials added in any order). Under the
    assumptions of Theorems B.1/B.2 (``Bound.assumptions``), ``|ĝ - g| <= total`` entry by
    entry, where ``total`` composes, each step from the enclosures of the one before:

    (a) the forward projections by Theorem A.2 (a) (float64 stand-ins ``q, k, v`` within
    ``given`` of the exact ones; the computed ones within ``fixed + κ e_x·slope``);
    (b) ``dO = fl_out(Ĝ Ŵ_oᵀ)`` by Theorem B.0 and the output rounding;
    (c) every head's backward by Theorem B.1 / B.2 on those enclosures (the operands are read
    into the input format from their storage formats; B.2's ``D`` reads the heads' forward
    output, bounded by A.1 on the same enclosures); with ``num_kv_heads``, a shared key/value
    head's ``dK``, ``dV`` the sum of its group's ``g = H / H_kv`` stored gradients in ``accum``,
    bounded for any order of the additions by

    .. math::

        \\sum_h r_h + \\gamma_{g-1}(u_a) \\sum_h (|dK_h| + r_h) + g\\,2^{e_{min}} + \\text{output
        rounding},\\quad r_h = e_h + \\text{read}(F_{out} \\to F_a);

    (d) ``dx_q = fl_out(dQ̂ Ŵ_qᵀ)``, ``dx_kv = fl_out([dK̂ dV̂] [Ŵ_k Ŵ_v]ᵀ)``, every weight's
    gradient (one dot over the batch's rows: ``x̂ᵀ dQ̂``, ``Ôᵀ Ĝ``) by B.0, and every bias's
    gradient (a sum over the rows in ``accum``, in the numerics' summation order) by Theorem
    S.0, each with its output rounding.

    Every stage's range is a hypothesis checked on the enclosures: a gradient a stage that may
    overflow reaches is ``inf``, with the reason in ``Bound.reasons``.

    **Theorem B.8 (probabilistic).** With ``lam=λ`` (or ``probability=P``, which solves for the
    least ``λ`` with the call's own chain count), every ``γ`` of a sum or dot chain is Theorem
    R.6's ``γ̃_m(λ)``. Under the model that the rounding errors are independent and of mean zero
    (``Bound.assumptions``; exact for stochastic rounding, a model for round to nearest), every
    bound holds at once with probability ``>= 1 - N (1 - P(λ))`` (``Bound.probability``, the
    same on every gradient), ``N`` the union bound's chains, one per term of every sum and dot:
    the forward projections of the grouped weights, ``G W_oᵀ``, every head's B.5 chains, the
    groups' sums, ``dx_q``, ``dx_kv`` and the weights' and biases' gradients. The float64
    evaluation, B.2's forward output, the exponentials, divisions and single roundings stay
    deterministic. Tensor-core dots are refused.

    Args:
        x_q, x_kv, params, num_heads, d_out, mask, bias, scale: as for
            :func:`mhanum.emulate.backward.mha_grad`.
        numerics, backward: as for :func:`mhanum.emulate.backward.mha_grad`.
        sink, softcap: as for :func:`mhanum.emulate.backward.mha_grad`: a sink is one more key
            of every head (B.1/B.2 with it; ``dsink`` bounded as in
            :func:`attention_grad_bound`), a soft-cap enters every head by Theorem B.7.
        num_kv_heads: grouped-query attention, as for
            :func:`mhanum.emulate.backward.mha_grad`: the bounds of ``dx_kv`` and of the grouped
            weights' gradients, through the groups' sums.
        lam, probability: the probabilistic variant (Theorem B.8): ``λ > 0``, or the
            probability ``P`` in ``(0, 1)`` with which every bound holds under the model.

    Returns:
        :class:`MHAGradientBounds` (``dsink``: the sinks' bound, ``(..., H)``, with sinks). Each :class:`Bound`'s terms: ``upstream`` (the error of the
        gradient the last dot reads: ``dQ``, ``dK``/``dV``, ``G``), ``inputs`` (the other
        operand's: weights, inputs, the forward output), ``accumulation`` and ``output``;
        ``dbias`` as :func:`attention_grad_bound`'s.

    Raises:
        InvalidArgument: for bad inputs (named), a row that attends no key in some head, a
            finite masking constant with a mask, the naive softmax, numerics the backward does
            not model, a bad ``num_kv_heads`` (as :meth:`mhanum.MHAParams.expand_kv_heads`),
            both ``lam`` and ``probability``, or ``lam`` with tensor-core dots.

    Examples:
        >>> import numpy as np
        >>> from mhanum import MHAParams
        >>> params = MHAParams.random(8, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((5, 8))
        >>> b = mha_grad_bound(x, x, params, 2, np.ones((5, 8)), numerics="fp32")
        >>> b.dx_q.theorem, b.dx_q.total.shape, sorted(b.params)
        ('B.6', (5, 8), ['bk', 'bo', 'bq', 'bv', 'wk', 'wo', 'wq', 'wv'])
        >>> p = mha_grad_bound(x, x, params, 2, np.ones((5, 8)), numerics="fp32", probability=0.99)
        >>> p.dx_q.theorem, p.dx_q.probability >= 0.99, bool((p.dx_q.total <= b.dx_q.total).all())
        ('B.8', True, True)

    References:
        dao2023; higham2019; papers/backward.md Theorems B.6 and B.8.
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    check_scope(num, bw, "B.6")
    check_scores_placement(num, bw, "B.6")
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, scale=scale, sink=sink,
        softcap=softcap, num_kv_heads=num_kv_heads, d_out=d_out,
    )  # fmt: skip
    num.check_problem(p)
    ly = _layer(p, num, bw, lam, probability)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        proj, e_in = _projections(ly)
        d_o, ag, e_g = _d_out(ly)
        hd = _heads(ly, proj, d_o)
        results = _layer_gradients(ly, hd, e_in, (ag, e_g))
    return _mha_bounds(ly, results, hd.gb.dsink)


class _Failures:
    """Which gradients a stage before or after the heads may make infinite, and why (B.6)."""

    def __init__(self, names: list[str]) -> None:
        self.hit = dict.fromkeys(names, False)
        self.reasons: list[str] = []

    def __call__(
        self, why: list[str] | tuple[str, ...], reaches: tuple[str, ...] | list[str]
    ) -> None:
        if why:
            self.reasons.extend(r for r in why if r not in self.reasons)
            for n in reaches:
                self.hit[n] = True


@dataclasses.dataclass(frozen=True)
class _Layer:
    """Theorem B.6's problem as every step reads it: the problem (its grouped weights
    ``wt`` as given, float64; ``w`` every field of the expanded layer), the numerics, the
    backward, ``λ`` and the chains' count (B.8), the heads per key/value head ``group``, the
    heads' scores' shape ``target`` (a sink's key included), the mask and bias checked as for
    one attention (``x0``), the scale, the float64 ``x_q``, ``x_kv``, ``d_out`` broadcast to the
    batch, and the failures every step records into."""

    p: MHAProblem
    num: Numerics
    bw: Backward
    lam: float | None
    chains: int
    group: int
    target: tuple[int, ...]
    x0: Inputs
    scaling: tuple[float, float]
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray]
    w: dict[str, Any]
    wt: dict[str, np.ndarray]
    fail: _Failures


def _layer(
    p: MHAProblem, num: Numerics, bw: Backward, lam: float | None, probability: float | None
) -> _Layer:
    """B.6's problem from the validated one: the sink's key appended to every head, the chains
    counted and ``λ`` solved (B.8), the mask and bias checked as for one attention."""
    params, full, heads, batch, target = p.grouped, p.params, p.num_heads, p.batch, p.scores
    group = 1 if p.num_kv_heads is None else heads // p.num_kv_heads
    lq = target[-2]
    mask, bias = p.mask, p.bias
    if p.sink is not None:  # one more key per head: zero key and value, bias σ, never masked
        mask, bias, target = masks.head_sinks(mask, bias, p.sink, target)
        batch = tuple(target[:-3])
    xq, xkv, g = (
        np.broadcast_to(np.asarray(a, np.float64), (*batch, *a.shape[-2:]))
        for a in (p.x_q, p.x_kv, p.d_out)
    )
    n_keys = target[-1]
    bw.key_blocks(n_keys)
    chains = _mha_chains(
        params, heads, group, (lq, n_keys), math.prod(batch), bw, p.sink is not None
    )
    lam = lam_or_probability(lam, probability, chains, num)
    if lam is not None and num.dot_kind not in ("ieee", "split"):
        msg = "lam: the probabilistic bound (Theorem B.8) does not cover tensor-core dot units"
        raise InvalidArgument(msg)
    # the mask and the bias, checked as for one attention
    dummy = np.zeros((*target[:-1], 1))
    keys = np.zeros((*target[:-2], n_keys, 1))
    x0 = inputs(AttentionProblem.of(dummy, keys, keys, mask=mask, bias=bias, d_out=dummy), num)
    c64 = V.scale_value(p.scale, params.qk_width // heads, placement=num.scale)
    u64 = 0.0
    if p.scale is None and not is_power_of_four(params.qk_width // heads):
        u64 = compound(U64, over=(U64,))
    # the forward projections of the expanded layer: a grouped key/value head's columns repeated
    # for each query head of its group, the same dots of the same operands (papers/attention.md)
    w: dict[str, Any] = {
        f.name: None if getattr(full, f.name) is None else np.asarray(getattr(full, f.name), np.float64)
        for f in dataclasses.fields(full)
    }  # fmt: skip
    wt = {n: np.asarray(getattr(params, n), np.float64) for n in ("wq", "wk", "wv", "wo")}
    names = ["dx_q", "dx_kv", *(n for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
             if w[n] is not None), "dbias"]  # fmt: skip
    return _Layer(
        p, num, bw, lam, chains, group, target, x0, (c64, u64), (xq, xkv, g), w, wt,
        _Failures(names),
    )  # fmt: skip


def _projections(ly: _Layer) -> tuple[dict[str, tuple[np.ndarray, ...]], dict[str, np.ndarray]]:
    """B.6 (a): the forward projections by Theorem A.2 (a), split into heads: per ``q``, ``k``,
    ``v`` the float64 stand-ins, their radii and the computed ones' errors; and ``|x̂ - x|`` of
    the inputs in the input format."""
    num, w, fail, heads = ly.num, ly.w, ly.fail, ly.p.num_heads
    xq, xkv, _ = ly.arrays
    fin, storage = num.format_of("input"), num.storage_format
    proj = {}
    e_in = {"x_q": rounding_error(xq, fin), "x_kv": rounding_error(xkv, fin)}
    for name, xn, wn, bn in (("q", "x_q", "wq", "bq"), ("k", "x_kv", "wk", "bk"),
                             ("v", "x_kv", "wv", "bv")):  # fmt: skip
        x64 = xq if xn == "x_q" else xkv
        lin = linear(x64, np.zeros_like(x64), w[wn], w[bn], num, storage, ly.lam)
        _, why = linear_overflow(
            lin, x64, e_in[xn], w[wn], w[bn], num, storage, f"{name} projection"
        )
        if not (np.abs(x64) + e_in[xn] <= fin.max_finite).all():
            why = [f"{xn}: values may overflow the input format {fin.name}", *why]
        fail(why, list(fail.hit))
        proj[name] = tuple(split_heads(a, heads) for a in (lin.y, lin.given, lin.error(e_in[xn])))
    return proj, e_in


def _d_out(ly: _Layer) -> tuple[Enclosure, np.ndarray, np.ndarray]:
    """B.6 (b): ``dO = fl_out(Ĝ Ŵ_oᵀ)`` by B.0 and the output rounding: its enclosure, and
    ``|G|``, ``|Ĝ - G|`` of ``d_out`` in the input format."""
    num, fail, wt = ly.num, ly.fail, ly.wt
    fin = num.format_of("input")
    g = ly.arrays[2]
    e_g = rounding_error(g, fin)
    ag, awo, e_wo = np.abs(g), np.abs(wt["wo"]).T, rounding_error(wt["wo"], fin).T
    fail([] if (ag + e_g <= fin.max_finite).all() else
         [f"d_out: values may overflow the input format {fin.name}"], list(fail.hit))  # fmt: skip
    product = _Product(ag, e_g, awo, e_wo, (fin, fin), "d_out woᵀ")
    do_err = sum(_grad_dot(num, product, fail, list(fail.hit), ly.lam).values())
    do_mid = g @ wt["wo"].T
    do_rad = f64_dot(ly.p.params.d_out) * (ag @ awo)
    return Enclosure(do_mid, do_rad, np.asarray(do_err)), ag, e_g


class _Heads(NamedTuple):
    """B.6 (c): the heads' bounds, ``dS``'s and the gradients' enclosures, and their forward
    output: ``|Ô - O|``, the stand-in and its radius."""

    gb: GradientBounds
    dsd: dict[str, np.ndarray]
    eps_o: np.ndarray
    o_mid: np.ndarray
    o_given: np.ndarray


def _heads(ly: _Layer, proj: dict[str, tuple[np.ndarray, ...]], d_o: Enclosure) -> _Heads:
    """B.6 (c): every head's backward by Theorem B.1/B.2 on the projections' enclosures, read
    into the input format from the storage format; B.2's ``D`` reads the heads' forward output
    (A.1, along ``d_out`` by A.1g); with a sink, its row of ``dk``, ``dv`` and its column of
    ``dbias`` dropped."""
    num, bw, fail, p, target = ly.num, ly.bw, ly.fail, ly.p, ly.target
    heads, cap, storage, out = p.num_heads, p.softcap, num.storage_format, num.format_of("output")
    c64, u64 = ly.scaling
    do_mid, do_rad, do_err = d_o.mid, d_o.rad, d_o.err
    if p.sink is not None:  # the sink's key and value: exact zeros
        for n in "kv":
            proj[n] = tuple(masks.zero_key(np.broadcast_to(a, (*target[:-2], *a.shape[-2:])))
                            for a in proj[n])  # fmt: skip
        proj["q"] = tuple(np.broadcast_to(a, (*target[:-2], *a.shape[-2:])) for a in proj["q"])
        do_mid, do_rad, do_err = (
            np.broadcast_to(a, (*target[:-3], *np.shape(a)[-2:]))
            for a in (do_mid, do_rad, np.asarray(do_err))
        )
    (q, rq, eq), (k, rk, ek), (v, rv, ev) = (proj[n] for n in "qkv")
    keep = np.broadcast_to(ly.x0.keep, target)
    hb = None if ly.x0.bias is None else np.broadcast_to(ly.x0.bias, target)
    # the heads' forward output: B.2's D reads it from operands in the input format, the
    # output projection's gradient from the storage format; the larger errors cover both
    rq_, rk_, rv_ = (
        np.asarray(e + read_error(np.abs(m) + r + e, storage, num.format_of("input")))
        for m, r, e in ((q, rq, eq), (k, rk, ek), (v, rv, ev))
    )
    read = (rq_, rk_, rv_)
    g_mid, g_rad = split_heads(do_mid, heads), split_heads(do_rad, heads)
    # B.2's D: the heads' forward error along their d_out (Theorem A.1g)
    along = (g_mid, np.abs(g_mid) + g_rad) if bw.algorithm == "flash2" else None
    setting = Setting(num, c64, p.scale is None, softcap=cap)
    fwd = head_output_bound((q, k, v), keep, hb, setting, read, (rq, rk, rv), along)
    eps_o, o_mid, o_given, fwd_why, o_along = fwd
    fail(fwd_why, list(fail.hit))
    heads_in = Inputs(
        q, k, v, g_mid, keep, hb, c64, u64,
        given=(rq, rk, rv, g_rad),
        errors=(eq, ek, ev, split_heads(np.asarray(do_err), heads)),
        sources=(storage, storage, storage, out),
        forward=(eps_o, fwd_why, o_along), sink=p.sink is not None, cap=cap, scale=p.scale,
    )  # fmt: skip
    gb, dsd = gradient_bounds(heads_in, num, bw, ly.lam, ly.chains)
    if p.sink is not None:  # the sink's row of dk and dv, and its column of dbias, dropped
        gb = with_sink(gb, dsd, num, bw, ly.lam)
        dsd = {**dsd, "dk_up": dsd["dk_up"][..., :-1, :], "dv_up": dsd["dv_up"][..., :-1, :]}
    for n, reach in (("dq", ("dx_q", "wq", "bq")), ("dk", ("dx_kv", "wk", "bk")),
                     ("dv", ("dx_kv", "wv", "bv")), ("dbias", ("dbias",))):  # fmt: skip
        b = getattr(gb, n)
        if not np.isfinite(b.total).all():
            fail(b.reasons or (f"{n}: infinite",), [r for r in reach if r in fail.hit])
    return _Heads(gb, dsd, eps_o, o_mid, o_given)


def _layer_gradients(
    ly: _Layer, hd: _Heads, e_in: dict[str, np.ndarray], g: tuple[np.ndarray, np.ndarray]
) -> dict[str, dict[str, np.ndarray]]:
    """B.6 (c)-(d): the heads' ``dQ``, ``dK``, ``dV`` merged (a shared key/value head's summed
    over its group), then ``dx_q``, ``dx_kv``, every weight's gradient by B.0 and every bias's
    by Theorem S.0; the terms of each."""
    num, fail, wt, lam, gb, dsd = ly.num, ly.fail, ly.wt, ly.lam, hd.gb, hd.dsd
    fin, out = num.format_of("input"), num.format_of("output")
    xq, xkv, _ = ly.arrays
    dq = (merge_heads(dsd["dq_up"]), merge_heads(np.asarray(gb.dq.total)))
    dk, dv = (
        tuple(merge_heads(a) for a in _group_sum(
            dsd[f"{n}_up"], np.asarray(getattr(gb, n).total), ly.group, num, lam, n, fail,
            tuple(r for r in ("dx_kv", f"w{n[1]}", f"b{n[1]}") if r in fail.hit),
        ))
        for n in ("dk", "dv")
    )  # fmt: skip
    ws = {n: (np.abs(wt[n]).T, rounding_error(wt[n], fin).T) for n in ("wq", "wk", "wv")}
    kv = (
        np.concatenate([dk[0], dv[0]], -1), np.concatenate([dk[1], dv[1]], -1),
        np.concatenate([ws["wk"][0], ws["wv"][0]], 0),
        np.concatenate([ws["wk"][1], ws["wv"][1]], 0),
    )  # fmt: skip
    results = {
        "dx_q": _grad_dot(num, _Product(*dq, *ws["wq"], (out, fin), "dQ wqᵀ"), fail, ("dx_q",)),
        "dx_kv": _grad_dot(num, _Product(*kv, (out, fin), "[dK dV] [wk wv]ᵀ"), fail, ("dx_kv",)),
    }  # fmt: skip
    o_up = merge_heads(np.abs(hd.o_mid) + hd.o_given)
    o_err = merge_heads(hd.eps_o)
    for n, a, a_err, b_, where in (
        ("wq", np.abs(xq), e_in["x_q"], dq, "x_qᵀ dQ"),
        ("wk", np.abs(xkv), e_in["x_kv"], dk, "x_kvᵀ dK"),
        ("wv", np.abs(xkv), e_in["x_kv"], dv, "x_kvᵀ dV"),
        ("wo", o_up, o_err, g, "Oᵀ G"),
    ):
        fmts = (fin, out) if n != "wo" else (out, fin)
        product = _Product(
            _rows(a).T, _rows(a_err).T, _rows(b_[0]), _rows(b_[1]), fmts, where, swap=True
        )
        results[n] = _grad_dot(num, product, fail, (n,), lam)
    for n, grad in (("bq", dq), ("bk", dk), ("bv", dv), ("bo", g)):
        if ly.w[n] is not None:
            results[n] = _grad_sum(num, _rows(grad[0]), _rows(grad[1]), n, fail, lam)
    own_b = np.asarray(gb.dbias.terms.get("output", 0.0))
    results["dbias"] = {"dS": np.asarray(gb.dbias.terms.get("dS", 0.0)), "output": own_b}
    return results


def _mha_bounds(
    ly: _Layer, results: dict[str, dict[str, np.ndarray]], dsink: Bound | None
) -> MHAGradientBounds:
    """B.6/B.8's statement on every gradient: ``inf`` where a stage that reaches it may
    overflow, the reasons where a bound is not finite; one event covers every gradient, the
    sinks' included."""
    fail, lam = ly.fail, ly.lam
    theorem = "B.6" if lam is None else "B.8"
    statement = Statement.of(theorem, lam, ly.chains, ly.num)
    bounds = {}
    for n, terms in results.items():
        terms = {t: np.asarray(val, np.float64) for t, val in terms.items()}
        total = sum(terms.values())
        total = np.where(np.isnan(total), np.inf, total)
        if fail.hit[n]:
            total = np.full(np.shape(total), np.inf)
        bounds[n] = Bound(
            total=total,
            terms=terms,
            theorem=theorem,
            assumptions=statement.assumptions,
            source="dao2023",
            probability=statement.probability,
            reasons=tuple(fail.reasons) if not np.isfinite(total).all() else (),
            lam=lam,
        )
    dsink = _finite_or_hit(dsink, fail.hit["dbias"], fail.reasons)
    if dsink is not None:  # one event covers every gradient, the sinks' included
        dsink = dataclasses.replace(
            dsink, theorem=theorem, assumptions=statement.assumptions,
            probability=statement.probability, lam=lam,
        )  # fmt: skip
    return MHAGradientBounds(
        bounds["dx_q"],
        bounds["dx_kv"],
        {n: bounds[n] for n in fail.hit if n not in ("dx_q", "dx_kv", "dbias")},
        bounds["dbias"],
        dsink,
    )


def _rows(x: np.ndarray) -> np.ndarray:
    """The rows of every batch element, one after another."""
    return x.reshape(-1, x.shape[-1])


def _finite_or_hit(bound: Bound | None, hit: bool, reasons: list[str]) -> Bound | None:
    """A head stage's bound (``dsink``), infinite where a stage before the heads may overflow."""
    if bound is None or not hit:
        return bound
    total = np.full(np.shape(bound.total), np.inf)
    return dataclasses.replace(bound, total=total, reasons=tuple(reasons), theorem="B.6")


@dataclasses.dataclass(frozen=True)
class _Product:
    """``fl_out(Â B̂)`` of one gradient: ``|A| <= a_up``, ``|Â - A| <= a_err`` (``B`` likewise),
    read from the formats ``fmts``; the stage's name; ``swap``: the gradient operand is ``B``."""

    a_up: np.ndarray
    a_err: np.ndarray
    b_up: np.ndarray
    b_err: np.ndarray
    fmts: tuple[Format, Format]
    stage: str
    swap: bool = False


def _grad_dot(
    num: Numerics,
    product: _Product,
    fail: Any,
    reaches: tuple[str, ...] | list[str],
    lam: float | None = None,
) -> dict[str, np.ndarray]:
    """B.0 for ``product``; the terms ``upstream`` (the gradient operand's error: ``a``'s, or
    ``b``'s with ``swap``), ``inputs``, ``accumulation`` and ``output``."""
    a_up, a_err, b_up, b_err = product.a_up, product.a_err, product.b_up, product.b_err
    fmts, stage, swap = product.fmts, product.stage, product.swap
    acc, out = num.format_of("accum"), num.format_of("output")
    n = a_up.shape[-1]
    bits = (operand_bits(num, fmts[0]), operand_bits(num, fmts[1]))
    f, eta, _ = dot_factor(num, n, None, bits, lam)
    from_a, from_b, accumulation = Dot(num)(a_up, a_err, b_up, b_err, f, eta)
    rng = Ranges()
    rng.operands(num, a_up + a_err, b_up + b_err, stage, ("dq",))
    rng.check(
        (1 + f) * ((a_up + a_err) @ (b_up + b_err)) + eta, acc, f"{stage} accumulated", ("dq",)
    )
    up = (a_up @ b_up) * (1 + evaluation_rounding(n))
    err = from_a + from_b + accumulation
    own = read_error(up + err, acc, out) + 0 * up
    rng.check(up + err + own, out, f"{stage} rounded to {out.name}", ("dq",))
    fail(rng.reasons, reaches)
    upstream, inputs = (from_b, from_a) if swap else (from_a, from_b)
    return {"upstream": upstream, "inputs": inputs, "accumulation": accumulation, "output": own}


def _grad_sum(
    num: Numerics, up: np.ndarray, err: np.ndarray, name: str, fail: Any, lam: float | None = None
) -> dict[str, np.ndarray]:
    """Theorem S.0 for a bias's gradient ``fl_out(Σ_rows x̂)``: the stored gradients ``x̂``
    (``|x̂ - x| <= err``, ``|x| <= up``, ``(N, n)``) read into ``accum`` and summed over the
    ``N`` rows in the numerics' order."""
    acc, out = num.format_of("accum"), num.format_of("output")
    rows = up.shape[0]
    read = err + read_error(up + err, out, acc)
    factor = chain(rows, num.summation, acc.u, lam, products=False)
    ev = 1 + evaluation_rounding(rows)
    carried = read.sum(axis=0) * ev
    accumulation = factor * (up + read).sum(axis=0) * ev + rows * acc.smallest_normal
    total_up = up.sum(axis=0) * ev
    own = read_error(total_up + carried + accumulation, acc, out) + 0 * total_up
    why = []
    for fmt in (acc, out):
        if not (total_up + carried + accumulation + own <= fmt.max_finite).all():
            why.append(f"{name}: the sum over the rows may overflow {fmt.name}")
    fail(why, (name,))
    return {"upstream": carried, "accumulation": accumulation, "output": own}


def _group_sum(
    up: np.ndarray,
    err: np.ndarray,
    group: int,
    num: Numerics,
    lam: float | None,
    name: str,
    fail: Any,
    reaches: tuple[str, ...],
) -> tuple[np.ndarray, np.ndarray]:
    """A shared key/value head's gradient ``fl_out(Σ_h x̂_h)`` over its ``group`` query heads
    (``(..., H, L, d)`` to ``(..., H / group, L, d)``): the stored ``x̂_h`` (``|x̂_h - x_h| <=
    err``, ``|x_h| <= up``) read into ``accum`` and added **in any order**, each through at most
    ``group - 1`` additions (``γ_{group-1}``), then rounded to ``output_format``. ``(up, err)``
    of the sums; one head per group is no sum."""
    if group == 1:
        return up, err
    acc, out = num.format_of("accum"), num.format_of("output")

    def split(x: np.ndarray) -> np.ndarray:
        return x.reshape(*x.shape[:-3], x.shape[-3] // group, group, *x.shape[-2:])

    up, err = split(up), split(err)
    read = err + read_error(up + err, out, acc)
    factor = chain(group, "sequential", acc.u, lam, products=False)
    ev = 1 + evaluation_rounding(group)
    total_up = up.sum(axis=-3) * ev
    carried = read.sum(axis=-3) * ev
    accumulation = factor * (up + read).sum(axis=-3) * ev + group * acc.smallest_normal
    own = read_error(total_up + carried + accumulation, acc, out) + 0 * total_up
    why = []
    for fmt in (acc, out):
        if not (total_up + carried + accumulation + own <= fmt.max_finite).all():
            why.append(f"{name}: the sum over a key/value head's group may overflow {fmt.name}")
    fail(why, reaches)
    return total_up, carried + accumulation + own


def _mha_chains(
    params: Any,
    heads: int,
    group: int,
    lengths: tuple[int, int],
    batch: int,
    bw: Backward,
    sink: bool,
) -> int:
    """The rounding chains of a multi-head backward pass (Theorem B.8), one per term of every
    sum and dot: the forward projections of the grouped weights (``x_q W_q``, ``x_kv W_k``,
    ``x_kv W_v``), ``G W_oᵀ``, every head's (:func:`head_chains`, ``lengths`` = ``(L_q, n)``
    with ``n`` the keys, a sink's included), the groups' sums of ``dK`` and ``dV``, ``dx_q``,
    ``dx_kv``, the weights' gradients (dots over the batch's rows) and the biases'."""
    lq, n = lengths
    keys = n - 1 if sink else n
    d_q, d_kv, d_o = params.d_q, params.d_kv, params.d_out
    qk, v_w = params.qk_width, np.shape(params.wo)[0]
    kv_qk, kv_v = np.shape(params.wk)[-1], np.shape(params.wv)[-1]
    per_row = (
        lq * qk * d_q  # q projection
        + keys * (kv_qk + kv_v) * d_kv  # k, v projections
        + lq * v_w * d_o  # dO = G W_oᵀ
        + heads * head_chains(lq, n, qk // heads, v_w // heads, bw.algorithm == "flash2", sink)
        + (keys * (kv_qk + kv_v) * group if group > 1 else 0)  # the groups' sums
        + lq * d_q * qk  # dx_q
        + keys * d_kv * (kv_qk + kv_v)  # dx_kv
    )
    weights = lq * (d_q * qk + v_w * d_o) + keys * d_kv * (kv_qk + kv_v)
    biases = {"bq": lq * qk, "bk": keys * kv_qk, "bv": keys * kv_v, "bo": lq * d_o}
    sums = sum(c for b, c in biases.items() if getattr(params, b) is not None)
    return int(batch * (per_row + weights + sums))
