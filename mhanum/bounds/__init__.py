"""Error bounds for attention, one module per error source; each bound is a theorem.

Every bound function returns a :class:`Bound`: the total and its named terms, with the theorem
number (in ``papers/``), its assumptions and its source.
"""

from mhanum.bounds import heads, masking, summation
from mhanum.bounds._result import Bound
from mhanum.bounds.a_priori import attention_bound_a_priori, mha_bound_a_priori
from mhanum.bounds.backward import (
    GradientBounds,
    MHAGradientBounds,
    attention_grad_bound,
    attention_grad_bound_a_priori,
    dq_order_difference,
    mha_grad_bound,
)
from mhanum.bounds.forward import attention_bound, attention_bound_along, mha_bound
from mhanum.bounds.masking import (
    MaskAnalysis,
    MaskRange,
    MaskRecommendation,
    analyze_mask,
    analyze_numerics,
    recommend_mask_value,
    safe_mask_range,
)
from mhanum.bounds.schedules import schedule_difference, shares_logits
from mhanum.bounds.summation import dot_bound, matmul_bound, probabilistic_gamma, sum_bound

__all__ = [
    "Bound",
    "GradientBounds",
    "MHAGradientBounds",
    "MaskAnalysis",
    "MaskRange",
    "MaskRecommendation",
    "analyze_mask",
    "analyze_numerics",
    "attention_bound",
    "attention_bound_a_priori",
    "attention_bound_along",
    "attention_grad_bound",
    "attention_grad_bound_a_priori",
    "dot_bound",
    "dq_order_difference",
    "heads",
    "masking",
    "matmul_bound",
    "mha_bound",
    "mha_bound_a_priori",
    "mha_grad_bound",
    "probabilistic_gamma",
    "recommend_mask_value",
    "safe_mask_range",
    "schedule_difference",
    "shares_logits",
    "sum_bound",
    "summation",
]
