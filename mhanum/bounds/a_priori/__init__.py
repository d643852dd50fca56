"""A priori componentwise bounds for attention and MHA from sizes and norms: papers/attention.md A.4.

:func:`attention_bound_a_priori` needs no inputs, only their shapes and bounds on their sizes
(the Euclidean norms of the query and key rows and the largest value entry); it bounds the error
of every output component of every input that satisfies them. :func:`mha_bound_a_priori` does
the same for a multi-head layer from its weights and a bound on the entries of its inputs. Both
are for planning and reports: the a posteriori bounds (A.1, A.2) are smaller on any given input.

Each step of A.1 is replaced by its worst case over the admissible inputs: ``|q_i|·|k_j| <=
‖q_i‖‖k_j‖`` (Cauchy–Schwarz), every logit error by one ``Δ``, the logit range by ``2c|q||k|``,
``Σ_j p̃_j <= e^{2Δ}`` and ``Σ_j p_j |v_j| <= max |v|``; the float64 evaluation error of A.1's
logits (step 0) is included the same way, so A.4 is at least A.1 on every admissible input. The
no-overflow hypothesis is proved from the same bounds, stage by stage (papers/attention.md, R);
where it cannot be, every entry is infinite and ``Bound.reasons`` says why. With the safe softmax,
step W (``|ô| + |o|`` from the computed weights' sum alone) caps every entry, as it caps A.1.
"""

from mhanum.bounds.a_priori.a4 import attention_bound_a_priori, mha_bound_a_priori
from mhanum.bounds.a_priori.softcap import (
    CappedLogits,
    CapRoundings,
    cap_constant,
    cap_roundings,
    evaluated_constants,
    softcap_a_priori,
)

__all__ = [
    "CapRoundings",
    "CappedLogits",
    "attention_bound_a_priori",
    "cap_constant",
    "cap_roundings",
    "evaluated_constants",
    "mha_bound_a_priori",
    "softcap_a_priori",
]
