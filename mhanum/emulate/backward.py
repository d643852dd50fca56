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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mhanum import _validate as V
from mhanum import masks
from mhanum.emulate._arith import Arith, runtime_zero, to_format
from mhanum.emulate.attention import (
    Stages,
    bias_array,
    check_x64,
    format_constant,
    host_round,
    partial_attention,
    stage_logits,
    stage_probabilities,
)
from mhanum.emulate.summation import sum_with
from mhanum.gradients import Gradients
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward

__all__ = ["attention_grad"]


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


def _running(st: Stages, a_blocks: jax.Array, b_blocks: jax.Array) -> jax.Array:
    """``Σ_b a_b b_b``: each block's dot on the dot unit, added to the running sum in block order
    (FlashAttention-2's ``dK`` and ``dV`` over query blocks); the first block's dot is the sum."""
    ar = st.acc

    def step(acc: jax.Array, blk: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return ar.add(acc, st.dot(*blk)), None

    first = st.dot(a_blocks[0], b_blocks[0])
    return lax.scan(step, first, (a_blocks[1:], b_blocks[1:]))[0]


def _finish(st: Stages, acc: jax.Array, scale: float | None) -> jax.Array:
    """``fl_out(fl_acc(acc·ĉ))`` with ``ĉ = fl_acc(scale)``, or ``fl_out(acc)``."""
    if scale is not None:
        acc = st.acc.mul(acc, format_constant(st.acc, scale))
    return to_format(acc, st.output)


def _textbook(
    st: Stages, gr: Arith, ds_fmt: Any, q: Any, k: Any, v: Any, g: Any, s: Any
) -> tuple[jax.Array, ...]:
    p = to_format(stage_probabilities(st, s), st.prob)  # the stored probabilities
    dv = st.dot(_t(p), g)
    dp = gr.take(st.dot(g, _t(v)))
    pg = gr.take(p)
    d = sum_with(gr, gr.mul(dp, pg), st.num.summation, keepdims=True)
    ds = gr.mul(pg, gr.sub(dp, d))
    ds_r = to_format(ds, ds_fmt)
    return st.dot(ds_r, k), st.dot(_t(ds_r), q), dv, ds


def _flash2(
    st: Stages,
    gr: Arith,
    ds_fmt: Any,
    bw: Backward,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    s: Any,
) -> tuple[jax.Array, ...]:
    sm = st.soft
    lse, o = partial_attention(st, s, v)  # the forward's log-sum-exp and output
    o = to_format(o, st.output)
    d = sum_with(gr, gr.mul(gr.take(g), gr.take(o)), st.num.summation, keepdims=True)
    empty = jnp.isneginf(lse)
    arg = sm.sub(sm.take(s), jnp.where(empty, jnp.zeros_like(lse), lse))
    p = jnp.where(empty, jnp.zeros_like(arg), sm.exp(arg))
    dp = gr.take(st.dot(g, _t(v)))
    ds = gr.mul(gr.take(p), gr.sub(dp, d))
    ds_r = to_format(ds, ds_fmt)
    p_r = to_format(p, st.prob)
    n_keys = k.shape[-2]
    # dV, dK: over query blocks, in order; dQ: one partial per key block, added in dq_order
    dv = _running(st, _blocks(_t(p_r), -1, bw.block_q), _blocks(g, -2, bw.block_q))
    dk = _running(st, _blocks(_t(ds_r), -1, bw.block_q), _blocks(q, -2, bw.block_q))
    parts = jax.vmap(st.dot)(_blocks(ds_r, -1, bw.block_k), _blocks(k, -2, bw.block_k))
    order = jnp.asarray(bw.key_blocks(n_keys))
    parts = parts[order]

    def add(acc: jax.Array, part: jax.Array) -> tuple[jax.Array, None]:
        return st.acc.add(acc, part), None

    dq = lax.scan(add, parts[0], parts[1:])[0]
    return dq, dk, dv, ds


@functools.partial(jax.jit, static_argnames=("numerics", "backward", "scale", "sink"))
def _grad_jit(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    mask: Any,
    bias: Any,
    *,
    numerics: Numerics,
    backward: Backward,
    scale: float,
    sink: bool = False,
) -> tuple[jax.Array, ...]:
    st = Stages(numerics, runtime_zero(q))
    q, k, v, g = (to_format(x, st.input) for x in (q, k, v, g))
    grad_fmt, ds_fmt = backward.formats(numerics)
    gr = Arith(grad_fmt, st.acc.guard)
    s = stage_logits(st, q, k, mask, bias, scale)
    batch = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-2])
    q, k, v, g = (jnp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v, g))
    s = jnp.broadcast_to(s, (*batch, *s.shape[-2:]))
    if backward.algorithm == "textbook":
        dq, dk, dv, ds = _textbook(st, gr, ds_fmt, q, k, v, g, s)
    else:
        dq, dk, dv, ds = _flash2(st, gr, ds_fmt, backward, q, k, v, g, s)
    dtype = st.output.jax_dtype
    grads = (
        _finish(st, dq, scale).astype(dtype),
        _finish(st, dk, scale).astype(dtype),
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


def attention_grad(
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
    sink: Any = None,
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
            scores, ``exp_form="exp"``, no split-KV: other numerics are refused by name).
        d_out: the output's cotangent ``(..., Lq, d_v)``, rounded to ``numerics.input``.
        backward: a :class:`mhanum.numerics.Backward` or an algorithm name (``"textbook"``,
            ``"flash2"``); default textbook.
        sink: optional attention-sink logits, as for :func:`mhanum.attention` (one more key with
            value 0 and bias ``σ``): its gradient ``dsink`` is the sum of that key's column of
            ``dS``, added row after row in ``accum``, then rounded to ``output_format``.

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
    q, k, v, g, batch = V.gradient_inputs(q, k, v, d_out)
    target = (*batch, q.shape[-2], k.shape[-2])
    if mask is not None:
        mask = V.bool_mask(mask, target)
    num.check_bias(bias)
    if sink is not None:
        num.check_sink()
        xp = jnp if any(isinstance(x, jax.Array) for x in (q, k, v, sink)) else np
        k, v, mask, bias = masks.with_sink(q, k, v, mask, bias, sink, xp=xp)
        target = (*k.shape[:-2], q.shape[-2], k.shape[-2])
    bw.key_blocks(k.shape[-2])
    if bias is not None:
        bias = bias_array(bias, target, num.format_of("score"))
    factor = V.scale_value(scale, q.shape[-1], placement=num.scale)
    fmt = num.format_of("input")
    q, k, v, g = (host_round(x, fmt) for x in (q, k, v, g))
    out = _grad_jit(
        q, k, v, g, mask, bias, numerics=num, backward=bw, scale=factor, sink=sink is not None
    )
    return Gradients(*out)
