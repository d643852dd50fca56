"""Steps 0, 3, 3c, 3' and 3'' of Theorem A.1 (papers/attention.md): the logits and their errors
``δ``, apportioned to their sources (the operands, the ``Q Kᵀ`` dot, the scale, the soft-cap,
the bias, a finite masking constant, the exponent's folded scale), with their range checks
(R.3, R.4, R.4')."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum.bounds.a_priori.softcap import cap_roundings, evaluated_constants
from mhanum.bounds.enclosure import one_signed_sizes, one_signed_total
from mhanum.bounds.factors import (
    F64_DOT,
    LOG2E,
    compound,
    rounding_error,
    tensor_core_anchor,
    unit_eta,
    unit_factor,
)
from mhanum.bounds.forward.evaluation import on
from mhanum.bounds.forward.operands import Constant, Operands
from mhanum.bounds.forward.ranges import Ranges
from mhanum.bounds.forward.stage import Head, Setting
from mhanum.formats import Format, round_to
from mhanum.numerics import Numerics
from mhanum.units import Fill

__all__ = [
    "Constant",
    "Dots",
    "Logits",
    "Masking",
    "bias_step",
    "dots_step",
    "fold_step",
    "known_scores_step",
    "logits_step",
    "masking_step",
    "softcap_step",
    "softmax_read_step",
]

LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True, eq=False)
class Dots:
    """Step 3's dots: ``t = q kᵀ`` (float64), ``|q||k|ᵀ``, the operands' part
    ``e_q|k| + |q|e_k + e_q e_k``, ``q_op k_opᵀ``, the unit's error, its anchor, and a bound on
    every partial sum of the accumulation (R.3's ``(1 + γ)q_op k_opᵀ`` and underflow: R.8's
    smaller error bounds the result, not the partial sums on the way)."""

    t: np.ndarray
    qk_abs: np.ndarray
    operands: np.ndarray
    qk_op: np.ndarray
    unit: np.ndarray
    anchor: float
    partials: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Logits:
    """The logits' enclosure as the stages of step 3 pass it on: the float64 logits ``s``,
    ``δ >= |ŝ - s*|`` and its sources (they add up to it), the bound ``s_upper`` on the
    computed scores, the float64 logits' own error ``eps64`` (step 0), ``QKᵀ``'s bound
    ``acc_upper``, the logits whose scores are used (not replaced by a mask), and the bias's
    factor on the earlier sources (``1 + u_s`` where a nonzero bias is added)."""

    s: np.ndarray
    delta: Any
    sources: dict[str, Any]
    s_upper: Any
    eps64: Any
    acc_upper: Any
    used: np.ndarray
    bias_factor: Any = 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class Masking:
    """Step 3': the keys of the leaky problem (``live``), those it attends beyond the exact
    attention (``exclude``)."""

    live: np.ndarray
    exclude: np.ndarray


def dots_step(head: Head, ops: Operands, num: Numerics, lam: float | None) -> Dots:
    """Step 3. The ``Q Kᵀ`` dots of the operands as read (step 1), and the unit's error:
    its factor of ``d_k`` terms times ``q_op k_opᵀ`` and its underflow (Theorem S.0), with the
    tensor-core unit's anchor."""
    q, k = head.q, head.k
    t = q @ k.T
    qk_abs = ops.q_abs @ ops.k_abs.T
    # e_q|k| + |q|e_k + e_q e_k (no product for operands read exactly)
    operands = np.zeros_like(t)
    if ops.some_errors[0]:
        operands = ops.e_q_op @ ops.k_op.T
    if ops.some_errors[1]:
        operands = operands + ops.q_abs @ ops.e_k_op.T
    # (operands read exactly: q_op = |q|, k_op = |k|, the product already taken)
    qk_op = qk_abs if _read_exactly(ops) else ops.q_op @ ops.k_op.T
    partials = qk_op + _unit_error(ops, num, qk_op, None, None)
    dots = Dots(t, qk_abs, operands, qk_op, partials, tensor_core_anchor(num), partials)
    unit = _unit_error(ops, num, qk_op, lam, _signed_dot(dots, ops.q_op.shape[-1]))
    return dataclasses.replace(dots, unit=unit)


def _read_exactly(ops: Operands) -> bool:
    """Whether the dot reads ``q`` and ``k`` as given (step 1: no operand errors)."""
    return not any(ops.some_errors)


def _signed_dot(dots: Dots, d_k: int) -> np.ndarray:
    """``>= |q̂·k̂|``, the exact dot of the operands as read: ``|t|``, their errors' part, and
    the float64 ``t``'s own error (``d_k`` products and sums)."""
    return np.abs(dots.t) + dots.operands + F64_DOT * (d_k + 2) * dots.qk_abs


def _unit_error(
    ops: Operands, num: Numerics, qk_op: np.ndarray, lam: float | None, signed: np.ndarray | None
) -> np.ndarray:
    """Step 3: the dot unit's error on ``q_op k_opᵀ``, its factor of ``d_k`` terms (Theorem
    S.0; A.3's with ``lam``) and its underflow, with the tensor-core unit's anchor; on an IEEE
    unit also at most Theorem R.8's, through the one-signed total of the products (``signed
    >= |q̂·k̂|``; ``None``: not), and with ``lam`` R.8''s. R.8 holds on every event; R.8' fails
    on one event per dot, of the ``d_k`` chains' the union bound counts for it, and which form
    is taken depends on the inputs only, so each dot's bound is still one of the counted
    events."""
    d_k = ops.q_op.shape[-1]
    f_qk, anchor = unit_factor(num, d_k, lam, bits=ops.bits_qk), tensor_core_anchor(num)
    unit = f_qk * qk_op + unit_eta(num, d_k)
    if anchor:
        sums = ops.q_op.sum(axis=-1)[:, None] + ops.k_op.sum(axis=-1)[None, :] + d_k * anchor
        return unit + f_qk * anchor * sums
    if signed is None:
        return unit
    sizes = one_signed_sizes(num, d_k, ops.bits_qk, qk_op, one_signed_total(qk_op, signed, d_k))
    if sizes is None:
        return unit
    for form in {None, lam}:  # R.8, and R.8' with lam: one event per dot, within the d_k
        one_signed = sizes.error(form)
        unit = unit if one_signed is None else np.fmin(unit, one_signed)
    return unit


def logits_step(
    dots: Dots, head: Head, setting: Setting, const: Constant, ranges: Ranges
) -> Logits:
    """Steps 0 and 3: the float64 logits ``s = c·t`` (off the exact ones by at most
    ``eps64``), their errors ``δ_ij`` by source (``operands``, ``qk_dot``, ``scale``), and
    R.3: ``QKᵀ`` in the accumulation format, rounded to the score format, scaled there (or,
    folded, R.3'': the products ``t·c2`` and ``m·c2`` in the softmax format)."""
    num, scale = setting.num, setting.scale
    d_k = head.q.shape[-1]
    acc, f_s, f_m = (num.format_of(r) for r in ("accum", "score", "softmax"))
    u_s, eta_s = f_s.u, f_s.smallest_normal
    theta, c_hat = const.theta, const.c_hat
    # Step 0. The float64 logits s = c·t (+ b) are off the exact ones by at most eps64.
    eps64 = F64_DOT * (d_k + 2) * abs(scale) * dots.qk_abs
    # the sources of δ (they add up to it), to apportion the logits term: Bound.parts
    sources = {
        "operands": abs(scale) * dots.operands * (1 + theta),
        "qk_dot": abs(scale) * dots.unit * (1 + theta),
        "scale": abs(scale) * theta * np.abs(dots.t) + (abs(c_hat) * (1 + u_s) + 2) * eta_s + eps64,
    }
    used = np.ones_like(head.keep) if head.replaced is None else ~head.replaced
    acc_upper = on(used, dots.qk_op + dots.unit, 0.0)
    ranges.check(on(used, dots.partials, 0.0), acc, "QKᵀ accumulated")
    ranges.check(acc_upper, f_s, "QKᵀ rounded to the score format")
    s_upper = abs(c_hat) * ((1 + u_s) * acc_upper + eta_s) * (1 + u_s) + eta_s
    if const.folded:
        c2_hat = const.c2_hat
        t_c2 = abs(c2_hat) * ((1 + u_s) * acc_upper + eta_s) * (1 + f_m.u)
        ranges.check(t_c2, f_m, f"the scores times c2 = {c2_hat:.4g} ({num.exp_form})")
    elif num.scale == "scores":
        ranges.check(s_upper, f_s, f"the scores times the scale {c_hat:.4g}")
    delta = sum(sources.values())
    return Logits(scale * dots.t, delta, sources, s_upper, eps64, acc_upper, used)


def _tanh_spread(x0: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``sup_{|y - x0| <= w} |tanh y - tanh x0| = sinh(w)/(cosh(x0)·cosh(||x0| - w|))``, rounded
    up (evaluated in log space; at most ``min(w, 2)``, tanh being 1-Lipschitz with range 2)."""
    a = np.abs(x0)
    b = np.abs(a - w)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        log_sinh = np.where(w > 20.0, w - LN2, np.log(np.sinh(np.minimum(w, 20.0))))

        def log_cosh(y: np.ndarray) -> np.ndarray:
            return y + np.log1p(np.exp(-2 * y)) - LN2

        d = np.exp(log_sinh - log_cosh(a) - log_cosh(b)) * (1 + 2.0**-30)
    return np.fmin(d, np.minimum(w, 2.0))


def softcap_step(lg: Logits, cap: float, num: Numerics, ranges: Ranges) -> Logits:
    """Step 3c (papers/attention.md): the scores capped at ``c·tanh(s/c)`` in the score format.

    The kernel computes ``x̂ = fl(ŝ·r̂)``, ``t̂ = fl(T(x̂))`` and ``fl(ĉ·t̂)`` with ``ĉ = fl(c)``,
    ``r̂ = fl(1/c)`` and ``T`` the carrier's ``tanh`` (within ``tanh_ulps``). With ``|ŝ - s| <= δ``,
    ``|x̂ - s/c| <= w = δ/c + |ŝ||r̂ - 1/c| + u_s|ŝ|r̂ + η_s``, and ``tanh`` moves by at most
    ``D = sinh(w)/(cosh(s/c)·cosh(||s/c| - w|))`` (far beyond the cap, far less than ``w``).
    Returns the capped float64 logits, their error sources (the incoming ones carried through
    ``tanh`` by their share of ``w``, and ``softcap``: the division's, ``tanh``'s and the
    product's roundings), the bound on the capped scores' magnitude and the float64 error.
    """
    s, sources, s_upper, eps64, used = lg.s, lg.sources, lg.s_upper, lg.eps64, lg.used
    rounded = cap_roundings(cap, num)
    fs, carrier, u_s, eta_s, u_t, eta_t = rounded[:6]
    narrow = carrier.name != fs.name
    if not rounded.finite:
        ranges.flag(
            True,
            f"softcap: the cap {cap:g} or its reciprocal does not fit the score format "
            f"{fs.name} (rounds to {rounded.c_hat:g} and {rounded.r_hat:g})",
        )
    # e_r covers any reciprocal within two roundings of 1/c (fl(1/fl(c)), a compiler's folded
    # constant) or a division by ĉ (|fl(ŝ/ĉ) - ŝ/c| is within the same w), not only this r̂; a
    # subnormal constant may be read as zero (XLA's flush of denormal inputs)
    c_hat, e_c, r_hat, e_r = evaluated_constants(rounded, cap)
    delta = sum(sources.values())
    s_hat = np.abs(s) + delta  # >= |ŝ|
    ranges.check(
        np.where(used, s_hat * r_hat * (1 + u_s) + eta_s, 0.0),
        fs,
        f"the scores times 1/softcap = {r_hat:.4g}",
    )
    x0 = s / cap
    rest = s_hat * e_r + u_s * s_hat * r_hat + eta_s + 2.0**-52 * np.abs(x0)
    w = delta / cap + rest
    spread = _tanh_spread(x0, w)
    tau = np.minimum(np.abs(np.tanh(x0)) * (1 + 2.0**-50) + spread, 1.0)  # >= |tanh(x̂)|
    e_t = u_t * tau + eta_t
    if narrow:
        e_t = e_t + u_s * (tau + e_t) + eta_s
    s_c = cap * np.tanh(x0)
    ev = 2.0**-50 * (np.abs(s) + np.abs(s_c)) + 2.0**-1070
    carried = cap * spread
    with np.errstate(invalid="ignore"):
        capped = {name: carried * (x / cap) / w for name, x in sources.items()}
    capped["softcap"] = (
        carried * rest / w + cap * e_t + (u_s * c_hat + e_c) * (tau + e_t) + eta_s + ev
    )
    s_upper = np.minimum(s_upper, c_hat * (tau + e_t) * (1 + u_s) + eta_s)
    eps64 = np.minimum(eps64, cap * _tanh_spread(x0, eps64 / cap)) + ev
    return dataclasses.replace(
        lg, s=s_c, sources=capped, s_upper=s_upper, eps64=eps64, delta=sum(capped.values())
    )


def bias_step(lg: Logits, bias: np.ndarray, num: Numerics, ranges: Ranges) -> Logits:
    """Step 3 (bias): ``fl(ŝ + b̂)`` with the bias rounded into the score format; adding a
    zero bias is exact (``fl(x + 0) = x``, in float64 too): no rounding there. The earlier
    sources take the sum's rounding (the factor ``1 + u_s``, ``bias_factor``); R.3: the
    scores plus the bias in the score format."""
    f_s = num.format_of("score")
    u_s, eta_s = f_s.u, f_s.smallest_normal
    b0 = np.where(np.isfinite(bias), bias, 0.0)
    e_b = rounding_error(b0, f_s)
    s = lg.s + b0
    added = b0 != 0
    k_add = np.where(added, 1 + u_s, 1.0)
    eps_b = np.where(added, 2.0**-53 * np.abs(s), 0.0)
    sources = {name: k_add * x for name, x in lg.sources.items()}
    sources["bias"] = np.where(added, (1 + u_s) * e_b + u_s * np.abs(s) + eta_s, 0.0)
    sources["scale"] = sources["scale"] + eps_b
    s_upper = lg.s_upper + np.abs(b0) + e_b
    ranges.check(on(lg.used, s_upper, 0.0), f_s, "the scores plus the bias")
    return dataclasses.replace(
        lg,
        s=s,
        delta=sum(sources.values()),
        sources=sources,
        s_upper=s_upper,
        eps64=lg.eps64 + eps_b,
        bias_factor=k_add,
    )


def softmax_read_step(lg: Logits, folded: bool, num: Numerics, ranges: Ranges) -> Logits:
    """R.4: the scores read into the softmax format (and its smallest normal); folded, the
    unscaled ones (no bias, no cap): with ``c2 < 1`` they reach further than their products."""
    f_s, f_m = num.format_of("score"), num.format_of("softmax")
    read = (1 + f_s.u) * lg.acc_upper + f_s.smallest_normal if folded else lg.s_upper
    ranges.check(on(lg.used, read, 0.0), f_m, "the scores read into the softmax format")
    if f_m.smallest_normal <= f_s.smallest_normal:
        return lg
    sources = {**lg.sources, "scale": lg.sources["scale"] + f_m.smallest_normal}
    return dataclasses.replace(lg, sources=sources, delta=sum(sources.values()))


def masking_step(lg: Logits, head: Head, num: Numerics, ranges: Ranges) -> tuple[Logits, Masking]:
    """Step 3'. A finite masking constant ``M``: the computed logits are those of the leaky
    problem (the masked keys keep the logit ``M`` (fill) or ``s + M`` (add)); ``live`` marks its
    keys. R.4': a masked logit the score or softmax format cannot hold is read as ``-inf``: the
    key drops out (``p = 0`` exactly, as under ``-inf`` masking) where that is certain, and the
    row's outputs are infinite where it is not, or where it leaves a row that attends no key
    without a finite logit (NaN) or without the leaky problem's value."""
    keep, masked = head.keep, head.masked
    if masked is None:
        return lg, Masking(keep, np.zeros_like(keep))
    f_s, f_m = num.format_of("score"), num.format_of("softmax")
    u_s, eta_s = f_s.u, f_s.smallest_normal
    s, delta, sources = lg.s, lg.delta, lg.sources
    nan_row = False  # an overflow of the masked logits is NaN (flagged), not -inf
    const = num.mask_constant()
    open_bias = np.ones_like(keep) if head.bias is None else ~np.isneginf(head.bias)
    narrow = min((f_s, f_m), key=lambda f: f.max_finite)
    empty_row = ~keep.any(axis=-1, keepdims=True)
    if isinstance(num.mask_mode, Fill):
        # M is exact in the score format and the softmax format is at least as precise:
        # its read is M or, past the softmax format's range, -inf
        read = float(round_to(const, f_m))
        leaky, candidates = np.full_like(s, read), masked
        dropped = masked & bool(read == -math.inf)
        delta = np.where(masked, 0.0, delta)
        sources = {name: np.where(masked, 0.0, x) for name, x in sources.items()}
        unsure = np.zeros_like(keep)
        if dropped.any():
            leaky = np.full_like(s, const)  # evaluated where flagged
    else:
        s_add = s + const
        with np.errstate(over="ignore", invalid="ignore"):
            finite = (np.abs(s_add) + delta) * (1 + u_s) <= narrow.max_finite
            gone = (np.abs(s_add) - delta) * (1 - u_s) >= narrow.max_finite * (1 + narrow.u)
        candidates, leaky = masked & open_bias, s_add
        dropped = candidates & gone
        unsure = candidates & ~finite & ~gone
        if not (f_s.has_inf and f_m.has_inf):
            # a format without an infinity (float8_e4m3fn) rounds an overflow to NaN, not
            # -inf: the key does not drop out, it makes the row NaN
            ranges.flag(
                (candidates & ~finite).any(axis=-1, keepdims=True),
                f"the masked logits s + {const:g} may overflow {narrow.name}, and a format "
                "without an infinity rounds an overflow to NaN",
            )
            dropped, nan_row = np.zeros_like(gone), True
        absorbed = u_s * np.abs(s_add) + eta_s
        delta = np.where(masked, (1 + u_s) * delta + absorbed, delta)
        sources = {n: np.where(masked, (1 + u_s) * x, x) for n, x in sources.items()}
        sources["mask_absorption"] = np.where(masked, absorbed, 0.0)
    out = dropped | unsure
    # a row left without a live key is flagged below; it is evaluated on the leaky logits
    none = ~(keep | (candidates & ~out)).any(axis=-1, keepdims=True)
    out = out & ~none
    live = keep | (candidates & ~out)
    s = np.where(masked, np.where(out, -np.inf, leaky), s)
    ranges.flag(
        unsure.any(axis=-1, keepdims=True) & (not nan_row),
        f"the masked logits s + {const:g}: may or may not overflow {narrow.name} "
        "(a key that drops out of the softmax is not charged)",
    )
    ranges.flag(
        empty_row & dropped.any(axis=-1, keepdims=True),
        f"a row that attends no key: masked logits overflow {narrow.name} and are read as "
        "-inf, so the output is not the leaky problem's (NaN where every logit is -inf)",
    )
    lg = dataclasses.replace(lg, s=s, delta=delta, sources=sources)
    return lg, Masking(live, live & ~keep)


def known_scores_step(
    lg: Logits, dots: Dots, ops: Operands, head: Head, setting: Setting, const: Constant
) -> tuple[np.ndarray, np.ndarray] | None:
    """Step 3k (papers/attention.md): the scores the kernel computes, known where their
    enclosure lies within one rounding interval of the score format (Lemma 6k).

    The dot unit accumulates ``t̂`` within ``e_t`` of ``t = q kᵀ`` (step 3's deterministic
    unit error, the operands' part of step 1 and the float64 ``t``'s own error), rounds it
    into the score format ``F_s`` (coarser than the accumulation format) and multiplies by
    ``ĉ`` there. Rounding to nearest is monotone, so where every value of ``[t - e_t, t +
    e_t]`` lies nearer to one value of ``F_s`` than half its spacing on either side, that value
    is the kernel's ``ŝ1``, for every tie rule (:func:`_nearest_within`). ``ŝ1·ĉ`` is exact in
    float64 (``2p_s <= 53``), so ``fl_s(ŝ1·ĉ)`` is known where it is not a tie (whose rule the
    model leaves open); so is ``fl_s(ŝ + b̂)`` with a bias ``b̂ = fl_s(b)`` (itself not a
    tie), the float64 sum within one rounding of the exact one; and a softmax format that
    holds ``F_s`` reads the score exactly. Taken with the scale on the scores, not folded,
    ``ĉ`` known from the scale's float64 value, no soft-cap, keys not masked, normal and
    finite scores; not asked for (``known_rounding=False``), ``None``.

    Returns the kernel's scores where known and the float64 logits elsewhere, with the radius
    the kernel's scores have around them: step 3''s fold where known, ``δ`` elsewhere. The
    softmax's probabilities of these scores bound the values step 6k rounds (``None`` where
    no score is known).
    """
    num = setting.num
    f_s, f_m = num.format_of("score"), num.format_of("softmax")
    eligible = (
        setting.known_rounding
        and num.scale == "scores"
        and not const.folded
        and setting.softcap is None
        and not setting.loose_constant
        and f_s.u > num.format_of("accum").u
        and 2 * f_s.precision <= 53
        and _holds(f_m, f_s)
    )
    if not eligible:
        return None
    c_hat = _known_constant(setting.scale, f_s)
    if c_hat is None:
        return None
    d_k = head.q.shape[-1]
    unit = dots.unit
    if setting.lam is not None:
        unit = _unit_error(ops, num, dots.qk_op, None, _signed_dot(dots, d_k))
    e_t = unit + dots.operands + F64_DOT * (d_k + 2) * dots.qk_abs
    with np.errstate(invalid="ignore", over="ignore"):
        s1, known = _nearest_within(dots.t, e_t, f_s)
        product = s1 * c_hat
        if _power_of_two(c_hat):  # the product is a value of F_s where it is normal, finite
            s_hat = product
            known &= (np.abs(product) >= 2 * f_s.smallest_normal) & (
                np.abs(product) <= f_s.max_finite
            )
        else:
            s_hat, known_c = _nearest_within(product, 0.0, f_s)
            known &= known_c
        if head.bias is not None:
            s_hat, known = _biased(s_hat, known, head.bias, f_s)
    known = known & lg.used
    if head.masked is not None:
        known = known & ~head.masked
    if not known.any():
        return None
    radius = lg.sources.get("exp_fold", 0.0)
    return np.where(known, s_hat, lg.s), np.where(known, radius, lg.delta)


def _biased(
    s_hat: np.ndarray, known: np.ndarray, bias: np.ndarray, f_s: Format
) -> tuple[np.ndarray, np.ndarray]:
    """Step 3k's bias: ``fl_s(ŝ + b̂)`` with ``b̂ = fl_s(b)``, known where ``b̂`` is (not a tie)
    and where the float64 sum, within ``2^-53`` of the exact one, lies within one rounding
    interval of ``F_s``; a zero bias adds nothing (``fl(x + 0) = x``)."""
    b0 = np.where(np.isfinite(bias), bias, 0.0)
    b_hat, known_b = _nearest_within(b0, 0.0, f_s)
    x = s_hat + b_hat
    s_b, known_x = _nearest_within(x, np.abs(x) * 2.0**-52, f_s)
    zero = b0 == 0
    return np.where(zero, s_hat, s_b), known & (zero | (known_b & known_x))


def _holds(wide: Format, narrow: Format) -> bool:
    """Whether every value of the format ``narrow`` is a value of ``wide``."""
    return (
        wide.precision >= narrow.precision
        and wide.smallest_normal <= narrow.smallest_normal
        and wide.max_finite >= narrow.max_finite
    )


def _known_constant(scale: float, f_s: Format) -> float | None:
    """``ĉ = fl_s(c)``, known where every float64 value within two roundings of the scale's
    (the default ``fl(1/fl(sqrt(d_k)))``, or a kernel's own) rounds to the same normal value."""
    c, known = _nearest_within(np.array(scale), abs(scale) * 2.0**-51, f_s)
    return float(c) if bool(known) else None


def _power_of_two(x: float) -> bool:
    """Whether ``|x|`` is a power of two."""
    return x != 0 and math.frexp(abs(x))[0] == 0.5


def _nearest_within(
    x: np.ndarray, e: np.ndarray | float, fmt: Format
) -> tuple[np.ndarray, np.ndarray]:
    """Lemma 6k for a value known to lie within ``e`` of ``x``: ``r``, the nearest value of
    ``fmt`` to ``x``, and where every value of ``[x - e, x + e]`` rounds to ``r`` for every tie
    rule: both ends strictly nearer to ``r`` than half its spacing on their side (``2^(E-p)``
    for ``|r|`` in ``[2^E, 2^(E+1))``, half that below a power of two), ``r`` finite and at
    least twice the smallest normal number (no flush reaches it). The distances are exact
    (Sterbenz) and their sum with ``e`` is rounded up by its one rounding."""
    r = round_to(x, fmt)
    ar = np.abs(r)
    mant, ex = np.frexp(ar)
    half = np.ldexp(1.0, ex - 1 - fmt.precision)
    toward = np.where(mant > 0.5, half, half / 2)  # below |r|: half as wide at a power of two
    away = (x - r) * np.sign(r)  # > 0: beyond |r|
    up = 1 + 2.0**-52
    known = (
        ((away + e) * up < half)
        & ((e - away) * up < toward)
        & np.isfinite(r)
        & (ar >= 2 * fmt.smallest_normal)
    )
    return r, known


def fold_step(
    lg: Logits, live: np.ndarray, u_c: float, num: Numerics, ranges: Ranges
) -> tuple[Logits, Any, Any]:
    """Step 3'': the exponent's argument, in base 2 (natural units, times ``ln 2``).

    Folded (``exp2-folded``, ``exp2-scaled``): ``fl(fl(t·c2) - fl(m·c2))``: the product
    ``t_j·c2`` is rounded (``u_m|s_j|``), and so is the shift ``m_b·c2`` of each block
    (``u_m|m_b·c|``, ``|m_b·c| <= R``, the row's largest ``|s| + δ``: under the online softmax
    the blocks' shifts differ and do not cancel), with an underflow ``η_m`` each; the
    subtraction's rounding is step 5's (on an argument up to gap + this term). With
    ``prob_offset`` (FlashAttention-3's ``fl(fl(m·c2) - k)``) one more rounding. ``exp2``: the
    logits, as under exp, taken into base 2 by ``x = fl(ŝ·L̂)`` with ``L̂ = fl_m(log2 e)``.
    Returns the logits with the source ``exp_fold``, the fold (``None`` for none) and, with
    ``prob_offset``, each row's largest argument of a lifted exponential (R.5).
    """
    if not (num.folds_scale or num.exp2):
        return lg, None, None
    f_m = num.format_of("softmax")
    u_m, eta_m = f_m.u, f_m.smallest_normal
    lift_arg = None
    s_abs = np.where(live, np.abs(lg.s) + lg.delta, 0.0)
    r_row = s_abs.max(axis=-1, keepdims=True)
    if num.folds_scale:
        fold = np.where(live, u_m * (1 + u_c) * (s_abs + r_row) + 2 * eta_m, 0.0)
        if num.prob_offset:
            # fl(fl(m·c2) - k), one more rounding of a value at most (|m·c2| + k) in base 2,
            # (1 + u_c)(1 + u_m)R + k·ln 2 in natural units
            k_ln2 = num.prob_offset * math.log(2.0)
            lifted_by = u_m * ((1 + u_c) * (1 + u_m) * r_row + k_ln2) + eta_m
            fold = fold + np.where(live, lifted_by, 0.0)
            # R.5, lifted: fl(t·c2) <= fl(m·c2) for t <= m, so the computed argument is at most
            # (k·ln 2 + that rounding)(1 + u_m), not k·ln 2: the exponentials' largest value
            lift_arg = (k_ln2 + lifted_by) * (1 + u_m)
    else:
        # a relative (1 + u_L)(1 + u_m) - 1 of each |ŝ| (natural units), an underflow η_m; the
        # shifts are x values themselves, and the rescalings' excess over u_m(2 + u_m)·gap is
        # at most 2u_m²R (papers/attention.md, step 3'', exp2)
        u_l = compound(2.0**-53, u_m)
        ranges.check(s_abs * LOG2E * (1 + u_l) * (1 + u_m), f_m, "the logits times fl(log2 e)")
        rel = compound(u_l, u_m)
        fold = np.where(live, rel * s_abs + 2 * u_m**2 * (1 + rel) * r_row + 2 * eta_m, 0.0)
    sources = {**lg.sources, "exp_fold": fold}
    return dataclasses.replace(lg, sources=sources, delta=lg.delta + fold), fold, lift_arg
