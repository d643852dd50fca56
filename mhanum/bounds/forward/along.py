"""Theorem A.1g (papers/attention.md): the output's error along a direction per query row, its
two brackets over the keys kept coupled."""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument
from mhanum.bounds.factors import evaluation_rounding
from mhanum.bounds.forward.evaluation import TINY
from mhanum.bounds.forward.stage import Values

__all__ = ["along_rows", "along_term", "directions"]


def along_term(
    along: tuple[np.ndarray, np.ndarray],
    values: Values,
    logits: np.ndarray,
    rounding: np.ndarray,
    logits_v: np.ndarray,
) -> np.ndarray:
    """Theorem A.1g (papers/attention.md): per row, ``C - Σ_c ḡ_c X_c`` (``-inf`` to ``inf``),
    with ``C >= |Σ_c g*_c X*_c|`` for the output's brackets ``X*`` that are sums over the keys
    (the logits': ``Σ_j (p̃_j - p_j) ṽ_j``, the roundings of ``p̂`` into the probability and
    operand formats: ``Σ_j r_j ṽ_j``, ``|r_j| <= rounding_j``), and ``X`` their entrywise
    bounds ``logits_v`` and ``rounding·v_abs`` that the terms carry. ``g`` is the float64
    direction of each row, ``ḡ >= |g*|`` for the exact one, ``ṽ_j`` the values as read
    (``|ṽ_j| <= v_abs_j``, within ``v_abs - |v|`` of ``v``).

    ``Σ_j (p̃_j - p_j) = 0``, so ``|Σ_j (p̃_j - p_j) g*·ṽ_j| <= Σ_j L_j |g*·ṽ_j - c|`` for the
    row's median ``c`` of ``g·v_j``; ``|Σ_j r_j g*·ṽ_j| <= Σ_j |r_j| |g*·ṽ_j|``. The float64
    products are charged their rounding; ``C`` rounds up and the entrywise form down."""
    g, g_up = along
    v, v_abs = values.v, values.v_abs
    ev = evaluation_rounding(max(v.shape))
    v_extra = v_abs - np.abs(v)
    with np.errstate(over="ignore", invalid="ignore"):
        gv = g @ v.T
        # |g*·ṽ_j - g·v_j| <= ḡ·v_extra_j + (ḡ - |g|)·|v_j| + γ |g|·|v_j| (float64); the first
        # two are 0 for values read exactly and an exact direction
        g_abs, v_mag = np.abs(g), np.abs(v)
        spread = ev * (g_abs @ v_mag.T)
        if v_extra.any():
            spread = spread + g_up @ v_extra.T
        g_rad = g_up - g_abs
        if g_rad.any():
            spread = spread + g_rad @ v_mag.T
        spread = spread * (1 + ev)
        centre = np.median(np.where(np.isfinite(gv), gv, 0.0), axis=-1, keepdims=True)
        dev = np.abs(gv - centre) * (1 + 2.0**-51) + spread
        coupled = (logits * dev + rounding * (np.abs(gv) + spread)).sum(axis=-1, keepdims=True)
        linear = (g_up * (logits_v + rounding @ v_abs)).sum(axis=-1, keepdims=True)
        # underflow: each of the n (d_v) products and additions loses at most 2^-1075
        tiny = 4 * (v.shape[-2] + 1) * (v.shape[-1] + 1) * TINY
        return coupled * (1 + ev) - linear * (1 - ev) + tiny


def along_rows(g_up: np.ndarray, total: np.ndarray, adjust: np.ndarray | None) -> np.ndarray:
    """Theorem A.1g per row: ``Σ_c ḡ_c total_c`` rounded up, less the coupled brackets' gain
    ``adjust`` (``ALONG``, ``(..., Lq, 1)``) where that is smaller (the first where NaN)."""
    ev = evaluation_rounding(total.shape[-1])
    # a product or sum that underflows float64 loses up to 2^-1075 (relative errors: ev)
    plain = (g_up * total).sum(axis=-1) * (1 + ev) + (2 * total.shape[-1] + 2) * TINY
    if adjust is None:
        return plain
    return np.fmin(plain, plain * (1 + ev) + adjust[..., 0])


def directions(direction: tuple[Any, Any], shape: tuple[int, ...]) -> tuple[Any, Any]:
    """A.1g's ``g`` (float64) and ``ḡ >= |g*|``, each broadcast to the output's ``shape``."""
    g, g_error = direction
    g = V.float_array(g, "g", min_ndim=2)
    V.check_finite(g, "g")
    try:
        gb = np.broadcast_to(np.asarray(g, np.float64), shape)
    except ValueError:
        msg = f"g: expected a shape broadcastable to the output's {shape}, got {g.shape}"
        raise InvalidArgument(msg) from None
    gu = np.abs(gb)
    if g_error is not None:
        err = np.asarray(g_error, np.float64)
        if not (np.isfinite(err).all() and (err >= 0).all()):
            msg = "g_error: expected finite values >= 0"
            raise InvalidArgument(msg)
        try:
            gu = gu + np.broadcast_to(err, shape)
        except ValueError:
            msg = f"g_error: expected a shape broadcastable to {shape}, got {err.shape}"
            raise InvalidArgument(msg) from None
    return gb, gu
