"""Error bounds for attention, one module per error source; each bound is a theorem.

Every bound function returns a :class:`Bound`: the total and its named terms, with the theorem
number (in ``papers/``), its assumptions and its source.
"""

from mhanum.bounds import heads, masking
from mhanum.bounds._result import Bound
from mhanum.bounds.attention import attention_bound, mha_bound
from mhanum.bounds.masking import (
    MaskAnalysis,
    MaskRange,
    MaskRecommendation,
    analyze_mask,
    analyze_numerics,
    recommend_mask_value,
    safe_mask_range,
)

__all__ = [
    "Bound",
    "MaskAnalysis",
    "MaskRange",
    "MaskRecommendation",
    "analyze_mask",
    "analyze_numerics",
    "attention_bound",
    "heads",
    "masking",
    "mha_bound",
    "recommend_mask_value",
    "safe_mask_range",
]
