"""The backward pass of attention in JAX, every rounding the one ``Numerics`` and ``Backward`` name.

``attention_grad(q, k, v, d_out, ..., numerics=..., backward=...)`` runs the forward pass of
:func:`mhanum.attention` with ``numerics`` and then the backward algorithm of
:class:`mhanum.numerics.Backward`: the textbook backward (autograd through the math path, from
the stored probabilities) or FlashAttention-2's (probabilities recomputed from the stored
log-sum-exp, ``D = rowsum(dO ∘ O)``, ``dQ`` summed from one partial per key block in the order
``backward.dq_order``, so that the run-to-run differences of atomic adds are reproduced bit for
bit). :func:`mhanum.bounds.backward.attention_grad_bound` bounds the error of every gradient
against :func:`mhanum.reference.attention_grad`, for every order of the ``dQ`` additions.

**Mask convention: True means attend**, as for :func:`mhanum.attention`. A row with no attended
key has no gradient: the textbook backward gives NaN there under ``-inf`` masking (as autograd
does); FlashAttention-2 gives 0 (its log-sum-exp is ``-inf`` and its probabilities 0).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mhanum import masks
from mhanum.emulate._arith import Arith, runtime_zero, to_format
from mhanum.emulate.attention import (
    Stages,
    attend,
    check_x64,
    head_logit_inputs,
    host_round,
    merge_heads,
    partial_attention,
    project,
    scaled_operands,
    softcap_tanh,
    split_heads,
    stage_logits,
    stage_probabilities,
)
from mhanum.emulate.constants import LOG2E, Const, Constants
from mhanum.emulate.summation import sum_with
from mhanum.gradients import Gradients, MHAGradients
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward
from mhanum.params import MHAParams
from mhanum.problem import AttentionProblem, MHAProblem

if TYPE_CHECKING:
    from mhanum._types import ArrayLike
    from mhanum.formats import Format
    from mhanum.masks import Band

__all__ = ["attention_grad", "mha_grad"]


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """``x`` cut along ``axis`` into zero-padded blocks of ``block``, stacked on a new axis 0."""
    axis = axis % x.ndim
    count = -(-x.shape[axis] // block)
    x = _pad_to(x, axis, count * block)
    x = x.reshape(*x.shape[:axis], count, block, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _running(
    st: Stages, a_blocks: jax.Array, b_blocks: jax.Array, scale: Const | None = None
) -> jax.Array:
    """``Σ_b a_b b_b``: each block's dot on the dot unit (times ``fl_acc(scale)`` when given,
    ``Backward.scale_at="partials"``), added to the running sum in block order
    (FlashAttention-2's ``dK`` and ``dV`` over query blocks); the first block's dot is the sum."""
    ar = st.acc

    def part(a: jax.Array, b: jax.Array) -> jax.Array:
        x = st.dot(a, b)
        return x if scale is None else ar.mul(x, st.constant(ar, scale))

    def step(acc: jax.Array, blk: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return ar.add(acc, part(*blk)), None

    first = part(a_blocks[0], b_blocks[0])
    return lax.scan(step, first, (a_blocks[1:], b_blocks[1:]))[0]


def _dp(acc: jax.Array, fmt: Format | None) -> jax.Array:
    """``dP``'s dot result, rounded to ``Backward.dp_format`` where one is given."""
    return acc if fmt is None else to_format(acc, fmt)


def _finish(st: Stages, acc: jax.Array, scale: Const | None) -> jax.Array:
    """``fl_out(fl_acc(acc·ĉ))`` with ``ĉ = fl_acc(scale)``, or ``fl_out(acc)``."""
    if scale is not None:
        acc = st.acc.mul(acc, st.constant(st.acc, scale))
    return to_format(acc, st.output)


def gradient_factors(placement: str) -> tuple[Const | None, Const | None]:
    """The factors ``dq`` and ``dk`` are multiplied by after their dots (``None``: none): the
    scale on the scores, ``(c, c)``; on ``q``, ``(c, None)`` (``dk``'s dot reads the scaled
    ``q``); ``sqrt(c)`` on ``q`` and ``k``, ``(sqrt(c), sqrt(c))``.

    Examples:
        >>> [c and c.value for c in gradient_factors("q") + gradient_factors("qk")]
        ['c', None, 'sqrt(c)', 'sqrt(c)']
    """
    if placement == "q":
        return Const.SCALE, None
    if placement == "qk":
        return Const.SQRT_SCALE, Const.SQRT_SCALE
    return Const.SCALE, Const.SCALE


def _cap_slope(
    st: Stages, gr: Arith, q: jax.Array, k: jax.Array, scale: Const | float
) -> jax.Array:
    """``σ̂ = fl(1 - fl(t̂·t̂))`` in the gradient format, ``t̂`` the forward's soft-cap ``tanh``
    (autograd's ``tanh`` backward, from its output)."""
    sc = st.score
    raw = sc.mul(sc.take(st.dot(q, _t(k))), st.constant(sc, scale))
    t = gr.take(softcap_tanh(st, raw))
    return gr.sub(jnp.ones_like(t), gr.mul(t, t))


def _capped(
    st: Stages, gr: Arith, ds: jax.Array, slope: jax.Array | None, scale: Const | None = None
) -> jax.Array:
    """The gradient of the scaled scores ``dA = fl(fl(fl(dS·ĉ)·σ̂)·r̂)`` through the soft-cap
    ``c·tanh(a/c)`` (autograd: the product by ``ĉ``, ``tanh``'s backward, the product by
    ``r̂ = fl(1/c)``); ``dS`` itself without a cap. With ``scale`` (``Backward.scale_at="ds"``)
    the gradient of the unscaled scores ``fl(dA·fl(scale))``, all in the gradient format."""
    if slope is not None:
        ds = gr.mul(gr.mul(ds, st.constant(gr, Const.CAP)), slope)
        ds = gr.mul(ds, st.constant(gr, Const.INV_CAP))
    return ds if scale is None else gr.mul(ds, st.constant(gr, scale))


def _textbook(
    st: Stages,
    gr: Arith,
    ds_fmt: Format,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    s: jax.Array,
    slope: jax.Array | None = None,
    on_ds: Const | None = None,
    dp_fmt: Format | None = None,
) -> tuple[jax.Array, ...]:
    p = to_format(stage_probabilities(st, s), st.prob)  # the stored probabilities
    dv = st.dot(_t(p), g)
    dp = gr.take(_dp(st.dot(g, _t(v)), dp_fmt))
    pg = gr.take(p)
    d = sum_with(gr, gr.mul(dp, pg), st.num.summation, keepdims=True)
    ds = gr.mul(pg, gr.sub(dp, d))
    ds_r = to_format(_capped(st, gr, ds, slope, on_ds), ds_fmt)
    return st.dot(ds_r, k), st.dot(_t(ds_r), q), dv, ds


def _flash2(
    st: Stages,
    gr: Arith,
    ds_fmt: Format,
    bw: Backward,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    s: jax.Array,
    slope: jax.Array | None = None,
    on_ds: Const | None = None,
    dp_fmt: Format | None = None,
    on_parts: Const | None = None,
) -> tuple[jax.Array, ...]:
    sm = st.soft
    lse, o = partial_attention(st, s, v)  # the forward's log-sum-exp and output
    o = to_format(o, st.output)
    d = sum_with(gr, gr.mul(gr.take(g), gr.take(o)), st.num.summation, keepdims=True)
    empty = jnp.isneginf(lse)
    lse = jnp.where(empty, jnp.zeros_like(lse), lse)
    if st.folded:  # FlashAttention-2's exp2: P = exp2(fl(fl(t·c2) - fl(lse·fl(log2 e))))
        assert st.c2 is not None
        top = sm.mul(lse, st.constant(sm, LOG2E))
        arg = sm.sub(sm.mul(sm.take(s), st.c2), top)
        p = jnp.where(empty, jnp.zeros_like(arg), sm.exp2(arg))
    else:
        arg = sm.sub(sm.take(s), lse)
        p = jnp.where(empty, jnp.zeros_like(arg), sm.exp(arg))
    dp = gr.take(_dp(st.dot(g, _t(v)), dp_fmt))
    ds = gr.mul(gr.take(p), gr.sub(dp, d))
    ds_r = to_format(_capped(st, gr, ds, slope, on_ds), ds_fmt)
    p_r = to_format(p, st.prob)
    n_keys = k.shape[-2]
    # dV, dK: over query blocks, in order; dQ: one partial per key block, added in dq_order
    dv = _running(st, _blocks(_t(p_r), -1, bw.block_q), _blocks(g, -2, bw.block_q))
    dk = _running(st, _blocks(_t(ds_r), -1, bw.block_q), _blocks(q, -2, bw.block_q), on_parts)
    parts = jax.vmap(st.dot)(_blocks(ds_r, -1, bw.block_k), _blocks(k, -2, bw.block_k))
    if on_parts is not None:
        parts = st.acc.mul(parts, st.constant(st.acc, on_parts))
    order = jnp.asarray(bw.key_blocks(n_keys))
    parts = parts[order]

    def add(acc: jax.Array, part: jax.Array) -> tuple[jax.Array, None]:
        return st.acc.add(acc, part), None

    dq = lax.scan(add, parts[0], parts[1:])[0]
    return dq, dk, dv, ds


def _core(
    st: Stages,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    mask: Band | jax.Array | None,
    bias: jax.Array | None,
    backward: Backward,
    sink: bool,
) -> tuple[jax.Array, ...]:
    """The backward of one attention from operands already in the input format: ``(dq, dk, dv,
    dbias[, dsink])`` in the output format."""
    numerics = st.num
    grad_fmt, ds_fmt = backward.formats(numerics)
    gr = Arith(grad_fmt, st.acc.guard)
    s = stage_logits(st, q, k, mask, bias)
    # the dots of dq and dk read the operands the logits' dot read (the scaled ones when the
    # scale is on q, or on q and k), and their gradients are multiplied by the factor again
    q, k = scaled_operands(st, q, k)
    f_q, f_k = gradient_factors(numerics.scale)
    on_ds = None
    if backward.scale_at == "ds":  # dS times the scale before the dots, and nothing after
        on_ds, f_q, f_k = Const.SCALE, None, None
    on_parts = None
    if backward.scale_at == "partials" and backward.algorithm == "flash2":
        on_parts, f_q, f_k = Const.SCALE, None, None  # each block's partial times the scale
    batch = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-2])
    q, k, v, g = (jnp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v, g))
    s = jnp.broadcast_to(s, (*batch, *s.shape[-2:]))
    slope = None
    if st.consts.capped:
        on_scores = Const.SCALE if numerics.scale == "scores" else 1.0
        slope = jnp.broadcast_to(_cap_slope(st, gr, q, k, on_scores), s.shape)
    if backward.algorithm == "textbook":
        dq, dk, dv, ds = _textbook(
            st, gr, ds_fmt, q, k, v, g, s, slope, on_ds, backward.dp_rounding()
        )
    else:
        dq, dk, dv, ds = _flash2(
            st, gr, ds_fmt, backward, q, k, v, g, s, slope, on_ds, backward.dp_rounding(),
            on_parts,
        )  # fmt: skip
    dtype = st.output.jax_dtype
    grads = (
        _finish(st, dq, f_q).astype(dtype),
        _finish(st, dk, f_k).astype(dtype),
        _finish(st, dv, None).astype(dtype),
        to_format(ds, st.output).astype(dtype),
    )
    if not sink:
        return grads
    # the sink's logit: the sum of its column of dS (the last key), row after row in accum
    column = jnp.moveaxis(st.acc.take(ds[..., -1]), -1, 0)

    def add(total: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return st.acc.add(total, x), None

    dsink = lax.scan(add, column[0], column[1:])[0]
    return (
        grads[0],
        grads[1][..., :-1, :],
        grads[2][..., :-1, :],
        grads[3][..., :-1],
        to_format(dsink, st.output).astype(dtype),
    )


@functools.partial(jax.jit, static_argnames=("numerics", "backward", "sink"))
def _grad_jit(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    mask: jax.Array,
    bias: jax.Array,
    consts: Constants,
    *,
    numerics: Numerics,
    backward: Backward,
    sink: bool = False,
) -> tuple[jax.Array, ...]:
    st = Stages(numerics, runtime_zero(q), consts)
    q, k, v, g = (to_format(x, st.input) for x in (q, k, v, g))
    return _core(st, q, k, v, g, mask, bias, backward, sink)


def attention_grad(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
    mask: Band | ArrayLike | None = None,
    *,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    sink: ArrayLike | None = None,
    softcap: float | None = None,
) -> Gradients:
    """The gradients of ``<d_out, attention(q, k, v)>`` with explicit numerics.

    .. math::

        dV = P^\\top G,\\quad dS = P \\circ (G V^\\top - D),\\quad
        dQ = c\\, dS\\, K,\\quad dK = c\\, dS^\\top Q,\\quad dB = dS

    with ``P`` the forward's probabilities, ``G = d_out``, ``c`` the scale and ``D`` the row
    vector ``rowsum(dP ∘ P)`` (textbook) or ``rowsum(G ∘ O)`` (FlashAttention-2), every stage
    rounded as :class:`mhanum.numerics.Backward` states.

    Args:
        q, k, v, mask, bias, scale, numerics: as for :func:`mhanum.attention` (the scale on the
            scores, ``exp_form="exp"``, or ``"exp2-folded"`` with the FlashAttention-2 backward,
            no split-KV: other numerics are refused by name). With ``"exp2-folded"`` the
            backward recomputes ``P = exp2(fl(fl(t·c2) - fl(lse·fl(log2 e))))`` from the
            unscaled scores ``t`` and the forward's ``lse``, as FlashAttention-2's
            ``scale_apply_exp2`` does (flash_bwd_kernel.h).
        d_out: the output's cotangent ``(..., Lq, d_v)``, rounded to ``numerics.input``.
        backward: a :class:`mhanum.numerics.Backward` or an algorithm name (``"textbook"``,
            ``"flash2"``); default textbook.
        sink: optional attention-sink logits, as for :func:`mhanum.attention` (one more key with
            value 0 and bias ``σ``): its gradient ``dsink`` is the sum of that key's column of
            ``dS``, added row after row in ``accum``, then rounded to ``output_format``.
        softcap: optional logit soft-cap ``c > 0``, as for :func:`mhanum.attention`: ``dQ`` and
            ``dK`` read ``dA = fl(fl(fl(dS·ĉ)·σ̂)·r̂)`` instead of ``dS``, with ``σ̂ = fl(1 -
            fl(t̂²))`` from the forward's ``tanh`` output ``t̂`` (autograd through
            ``c·tanh(a/c)``; ``ĉ = fl(c)``, ``r̂ = fl(1/c)``, all in the gradient format);
            ``dbias`` is ``dS`` (the bias is added after the cap).

    Returns:
        :class:`mhanum.gradients.Gradients` ``(dq, dk, dv, dbias)`` (and ``dsink``, shaped like
        the batch, with a sink), each broadcast to the batch and in the dtype that stores
        ``numerics.output_format``.

    Raises:
        InvalidArgument: for bad inputs (named, as :func:`mhanum.attention`), a ``d_out`` not
            shaped like the output, or a ``dq_order`` that is not a permutation of the key
            blocks.

    Examples:
        >>> import numpy as np
        >>> from mhanum.numerics import Backward
        >>> q = k = v = np.eye(4)
        >>> a = attention_grad(q, k, v, np.ones((4, 4)), backward=Backward("flash2", block_k=2))
        >>> b = attention_grad(q, k, v, np.ones((4, 4)),
        ...                    backward=Backward("flash2", block_k=2, dq_order=(1, 0)))
        >>> a.dq.shape, bool(np.all(np.abs(a.dq - b.dq) <= 1e-6))
        ((4, 4), True)
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    bw.check_forward(num)
    check_x64(num)
    p = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, d_out=d_out
    )
    num.check_problem(p)
    qa, ka, va, ga, m, b = p.q, p.k, p.v, p.d_out, p.mask, p.bias
    if p.sink is not None:
        xp = jnp if any(isinstance(x, jax.Array) for x in (qa, ka, va, p.sink)) else np
        ka, va, m, b = masks.with_sink(qa, ka, va, m, b, p.sink, xp=xp)
    bw.key_blocks(ka.shape[-2])
    if b is not None:
        b = host_round(b, num.format_of("score"))
    fmt = num.format_of("input")
    qa, ka, va, ga = (host_round(x, fmt) for x in (qa, ka, va, ga))
    consts = Constants.of(num, p.scale_value(num.scale), p.softcap, *bw.formats(num)[:1])
    out = _grad_jit(
        qa, ka, va, ga, m, b, consts, numerics=num, backward=bw, sink=p.sink is not None
    )
    return Gradients(*out)


def _rows(x: jax.Array) -> jax.Array:
    """``(..., L, n)`` as ``(N, n)``: the batch's rows, batch-major, for a weight's gradient."""
    return x.reshape(-1, x.shape[-1])


def _group_sum(st: Stages, x: jax.Array, group: int) -> jax.Array:
    """The gradients ``(..., H, L, d)`` of ``H`` query heads, stored in ``output_format``, summed
    over each group of ``group`` consecutive heads into ``(..., H / group, L, d)``: read into
    ``accum``, added in head order, rounded to ``output_format`` (FlashAttention-2's ``mha_bwd``:
    ``dk_expanded`` in the inputs' dtype, then ``at::sum_out`` over the groups; autograd through
    a ``repeat_interleave`` of ``k``, ``v``). One head per group is no sum."""
    if group == 1:
        return x
    parts = st.acc.take(x)
    parts = parts.reshape(*x.shape[:-3], x.shape[-3] // group, group, *x.shape[-2:])
    total = parts[..., 0, :, :]
    for j in range(1, group):
        total = st.acc.add(total, parts[..., j, :, :])
    return to_format(total, st.output).astype(x.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("num_heads", "group", "numerics", "backward", "sink"),
)
def _mha_grad_jit(
    x_q: jax.Array,
    x_kv: jax.Array,
    params: MHAParams,
    g: jax.Array,
    mask: Band | jax.Array | None,
    bias: jax.Array | None,
    consts: Constants,
    *,
    num_heads: int,
    group: int,
    numerics: Numerics,
    backward: Backward,
    sink: bool = False,
) -> tuple[Any, ...]:
    st = Stages(numerics, runtime_zero(x_q), consts)
    x_q, x_kv, g = (to_format(x, st.input) for x in (x_q, x_kv, g))
    p = jax.tree_util.tree_map(lambda w: to_format(w, st.input), params)
    # the forward, as multi_head_attention computes it; a grouped key/value head repeated for
    # each query head of its group (the same values as the expanded projection's)
    q = split_heads(project(st, x_q, p.wq, p.bq, st.storage), num_heads)
    k, v = (
        jnp.repeat(split_heads(project(st, x_kv, w, b, st.storage), num_heads // group), group, -3)
        for w, b in ((p.wk, p.bk), (p.wv, p.bv))
    )
    if sink:  # the sink's key and value: zeros, the last of every row (masks.with_sink)
        k, v = masks.zero_key(k, xp=jnp), masks.zero_key(v, xp=jnp)
    o = merge_heads(attend(st, q, k, v, mask, bias))
    out = st.output

    def grad_dot(a: jax.Array, b: jax.Array) -> jax.Array:
        return to_format(st.dot(a, b), out)

    def grad_sum(x: jax.Array) -> jax.Array:  # a bias's gradient: Σ over the batch's rows
        return to_format(sum_with(st.acc, _t(_rows(x)), numerics.summation), out)

    # the heads' cotangent, then every head's backward from its own operands
    d_o = grad_dot(g, _t(p.wo))
    qi, ki, vi, gi = (to_format(x, st.input) for x in (q, k, v, split_heads(d_o, num_heads)))
    heads = _core(st, qi, ki, vi, gi, mask, bias, backward, sink)
    dq = merge_heads(heads[0])
    dk, dv = (merge_heads(_group_sum(st, x, group)) for x in heads[1:3])
    dbias = heads[3]
    dsink = heads[4].astype(out.jax_dtype) if sink else None
    # the inputs: dx_kv is one dot over [dK dV] against [wk wv] (a packed in-projection)
    dx_q = grad_dot(dq, _t(p.wq))
    dx_kv = grad_dot(jnp.concatenate([dk, dv], -1), _t(jnp.concatenate([p.wk, p.wv], -1)))
    grads: dict[str, jax.Array | None] = {
        "wq": grad_dot(_t(_rows(x_q)), _rows(dq)),
        "wk": grad_dot(_t(_rows(x_kv)), _rows(dk)),
        "wv": grad_dot(_t(_rows(x_kv)), _rows(dv)),
        "wo": grad_dot(_t(_rows(o)), _rows(g)),
    }
    for name, d in (("bq", dq), ("bk", dk), ("bv", dv), ("bo", g)):
        grads[name] = None if getattr(p, name) is None else grad_sum(d)
    dtype = out.jax_dtype
    cast = {n: None if a is None else a.astype(dtype) for n, a in grads.items()}
    return dx_q.astype(dtype), dx_kv.astype(dtype), cast, dbias.astype(dtype), dsink


def mha_grad(
    x_q: ArrayLike,
    x_kv: ArrayLike,
    params: MHAParams,
    num_heads: int,
    d_out: ArrayLike,
    *,
    mask: Band | ArrayLike | None = None,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    sink: ArrayLike | None = None,
    softcap: float | None = None,
    num_kv_heads: int | None = None,
) -> MHAGradients:
    r"""The gradients of ``<d_out, multi_head_attention(x_q, x_kv, params, H)>`` with explicit
    numerics: the forward of :func:`mhanum.multi_head_attention`, then

    .. math::

        dO = G\,W_o^\top,\quad (dQ_h, dK_h, dV_h) = \text{attention\_grad}(q_h, k_h, v_h,
        dO_h),\quad dx_q = dQ\,W_q^\top,\quad dx_{kv} = [dK\; dV]\,[W_k\; W_v]^\top,

    ``dW_q = x_qᵀ dQ`` (``dW_k``, ``dW_v`` and ``dW_o = Oᵀ G`` likewise) and ``db_q = Σ dQ``
    (the biases' gradients: sums over every row of the batch), ``G = d_out``. Every dot is on
    the numerics' dot unit in its summation order, accumulated in ``accum`` (a weight's gradient:
    one dot over the batch's rows, batch-major) and rounded to ``output_format``, the format a
    framework stores its gradients in; each head's backward is :func:`attention_grad`'s with
    ``backward``, from the heads' projections and ``dO`` read into the input format.

    Args:
        x_q, x_kv, params, num_heads, mask, bias, scale, numerics: as for
            :func:`mhanum.multi_head_attention` (the scale on the scores, ``exp_form="exp"``,
            no split-KV, as for :func:`attention_grad`).
        d_out: the output's cotangent ``(..., Lq, d_out)``, rounded to ``numerics.input``.
        backward: a :class:`mhanum.numerics.Backward` or an algorithm name, as for
            :func:`attention_grad`.
        sink: attention sinks, one logit per head, as for
            :func:`mhanum.multi_head_attention`: each head's ``dsink`` as
            :func:`attention_grad` computes it, ``(..., H)``.
        softcap: the logit soft-cap of every head, as for :func:`attention_grad`.
        num_kv_heads: grouped-query attention, as for :func:`mhanum.multi_head_attention`
            (``wk``, ``bk``, ``wv``, ``bv`` of ``num_kv_heads`` heads; ``1``: multi-query). Each
            key/value head is repeated for the query heads of its group (torch's
            ``enable_gqa``, ``repeat_interleave``), so its gradient is the sum of theirs: the
            group's ``dK_h`` (and ``dV_h``), each stored in ``output_format``, read into
            ``accum``, added in head order and rounded to ``output_format``, as
            FlashAttention-2's ``mha_bwd`` does (``dk_expanded`` in the inputs' dtype, then
            ``at::sum_out`` over the groups; torch's CPU math SDPA sums the float32 heads'
            gradients before its one rounding, an order the bound covers too). ``dx_kv`` and
            the gradients of ``wk``, ``wv``, ``bk``, ``bv`` are then those of the grouped
            weights, from the summed ``dK`` and ``dV``.

    Returns:
        :class:`mhanum.gradients.MHAGradients` ``(dx_q, dx_kv, params, dbias[, dsink])``, each
        in the dtype that stores ``numerics.output_format`` (``dbias`` without the sink's
        column; ``params`` shaped like the given, grouped, weights).

    Raises:
        InvalidArgument: for bad inputs (named), as :func:`mhanum.multi_head_attention` and
            :func:`attention_grad` (``num_kv_heads`` not dividing ``num_heads``, or weights
            whose widths do not fit it, as :meth:`MHAParams.expand_kv_heads`).

    Examples:
        >>> import numpy as np
        >>> from mhanum import MHAParams
        >>> params = MHAParams.random(8, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((5, 8))
        >>> g = mha_grad(x, x, params, 2, np.ones((5, 8)), numerics="fp32")
        >>> grouped = MHAParams.random(8, seed=0, kv_width=4)  # 4 heads of 2, 2 key/value heads
        >>> mha_grad(x, x, grouped, 4, np.ones((5, 8)), num_kv_heads=2).params.wk.shape
        (8, 4)
        >>> g.dx_q.shape, g.params.wq.shape, g.dbias.shape
        ((5, 8), (8, 8), (2, 5, 5))
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    bw.check_forward(num)
    check_x64(num)
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, scale=scale, sink=sink,
        softcap=softcap, num_kv_heads=num_kv_heads, d_out=d_out,
    )  # fmt: skip
    heads = p.num_heads
    group = 1 if p.num_kv_heads is None else heads // p.num_kv_heads
    mask, bias, target, cap = head_logit_inputs(num, p)
    batch = target[:-3]
    bw.key_blocks(target[-1])
    fmt = num.format_of("input")
    xq, xkv, gj = (
        jnp.broadcast_to(host_round(x, fmt), (*batch, *np.shape(x)[-2:]))
        for x in (p.x_q, p.x_kv, p.d_out)
    )
    params = jax.tree_util.tree_map(lambda w: host_round(w, fmt), p.grouped)
    consts = Constants.of(num, p.scale_value(num.scale), cap, *bw.formats(num)[:1])
    dx_q, dx_kv, grads, dbias, dsink = _mha_grad_jit(
        xq, xkv, params, gj, mask, bias, consts, num_heads=heads, group=group, numerics=num,
        backward=bw, sink=p.sink is not None,
    )  # fmt: skip
    return MHAGradients(dx_q, dx_kv, MHAParams(**grads), dbias, dsink)
