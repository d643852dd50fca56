"""Transitional: the names other modules still import from here; see :mod:`mhanum.bounds.forward`."""

from mhanum.bounds.forward import attention_bound

__all__ = ["attention_bound"]
