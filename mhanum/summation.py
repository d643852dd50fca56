"""Compatibility alias of :mod:`mhanum.emulate.summation` (kept until 0.2)."""

from mhanum.emulate.summation import matmul, matmul_with, sum, sum_with

__all__ = ["matmul", "matmul_with", "sum", "sum_with"]
