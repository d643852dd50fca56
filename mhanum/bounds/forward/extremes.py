"""Lemma 4 (papers/attention.md, step 4): the probabilities' extremes over the box of the logits'
errors, evaluated directly where the errors are small and in log space elsewhere."""

from __future__ import annotations

import dataclasses

import numpy as np

from mhanum.bounds.forward.evaluation import logsumexp, on
from mhanum.bounds.forward.stage import Enclosure

__all__ = [
    "PerKey",
    "direct_rows",
    "extremes",
    "extremes_direct",
    "extremes_log",
    "log_sum_excluding",
    "per_key",
]


@dataclasses.dataclass(frozen=True, eq=False)
class PerKey:
    """Step 4: the row maximum ``top``, the shifted logits ``sc``, ``p``, its extremes ``hi``
    and ``lo`` over the box, ``log Σ e^{sc - δ}`` and the per-key deviations ``logits``."""

    top: np.ndarray
    sc: np.ndarray
    p: np.ndarray
    hi: np.ndarray
    lo: np.ndarray
    log_sum_lo: np.ndarray
    logits: np.ndarray


def per_key(enc: Enclosure) -> PerKey:
    """Step 4 (per key, Lemma 4). ``p̃_j = p_j e^{ε_j} / Σ_l p_l e^{ε_l}``, ``|ε_l| <= δ_l``,
    grows with ``ε_j`` and falls with every other ``ε_l``, so its extremes over the box are
    ``p_j e^{±δ_j} / (p_j e^{±δ_j} + Σ_{l≠j} p_l e^{∓δ_l})``."""
    s, live = enc.s, enc.live
    top = s.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        sc = on(live, s - np.where(np.isfinite(top), top, 0.0), -np.inf)
    p, p_tilde_hi, p_tilde_lo, log_sum_lo = extremes(sc, enc.delta, live)
    logits = np.maximum(p_tilde_hi - p, p - p_tilde_lo)
    return PerKey(top, sc, p, p_tilde_hi, p_tilde_lo, log_sum_lo, logits)


def extremes(
    sc: np.ndarray, delta: np.ndarray, live: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step 4's probabilities and their extremes over the box ``|ε_l| <= δ_l``.

    For logits ``sc`` shifted by the row maximum (``-inf`` where not live): ``p``, the extremes
    ``p̃_j = p_j e^{±δ_j} / (p_j e^{±δ_j} + Σ_{l≠j} p_l e^{∓δ_l})`` (Lemma 4; the upper one at
    most 1, both 0 off the live keys) and ``log Σ_l e^{sc_l - δ_l}`` per row. Rows whose
    errors are at most 1 are evaluated directly (every exponential is within ``e^{±1}`` of
    ``e^{sc}``, whose largest is 1); the others, and rows without a live key, in log space.
    """
    fast = direct_rows(delta, live)
    if fast.all():
        return extremes_direct(sc, delta, live)
    p = np.zeros(sc.shape)
    hi, lo = np.zeros(sc.shape), np.zeros(sc.shape)
    log_sum = np.zeros((*sc.shape[:-1], 1))
    for rows, how in ((fast, extremes_direct), (~fast, extremes_log)):
        if rows.any():
            p[rows], hi[rows], lo[rows], log_sum[rows] = how(sc[rows], delta[rows], live[rows])
    return p, hi, lo, log_sum


def direct_rows(delta: np.ndarray, live: np.ndarray) -> np.ndarray:
    """The rows :func:`extremes` evaluates directly: a live key, and errors at most 1."""
    return live.any(axis=-1) & (on(live, delta, 0.0).max(axis=-1) <= 1.0)


def _first_largest(x: np.ndarray) -> np.ndarray:
    """The first largest entry of each row (one key per row, ties included)."""
    return np.arange(x.shape[-1]) == np.argmax(x, axis=-1)[..., None]


def _rest(e: np.ndarray, total: np.ndarray) -> np.ndarray:
    """``Σ_{l≠j} e_l`` for every ``j``: ``total - e_j`` where ``e_j`` is at most half the total
    (no cancellation), the direct sum over the others for the one key that may exceed it: the
    row's first largest (two tied keys whose computed shares both exceed one half must not
    both leave the other out)."""
    rest = total - e
    dominant = e > 0.5 * total
    if dominant.any():
        dominant &= _first_largest(e)
        others = np.where(dominant, 0.0, e).sum(axis=-1, keepdims=True)
        rest = np.where(dominant, others, rest)
    return rest


def extremes_direct(
    sc: np.ndarray, delta: np.ndarray, live: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`extremes` for rows with a live key and ``δ <= 1``: linear arithmetic."""
    e = np.exp(sc)  # 0 off the live keys, 1 at the row maximum
    grow = np.exp(delta)
    e_hi, e_lo = e * grow, e / grow
    s_lo = e_lo.sum(axis=-1, keepdims=True)
    s_hi = e_hi.sum(axis=-1, keepdims=True)
    p = e / e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        # the denominators summed in place on the fresh rests (the same values, fewer arrays)
        den_hi, den_lo = _rest(e_lo, s_lo), _rest(e_hi, s_hi)
        den_hi += e_hi
        den_lo += e_lo
        p_hi = np.minimum(e_hi / den_hi, 1.0)
        p_lo = e_lo / den_lo
    p_hi = on(live, p_hi, 0.0)
    p_lo = on(live, p_lo, 0.0)
    return p, p_hi, p_lo, np.log(s_lo)


def extremes_log(
    sc: np.ndarray, delta: np.ndarray, live: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`extremes` in log space: any ``δ``, rows without a live key."""
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = sc - np.log(np.exp(sc).sum(axis=-1, keepdims=True))
        a_lo, a_hi = log_p - delta, log_p + delta
        log_pt_hi = a_hi - np.logaddexp(a_hi, log_sum_excluding(a_lo))
        log_pt_lo = a_lo - np.logaddexp(a_lo, log_sum_excluding(a_hi))
    log_pt_hi = np.where(live, np.minimum(log_pt_hi, 0.0), -np.inf)  # p̃_j <= 1
    log_pt_lo = np.where(live, log_pt_lo, -np.inf)
    return np.exp(log_p), np.exp(log_pt_hi), np.exp(log_pt_lo), logsumexp(sc - delta)


def log_sum_excluding(a: np.ndarray) -> np.ndarray:
    """``log Σ_{l≠j} e^{a_l}`` over the last axis, for every ``j`` (``-inf`` for a lone key).

    ``log Σ - log(1 - share_j)`` loses no accuracy while ``share_j <= 1/2``; at most one key
    per row has a larger share, the row's first largest, and its sum is taken directly over
    the other keys. (Two tied keys may both have a computed share just above one half; the
    second is then taken as sharing one half, within its share's rounding.)
    """
    total = logsumexp(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(np.isfinite(a), np.exp(a - total), 0.0)
        rest = total + np.log1p(-np.minimum(share, 0.5))
        dominant = share > 0.5
        if dominant.any():
            dominant &= _first_largest(a)
            others = logsumexp(np.where(dominant, -np.inf, a))
            rest = np.where(dominant, others, rest)
    return rest
