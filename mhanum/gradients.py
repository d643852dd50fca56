"""The gradients of attention, as the backward emulation and the reference return them."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Gradients", "MHAGradients"]


class Gradients(NamedTuple):
    """The gradients of ``<d_out, attention(q, k, v)>``: ``dq``, ``dk``, ``dv`` shaped like the
    inputs broadcast to the batch (a broadcast input's gradient is per batch element: sum over
    the dimensions it was broadcast along for its own), and ``dbias``, the gradient with respect
    to the logits' additive bias, shaped ``(..., Lq, Lk)`` (0 at masked keys); with a sink,
    ``dsink``, the gradient with respect to the sink logit of each batch element (``(...)``:
    sum it over the dimensions a shared sink was broadcast along)."""

    dq: Any
    dk: Any
    dv: Any
    dbias: Any
    dsink: Any = None


class MHAGradients(NamedTuple):
    """The gradients of ``<d_out, multi_head_attention(x_q, x_kv, params, H)>``: ``dx_q`` and
    ``dx_kv`` shaped like the inputs broadcast to the batch, ``params`` an
    :class:`mhanum.MHAParams` holding the gradient of every weight and bias (``None`` where the
    layer has no such bias; summed over the batch), and ``dbias``, the gradient with respect to
    the logits' additive bias, ``(..., H, Lq, Lk)``. For self-attention (``x_q`` and ``x_kv`` the
    same array) the input's gradient is ``dx_q + dx_kv``. With sinks, ``dsink``: the gradient
    of every head's sink logit, ``(..., H)`` (sum it over the batch for a shared sink)."""

    dx_q: Any
    dx_kv: Any
    params: Any
    dbias: Any
    dsink: Any = None
