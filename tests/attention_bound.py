"""A rigorous componentwise error bound for single-head attention, used as the tests' tolerance.

Scope: inputs q, k, v already values of the input format (so no input rounding), a scale that is a
power of two (``d_k = 4**m``, so scaling is exact up to underflow), score format contained in the
softmax format, no bias, a boolean mask (if any) applied with ``-inf`` and no fully-masked row,
and ``exp`` accurate to ``exp_ulps`` ulps. A masked key has logit ``-inf`` exactly, so its weight
is exactly 0 at every stage; the sums still count all ``n`` keys, which only loosens the bound. An operand format
(tf32) rounds each dot operand once more: ``x̃ = x(1 + δ) + η``, ``|δ| <= u_op``, so
``|q̃·k̃ - q·k| <= ((1 + u_op)² - 1)|q|·|k| + η_op(Σ|q| + Σ|k|)(1 + u_op) + d_k η_op²`` and the
dot's own error is taken over ``|q̃|·|k̃| <= (1 + u_op)²|q|·|k| + ...``; likewise for ``P V``.

Standard model with underflow: every rounding into a format F gives ``x(1 + δ) + η`` with
``|δ| <= u_F`` and ``|η| <= η_F := 2**emin_F``. (``η_F`` is the smallest normal number rather than
half the subnormal spacing because XLA's CPU backend flushes float32 subnormals to zero.)
``γ(n, u) = n·u/(1 - n·u)``. Errors of the exact quantities ``t_ij = q_i·k_j``,
``s_ij = scale·t_ij``, ``p = softmax(s)``, ``o = p v``:

1. Scores (any summation order, products rounded; Higham 2002, eq. (3.5) and §3.1):
   ``|ŝ_ij - s_ij| <= δ_ij := scale·(A_ij(1 + u_s) + u_s|t_ij|) + 2η_s`` with
   ``A_ij = γ(d_k, u_a)|q_i|·|k_j| + 2·d_k·η_a``. Let ``Δ_i = max_j δ_ij``.
2. Exact softmax of the computed logits, ``p̃ = softmax(ŝ)``: ``p̃_ij/p_ij ∈ [e^{-2Δ_i}, e^{2Δ_i}]``.
3. Computed softmax of ``ŝ`` (shift ``m``, ``x_j = fl(ŝ_j - m)``, ``ê_j = fl(exp x_j)``):
   ``|ê_j - e_j| <= R_j e_j + η_m`` with ``e_j = exp(ŝ_j - m)``,
   ``R_j = e^{σ_j}(1 + ε_e) - 1``, ``σ_j = u_m|ŝ_j - m| + η_m`` (0 for the naive softmax, where
   ``m = 0``), ``ε_e = 2·exp_ulps·u_m`` (an ulp is at most ``2u`` relative). (A lower deviation
   ``1 - e^{-σ}(1 - ε) <= σ + ε <= R``.)
   Sum in any order: ``d̂ = S(1 + θ)``, ``|θ| <= T := (1 + R_max + nη_m/S)(1 + γ(n-1, u_m)) - 1 +
   nη_m/S`` with ``S = Σ e_j``. Division ``(1 + u_div)``, ``u_div = 2·div_ulps·u_m``, ``+ η_m``.
   So ``|p̂_j - p̃_j| <= p̃_j((1 + R_j)(1 + u_div)/(1 - T) - 1) + η_m(1 + u_div)/(S(1 - T)) + η_m``,
   and rounding to the probability format adds ``u_p|p̂_j| + η_p``.
   Online softmax (blocks of B, ``nb`` blocks): each term is further multiplied by at most
   ``nb - 1`` rescaling factors ``ĉ = fl(exp(fl(m - m')))``, each rounded once more in the
   softmax format (for ``d``) and, after conversion, twice in the accumulation format (for the
   accumulator); ``|m - m'|`` and ``|ŝ_j - m|`` are at most the logit range ``ρ``. So ``R_j`` is
   replaced by ``(1 + R)·((1 + R_c)(1 + u_m)(1 + u_a)²)^{nb-1} - 1`` with
   ``R = R_c = e^{u_m ρ + η_m}(1 + ε_e) - 1``, the sums by ``γ(n + nb, ·)`` (the running sum adds
   one rounding per block), and the final ``acc / d`` adds ``u_div`` relative and ``η_m``.
4. ``P V`` in any order: ``|fl(p̂'·v) - p̂'·v| <= γ(n, u_a)|p̂'|·|v| + 2nη_a``; output rounding
   ``u_o|ô'| + η_o``.
Altogether ``|ô - o| <= u_o|o| + (1 + u_o)(Σ_j |p̂'_j - p_j||v_j| + γ(n, u_a)Σ_j|p̂'_j||v_j| +
2nη_a) + η_o``, with ``|p̂'_j - p_j| <= |p̂'_j - p̃_j| + (e^{2Δ} - 1)p_j`` and ``|p̂'_j| <=
p_j e^{2Δ} + |p̂'_j - p̃_j|``.

The bound is evaluated in float64 from the float64 exact quantities; the factor ``1 + 2**-40``
covers the rounding of that evaluation (a few hundred float64 roundings, each ``2**-53``).
"""

from __future__ import annotations

import math

import numpy as np

from mhanum import Numerics


class VacuousBoundError(ArithmeticError):
    """The inputs lie outside the bound's hypotheses (the computed softmax sum may be off by 100%)."""


def _gamma(n: int, u: float) -> float:
    assert n * u < 1
    return n * u / (1 - n * u)


def attention_error_bound(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, num: Numerics, mask: np.ndarray | None = None
) -> np.ndarray:
    """Componentwise bound on ``|attention(q, k, v, mask, numerics=num) - exact|`` (2-D inputs)."""
    keep = (
        np.ones((q.shape[0], k.shape[0]), bool)
        if mask is None
        else np.broadcast_to(mask, (q.shape[0], k.shape[0]))
    )
    assert keep.any(axis=-1).all()
    assert mask is None or num.mask_value == -math.inf
    d_k, n = q.shape[-1], k.shape[-2]
    assert math.log(d_k, 4).is_integer(), "the scale must be a power of two"
    assert num.scale == "scores"
    op = num.format_of("operand")
    u_op, eta_op = (op.u, op.smallest_normal) if num.operand_format is not None else (0.0, 0.0)
    op_factor = (1 + u_op) ** 2
    f = {r: num.format_of(r) for r in ("accum", "score", "softmax", "prob", "output")}
    assert f["score"].precision <= f["softmax"].precision
    u_a, u_s, u_m, u_p, u_o = (f[r].u for r in ("accum", "score", "softmax", "prob", "output"))
    eta_a, eta_s, eta_m, eta_p, eta_o = (
        f[r].smallest_normal for r in ("accum", "score", "softmax", "prob", "output")
    )
    eps_e = 2 * num.exp_ulps * u_m
    u_div = 2 * num.div_ulps * u_m
    scale = d_k**-0.5

    t = q @ k.T
    s = scale * t
    qk_abs = np.abs(q) @ np.abs(k).T
    op_abs = 2 * eta_op * (np.abs(q).sum(-1)[:, None] + np.abs(k).sum(-1)[None, :] + d_k)
    a = (op_factor - 1) * qk_abs + op_abs + _gamma(d_k, u_a) * (op_factor * qk_abs + op_abs)
    a += 2 * d_k * eta_a
    delta = scale * (a * (1 + u_s) + u_s * np.abs(t)) + 2 * eta_s
    delta = np.where(keep, delta, 0.0)
    big_delta = delta.max(axis=-1, keepdims=True)
    s = np.where(keep, s, -np.inf)

    shift = s.max(axis=-1, keepdims=True)
    p = np.exp(s - shift)
    p /= p.sum(axis=-1, keepdims=True)
    spread = 2 * big_delta
    lowest = np.where(keep, s, np.inf).min(axis=-1)
    logit_range = (s.max(axis=-1) - lowest)[:, None] + 2 * big_delta

    kind = num.softmax_kind
    if kind == "naive":
        sigma = np.full_like(s, eta_m)
        e_sum = np.exp(s).sum(axis=-1, keepdims=True) * np.exp(-spread)
    else:
        sigma = np.where(keep, u_m * (np.abs(np.where(keep, s, 0) - shift) + 2 * big_delta), 0)
        sigma = sigma + eta_m
        e_sum = np.exp(s - shift).sum(axis=-1, keepdims=True) * np.exp(-spread)
    r_term = np.exp(sigma) * (1 + eps_e) - 1
    n_sum, n_pv, blocks = n - 1, n, 0
    if kind == "online":
        blocks = -(-n // num.softmax_block)
        r_c = np.exp(u_m * logit_range + eta_m) * (1 + eps_e) - 1
        rescale = ((1 + r_c) * (1 + u_m) * (1 + u_a) ** 2) ** (blocks - 1)
        r_term = (1 + np.maximum(r_term, r_c)) * rescale - 1
        n_sum, n_pv = n + blocks, n + blocks
    underflow = n * eta_m / e_sum
    t_sum = (1 + r_term.max(axis=-1, keepdims=True) + underflow) * (1 + _gamma(n_sum, u_m)) - 1
    t_sum = t_sum + underflow
    if not np.all(t_sum < 1):
        raise VacuousBoundError(
            f"the relative error of the computed sum may reach {t_sum.max():.3g}"
        )
    p_tilde_hi = p * np.exp(spread)
    dev = p_tilde_hi * ((1 + r_term) * (1 + u_div) / (1 - t_sum) - 1)
    # Absolute errors of unnormalised quantities reach p divided by the computed sum.
    per_sum = 1 / (e_sum * (1 - t_sum))
    dev += eta_m * (1 + u_div) * per_sum + eta_m
    p_hat_hi = p_tilde_hi + dev
    online = kind == "online"
    dev += u_p * p_hat_hi + (eta_p * per_sum + blocks * eta_m * per_sum if online else eta_p)
    p_hat_hi = p_tilde_hi + dev
    dev += u_op * p_hat_hi + eta_op  # the operand rounding of P (absent without an operand format)
    p_hat_hi = p_tilde_hi + dev
    p_dev = dev + (np.exp(spread) - 1) * p
    v_abs = (1 + u_op) * np.abs(v) + eta_op

    o = p @ v
    pv_underflow = 2 * (n + blocks) * eta_a * per_sum if online else 2 * n * eta_a
    inner = p_dev @ v_abs + _gamma(n_pv, u_a) * (p_hat_hi @ v_abs) + pv_underflow
    inner += p_hat_hi @ (v_abs - np.abs(v))  # the operand rounding of V
    if online:  # the final acc / d: |fl(X) - o| <= u_div|o| + (1 + u_div)|X - o| + η_m
        inner = u_div * np.abs(o) + (1 + u_div) * inner + eta_m
    bound = u_o * np.abs(o) + (1 + u_o) * inner + eta_o
    return bound * (1 + 2.0**-40)
