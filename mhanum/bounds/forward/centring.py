"""Step 4, centred (papers/attention.md): the weights' deviations sum to zero over the keys, so
the logits' share of the output reads the values less any constant per column; the keys'
median makes that least."""

from __future__ import annotations

import numpy as np

__all__ = ["centred", "column_median"]


def centred(v: np.ndarray, v_extra: np.ndarray, centre: np.ndarray | None = None) -> np.ndarray:
    """``|v_j - c| + e_j`` (with the float64 subtraction's rounding) for ``c`` the median of
    ``v`` over the keys, per column: a bound on ``|ṽ_j - c|`` for any ``|ṽ_j - v_j| <= e_j``.
    Every ``c`` will do where the weights' deviations sum to zero (step 4); the median makes
    ``Σ_j |v_j - c|`` least, and removes what the values share (a bias of the projection).
    ``centre``: that median, where it was taken already (:func:`column_median`)."""
    if centre is None:
        centre = column_median(v)
    with np.errstate(invalid="ignore"):
        return np.abs(v - centre) * (1 + 2.0**-51) + v_extra


def column_median(v: np.ndarray) -> np.ndarray:
    """The median of ``v``'s finite entries over the keys, per column (an infinite entry
    counts as 0), keeping the keys' axis: :func:`centred`'s ``c``."""
    finite = np.where(np.isfinite(v), v, 0.0)
    return np.median(finite, axis=-2, keepdims=True)
