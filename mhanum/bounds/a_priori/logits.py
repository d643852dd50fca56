"""Theorem A.4 (papers/attention.md), steps 0-3 of A.1 at their worst over the admissible inputs:
the operands (R.1, R.2), the scale (steps 2 and 2'), the logits' error and range (R.3, R.4), and
the values the ``P V`` unit reads."""

from __future__ import annotations

import numpy as np

from mhanum.bounds.a_priori.sizes import Logits, Operand, Range, pair, perturbed
from mhanum.bounds.factors import (
    F64_DOT,
    compound,
    conversion_eta,
    operand_bits,
    operand_error,
    tensor_core_anchor,
    unit_eta,
    unit_factor,
)
from mhanum.bounds.scale import is_power_of_four, operand_scale, power_of_two, scale_rounding
from mhanum.numerics import Numerics

__all__ = ["logit_error", "read_values"]


def logit_error(
    qo: Operand,
    ko: Operand,
    d_k: int,
    num: Numerics,
    scale: float,
    default_scale: bool,
    rng: Range,
) -> Logits:
    """A.1 steps 0-3 at their worst over the admissible inputs (A.4), with R.1-R.4."""
    store = num.storage_format
    # R.1: the stored operands
    rng.check(qo.stored(), store, "q in the input format")
    rng.check(ko.stored(), store, "k in the input format")
    if num.scale != "scores":
        qo, ko = _scaled_bounds(qo, ko, d_k, num, scale, default_scale, rng)
        scale, default_scale = 1.0, False
    score, soft, acc = (num.format_of(r) for r in ("score", "softmax", "accum"))
    u_s, eta_s = score.u, score.smallest_normal
    f_q = num.format_of("scale") if num.scale != "scores" else store
    f_k = num.format_of("scale") if num.scale == "qk" else store
    # Step 1: e_op = e + u_op(|x| + e) + η_op + η_conv with e = rel·B + err
    u_op, eta_op = operand_error(num)
    op = num.operand_rounding
    a_q, a_k = qo.rel + u_op * (1 + qo.rel), ko.rel + u_op * (1 + ko.rel)
    b_q = (1 + u_op) * qo.err + eta_op + conversion_eta(num, op or f_q)
    b_k = (1 + u_op) * ko.err + eta_op + conversion_eta(num, op or f_k)
    # R.2: the operands read into the operand and accumulation formats
    q_op = (1 + a_q) * qo.entry() + float(np.max(b_q))
    k_op = (1 + a_k) * ko.entry() + float(np.max(b_k))
    for fmt, where in ((op, "the dot's operand format"), (acc, "the accumulation format")):
        if fmt is not None:
            rng.check(q_op, fmt, f"q read into {where}")
            rng.check(k_op, fmt, f"k read into {where}")
    pq = pair(qo, ko)
    operands = perturbed(qo, a_q, b_q, ko, a_k, b_k, d_k)
    op_pair = pq + operands  # >= |q_op|·|k_op|
    bits = (operand_bits(num, f_q), operand_bits(num, f_k))
    f_qk, anchor = unit_factor(num, d_k, None, bits=bits), tensor_core_anchor(num)
    unit = f_qk * op_pair + unit_eta(num, d_k)
    if anchor:
        sums = (1 + a_q) * qo.sums(d_k) + (1 + a_k) * ko.sums(d_k)
        sums += float(np.sum(np.broadcast_to(b_q, (d_k,))) + np.sum(np.broadcast_to(b_k, (d_k,))))
        unit += f_qk * anchor * (sums + d_k * anchor)
    # Step 2: the constant (a subnormal one may be read as zero: u_c = 1)
    c_hat, u_c, u_mul = scale_rounding(scale, score)
    if default_scale and not is_power_of_four(d_k):
        u_c = compound(2.0**-53, u_c, over=(2.0**-53,))
    theta = compound(u_s, u_c, u_mul)
    # Step 0: the float64 logits are off the stand-ins' exact logits by at most eps64
    c = abs(scale)
    eps64 = F64_DOT * (d_k + 2) * c * pq
    delta = c * ((operands + unit) * (1 + theta) + theta * pq)
    delta += (abs(c_hat) * (1 + u_s) + 2) * eta_s + eps64
    # R.3: QKᵀ accumulated, rounded to the score format, times the constant; R.4 its read
    acc_upper = op_pair + unit
    rng.check(acc_upper, acc, "QKᵀ accumulated")
    rng.check(acc_upper, score, "QKᵀ rounded to the score format")
    s_upper = abs(c_hat) * ((1 + u_s) * acc_upper + eta_s) * (1 + u_s) + eta_s
    if num.scale == "scores":
        rng.check(s_upper, score, f"the scores times the scale {c_hat:.4g}")
    rng.check(s_upper, soft, "the scores read into the softmax format")
    if soft.smallest_normal > score.smallest_normal:
        delta += soft.smallest_normal
    moved = c * perturbed(qo, qo.grel, qo.gerr, ko, ko.grel, ko.gerr, d_k)
    return Logits(delta, c * pq + eps64, eps64, moved)


def _scaled_bounds(
    qo: Operand,
    ko: Operand,
    d_k: int,
    num: Numerics,
    scale: float,
    default_scale: bool,
    rng: Range,
) -> tuple[Operand, Operand]:
    """Step 2' at its worst: the scaled stand-ins ``fl64(f64·x)``, their errors (as in A.1) and
    R.2 for the read into the scale format and the product there."""
    sc = operand_scale(scale, d_k, default_scale, num)
    fmt, f64, u64, f_hat, u_t = sc.fmt, sc.f64, sc.u64, sc.f_hat, sc.u_t
    theta, up, eta = sc.theta, sc.up, sc.eta
    r64 = 0.0 if power_of_two(f64) else 2.0**-53  # the float64 product's rounding

    def scaled(x: Operand, name: str) -> Operand:
        stored = x.stored()
        rng.check(stored, fmt, f"{name} read into the scale format")
        rng.check(
            abs(f_hat) * stored * (1 + u_t) + fmt.smallest_normal,
            fmt,
            f"{name} times the scale factor {f_hat:.4g}",
        )
        return Operand(
            None if x.size is None else up * x.size,
            up * x.norm,
            theta + (1 + theta) * x.rel + r64,
            up * (1 + theta) * x.err + 2.0**-1074 + eta,
            (x.grel + u64) / (1 - u64) + r64,
            up * np.asarray(x.gerr) / (1 - u64) + 2.0**-1074,
        )

    return scaled(qo, "q"), (scaled(ko, "k") if num.scale == "qk" else ko)


def read_values(v_abs: np.ndarray, e_v: np.ndarray, num: Numerics, rng: Range) -> np.ndarray:
    """``v̄ >= |v_used|``, the values the ``P V`` unit reads (A.1 step 1), with R.1 and R.2."""
    rng.check(v_abs + e_v, num.storage_format, "v in the input format")
    u_op, eta_op = operand_error(num)
    op = num.operand_rounding
    v_bar = (1 + u_op) * (v_abs + e_v) + eta_op + conversion_eta(num, op or num.storage_format)
    for fmt, where in (
        (op, "the dot's operand format"),
        (num.format_of("accum"), "the accumulation format"),
    ):
        if fmt is not None:
            rng.check(v_bar, fmt, f"v read into {where}")
    return v_bar
