"""Deprecated: the error metrics are :mod:`mhanum.metrics`.

This module, the metrics' old name, was renamed so that it is never confused with the command
that runs attention on a device and writes records (:func:`mhanum.devices.measure`). It
re-exports :class:`~mhanum.metrics.Errors` and :func:`~mhanum.metrics.errors` and warns once, on
import; it will be removed in a later release.
"""

from __future__ import annotations

import warnings

from mhanum.metrics import Errors, errors

__all__ = ["Errors", "errors"]

warnings.warn(
    "mhanum.measure is deprecated: the error metrics are mhanum.metrics (the same Errors and "
    "errors); 'mhanum measure' on the command line runs devices",
    DeprecationWarning,
    stacklevel=2,
)
