"""Theorem A.4 (papers/attention.md), steps 4-7 of A.1 at their worst over the admissible inputs,
with step W for the safe softmax and the range checks R.4-R.6."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from mhanum.bounds._result import where_smaller
from mhanum.bounds.a_priori.sizes import Logits, Range
from mhanum.bounds.factors import (
    EVALUATION,
    compound,
    conversion_eta,
    exp_and_sum_factors,
    operand_bits,
    operand_error,
    safe_weight_sums,
    step_w_output,
    tensor_core_anchor,
)
from mhanum.bounds.softmax import division_error
from mhanum.numerics import Numerics
from mhanum.units import Naive, Online, Safe

__all__ = ["softmax_pv"]


def _expm1(x: float) -> float:
    return math.expm1(x) if x < 700 else math.inf


def softmax_pv(
    logits: Logits,
    n: int,
    min_keys: int,
    v_abs: np.ndarray,
    v_bar: np.ndarray,
    g_v: Any,
    num: Numerics,
    rng: Range,
) -> dict[str, np.ndarray]:
    """A.1 steps 4-7 at their worst over the admissible inputs (A.4), with R.4-R.6: vectors over
    ``d_v``; only the finite terms (what cannot be bounded is flagged in ``rng``).

    ``v_abs`` bounds the stand-ins ``|v_jl|`` (and the exact values), ``v_bar`` the entries the
    ``P V`` unit reads, ``g_v`` the stand-ins' error.
    """
    delta, reach = logits.delta, logits.reach
    fm = num.format_of("softmax")
    bits_pv = (operand_bits(num, num.format_of("prob")), operand_bits(num, num.format_of("input")))
    evaluation = _evaluation(logits, v_abs, g_v, rng)
    if evaluation is None:
        return {}
    gap = 2 * reach + 2 * delta
    x, blocks, g_sum, g_pv, eta_pv = exp_and_sum_factors(num, n, gap, None, bits_pv)
    # step W: the computed output's magnitude, whatever the logit errors (safe softmax)
    whole = _step_w(n, (g_sum, g_pv, eta_pv), v_abs, v_bar, num, rng)
    if not (2 * delta <= 700 and reach < math.inf):
        if whole is not None:
            return _whole_only(whole, num, rng)
        rng.flag(
            "the logit errors may reach Δ = {:.4g}: the softmax perturbation e^(2Δ) is not finite",
            "vacuous",
            delta,
        )
        return {"evaluation": evaluation}
    log_s_lo = 0.0
    if isinstance(num.softmax_algorithm, Naive):
        log_s_lo = _naive_ranges(reach + delta, n, min_keys, num, rng)
        if rng.vacuous:
            return {"evaluation": evaluation}
    r = _expm1(x)
    underflow = n * fm.smallest_normal * math.exp(-log_s_lo)
    t_sum = compound(r + underflow, g_sum) + underflow
    if not t_sum < 1:
        if whole is not None:
            return _whole_only(whole, num, rng)
        rng.flag(
            "softmax: the computed row sum may be off by 100% (its error factor T >= 1)", "vacuous"
        )
        return {"evaluation": evaluation}
    per_sum = math.exp(-log_s_lo) / (1 - t_sum)
    factors = (x, blocks, g_pv, eta_pv, t_sum, per_sum)
    terms, p_hat, pv_eta = _terms(delta, n, factors, v_abs, v_bar, num)
    terms["evaluation"] = evaluation
    if not all(np.isfinite(t).all() for t in terms.values()):
        if whole is not None:
            return _whole_only(whole, num, rng)
        rng.flag("the softmax and P·V terms are not finite in float64", "vacuous")
        return {"evaluation": evaluation}
    if whole is not None:
        return _least(
            terms,
            whole,
            (1 + g_pv) * p_hat * v_bar + pv_eta,
            v_abs + (1 + EVALUATION) * sum(terms.values()),
            num,
            rng,
        )
    _sum_ranges(terms, n, (blocks, g_sum, g_pv, p_hat, pv_eta), v_abs, v_bar, num, rng)
    return terms


def _evaluation(logits: Logits, v_abs: np.ndarray, g_v: Any, rng: Range) -> Any:
    """Step 0 and A.2 (b): the target moves with the float64 logits' error and the stand-ins'
    (``None``, flagged, where that perturbation is not finite)."""
    eps64, moved = logits.eps64, logits.moved
    if not 2 * max(eps64, moved) <= 700:
        rng.flag(
            "the float64 logits may be off the exact ones by {:.4g}: the target's perturbation "
            "e^(2ε) is not finite",
            "vacuous",
            max(eps64, moved),
        )
        return None
    evaluation = (math.expm1(2 * eps64) + math.expm1(2 * moved)) * v_abs
    return evaluation + math.exp(2 * moved) * np.asarray(g_v)


def _step_w(
    n: int,
    factors: tuple[Any, Any, Any],
    v_abs: np.ndarray,
    v_bar: np.ndarray,
    num: Numerics,
    rng: Range,
) -> _Whole | None:
    """Step W (safe softmax only; ``prob_offset`` is online only): Lemma W at the bounds, and
    R.5: the row sum of the computed exponentials, each at most ``1 + ε_e``. ``factors``:
    step 5's ``g_sum``, ``g_pv`` and ``η_pv``."""
    if not isinstance(num.softmax_algorithm, Safe):
        return None
    g_sum, g_pv, eta_pv = factors
    fm = num.format_of("softmax")
    u_div = division_error(num.div_ulps, fm.u)
    e_top = 1 + 2 * num.exp_ulps * fm.u
    rng.check(n * e_top * (1 + g_sum) + n * fm.smallest_normal, fm, "the softmax's row sum")
    _, row = safe_weight_sums(n, g_sum, u_div, fm)
    if not np.isfinite(row):
        return None
    acc, out = step_w_output(row, n, n, v_bar, n * v_bar, g_pv, eta_pv, num)
    return _Whole(acc, out, out + v_abs)


def _naive_ranges(top: float, n: int, min_keys: int, num: Numerics, rng: Range) -> float:
    """R.4, naive softmax: no shift: exp of a logit up to ``top = ρ + Δ``, the row sum up to
    ``2n·e^(ρ+Δ)`` (``T < 1``), and the reciprocal of the row sum, flushed once it is below
    ``2^emin`` of its carrier. Returns ``log`` of the row sum's least value."""
    fm = num.format_of("softmax")
    log_max = math.log(fm.max_finite)
    log_sum = math.log(n) + top + math.log(2)
    if top >= log_max - 1:
        rng.flag(
            "naive softmax: exp of an unshifted logit (up to ρ + Δ = {:.4g}) may overflow "
            f"{fm.name} (largest finite {fm.max_finite:.6g})",
            "vacuous",
            top,
        )
    elif log_sum >= log_max:
        rng.flag(
            f"naive softmax: the row sum of n = {n} exponentials (up to 2n·e^(ρ+Δ) = "
            f"e^{{:.4g}}) may overflow {fm.name} (largest finite {fm.max_finite:.6g})",
            "vacuous",
            log_sum,
        )
    carrier_emin = -1022 if fm.name == "float64" else -126
    if log_sum >= -carrier_emin * math.log(2) - 1:
        rng.flag(
            "naive softmax: the row sum may exceed 2^-emin of the reciprocal's format, which "
            "then flushes to zero",
            "vacuous",
        )
    return math.log(min_keys) - top  # > -log(max F_m): its exp is finite


def _terms(
    delta: float,
    n: int,
    factors: tuple[Any, ...],
    v_abs: np.ndarray,
    v_bar: np.ndarray,
    num: Numerics,
) -> tuple[dict[str, Any], Any, Any]:
    """Steps 5'-7 at their worst: the weights' deviations, their roundings into the
    probability and operand formats, ``P·V`` and the output. ``factors``: step 5's ``x``,
    blocks, ``g_pv``, ``η_pv``, the row sum's ``T`` and ``1/(S(1 - T))``. Returns the terms,
    the bound on the weights ``P·V`` reads and its underflow."""
    x, blocks, g_pv, eta_pv, t_sum, per_sum = factors
    fmts = {r: num.format_of(r) for r in ("softmax", "prob", "output")}
    u_p, u_o = fmts["prob"].u, fmts["output"].u
    eta_m, eta_p, eta_o = (fmts[r].smallest_normal for r in ("softmax", "prob", "output"))
    u_op, eta_op = operand_error(num)
    eta_op += conversion_eta(num, num.operand_rounding or fmts["prob"])
    u_div = division_error(num.div_ulps, fmts["softmax"].u)
    online = isinstance(num.softmax_algorithm, Online)
    mass = math.exp(2 * delta)  # Σ_j p̃_j <= Σ_j p_j e^{2Δ}
    y = x + math.log1p(u_div) - math.log1p(-t_sum)
    soft = mass * _expm1(y) + n * (eta_m * (1 + u_div) * per_sum + eta_m)
    p_hat = mass + soft
    prob = u_p * p_hat + n * (eta_p * per_sum + blocks * eta_m * per_sum if online else eta_p)
    p_hat += prob
    operand_p = u_op * p_hat + n * eta_op
    p_hat += operand_p
    anchor = tensor_core_anchor(num)
    pv_eta: Any = eta_pv
    if anchor:
        weights = n if online else p_hat
        pv_eta = eta_pv + g_pv * anchor * (weights + n * v_bar + n * anchor)
    scale_out = (1 + u_o) * ((1 + u_div) if online else 1.0)
    terms = {
        "logits": scale_out * math.expm1(2 * delta) * v_bar,
        "softmax": scale_out * soft * v_bar,
        "probability_rounding": scale_out * prob * v_bar,
        "operands": scale_out * (operand_p * v_bar + p_hat * (v_bar - v_abs)),
        "pv": scale_out * (g_pv * p_hat * v_bar + (pv_eta * per_sum if online else pv_eta)),
        "output": u_o * v_abs + eta_o + ((1 + u_o) * (u_div * v_abs + eta_m) if online else 0.0),
    }
    return terms, p_hat, pv_eta


def _sum_ranges(
    terms: dict[str, Any],
    n: int,
    factors: tuple[Any, ...],
    v_abs: np.ndarray,
    v_bar: np.ndarray,
    num: Numerics,
    rng: Range,
) -> None:
    """R.5: the sums of steps 5 and 7; R.6: the output, ``|ô| <= max|v*| + the bound`` (online:
    also where it is divided). ``factors``: blocks, ``g_sum``, ``g_pv``, ``p̂`` and ``η_pv``."""
    blocks, g_sum, g_pv, p_hat, pv_eta = factors
    fm, fa = num.format_of("softmax"), num.format_of("accum")
    online = isinstance(num.softmax_algorithm, Online)
    if online:
        eps_e = 2 * num.exp_ulps * fm.u
        growth = ((1 + eps_e) * (1 + fm.u) * (1 + fa.u) ** 2) ** (blocks + 1)
        rng.check(
            n * growth * (1 + g_sum) + n * blocks * fm.smallest_normal,
            fm,
            "online softmax: the running sum",
        )
        u_p = num.format_of("prob").u
        acc_upper = growth * (1 + u_p) * (1 + g_pv) * n * v_bar + pv_eta
        for fmt in (fa, fm):
            rng.check(acc_upper, fmt, "online softmax: the unnormalised P·V accumulator")
    else:
        rng.check((1 + g_pv) * p_hat * v_bar + pv_eta, fa, "P·V accumulated")
    upper = v_abs + (1 + EVALUATION) * sum(terms.values())
    rng.check(upper, num.format_of("output"), "the output")
    if online:
        rng.check(upper, fm, "the output divided in the softmax format")


class _Whole(NamedTuple):
    """Lemma W (papers/attention.md, step W) at the bounds: ``acc >= |P·V accumulated|``,
    ``out >= |ô|``, ``total = out + |v| >= |ô - o|``, whatever the logit errors."""

    acc: np.ndarray
    out: np.ndarray
    total: np.ndarray


def _whole_checks(whole: _Whole, acc_upper: Any, out_upper: Any, num: Numerics, rng: Range) -> None:
    """R.5 and R.6 with the least enclosures (``whole``'s or the terms'): ``P·V`` accumulated,
    the output."""
    rng.check(np.fmin(acc_upper, whole.acc), num.format_of("accum"), "P·V accumulated")
    rng.check(np.fmin(out_upper, whole.out), num.format_of("output"), "the output")


def _whole_only(whole: _Whole, num: Numerics, rng: Range) -> dict[str, Any]:
    """The bound where the logit errors leave only the magnitudes: ``|ô - o| <= |ô| + |o|``."""
    _whole_checks(whole, math.inf, math.inf, num, rng)
    return {"magnitudes": whole.total}


def _least(
    terms: dict[str, Any],
    whole: _Whole,
    acc_upper: Any,
    out_upper: Any,
    num: Numerics,
    rng: Range,
) -> dict[str, Any]:
    """The terms, or entrywise the magnitudes where they are smaller than the terms' sum."""
    _whole_checks(whole, acc_upper, out_upper, num, rng)
    return where_smaller(terms, whole.total, "magnitudes")[0]
