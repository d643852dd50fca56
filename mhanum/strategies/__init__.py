"""Hypothesis strategies for attention numerics, in the style of ``hypothesis.extra.numpy``.

Every function is keyword-only, named for what its strategy produces, accepts values *or*
strategies for its arguments, and rejects a bad value with
:class:`hypothesis.errors.InvalidArgument` when it is called (a bad value drawn from a strategy
argument raises the same error when it is drawn).

* :func:`formats` — :class:`~mhanum.formats.Format` objects;
* :func:`numerics` — :class:`~mhanum.Numerics`, presets, free combinations and (on request)
  custom numerics that set every field;
* :func:`attention_inputs` — :class:`AttentionInputs` ``(q, k, v)`` whose values lie in a format,
  with error-provoking structure (:data:`STRUCTURES`) on request and mixed in by default, and
  structures at the edges of every format's range (:data:`RANGE_STRUCTURES`, with a scale and a
  bias) on request;
* :func:`masks` — boolean masks (True = attend): padding, causal, random, fully-masked rows on
  request;
* :func:`mha_inputs` — :class:`MHAInputs` ``(x_q, x_kv)`` for multi-head attention, with
  the token-level structures of :data:`MHA_STRUCTURES`;
* :func:`perturbed_inputs` — a real layer's input perturbed (:data:`PERTURBATIONS`), as
  :class:`MHAInputs` for self-attention;
* :func:`mha_params` — :class:`~mhanum.MHAParams` with values in a format.

The arrays are built by numpy from a drawn seed and a few drawn *structure parameters*
(exponents, positions, counts), so Hypothesis's targeting and shrinking act on the parameters that
matter (how large the logits are, how many keys tie, where the small addends sit) rather than on
thousands of independent floats. :mod:`mhanum.search` drives these strategies with
``hypothesis.target``.

Examples:
    >>> from hypothesis import given
    >>> from mhanum import strategies as mst
    >>> @given(mst.attention_inputs(q_len=2, kv_len=4, d_k=3, d_v=2, fmt="bfloat16"))
    ... def test_shapes(x):
    ...     assert x.q.shape == (1, 1, 2, 3) and x.v.shape == (1, 1, 4, 2)
    >>> test_shapes()
"""

from __future__ import annotations

from mhanum.strategies._attention import attention_inputs
from mhanum.strategies._common import (
    MASK_KINDS,
    RANGE_STRUCTURES,
    STRUCTURES,
    AttentionInputs,
    default_mixes,
    range_mixes,
)
from mhanum.strategies._masks import bands, masks
from mhanum.strategies._mha import (
    MHA_STRUCTURES,
    PERTURBATIONS,
    MHAInputs,
    mha_inputs,
    mha_mixes,
    mha_params,
    perturbed_inputs,
)
from mhanum.strategies._numerics import formats, numerics

__all__ = [
    "MASK_KINDS",
    "MHA_STRUCTURES",
    "PERTURBATIONS",
    "RANGE_STRUCTURES",
    "STRUCTURES",
    "AttentionInputs",
    "MHAInputs",
    "attention_inputs",
    "bands",
    "default_mixes",
    "formats",
    "masks",
    "mha_inputs",
    "mha_mixes",
    "mha_params",
    "numerics",
    "perturbed_inputs",
    "range_mixes",
]
