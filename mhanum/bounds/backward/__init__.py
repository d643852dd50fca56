"""Componentwise bounds on the error of attention's backward pass: papers/backward.md B.0-B.9.

:func:`attention_grad_bound` bounds ``|ĝ - g|`` for each gradient ``g`` of
:func:`mhanum.reference.attention_grad` (``dq``, ``dk``, ``dv``, ``dbias``) and ``ĝ`` the one
:func:`mhanum.emulate.backward.attention_grad` computes, or any kernel that rounds as its
:class:`~mhanum.numerics.Numerics` and :class:`~mhanum.numerics.Backward` say, **whatever order
its ``dQ`` additions take** (Theorem B.2: FlashAttention-2's ``atomicAdd`` of one partial per key
block). :func:`dq_order_difference` bounds ``|dq_a - dq_b|`` between two such orders (Theorem
B.3: run-to-run nondeterminism). :func:`attention_grad_bound_a_priori` bounds them from the
inputs' sizes and norms alone (B.4, B.9). :func:`mha_grad_bound` bounds every gradient of
multi-head attention, grouped-query layers included (Theorem B.6), and its probabilistic variant
(B.8).

The bounds are evaluated on the given inputs in float64, each float64 value standing in for an
exact one with its own enclosure (papers/backward.md, §0, :mod:`mhanum.bounds.enclosure`). Every
stage's rounding is charged where it happens, and every stage's range is a hypothesis proved on
the enclosures: where it cannot be, the gradient it feeds is ``inf`` with the reason in
``Bound.reasons``.

One module per theorem, one function per step of its proof:

* :mod:`~mhanum.bounds.backward.b1`: Theorems B.1/B.2 (B.5, B.7), steps 1-2 and the driver;
  :mod:`~mhanum.bounds.backward.probabilities` (step 3), :mod:`~mhanum.bounds.backward.dp`
  (steps 4-5), :mod:`~mhanum.bounds.backward.gradients` (steps 6-8),
  :mod:`~mhanum.bounds.backward.softcap` (B.7's steps 2c, 6c; B.9 (b));
* :mod:`~mhanum.bounds.backward.order_difference`: Theorem B.3;
* :mod:`~mhanum.bounds.backward.a_priori`: Theorems B.4 and B.9;
* :mod:`~mhanum.bounds.backward.mha`: Theorems B.6 and B.8;
* :mod:`~mhanum.bounds.backward.inputs` and :mod:`~mhanum.bounds.backward.scope`: the inputs,
  the context every step reads, the assumptions and the results.
"""

from mhanum.bounds.backward.a_priori import attention_grad_bound_a_priori
from mhanum.bounds.backward.b1 import attention_grad_bound
from mhanum.bounds.backward.mha import MHAGradientBounds, mha_grad_bound
from mhanum.bounds.backward.order_difference import dq_order_difference
from mhanum.bounds.backward.scope import GradientBounds

__all__ = [
    "GradientBounds",
    "MHAGradientBounds",
    "attention_grad_bound",
    "attention_grad_bound_a_priori",
    "dq_order_difference",
    "mha_grad_bound",
]
