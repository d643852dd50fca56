"""Compatibility alias of :mod:`mhanum.emulate.attention` (kept until 0.2)."""

from mhanum.emulate.attention import attention, multi_head_attention, softmax

__all__ = ["attention", "multi_head_attention", "softmax"]
