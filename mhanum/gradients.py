"""The gradients of attention, as the backward emulation and the reference return them."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Gradients"]


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
