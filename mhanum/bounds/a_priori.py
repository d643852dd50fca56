"""A priori componentwise bounds for attention and MHA from sizes and norms: papers/attention.md A.4.

:func:`attention_bound_a_priori` needs no inputs, only their shapes and bounds on their sizes
(the Euclidean norms of the query and key rows and the largest value entry); it bounds the error
of every output component of every input that satisfies them. :func:`mha_bound_a_priori` does
the same for a multi-head layer from its weights and a bound on the entries of its inputs. Both
are for planning and reports: the a posteriori bounds (A.1, A.2) are smaller on any given input.

Each step of A.1 is replaced by its worst case over the admissible inputs: ``|q_i|·|k_j| <=
‖q_i‖‖k_j‖`` (Cauchy–Schwarz), every logit error by one ``Δ``, the logit range by ``2c|q||k|``,
``Σ_j p̃_j <= e^{2Δ}`` and ``Σ_j p_j |v_j| <= max |v|``; the float64 evaluation error of A.1's
logits (step 0) is included the same way, so A.4 is at least A.1 on every admissible input. The
no-overflow hypothesis is proved from the same bounds, stage by stage (papers/attention.md, R);
where it cannot be, every entry is infinite and ``Bound.reasons`` says why. With the safe softmax,
step W (``|ô| + |o|`` from the computed weights' sum alone) caps every entry, as it caps A.1.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound, where_smaller
from mhanum.bounds.attention import ASSUMPTIONS
from mhanum.bounds.factors import (
    EVALUATION,
    F64_DOT,
    compound,
    conversion_eta,
    exp_and_sum_factors,
    is_power_of_four,
    linear,
    linear_overflow,
    operand_bits,
    operand_error,
    power_of_two,
    safe_weight_sums,
    scale_rounding,
    step_w_output,
    tensor_core_anchor,
    unit_eta,
    unit_factor,
)
from mhanum.bounds.softmax import division_error
from mhanum.formats import Format, get_format, round_to
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams

__all__ = ["attention_bound_a_priori", "mha_bound_a_priori"]

A_PRIORI = (
    "a priori: every input satisfies the stated size bounds (row norms of q and k, entries of v "
    "or of x); no bias; masks with -inf (at least min_keys attended keys per row)"
)


class _Range:
    """Stages that may overflow and softmax hypotheses that cannot be proved, from the norms.

    A.4 is uniform over the admissible inputs, so a stage that may overflow makes every output
    entry infinite (term ``overflow``; ``vacuous`` for the softmax), with one reason per cause:
    per stage and format, with the largest value over the heads.
    """

    def __init__(self) -> None:
        self.where: dict[str, bool] = {}
        self.worst: dict[str, float] = {}  # reason template -> the largest value it reports

    def check(self, upper: Any, fmt: Format, stage: str) -> None:
        """Flag ``stage`` unless ``upper`` (an enclosure of what it rounds) fits ``fmt``."""
        worst = float(np.max(upper))
        if not worst <= fmt.max_finite:  # NaN counts as an overflow
            reason = (
                f"{stage}: values up to {{:.4g}} may overflow {fmt.name} "
                f"(largest finite {fmt.max_finite:.6g})"
            )
            self.flag(reason, "overflow", worst)

    def flag(self, reason: str, term: str = "overflow", value: float = math.nan) -> None:
        """Mark every entry infinite in ``term`` for ``reason`` (``{:.4g}`` shows ``value``)."""
        self.where[term] = True
        seen = self.worst.get(reason, value)
        self.worst[reason] = value if math.isnan(seen) or value > seen else seen

    @property
    def vacuous(self) -> bool:
        return "vacuous" in self.where

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(reason.format(value) for reason, value in self.worst.items())

    def terms(self, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {name: np.full(shape, np.inf) for name in self.where}


@dataclasses.dataclass(frozen=True)
class _Operand:
    """Bounds on a dot operand's rows, for the float64 stand-in ``x`` A.1 is evaluated on.

    ``|x| <= B`` with ``B = size`` entrywise (a vector over the row) or, in the norm form,
    ``‖x‖ <= norm``; the operand the computation uses is within ``rel·B + err`` of ``x`` and
    the stand-in within ``grel·B + gerr`` of the exact operand (``given``: A.2's projections,
    the float64 scale of step 2'), entrywise.
    """

    size: np.ndarray | None
    norm: float
    rel: float
    err: np.ndarray
    grel: float = 0.0
    gerr: Any = 0.0

    def sums(self, d: int) -> float:
        """A bound on ``Σ_t |x_t|``."""
        return float(self.size.sum()) if self.size is not None else math.sqrt(d) * self.norm

    def entry(self) -> float:
        """A bound on ``max_t |x_t|``."""
        return float(self.size.max()) if self.size is not None else self.norm

    def stored(self) -> float:
        """A bound on ``max_t |x_used,t|``: the stored operand (R.1)."""
        return (1 + self.rel) * self.entry() + float(np.max(self.err))


def _times(a: float, b: float) -> float:
    """``a·b`` for bounds ``a, b >= 0``, with ``0·inf = 0`` (a zero bound stays zero)."""
    return a * b if a and b else 0.0


def _pair(a: _Operand, b: _Operand) -> float:
    """A bound on ``|a|·|b|`` (Cauchy–Schwarz in the norm form)."""
    if a.size is not None and b.size is not None:
        return float(a.size @ b.size)
    return _times(a.norm, b.norm)


def _err_pair(ea: Any, b: _Operand, d: int) -> float:
    """A bound on ``e_a·|b|`` for an error vector ``ea`` (a scalar spread over ``d`` entries)."""
    if b.size is not None:
        return float(np.broadcast_to(ea, (d,)) @ b.size)
    return _times(float(np.linalg.norm(np.broadcast_to(ea, (d,)))), b.norm)


def _perturbed(a: _Operand, ra: float, ea: Any, b: _Operand, rb: float, eb: Any, d: int) -> float:
    """A bound on ``e_a·|b| + |a|·e_b + e_a·e_b`` for ``e_a <= ra·A + ea``, ``e_b <= rb·B + eb``
    (``A``, ``B`` the operands' bounds): ``(|a| + e_a)·(|b| + e_b) - |a|·|b|``."""
    bb = float(np.broadcast_to(ea, (d,)) @ np.broadcast_to(eb, (d,)))
    return (
        _times(ra + rb + ra * rb, _pair(a, b))
        + (1 + rb) * _err_pair(ea, b, d)
        + (1 + ra) * _err_pair(eb, a, d)
        + bb
    )


@dataclasses.dataclass(frozen=True)
class _Logits:
    """A.1 steps 0-3 at their worst: every logit error (``delta``), every float64 logit's
    magnitude (``reach``), the float64 logits' own error (``eps64``, step 0) and the logit
    error of the stand-ins against the exact operands (``moved``, A.2 (b), step 2')."""

    delta: float
    reach: float
    eps64: float
    moved: float


_Z_SECH2 = 0.45  # >= max_z z·sech²(z) = 0.4477 (at z = 0.772)


class CappedLogits(NamedTuple):
    """Theorem B.9 (a): the soft-capped logits at their worst over the admissible inputs."""

    reach: float  # >= |a| = c|tanh(s/c)|
    delta: float  # >= |â - a|
    tau: float  # >= |tanh(s/c)|
    e_tau: float  # >= |t̂ - tanh(s/c)|
    t_used: float  # >= |t̂|


def cap_constant(value: float, fmt: Format) -> tuple[float, float]:
    """``(v̂, e)`` with ``e >= |v̂ - value|`` for ``value`` rounded into ``fmt`` (a subnormal
    constant may be read as zero: then ``e >= |value|``; one past the format's range rounds to
    ``inf``, and so is ``e``)."""
    hat = float(round_to(value, fmt))
    if not math.isfinite(hat):
        return hat, math.inf
    err = float(abs(fractions.Fraction(hat) - fractions.Fraction(value))) * (1 + 2.0**-52)
    if hat < fmt.smallest_normal:
        err = max(err, abs(value) * (1 + 2.0**-52))
    return hat, err


class CapRoundings(NamedTuple):
    """The constants and unit roundings of a soft-cap ``c·tanh(s/c)`` in the score format.

    ``fs`` the score format (``u_s``, ``eta_s``); ``carrier`` the float32 or float64 format tanh
    is evaluated in, ``u_t``, ``eta_t`` its relative error (``tanh_ulps``) and underflow; ``c_hat``, ``e_c`` the cap
    rounded into ``fs`` and its error; ``r_hat``, ``e_r`` its reciprocal's, ``e_r`` also covering
    ``fl(1/fl(c))``; ``finite``: both constants finite and positive in ``fs``.
    """

    fs: Format
    carrier: Format
    u_s: float
    eta_s: float
    u_t: float
    eta_t: float
    c_hat: float
    e_c: float
    r_hat: float
    e_r: float
    finite: bool


def cap_roundings(cap: float, num: Numerics) -> CapRoundings:
    """:class:`CapRoundings` of ``cap`` under ``num`` (Theorems B.7 and B.9)."""
    fs = num.format_of("score")
    u_s, eta_s = fs.u, fs.smallest_normal
    carrier = fs if fs.name in ("float32", "float64") else get_format("float32")
    u_t, eta_t = 2 * num.tanh_ulps * carrier.u, carrier.smallest_normal
    c_hat, e_c = cap_constant(cap, fs)
    r_hat, e_r = cap_constant(1.0 / cap, fs)
    e_r = max(e_r, (2 * u_s + 2 * u_s * u_s) / cap * (1 + 2.0**-50))  # fl(1/fl(c)) as well
    finite = math.isfinite(c_hat) and math.isfinite(r_hat) and c_hat > 0 and r_hat > 0
    return CapRoundings(fs, carrier, u_s, eta_s, u_t, eta_t, c_hat, e_c, r_hat, e_r, finite)


def softcap_a_priori(
    s_up: float,
    delta: float,
    cap: float,
    num: Numerics,
    check: Callable[[float, Format, str], None],
) -> CappedLogits:
    """Theorem B.9 (a) (papers/backward.md): scaled scores ``|s| <= s_up`` computed within
    ``delta``, capped as the kernel does, ``â = fl_s(ĉ·fl_s(T(fl_s(ŝ·r̂))))``.

    ``x̂ - s/c = e_a + e_r`` with ``|e_a| <= w_a = δ r̂(1 + u_s) + η_s`` (the scores' error) and
    ``|e_r| <= w_r|s/c|``, ``w_r = c|r̂ - 1/c| + u_s c r̂`` (the reciprocal's and the product's
    roundings). ``tanh`` is 1-Lipschitz with range ``(-1, 1)`` and ``y·sech²(y(1 - w_r) - w_a)
    <= (w_a + 0.45)/(1 - w_r)``, so ``|tanh x̂ - tanh(s/c)| <= min(min(w_a, 2) +
    w_r·min(s_up/c, (w_a + 0.45)/(1 - w_r)), 2)`` whatever the norms; ``|a| <= c·tanh(s_up/c)
    <= min(c, s_up)``. ``check(upper, format, stage)`` is called on the
    stages that may overflow."""
    fs, carrier, u_s, eta_s, u_t, eta_t, c_hat, e_c, r_hat, e_r, finite = cap_roundings(cap, num)
    if not finite:
        check(math.inf, fs, f"softcap: the cap {cap:g} or its reciprocal in {fs.name}")
        c_hat, r_hat = cap, 1.0 / cap
    s_hat = s_up + delta  # >= |ŝ|
    check(s_hat * r_hat * (1 + u_s) + eta_s, fs, f"the scores times 1/softcap = {r_hat:.4g}")
    # x̂ - s/c = e_a + e_r: |e_a| <= w_a (the scores' error), |e_r| <= w_r|s/c| (the roundings)
    w_a = delta * r_hat * (1 + u_s) + eta_s
    w_r = cap * e_r + u_s * cap * r_hat
    y_up = s_up / cap * (1 + 2.0**-52)
    relative = w_r * y_up
    if w_r < 1:  # |y|·sech²(|y|(1 - w_r) - w_a) <= (w_a + max z·sech² z)/(1 - w_r)
        relative = min(relative, w_r * (w_a + _Z_SECH2) / (1 - w_r))
    spread = min(min(w_a, 2.0) + relative, 2.0)  # >= |tanh x̂ - tanh(s/c)|
    tau = min(1.0, math.tanh(y_up) * (1 + 2.0**-50))
    t_x = min(1.0, tau + spread)  # >= |tanh x̂|
    e_t = u_t * t_x + eta_t
    t_top = t_x + e_t  # >= |T(x̂)|
    if carrier.name != fs.name:
        e_t = e_t + u_s * t_top + eta_s
        t_top = t_top * (1 + u_s) + eta_s
    e_tau = spread + e_t
    t_used = min(tau + e_tau, t_top)
    a_err = e_c * t_used + cap * e_tau + u_s * c_hat * t_used + eta_s
    check(c_hat * t_used * (1 + u_s) + eta_s, fs, "the capped logits")
    return CappedLogits(cap * tau * (1 + 2.0**-50), a_err, tau, e_tau, t_used)


def _capped(logits: _Logits, cap: float, num: Numerics, rng: _Range) -> _Logits:
    """A.4's logits soft-capped (Theorem B.9 (a)): the computed capped logits within ``Δ_c`` of
    ``c·tanh(s̃/c)`` (the stand-in logits ``s̃`` within ``Δ``, ``|s̃| <= ρ``), read again into
    the softmax format; the stand-ins' own errors carried through ``tanh`` (1-Lipschitz,
    range 2)."""
    soft = num.format_of("softmax")
    capped = softcap_a_priori(logits.reach, logits.delta, cap, num, rng.check)
    delta = capped.delta
    if soft.smallest_normal > num.format_of("score").smallest_normal:
        delta += soft.smallest_normal
    return _Logits(delta, capped.reach, min(logits.eps64, 2 * cap), min(logits.moved, 2 * cap))


def _logit_error(
    qo: _Operand,
    ko: _Operand,
    d_k: int,
    num: Numerics,
    scale: float,
    default_scale: bool,
    rng: _Range,
) -> _Logits:
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
    pq = _pair(qo, ko)
    operands = _perturbed(qo, a_q, b_q, ko, a_k, b_k, d_k)
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
    moved = c * _perturbed(qo, qo.grel, qo.gerr, ko, ko.grel, ko.gerr, d_k)
    return _Logits(delta, c * pq + eps64, eps64, moved)


def _scaled_bounds(
    qo: _Operand,
    ko: _Operand,
    d_k: int,
    num: Numerics,
    scale: float,
    default_scale: bool,
    rng: _Range,
) -> tuple[_Operand, _Operand]:
    """Step 2' at its worst: the scaled stand-ins ``fl64(f64·x)``, their errors (as in A.1) and
    R.2 for the read into the scale format and the product there."""
    fmt = num.format_of("scale")
    u64 = 0.0
    if default_scale and not is_power_of_four(d_k):
        u64 = compound(2.0**-53, over=(2.0**-53,))
    f64 = scale
    if num.scale == "qk":
        f64 = math.sqrt(scale)
        if fractions.Fraction(f64) ** 2 != fractions.Fraction(scale):
            u64 = compound(u64, 2.0**-53)
    f_hat, u_r, u_mul = scale_rounding(f64, fmt)
    # the operand is first read into the scale format (rounded if that is less precise)
    u_t = fmt.u if fmt.precision < num.storage_format.precision else 0.0
    theta = compound(u_r, u_t, u_mul)
    up = abs(f64) * (1 + 2.0**-52)  # >= |fl64(f64·x)| / |x|
    # the read's underflow, times f̂ and rounded in the product, then the product's own
    eta = fmt.smallest_normal * (1 + up * (1 + u_r) * (1 + u_mul))
    r64 = 0.0 if power_of_two(f64) else 2.0**-53  # the float64 product's rounding

    def scaled(x: _Operand, name: str) -> _Operand:
        stored = x.stored()
        rng.check(stored, fmt, f"{name} read into the scale format")
        rng.check(
            abs(f_hat) * stored * (1 + u_t) + fmt.smallest_normal,
            fmt,
            f"{name} times the scale factor {f_hat:.4g}",
        )
        return _Operand(
            None if x.size is None else up * x.size,
            up * x.norm,
            theta + (1 + theta) * x.rel + r64,
            up * (1 + theta) * x.err + 2.0**-1074 + eta,
            (x.grel + u64) / (1 - u64) + r64,
            up * np.asarray(x.gerr) / (1 - u64) + 2.0**-1074,
        )

    return scaled(qo, "q"), (scaled(ko, "k") if num.scale == "qk" else ko)


def _values(v_abs: np.ndarray, e_v: np.ndarray, num: Numerics, rng: _Range) -> np.ndarray:
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


def _expm1(x: float) -> float:
    return math.expm1(x) if x < 700 else math.inf


def _softmax_pv(
    logits: _Logits,
    n: int,
    min_keys: int,
    v_abs: np.ndarray,
    v_bar: np.ndarray,
    g_v: Any,
    num: Numerics,
    rng: _Range,
) -> dict[str, np.ndarray]:
    """A.1 steps 4-7 at their worst over the admissible inputs (A.4), with R.4-R.6: vectors over
    ``d_v``; only the finite terms (what cannot be bounded is flagged in ``rng``).

    ``v_abs`` bounds the stand-ins ``|v_jl|`` (and the exact values), ``v_bar`` the entries the
    ``P V`` unit reads, ``g_v`` the stand-ins' error.
    """
    delta, reach = logits.delta, logits.reach
    fmts = {r: num.format_of(r) for r in ("softmax", "prob", "output", "accum")}
    fm = fmts["softmax"]
    u_m, u_p, u_o = (fmts[r].u for r in ("softmax", "prob", "output"))
    eta_m, eta_p, eta_o = (fmts[r].smallest_normal for r in ("softmax", "prob", "output"))
    u_op, eta_op = operand_error(num)
    eta_op += conversion_eta(num, num.operand_rounding or fmts["prob"])
    u_div = division_error(num.div_ulps, u_m)
    kind = num.softmax_kind
    bits_pv = (operand_bits(num, fmts["prob"]), operand_bits(num, num.format_of("input")))
    online = kind == "online"
    # Step 0 and A.2 (b): the target moves with the float64 logits' error and the stand-ins'
    eps64, moved = logits.eps64, logits.moved
    if not 2 * max(eps64, moved) <= 700:
        rng.flag(
            "the float64 logits may be off the exact ones by {:.4g}: the target's perturbation "
            "e^(2ε) is not finite",
            "vacuous",
            max(eps64, moved),
        )
        return {}
    evaluation = (math.expm1(2 * eps64) + math.expm1(2 * moved)) * v_abs
    evaluation = evaluation + math.exp(2 * moved) * np.asarray(g_v)
    gap = 2 * reach + 2 * delta
    x, blocks, g_sum, g_pv, eta_pv = exp_and_sum_factors(num, n, gap, None, bits_pv)
    # step W: the computed output's magnitude, whatever the logit errors (safe softmax)
    whole = None
    if kind == "safe":  # (prob_offset is online only)
        # R.5: the row sum of the computed exponentials, each at most 1 + ε_e (Lemma W)
        e_top = 1 + 2 * num.exp_ulps * u_m
        rng.check(n * e_top * (1 + g_sum) + n * eta_m, fm, "the softmax's row sum")
        _, row = safe_weight_sums(n, g_sum, u_div, fm)
        if np.isfinite(row):
            acc, out = step_w_output(row, n, n, v_bar, n * v_bar, g_pv, eta_pv, num)
            whole = _Whole(acc, out, out + v_abs)
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
    if kind == "naive":
        # R.4: no shift: exp of a logit up to ρ + Δ, the row sum up to 2n·e^(ρ+Δ) (T < 1),
        # and the reciprocal of the row sum, flushed once it is below 2^emin of its carrier.
        log_max = math.log(fm.max_finite)
        top = reach + delta
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
        if rng.vacuous:
            return {"evaluation": evaluation}
        log_s_lo = math.log(min_keys) - top  # > -log(max F_m): its exp is finite
    r = _expm1(x)
    underflow = n * eta_m * math.exp(-log_s_lo)
    t_sum = compound(r + underflow, g_sum) + underflow
    if not t_sum < 1:
        if whole is not None:
            return _whole_only(whole, num, rng)
        rng.flag(
            "softmax: the computed row sum may be off by 100% (its error factor T >= 1)", "vacuous"
        )
        return {"evaluation": evaluation}
    per_sum = math.exp(-log_s_lo) / (1 - t_sum)
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
        "evaluation": evaluation,
    }
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
    # R.5: the sums of step 5 and 7
    if online:
        eps_e = 2 * num.exp_ulps * u_m
        growth = ((1 + eps_e) * (1 + u_m) * (1 + fmts["accum"].u) ** 2) ** (blocks + 1)
        rng.check(
            n * growth * (1 + g_sum) + n * blocks * eta_m, fm, "online softmax: the running sum"
        )
        acc_upper = growth * (1 + u_p) * (1 + g_pv) * n * v_bar + pv_eta
        for fmt in (fmts["accum"], fm):
            rng.check(acc_upper, fmt, "online softmax: the unnormalised P·V accumulator")
    else:
        rng.check((1 + g_pv) * p_hat * v_bar + pv_eta, fmts["accum"], "P·V accumulated")
    # R.6: the output, |ô| <= max|v*| + the bound (online: also where it is divided)
    upper = v_abs + (1 + EVALUATION) * sum(terms.values())
    rng.check(upper, fmts["output"], "the output")
    if online:
        rng.check(upper, fm, "the output divided in the softmax format")
    return terms


class _Whole(NamedTuple):
    """Lemma W (papers/attention.md, step W) at the bounds: ``acc >= |P·V accumulated|``,
    ``out >= |ô|``, ``total = out + |v| >= |ô - o|``, whatever the logit errors."""

    acc: np.ndarray
    out: np.ndarray
    total: np.ndarray


def _whole_checks(
    whole: _Whole, acc_upper: Any, out_upper: Any, num: Numerics, rng: _Range
) -> None:
    """R.5 and R.6 with the least enclosures (``whole``'s or the terms'): ``P·V`` accumulated,
    the output."""
    rng.check(np.fmin(acc_upper, whole.acc), num.format_of("accum"), "P·V accumulated")
    rng.check(np.fmin(out_upper, whole.out), num.format_of("output"), "the output")


def _whole_only(whole: _Whole, num: Numerics, rng: _Range) -> dict[str, Any]:
    """The bound where the logit errors leave only the magnitudes: ``|ô - o| <= |ô| + |o|``."""
    _whole_checks(whole, math.inf, math.inf, num, rng)
    return {"magnitudes": whole.total}


def _least(
    terms: dict[str, Any],
    whole: _Whole,
    acc_upper: Any,
    out_upper: Any,
    num: Numerics,
    rng: _Range,
) -> dict[str, Any]:
    """The terms, or entrywise the magnitudes where they are smaller than the terms' sum."""
    _whole_checks(whole, acc_upper, out_upper, num, rng)
    return where_smaller(terms, whole.total, "magnitudes")[0]


def _check_a_priori_scope(num: Numerics) -> None:
    if num.exp_form != "exp":
        msg = (
            f"numerics.exp_form: the a priori bound (A.4) covers 'exp', got {num.exp_form!r}; "
            "use the a posteriori attention_bound (A.1) for the folded exp2"
        )
        raise InvalidArgument(msg)
    if num.kv_splits is not None:
        msg = (
            f"numerics.kv_splits: the a priori bound (A.4) covers unsplit keys, got "
            f"{num.kv_splits}; use the a posteriori attention_bound (A.6) for split-KV"
        )
        raise InvalidArgument(msg)
    if num.mask_value != -math.inf:
        msg = (
            "numerics.mask_value: the a priori bound (A.4) covers masks applied with -inf, got "
            f"{num.mask_value!r}; use the a posteriori attention_bound for finite constants"
        )
        raise InvalidArgument(msg)
    if num.softmax_kind == "online" and (
        num.format_of("accum").precision > num.format_of("softmax").precision
    ):
        msg = "numerics.softmax_format: the online softmax needs it at least as precise as accum"
        raise InvalidArgument(msg)
    if num.format_of("score").precision > num.format_of("softmax").precision:
        msg = "numerics.score_format: expected a score format no wider than the softmax format"
        raise InvalidArgument(msg)


def _nonnegative(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        msg = f"{name}: expected a finite number >= 0, got {x!r}"
        raise InvalidArgument(msg)
    return float(x)


def _literal(reason: str) -> str:
    """A finished sentence as a :meth:`_Range.flag` template."""
    return reason.replace("{", "{{").replace("}", "}}")


def _total(terms: dict[str, Any], theorem: str, rng: _Range, shape: tuple[int, ...]) -> Bound:
    terms = {name: np.asarray(t, np.float64) * (1 + EVALUATION) for name, t in terms.items()}
    terms = {name: np.broadcast_to(t, shape).copy() for name, t in terms.items()}
    terms.update(rng.terms(shape))
    total = sum(terms.values()) if terms else np.zeros(shape)
    return Bound(
        total,
        terms,
        theorem,
        (*ASSUMPTIONS, A_PRIORI),
        "blanchard2021",
        reasons=rng.reasons,
    )


def attention_bound_a_priori(
    q_len: int,
    kv_len: int,
    d_k: int,
    d_v: int | None = None,
    *,
    q_norm: float,
    k_norm: float,
    v_max: float,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    min_keys: int | None = None,
    softcap: float | None = None,
) -> Bound:
    """Theorem A.4: an a priori componentwise bound on the error of ``mhanum.attention``.

    For every input ``q`` (``q_len × d_k``), ``k`` (``kv_len × d_k``), ``v`` (``kv_len × d_v``)
    with ``‖q_i‖₂ <= q_norm``, ``‖k_j‖₂ <= k_norm``, ``|v_jl| <= v_max``, given as float64
    numbers (their rounding into ``numerics.input`` is included) and any mask applied with
    ``-inf`` that leaves at least ``min_keys`` keys per row,

    .. math::

        |\\hat o_{il} - o_{il}| \\le \\text{total}\\quad\\text{for every } i, l,

    where ``total`` is Theorem A.1 evaluated at its worst over those inputs: every logit error by
    ``Δ = c(G_{d_k}(1+θ)+θ)·q_norm·k_norm + ... + ε64`` (A.1 step 3 with Cauchy–Schwarz, and
    step 0's ``ε64 = 2^-52 (d_k+2) c·q_norm·k_norm``, the float64 logits' own error, whose
    effect on the target is the term ``evaluation``), the logit range by
    ``2c·q_norm·k_norm + 2Δ``, ``Σ_j p̃_j <= e^{2Δ}``, ``Σ_j p_j|v_jl| <= v_max``
    (papers/attention.md, Theorem A.4). So on any admissible input it is at least A.1. The bound
    does not depend on ``q_len``; on ``kv_len`` through the summation factors and underflow
    terms.

    *No overflow* is proved from the norms, stage by stage as A.1 does from the values
    (papers/attention.md, R): the stored operands, their reads into the scale, operand and
    accumulation formats, ``Q Kᵀ`` and the scores, the naive softmax's exponentials, row sum
    and reciprocal, the online running sum and accumulator, ``P V`` and the output. Where a
    stage may overflow, every entry is ``inf`` (term ``overflow``; ``vacuous`` where the
    softmax cannot be bounded: the naive softmax's overflow or flushed reciprocal, or a row sum
    that may be off by 100%), and ``Bound.reasons`` says which stage, format and value.

    With the safe softmax, step W's ``|ô| + |o|`` (the computed weights sum to a little over 1
    whatever the logits, papers/attention.md) replaces the terms where it is smaller and where
    the softmax could not be bounded (term ``magnitudes``): large norms give a finite bound, of
    about twice ``v_max``, wherever no stage may overflow.

    Assumptions: those of Theorem A.1, no bias, masks with ``-inf`` (a finite masking constant is
    refused: its leakage depends on the logits, use :func:`~mhanum.bounds.attention_bound`).

    Args:
        q_len, kv_len, d_k, d_v: the shapes (``d_v`` defaults to ``d_k``).
        q_norm, k_norm: bounds on the Euclidean norms of the query and key rows.
        v_max: a bound on the magnitude of every value entry.
        numerics: a :class:`~mhanum.Numerics` or preset name.
        scale: the logit scale; default ``1/sqrt(d_k)``.
        min_keys: the fewest keys a row attends (only the naive softmax uses it); default
            ``kv_len``.
        softcap: the logit soft-cap ``c`` (``c·tanh(s/c)`` on the scaled scores), or ``None``:
            A.4 then reads the capped logits, ``|a| <= c·tanh(c_s·q_norm·k_norm/c)`` within the
            error of Theorem B.9 (a) (papers/backward.md), so the logit range is at most ``2c``
            however large the norms.

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has shape ``(d_v,)`` (the same bound for
        every row); ``terms`` as for :func:`~mhanum.bounds.attention_bound`. ``total`` is
        ``inf`` (terms ``overflow``, ``vacuous``) exactly when ``Bound.reasons`` is not empty.

    Raises:
        InvalidArgument: for non-positive sizes, negative or non-finite norms, or numerics
            outside the theorem's scope. A possible overflow is not an error: it is an infinite
            bound with its reason in ``Bound.reasons``.

    References:
        blanchard2021; higham2002 (§3.1); papers/attention.md Theorem A.4.

    Examples:
        >>> b = attention_bound_a_priori(64, 64, 64, q_norm=8.0, k_norm=8.0, v_max=3.0,
        ...                              numerics="fp32")
        >>> bool(b.total.max() < 1e-3), b.reasons
        (True, ())
    """
    num = resolve(numerics)
    _check_a_priori_scope(num)
    V.positive_int(q_len, "q_len")
    n = V.positive_int(kv_len, "kv_len")
    d_k = V.positive_int(d_k, "d_k")
    d_v = d_k if d_v is None else V.positive_int(d_v, "d_v")
    least = n if min_keys is None else V.positive_int(min_keys, "min_keys")
    if least > n:
        msg = f"min_keys: expected at most kv_len = {n}, got {least}"
        raise InvalidArgument(msg)
    qn, kn = _nonnegative(q_norm, "q_norm"), _nonnegative(k_norm, "k_norm")
    vm = _nonnegative(v_max, "v_max")
    cap = V.softcap_value(softcap)
    if cap is not None:
        num.check_softcap()
    fin = num.format_of("input")
    c = V.scale_value(scale, d_k, placement=num.scale)
    rng = _Range()
    # |x̃ - x| <= u_in|x| + η_in for unrounded inputs (A.1 step 1)
    qo = _Operand(None, qn, fin.u, np.full(d_k, fin.smallest_normal))
    ko = _Operand(None, kn, fin.u, np.full(d_k, fin.smallest_normal))
    v_abs = np.full(d_v, vm)
    with np.errstate(over="ignore"):  # bounds beyond float64 are inf, and flagged
        logits = _logit_error(qo, ko, d_k, num, c, scale is None, rng)
        if cap is not None:
            logits = _capped(logits, cap, num, rng)
        v_bar = _values(v_abs, fin.u * v_abs + fin.smallest_normal, num, rng)
        terms = _softmax_pv(logits, n, least, v_abs, v_bar, 0.0, num, rng)
    return _total(terms, "A.4", rng, (d_v,))


def mha_bound_a_priori(
    params: MHAParams,
    num_heads: int,
    q_len: int,
    kv_len: int,
    *,
    x_max: float,
    x_kv_max: float | None = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    min_keys: int | None = None,
    num_kv_heads: int | None = None,
) -> Bound:
    """Theorem A.4 for multi-head attention: a bound from the weights and ``max |x|`` only.

    For every input with ``|x_q| <= x_max`` and ``|x_kv| <= x_kv_max`` entrywise (float64 values,
    rounded into ``numerics.input``), the error of every output component of
    ``mhanum.multi_head_attention(x_q, x_kv, params, num_heads, mask=..., numerics=...)`` is at
    most ``total[l]``. The projections follow A.2 (a) evaluated at ``|x| = x_max``, ``|w|`` and
    ``|b|`` (every term is nondecreasing in them), which bounds each projected entry, its float64
    stand-in's error and the computed entry's error coordinatewise; each head is then A.4 with
    ``|q_i|·|k_j| <= Σ_t Q_t K_t`` for those coordinate bounds and the term ``evaluation`` of
    A.2 (b), and the output projection is A.2 (c) at ``|o_l| <= max |v_l|``.

    No overflow is proved from the same bounds: the inputs in the input format, every stage of
    the projections (R.7: weights, operands, partial sums, bias, the result in the storage
    format), every stage of each head (as :func:`attention_bound_a_priori`) and the output
    projection (in the output format). Where a stage may overflow, every entry is ``inf``
    (terms ``overflow``, ``vacuous``) and ``Bound.reasons`` says why.

    Args:
        params: the layer's weights.
        num_heads: number of heads.
        num_kv_heads: grouped-query attention, as in :func:`mhanum.multi_head_attention`.
        q_len, kv_len: sequence lengths.
        x_max: a bound on ``|x_q|`` entries; ``x_kv_max`` on ``|x_kv|`` (default ``x_max``).
        numerics, scale, min_keys: as for :func:`attention_bound_a_priori`.

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has shape ``(d_out,)``, ``inf`` exactly
        when ``Bound.reasons`` is not empty.

    Raises:
        InvalidArgument: for non-positive sizes, negative or non-finite bounds, parameters that
            do not fit ``num_heads``, or numerics outside the theorem's scope.

    References:
        papers/attention.md Theorems A.2 and A.4.
    """
    num = resolve(numerics)
    _check_a_priori_scope(num)
    if not isinstance(params, MHAParams):
        msg = f"params: expected an MHAParams, got {type(params).__name__}"
        raise InvalidArgument(msg)
    if num_kv_heads is not None:
        params = params.expand_kv_heads(num_heads, num_kv_heads)
    heads = V.positive_int(num_heads, "num_heads")
    params.validate(heads)
    V.positive_int(q_len, "q_len")
    n = V.positive_int(kv_len, "kv_len")
    least = n if min_keys is None else V.positive_int(min_keys, "min_keys")
    if least > n:
        msg = f"min_keys: expected at most kv_len = {n}, got {least}"
        raise InvalidArgument(msg)
    xq = _nonnegative(x_max, "x_max")
    xkv = xq if x_kv_max is None else _nonnegative(x_kv_max, "x_kv_max")
    with np.errstate(over="ignore"):  # bounds beyond float64 are inf, and flagged
        return _mha(params, heads, n, least, xq, xkv, num, scale)


def _mha(
    params: MHAParams,
    heads: int,
    n: int,
    least: int,
    xq: float,
    xkv: float,
    num: Numerics,
    scale: float | None,
) -> Bound:
    """:func:`mha_bound_a_priori` after its arguments are checked."""
    fin, storage, out_fmt = num.format_of("input"), num.storage_format, num.format_of("output")
    w: dict[str, Any] = {
        f.name: None if getattr(params, f.name) is None else np.abs(getattr(params, f.name))
        for f in dataclasses.fields(params)
    }
    w = {k: None if a is None else np.asarray(a, np.float64) for k, a in w.items()}
    shape = (params.d_out,)
    rng = _Range()
    bounds = {}
    for name, xname, x, width in (
        ("q", "x_q", xq, params.d_q),
        ("k", "x_kv", xkv, params.d_kv),
        ("v", "x_kv", xkv, params.d_kv),
    ):
        x64 = np.full((1, width), x)
        e_in = fin.u * x64 + fin.smallest_normal
        rng.check(x64 + e_in, fin, f"{xname} in the input format")
        wn, bn = f"w{name}", f"b{name}"
        lin = linear(x64, np.zeros_like(x64), w[wn], w[bn], num, storage)
        _, why = linear_overflow(lin, x64, e_in, w[wn], w[bn], num, storage, f"{name} projection")
        for reason in why:
            rng.flag(_literal(reason))
        given = lin.given[0]
        # |y*| <= lin.y + given at x_max; the stand-in of an admissible input is within given
        # of its y*; the computed entry within used + given of the stand-in (A.2 (b))
        bounds[name] = (lin.y[0] + 2 * given, lin.error(e_in)[0] + given, given)
    if not all(np.isfinite(np.concatenate(b)).all() for b in bounds.values()):
        rng.flag("the projections' bounds are not finite in float64")
        return _total({}, "A.4", rng, shape)
    d_k, d_v = params.qk_width // heads, params.v_width // heads
    c = V.scale_value(scale, d_k, placement=num.scale)
    per_head = []
    for h in range(heads):
        qs, ks, vs = (slice(h * d, (h + 1) * d) for d in (d_k, d_k, d_v))
        (q_size, e_q, g_q), (k_size, e_k, g_k) = (
            tuple(a[s] for a in bounds[name]) for name, s in (("q", qs), ("k", ks))
        )
        qo = _Operand(q_size, 0.0, 0.0, e_q, 0.0, g_q)
        ko = _Operand(k_size, 0.0, 0.0, e_k, 0.0, g_k)
        logits = _logit_error(qo, ko, d_k, num, c, scale is None, rng)
        v_abs, e_v, g_v = (a[vs] for a in bounds["v"])
        v_bar = _values(v_abs, e_v, num, rng)
        per_head.append(_softmax_pv(logits, n, least, v_abs, v_bar, g_v, num, rng))
    names = sorted({name for t in per_head for name in t})
    merged = {
        name: np.concatenate([np.broadcast_to(t.get(name, 0.0), (d_v,)) for t in per_head])
        for name in names
    }
    merged = {name: t * (1 + EVALUATION) for name, t in merged.items()}
    # A.2 (c): the heads' outputs within |v| of zero, their stand-ins within the evaluation
    # error of the exact ones, and the computed ones within the heads' totals
    o_abs = bounds["v"][0][None, :]
    o_given = EVALUATION * o_abs + merged.get("evaluation", np.zeros(params.v_width))[None, :]
    out = linear(o_abs, o_given, w["wo"], w["bo"], num, out_fmt)
    o_err = sum(merged.values(), np.zeros(params.v_width))[None, :]
    _, why = linear_overflow(out, o_abs, o_err, w["wo"], w["bo"], num, out_fmt, "output projection")
    for reason in why:
        rng.flag(_literal(reason))
    terms = {f"attention.{name}": out.kappa * (t @ out.slope) for name, t in merged.items()}
    terms["output_projection"] = out.fixed[0]
    return _total(terms, "A.4", rng, shape)
