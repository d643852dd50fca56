"""Theorem A.2, steps (c') and (c'') (papers/attention.md): a head's logits and softmax terms
through the output projection's weights with their signs, where (c) takes them through ``|ŵ|``.
Each is the head's share of ``|Σ_l e_l ŵ_op,lm|`` for its part ``e`` of the head output's error;
the layer's bound (:mod:`mhanum.bounds.forward.mha`) takes it where it is smaller."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mhanum.bounds.factors import evaluation_rounding
from mhanum.bounds.forward.stage import PROJECTED, SOFTMAX_PROJECTED, Projection

__all__ = ["Through", "through_keys", "through_weights"]


@dataclasses.dataclass(frozen=True, eq=False)
class Through:
    """Steps (c') and (c'') on one head's keys, the same for every chunk of its query rows:
    the projection, ``read`` the values' errors through ``|ŵ_op|`` (``v_extra @ slope``),
    ``z = plain + read >= |z̃|``, ``centred + read``, ``Σ_j z_j`` and ``slope - |ŵ|``."""

    project: Projection
    read: np.ndarray
    z: np.ndarray
    centred_read: np.ndarray
    z_sum: np.ndarray
    slope_gap: np.ndarray


def through_keys(project: Projection, v_extra: np.ndarray) -> Through:
    """:class:`Through` for the values' errors ``v_extra >= |ṽ - v|``: taken once per head."""
    with np.errstate(over="ignore", invalid="ignore"):
        read = v_extra @ project.slope
        z = project.plain + read
        return Through(
            project, read, z, project.centred + read, z.sum(axis=0),
            project.slope - np.abs(project.weights),
        )  # fmt: skip


def through_weights(
    through: Through,
    logits: tuple[np.ndarray, np.ndarray],
    softmax: tuple[Any, Any, Any, Any, Any],
    row_sum: np.ndarray,
    output: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    scale_out: float | np.ndarray,
) -> dict[str, np.ndarray]:
    """Steps (c') and (c'') for one head's rows.

    ``logits = (L, L|v - c|)``: step 4's per-key deviations ``L_j >= |p̃_j - p_j|`` and the
    logits term before the output's rounding. ``softmax = (rel, soft, η, term, p̄)``: step 5''s
    ``rel_j = p̄_jΦ_j``, the per-key deviations ``soft_j >= |p̂_j - p̃_j|``, the absolute part
    ``η``, the softmax term before the output's rounding and ``p̄_j >= p̃_j``; ``row_sum`` the
    row sum's relative error ``T``; ``output = (o, p, ev, v_extra)``: the float64 head output,
    the probabilities it was formed with, its evaluation error and the values' errors
    (``|ṽ - v| <= v_extra``). ``scale_out`` is the head output's rounding factor ``κ_h``: its
    rounding ``θ_l`` is not common to the row, so the parts it multiplies go through
    ``|ŵ_op| <= slope``. ``through``: the head's keys' side (:func:`through_keys`), whose
    ``read`` bounds ``|z̃_jm - z*_jm|`` for the values as read (their errors through
    ``|ŵ_op|``).
    """
    project = through.project
    slope = project.slope
    with np.errstate(over="ignore", invalid="ignore"):
        return {
            PROJECTED: logits[0] @ project.centred + (scale_out - 1) * (logits[1] @ slope),
            SOFTMAX_PROJECTED: _softmax_signed(through, (logits[0], *softmax), row_sum, output)
            + (scale_out - 1) * (softmax[3] @ slope),
        }


def _softmax_signed(
    through: Through,
    weights: tuple[Any, Any, Any, Any, Any, Any],
    row_sum: np.ndarray,
    output: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> np.ndarray:
    """Step (c''): with ``p̂_j = p̃_j(1 + φ_j)/(1 + τ) + a_j`` (step 5', ``|φ_j| <= Φ_j``,
    ``|τ| <= T``, ``|a_j| <= η``) and ``Σ_j p̃_j ṽ_j = õ``,
    ``Σ_l ŵ_op,lm Σ_j (p̂_j - p̃_j)ṽ_jl = (Σ_j p̃_jφ_j z̃_jm - τ õ·ŵ_op,m)/(1 + τ) + Σ_j a_j z̃_jm``
    (``z̃_jm = ṽ_j·ŵ_op,m``), at most ``(Σ_j rel_j Z_jm + T Õ_m)/(1 - T) + η Σ_j Z_jm`` with
    ``Z >= |z̃|`` and ``Õ_m >= |õ·ŵ_op,m|``; and at most ``Σ_j soft_j Z_jm``. ``Õ`` keeps the
    cancellation in ``o·ŵ``: ``õ·ŵ_op = o*·ŵ_op + Σ_j p_j (ṽ_j - v*_j)·ŵ_op +
    Σ_j (p̃_j - p_j)(z̃_jm - c_m)`` (the deviations sum to zero), each part bounded, the
    float64 ``o·ŵ`` with its rounding and the read of ``ŵ``; or ``Σ_j p̄_j Z_jm``."""
    deviations, rel, soft, eta, _, p_hi = weights
    o, p, o_err, _ = output
    project, z = through.project, through.z
    o_abs = np.abs(o)
    ev = evaluation_rounding(max(o.shape[-1], p.shape[-1]))
    o_w = np.abs(o @ project.weights) + (ev * o_abs + o_err) @ project.slope
    o_w = o_w + o_abs @ through.slope_gap
    o_w = o_w + p @ through.read + deviations @ through.centred_read
    o_w = np.fmin(o_w * (1 + 4 * ev), p_hi @ z)
    inv = np.where(row_sum < 1, 1 / (1 - row_sum), np.inf)
    signed = (rel @ z) * inv + row_sum * inv * o_w + eta * through.z_sum
    return np.fmin(signed, soft @ z) * (1 + 4 * ev)
