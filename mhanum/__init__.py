"""mhanum: numerical analysis of multi-head attention.

Attention in JAX with explicit numerics, certified arbitrary-precision references, error metrics,
and (in :mod:`mhanum.bounds`) error bounds stated as theorems.
"""

from mhanum import bounds, cases, formats, measure, reference, search, strategies, summation
from mhanum._errors import CertificationError, InvalidArgument
from mhanum.adapters.compare import compare
from mhanum.attention import attention, multi_head_attention, softmax
from mhanum.formats import Format, get_format, round_to
from mhanum.numerics import PRESETS, Numerics
from mhanum.params import MHAParams

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CertificationError",
    "Format",
    "InvalidArgument",
    "MHAParams",
    "Numerics",
    "__version__",
    "attention",
    "bounds",
    "cases",
    "compare",
    "formats",
    "get_format",
    "measure",
    "multi_head_attention",
    "reference",
    "round_to",
    "search",
    "softmax",
    "strategies",
    "summation",
]
