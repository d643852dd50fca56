"""The forward bounds, one module per theorem and one function per proof step
(papers/attention.md): Theorem A.1 (:mod:`~mhanum.bounds.forward.a1`; its steps in
:mod:`~mhanum.bounds.forward.operands`, :mod:`~mhanum.bounds.forward.logits` and
:mod:`~mhanum.bounds.forward.softmax_pv`, chained per head in
:mod:`~mhanum.bounds.forward.head`), A.1g (:mod:`~mhanum.bounds.forward.along`), A.2
(:mod:`~mhanum.bounds.forward.mha`), A.3' (:mod:`~mhanum.bounds.forward.across_keys`), A.3''
and A.3e (:mod:`~mhanum.bounds.forward.one_martingale`) and A.6
(:mod:`~mhanum.bounds.forward.split_kv`)."""

from mhanum.bounds.forward.a1 import attention_bound, attention_bound_along
from mhanum.bounds.forward.mha import head_output_bound, merge_heads, mha_bound, split_heads
from mhanum.bounds.forward.result import ASSUMPTIONS, PROBABILISTIC

__all__ = [
    "ASSUMPTIONS",
    "PROBABILISTIC",
    "attention_bound",
    "attention_bound_along",
    "head_output_bound",
    "merge_heads",
    "mha_bound",
    "split_heads",
]
