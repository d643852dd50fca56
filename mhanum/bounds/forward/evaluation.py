"""The float64 evaluation of the forward bounds: passes that change nothing are skipped, sums of
exponentials stay finite (papers/attention.md, step 0)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum._types import ArrayLike

__all__ = [
    "TINY",
    "certified_difference",
    "dot",
    "log_expm1_upper",
    "logsumexp",
    "on",
    "quiet",
    "times_expm1",
    "weighted_expm1",
]

TINY = 2.0**-1074  # float64's smallest subnormal number


def on(where: np.ndarray, x: Any, other: float) -> Any:
    """``np.where(where, x, other)``, and ``x`` itself (no pass over it) where ``where`` holds
    everywhere: the same values, since ``x`` broadcasts to ``where``'s shape."""
    if where.all():
        shape = np.shape(x)
        if shape == where.shape or shape == np.broadcast_shapes(shape, where.shape):
            return x
    return np.where(where, x, other)


def dot(a: np.ndarray, b: np.ndarray, nonzero: bool | None = None) -> np.ndarray:
    """``a @ b``, with no product where the (thin) factor ``b`` is zero (``nonzero``: whether
    ``b`` has an entry other than zero, where that is known already)."""
    if np.any(b) if nonzero is None else nonzero:
        return a @ b
    return np.zeros((*a.shape[:-1], b.shape[-1]))


def quiet() -> Any:
    """Floating-point warnings off: the range checks catch what overflows in float64."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore")


def logsumexp(x: np.ndarray) -> np.ndarray:
    """``log Σ_j e^{x_j}`` over the last axis (keepdims), ``-inf`` for an all ``-inf`` row."""
    top = x.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(x - safe).sum(axis=-1, keepdims=True))


def log_expm1_upper(x: np.ndarray) -> np.ndarray:
    """An upper bound on ``log(e^x - 1)`` for ``x > 0`` that does not overflow."""
    small = np.minimum(x, 30.0)
    with np.errstate(divide="ignore"):
        return np.where(x > 30.0, x, np.log(np.expm1(small)))


def times_expm1(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``a·(e^y - 1)`` for ``0 <= a <= 1`` and ``y >= 0``, without ``0·inf``."""
    if np.max(y, initial=0.0) <= 1.0:  # (NaN fails the test)
        return a * np.expm1(y)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = a * np.expm1(np.minimum(y, 1.0))
        big = y > 1.0
        if big.any():
            out = np.where(big, np.exp(np.log(a) + y), out)
    return out


def weighted_expm1(a: np.ndarray, x: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``Σ_j a_j (e^{x_j} - 1)`` over the live keys of each row (keepdims), ``0 <= a <= 1``,
    ``x >= 0``; in log space for a row with an ``x_j > 30`` (the sum may overflow)."""
    if np.max(x, initial=0.0) <= 30.0:  # (NaN fails the test)
        return on(live, a * np.expm1(x), 0.0).sum(axis=-1, keepdims=True)
    out = on(live, a * np.expm1(np.minimum(x, 30.0)), 0.0).sum(axis=-1, keepdims=True)
    big = (x > 30.0).any(axis=-1)
    if big.any():
        with np.errstate(divide="ignore", over="ignore"):
            log_r = log_expm1_upper(np.maximum(x[big], 1e-300))
            terms = np.where(live[big], np.log(a[big]) + log_r, -np.inf)
            out[big] = np.exp(logsumexp(terms))
    return out


def certified_difference(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """An upper bound on ``|a* - b*|`` from ``a`` and ``b``, two certified references (each the
    exact value rounded to float64, within ``2^-53`` relative, and 0 only where it is exactly):
    their float64 difference, their own errors, and its rounding, rounded up."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (np.abs(a - b) + 2.0**-52 * (np.abs(a) + np.abs(b))) * (1 + 2.0**-50)
