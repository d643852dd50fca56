"""Componentwise bounds on the error of attention's backward pass: papers/backward.md B.0-B.9.

:func:`attention_grad_bound` bounds ``|ĝ - g|`` for each gradient ``g`` of
:func:`mhanum.reference.attention_grad` (``dq``, ``dk``, ``dv``, ``dbias``) and ``ĝ`` the one
:func:`mhanum.emulate.backward.attention_grad` computes, or any kernel that rounds as its
:class:`~mhanum.numerics.Numerics` and :class:`~mhanum.numerics.Backward` say, **whatever order
its ``dQ`` additions take** (Theorem B.2: FlashAttention-2's ``atomicAdd`` of one partial per key
block). :func:`dq_order_difference` bounds ``|dq_a - dq_b|`` between two such orders (Theorem
B.3: run-to-run nondeterminism). :func:`mha_grad_bound` bounds every gradient of multi-head
attention, grouped-query layers included (Theorem B.6), and its probabilistic variant (B.8).

The bounds are evaluated on the given inputs in float64, each float64 value standing in for an
exact one with its own enclosure (papers/backward.md, §0). Every stage's rounding is charged
where it happens, and every stage's range is a hypothesis proved on the enclosures: where it
cannot be, the gradient it feeds is ``inf`` with the reason in ``Bound.reasons``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.bounds._result import Bound
from mhanum.bounds.a_priori import (
    CappedLogits,
    attention_bound_a_priori,
    cap_constant,
    cap_roundings,
    softcap_a_priori,
)
from mhanum.bounds.attention import (
    PROBABILISTIC,
    attention_bound_along,
    head_output_bound,
    merge_heads,
    split_heads,
)
from mhanum.bounds.factors import (
    chain,
    compound,
    division_error,
    evaluation_rounding,
    exp_and_sum_factors,
    is_power_of_four,
    lam_or_probability,
    linear,
    linear_overflow,
    operand_bits,
    operand_error,
    rounding_error,
    safe_weight_sums,
    scale_rounding,
    tensor_core_anchor,
    union_failure,
    unit_eta,
    unit_factor,
)
from mhanum.formats import Format
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward
from mhanum.problem import AttentionProblem, MHAProblem

__all__ = [
    "GradientBounds",
    "MHAGradientBounds",
    "attention_grad_bound",
    "attention_grad_bound_a_priori",
    "dq_order_difference",
    "mha_grad_bound",
]

ASSUMPTIONS = (
    "round-to-nearest; a rounding into F is x(1+δ)+η, |δ| <= u_F, |η| <= 2^emin_F (flush-to-zero)",
    "exp and log in the softmax format within exp_ulps ulps, division within div_ulps ulps",
    "every dot on the numerics' dot unit in its summation order (Theorem S.0 / R.5 / T.2)",
    "masked keys excluded exactly (-inf masking); the scale on the scores",
    "float64 evaluation of the bound: numpy's exp and log within 1 ulp, sums within γ_n",
    (
        "no overflow: proved on the given values stage by stage; where it cannot be, the "
        "gradient is inf with Bound.reasons"
    ),
)

_U64 = 2.0**-53


class GradientBounds(NamedTuple):
    """The bounds of one backward pass, one :class:`Bound` per gradient (each shaped like it),
    and ``stages``: componentwise bounds on the error of the intermediates every gradient reads
    (``P``, the probabilities each gradient's stage uses; ``dP``, ``D`` and ``dS``), so that a
    user sees where the error enters; with a sink, ``dsink``."""

    dq: Bound
    dk: Bound
    dv: Bound
    dbias: Bound
    stages: dict[str, np.ndarray]
    dsink: Bound | None = None


@dataclasses.dataclass
class _Q:
    """A quantity: its float64 stand-in ``mid``, ``rad >= |mid - exact|`` and
    ``err >= |computed - exact|`` (componentwise)."""

    mid: np.ndarray
    rad: np.ndarray
    err: np.ndarray

    @property
    def up(self) -> np.ndarray:
        """``>= |exact|``."""
        return np.abs(self.mid) + self.rad

    @property
    def used(self) -> np.ndarray:
        """``>= |computed|``."""
        return np.abs(self.mid) + self.rad + self.err


class _Range:
    """Which gradients a stage that may overflow reaches, and why."""

    def __init__(self) -> None:
        self.hit: dict[str, bool] = dict.fromkeys(("dq", "dk", "dv", "dbias"), False)
        self.reasons: list[str] = []

    def check(self, upper: Any, fmt: Format, stage: str, reaches: tuple[str, ...]) -> None:
        upper = np.asarray(upper, np.float64)
        bad = ~(upper <= fmt.max_finite)  # NaN counts
        if not bad.any():
            return
        worst = float(np.max(np.where(np.isnan(upper), np.inf, upper)[bad]))
        reason = (
            f"{stage}: values up to {worst:.4g} may overflow {fmt.name} "
            f"(largest finite {fmt.max_finite:.6g})"
        )
        if reason not in self.reasons:
            self.reasons.append(reason)
        for name in reaches:
            self.hit[name] = True

    def operands(
        self, num: Numerics, a_used: Any, b_used: Any, stage: str, reaches: tuple[str, ...]
    ) -> None:
        """A dot's operands, ``|â| <= a_used`` and ``|b̂| <= b_used``, read into its operand
        format (tf32, a tensor core's input, bfloat16 pieces: it may round the largest float32
        values up to inf) and then, rounded (``(1 + u_op)|x| + η_op``, at most the operand
        format's largest finite number), into the accumulation format: float16's 65504 is
        65536 in bfloat16, past float16's range."""
        op, acc = num.operand_rounding, num.format_of("accum")
        u_op, eta_op = operand_error(num)
        for side, used in (("first", a_used), ("second", b_used)):
            top = float(np.max(np.asarray(used, np.float64), initial=0.0))
            read = top * (1 + u_op) + eta_op
            if op is not None:
                where = f"{stage}: the {side} operand read into the operand format"
                self.check(top, op, where, reaches)
                read = min(read, op.max_finite)
            where = f"{stage}: the {side} operand read into the accumulation format"
            self.check(read, acc, where, reaches)


def _take(
    upper: np.ndarray, src: Format, dst: Format, lower: np.ndarray | None = None
) -> np.ndarray | float:
    """The error of reading a value of ``src`` (``|x| <= upper``) into ``dst``: ``u|x|`` in
    ``dst``'s normal range; below it at most ``min(|x|, η)`` (flushed or rounded to a
    subnormal number, 0 being a candidate), ``η`` ``dst``'s smallest normal number. With
    ``lower <= |x|``, the second part only where ``lower < η`` (the value may lie below it)."""
    if dst.precision >= src.precision and dst.smallest_normal <= src.smallest_normal:
        return 0.0
    u = dst.u if dst.precision < src.precision else 0.0
    flush = np.minimum(upper, _flush(src, dst))
    if lower is not None:
        flush = np.where(lower >= _flush(src, dst), 0.0, flush)
    return u * upper + flush


def _shift(p_up: np.ndarray, delta: np.ndarray, keep: np.ndarray, top: np.ndarray) -> np.ndarray:
    """B.1 step 3's ``W_i >= |log Σ_k p_k e^{δ_k}|`` for logit errors ``|δ_k| <= Δ_k`` and the
    exact softmax ``p`` of the row: ``min(max_k Δ_k, log Σ_k p̄_k e^{Δ_k})`` with ``p̄ >= p``
    (papers/backward.md, step 3), evaluated upward in float64 (``top`` is ``max_k Δ_k``)."""
    n = delta.shape[-1]
    with np.errstate(over="ignore", invalid="ignore"):
        lse = np.where(keep, p_up * np.exp(delta), 0.0).sum(axis=-1, keepdims=True)
        w = np.log(lse) * (1 + 4 * _U64) + (n + 4) * _U64
    return np.where(np.isfinite(w) & (w < top), np.maximum(w, 0.0), top)


def _pair_sums(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``>= Σ_{l ≠ j} w_l |a_j + a_l|`` along the last axis, for ``w >= 0``: the keys sorted by
    ``a`` once per row, each ``j`` split at ``a_l = -a_j`` (``O(n log n)`` per row, where the
    direct sum is ``O(n²)``), plus the float64 evaluation of the prefix sums,
    ``(4n + 16)u64 (|a_j| Σ w + Σ w|a|)`` (each partial sum is within ``γ_n`` of its terms'
    magnitudes; a few operations combine them)."""
    n = a.shape[-1]
    order = np.argsort(a, axis=-1, kind="stable")
    a_s = np.take_along_axis(a, order, axis=-1)
    w_s = np.take_along_axis(w, order, axis=-1)
    zero = np.zeros((*a.shape[:-1], 1))
    cw = np.concatenate([zero, np.cumsum(w_s, axis=-1)], axis=-1)
    cwa = np.concatenate([zero, np.cumsum(w_s * a_s, axis=-1)], axis=-1)
    # below[..., j]: how many keys have a_l < -a_j, from one stable sort of (-a, sorted a):
    # each -a_j is preceded by the a_l below it (a tie adds |a_j + a_l| = 0 either way)
    merged = np.argsort(np.concatenate([-a, a_s], axis=-1), axis=-1, kind="stable")
    is_key = merged >= n
    ranks = np.empty(merged.shape, dtype=np.intp)
    np.put_along_axis(ranks, merged, np.cumsum(is_key, axis=-1) - is_key, axis=-1)
    below = ranks[..., :n]
    w_lo = np.take_along_axis(cw, below, axis=-1)
    wa_lo = np.take_along_axis(cwa, below, axis=-1)
    w_all, wa_all = cw[..., -1:], cwa[..., -1:]
    total = a * (w_all - 2 * w_lo) + (wa_all - 2 * wa_lo)  # Σ_l w_l |a_j + a_l|
    mass = np.abs(a) * w_all + (w * np.abs(a)).sum(axis=-1, keepdims=True)
    total = np.maximum(total, 0.0) + (4 * n + 16) * _U64 * mass
    # less the l = j term 2 w_j |a_j|, taken low
    return np.maximum(total - 2 * w * np.abs(a) * (1 - 4 * _U64), 0.0)


def _signed_product(
    a_mid: np.ndarray, a_up: np.ndarray, b_mid: np.ndarray, b_up: np.ndarray
) -> np.ndarray:
    """Step 8: ``>= |a b|`` for ``|a - a_mid| <= a_up - |a_mid|``, ``|b - b_mid| <= b_up -
    |b_mid|``: ``|a_mid b_mid| + (a_up - |a_mid|) b_up + |a_mid| (b_up - |b_mid|)``, the float64
    product of the midpoints within ``γ_n`` of ``a_up b_up``; NaN where an operand is not
    finite."""
    n = a_up.shape[-1]
    m_a, m_b = np.abs(a_mid), np.abs(b_mid)
    with np.errstate(invalid="ignore", over="ignore"):
        signed = np.abs(a_mid @ b_mid) + _f64_dot(n) * (a_up @ b_up)
        signed = signed + (a_up - m_a) @ b_up + m_a @ (b_up - m_b)
        return signed * (1 + evaluation_rounding(n))


def _coupled_dq(
    p_mid: np.ndarray,
    p_up: np.ndarray,
    pe: np.ndarray,
    t: np.ndarray,
    t_rad: np.ndarray,
    dp: _Q,
    k: np.ndarray,
    k_rad: np.ndarray | None,
) -> np.ndarray:
    """B.1 step 7': ``>= |Σ_j π_ij (t_ij k_jc - dP_ij k̄_ic)|`` for ``|π| <= pe``, the exact
    ``t = dP - D``, ``dP`` and ``k`` within their radii of the float64 stand-ins ``t``,
    ``dp.mid`` and ``k``, and ``k̄ = Σ_j P_ij k_j`` with ``|P - p_mid| <= p_up - p_mid``.
    The radii's shares are matrix products; ``Σ_j pe_ij |t_ij k_jc - dP_ij k̄_ic|`` is
    ``O(L_q L_k d)`` elementwise work, in chunks of query rows."""
    lq, n, d = p_mid.shape[-2], p_mid.shape[-1], k.shape[-1]
    outer = np.broadcast_shapes(p_mid.shape[:-2], k.shape[:-2], t.shape[:-2])
    kr = np.zeros_like(k) if k_rad is None else np.broadcast_to(k_rad, k.shape)

    def flat(a: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
        return np.broadcast_to(a, outer + tail).reshape((-1, *tail))

    p_mid, p_up, pe = (flat(a, (lq, n)) for a in (p_mid, p_up, pe))
    t, t_rad, dpm, dpr = (flat(a, (lq, n)) for a in (t, t_rad, dp.mid, dp.rad))
    k, kr = flat(k, (n, d)), flat(kr, (n, d))
    ka = np.abs(k)
    kbar, kbar_rad = _kbar(p_mid, p_up, k, kr)
    pe_t = pe * np.abs(t)
    pe_dp = (pe * np.abs(dpm)).sum(axis=-1, keepdims=True)
    pe_dpr = (pe * dpr).sum(axis=-1, keepdims=True)
    # Σ_j pe_j T_jc with T_jc = |t k - dP k̄| of the stand-ins, plus 4u64(|t k| + |dP k̄|)
    # for its float64 evaluation, plus each stand-in's radius times the other factor
    out = 4 * _U64 * (pe_t @ ka + pe_dp * np.abs(kbar))
    out += (pe * t_rad) @ (ka + kr) + pe_t @ kr
    out += pe_dpr * (np.abs(kbar) + kbar_rad) + pe_dp * kbar_rad
    step = max(1, 2**22 // max(1, n * d))
    for b in range(k.shape[0]):
        for i in range(0, lq, step):
            sl = slice(i, i + step)
            diff = t[b, sl, :, None] * k[b, None] - dpm[b, sl, :, None] * kbar[b, sl, None, :]
            out[b, sl] += np.einsum("ij,ijc->ic", pe[b, sl], np.abs(diff))
    return out.reshape((*outer, lq, d))


def _kbar(
    p_mid: np.ndarray, p_up: np.ndarray, k: np.ndarray, k_rad: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(p_mid k, rad)`` with ``|Σ_j P_ij k_jc - (p_mid k)_ic| <= rad`` for
    ``|P - p_mid| <= p_up - p_mid`` and ``k`` within ``k_rad`` of the float64 stand-in:
    ``(p_up - p_mid)(|k| + r) + p_mid r + γ p_mid|k|``."""
    ka = np.abs(k)
    kbar = p_mid @ k
    rad = _f64_dot(p_mid.shape[-1]) * (p_mid @ ka)
    if k_rad is None:
        return kbar, rad + (p_up - p_mid) @ ka
    return kbar, rad + (p_up - p_mid) @ (ka + k_rad) + p_mid @ k_rad


def _flush(src: Format, dst: Format) -> float:
    """The absolute part ``η`` of reading a value of ``src`` into ``dst`` (its relative part
    ``u`` is carried as a ratio): ``dst``'s smallest normal number where that is above
    ``src``'s, else 0."""
    return dst.smallest_normal if dst.smallest_normal > src.smallest_normal else 0.0


def _log_radius(r: Any) -> Any:
    """``-log(1 - r)``: a ratio within ``1 ± r`` is within ``e^{±ρ}`` (``inf`` for ``r >= 1``)."""
    r = np.asarray(r, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(r < 1, -np.log1p(-np.minimum(r, 0.5 + 0.5 * (r < 1))), np.inf)


def _f64_dot(n: int) -> float:
    """The float64 evaluation factor of a dot of length ``n`` (any order)."""
    return chain(n, "sequential", _U64, None, products=True)


class _Dot:
    """Theorem B.0: the error of a dot on the numerics' unit from enclosed operands."""

    def __init__(self, num: Numerics) -> None:
        self.num = num
        self.u_op, self.eta_op = operand_error(num)
        self.anchor = tensor_core_anchor(num)

    def __call__(
        self,
        a_up: np.ndarray,
        a_err: np.ndarray,
        b_up: np.ndarray,
        b_err: np.ndarray,
        factor: float,
        eta: float,
        coupled: list[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(from a, from b, accumulation)`` with ``|Ĉ - a b| <=`` their sum, for operands
        ``|â - a| <= a_err``, ``|a| <= a_up`` (``b`` likewise) rounded to the operand format.

        ``coupled=[(rest, bound), ...]``: each a split ``â - a = x + y`` with ``|y| <= rest`` and
        ``|x b| <= bound`` (B.1 steps 7′ and 3W, the coupled ``dS``); ``|(â - a) b|`` is then
        also within ``(rest + operand rounding) |b| + bound``, and the smallest is taken."""
        n = a_up.shape[-1]
        a_e = a_err + self.u_op * (a_up + a_err) + self.eta_op
        b_e = b_err + self.u_op * (b_up + b_err) + self.eta_op
        ev = 1 + evaluation_rounding(n)
        from_a = (a_e @ b_up) * ev
        for rest, bound in coupled or []:
            a_rest = rest + self.u_op * (a_up + a_err) + self.eta_op
            from_a = np.fmin(from_a, (a_rest @ b_up + bound) * ev)  # a NaN alternative: no bound
        from_a = from_a + (a_e @ b_e) * ev
        from_b = (a_up @ b_e) * ev
        au, bu = a_up + a_e, b_up + b_e
        acc = factor * (au @ bu) * ev + eta
        if self.anchor:
            acc = acc + factor * self.anchor * (
                au.sum(axis=-1, keepdims=True) + bu.sum(axis=-2, keepdims=True) + n * self.anchor
            )
        return from_a, from_b, acc


def _dot_factor(
    num: Numerics, n: int, block: int | None, bits: tuple[int, int], lam: float | None = None
) -> tuple[float, float, int]:
    """``(factor, eta, height)``: one chain of ``n`` (``block=None``), or dots over blocks of
    ``block`` whose ``ceil(n/block)`` results are added in any order (each passes through at
    most ``count - 1`` additions)."""
    eta_a = num.format_of("accum").smallest_normal
    if block is None or block >= n:
        return unit_factor(num, n, lam, bits=bits), unit_eta(num, n), 1
    count = -(-n // block)
    factor = unit_factor(num, block, lam, bits=bits, extra=count - 1)
    return factor, count * unit_eta(num, block) + count * eta_a, count


def _scaled_output(
    x_up: np.ndarray,
    x_err: np.ndarray,
    c: float,
    c64: float,
    u64: float,
    num: Numerics,
) -> tuple[np.ndarray, np.ndarray]:
    """``fl_out(fl_acc(X̂·ĉ))`` against ``c·X`` (``ĉ = fl_acc(c64)``): ``(from X's error, the
    scaling's and the output's roundings)``."""
    acc, out = num.format_of("accum"), num.format_of("output")
    _, u_r, u_mul = scale_rounding(c64, acc)
    theta = compound(u64, u_r)
    a = abs(c)
    carried = a * (1 + theta) * (1 + u_mul) * x_err
    y_up = a * x_up
    own = theta * y_up + u_mul * (1 + theta) * y_up + acc.smallest_normal
    y_err = carried + own
    rounding = _take(y_up + y_err, acc, out)
    return carried, own + rounding


def _plain_output(x_up: np.ndarray, x_err: np.ndarray, num: Numerics) -> np.ndarray:
    return _take(x_up + x_err, num.format_of("accum"), num.format_of("output")) + 0 * x_up


class _Inputs(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    keep: np.ndarray
    bias: np.ndarray | None
    c64: float
    u64: float
    sink: bool = False
    # multi-head attention's heads (Theorem B.6): the float64 q, k, v, d_out are stand-ins off
    # the exact ones by ``given``; the computed ones, before they are read into the input
    # format, are off the exact ones by ``errors`` and stored in the formats ``sources``
    given: tuple[np.ndarray, ...] | None = None
    errors: tuple[np.ndarray, ...] | None = None
    sources: tuple[Format, ...] | None = None
    # |Ô - O|, its reasons, and (or None) A.1g's bound along g per row
    forward: tuple[np.ndarray, tuple[str, ...], np.ndarray | None] | None = None
    cap: float | None = None  # the logit soft-cap
    scale: float | None = None  # the scale as given (None: 1/sqrt(d_k), rounded in float64)


def _inputs(p: AttentionProblem, num: Numerics) -> _Inputs:
    """The float64 inputs of Theorem B.1 for the backward problem ``p`` (``p.d_out`` given),
    broadcast to its batch, with the attended keys and the sink's key and value appended."""
    num.check_problem(p)
    batch, target, cap = p.batch, p.scores, p.softcap
    q, k, v, g = (
        np.broadcast_to(np.asarray(x, np.float64), (*batch, *x.shape[-2:]))
        for x in (p.q, p.k, p.v, p.d_out)
    )
    keep = masks.dense(p.mask, target)
    if p.mask is not None and not math.isinf(num.mask_constant()):
        msg = (
            "numerics.mask_value: the backward bound (Theorem B.1) needs -inf masking, got "
            f"{num.mask_value!r}"
        )
        raise InvalidArgument(msg)
    b = None
    if p.bias is not None:
        b = np.broadcast_to(np.asarray(p.bias, np.float64), target)
        keep = keep & np.isfinite(b)
        b = np.where(keep, b, 0.0)
    if p.sink is not None:  # one more key: k = v = 0, bias σ, never masked
        k, v, keep2, b = masks.with_sink(q, k, v, keep, b, p.sink)
        keep = np.ones(b.shape, bool) if keep2 is None else np.asarray(keep2, bool)
        q, g = (np.broadcast_to(x, (*b.shape[:-2], *x.shape[-2:])) for x in (q, g))
    if not keep.any(axis=-1).all():
        msg = "mask: expected every row to attend some key (an empty softmax has no gradient)"
        raise InvalidArgument(msg)
    c64 = p.scale_value(num.scale)
    u64 = 0.0
    if p.scale is None and not is_power_of_four(q.shape[-1]):
        u64 = compound(_U64, over=(_U64,))  # 1/sqrt(d): two float64 roundings
    return _Inputs(q, k, v, g, keep, b, c64, u64, p.sink is not None, cap=cap, scale=p.scale)


def _sech2(x: np.ndarray) -> np.ndarray:
    """``sech²(x)``, 0 past float64's range (rounded up: ``(1 + 2^-50)``)."""
    with np.errstate(over="ignore"):
        return (1 + 2.0**-50) / np.cosh(np.minimum(np.abs(x), 400.0)) ** 2


def _softcap_stage(
    s: _Q, cap: float, num: Numerics, grad: Format, keep: np.ndarray, rng: _Range
) -> tuple[_Q, _Q]:
    """Step 2c (papers/backward.md, B.7): the scaled scores ``s`` (computed ``ŝ``) capped at
    ``a = c·tanh(s/c)``, computed as ``fl_s(ĉ·fl_s(T(fl_s(ŝ·r̂))))``; and the slope
    ``σ = 1 - tanh²(s/c)`` the backward reads, computed as ``fl_g(1 - fl_g(t̂²))``.

    With ``y₀ = fl(s̃/c)``, every value in play lies within ``R`` of ``y₀``; ``tanh`` moves by at
    most ``sech²(max(0, |y₀| - R))`` per unit there, so ``|t̂ - tanh(s/c)| <= L·w + e_T`` for
    ``|x̂ - s/c| <= w = |ŝ - s| r̂ + |s||r̂ - 1/c| + u_s|ŝ|r̂ + η_s`` and ``tanh``'s rounding
    ``e_T`` (``tanh_ulps`` of its carrier, then the score format)."""
    fs, carrier, u_s, eta_s, u_t, eta_t, c_hat, e_c, r_hat, e_r, finite = cap_roundings(cap, num)
    if not finite:
        rng.check(np.inf, fs, f"softcap: the cap {cap:g} or its reciprocal in {fs.name}",
                  ("dq", "dk", "dv", "dbias"))  # fmt: skip
        c_hat, r_hat = cap, 1.0 / cap
    s_up, s_used = s.up, s.used
    rng.check(np.where(keep, s_used * r_hat * (1 + u_s) + eta_s, 0.0), fs,
              f"the scores times 1/softcap = {r_hat:.4g}", ("dq", "dk", "dv", "dbias"))  # fmt: skip
    y0 = s.mid / cap
    r_y = s.rad / cap + 2 * _U64 * np.abs(y0)
    w = s.err * r_hat + s_up * e_r + u_s * s_used * r_hat + eta_s
    big_r = r_y + w
    lip = _sech2(np.maximum(0.0, np.abs(y0) - big_r))
    th0 = np.abs(np.tanh(y0)) * (1 + 2.0**-50)
    tau = np.minimum(1.0, th0 + lip * big_r)  # >= |tanh| anywhere in play
    tau_x = np.minimum(1.0, th0 + lip * r_y)  # >= |tanh(s/c)|
    e_t = u_t * tau + eta_t
    if carrier.name != fs.name:
        e_t = e_t + u_s * (tau + e_t) + eta_s
    e_tau = lip * w + e_t  # |t̂ - tanh(s/c)|
    a_mid = cap * np.tanh(y0)
    a_rad = cap * lip * r_y + 2.0**-50 * np.abs(a_mid) + 2.0**-1070
    a_err = e_c * (tau_x + e_tau) + cap * e_tau + u_s * c_hat * (tau_x + e_tau) + eta_s
    # the slope, in the gradient format
    u_g, eta_g = grad.u, grad.smallest_normal
    e_tg = e_tau + _take(tau_x + e_tau, fs, grad)
    sq = (tau_x + e_tg) ** 2
    # |1 - fl(t̂²)| <= 1 + fl(t̂²) <= 1 + sq(1 + u_g) + η_g
    sig_err = (
        e_tg * (2 * tau_x + e_tg) + u_g * sq + eta_g + u_g * (1 + sq * (1 + u_g) + eta_g) + eta_g
    )
    low = np.maximum(0.0, np.abs(np.tanh(y0)) * (1 - 2.0**-50) - lip * r_y)
    sig_up = np.minimum(1.0, 1 - low * low + 2.0**-50)
    return _Q(a_mid, a_rad, a_err), _Q(np.zeros_like(sig_up), sig_up, sig_err)


def _through_cap(
    ds_up: np.ndarray,
    ds_err: np.ndarray,
    slope: _Q,
    cap: float,
    grad: Format,
    rng: _Range,
) -> tuple[np.ndarray, np.ndarray]:
    """``|dA|`` and ``|dÂ - dA|`` for ``dA = dS·σ`` computed as ``fl(fl(fl(dŜ·ĉ)·σ̂)·r̂)`` in
    the gradient format: ``dŜσ̂ĉr̂ - dSσ = (dŜ - dS)σ̂(1 + ρ) + dS(σ̂ - σ)(1 + ρ) + dSσρ`` with
    ``ĉr̂ = 1 + ρ``, and three roundings."""
    u_g, eta_g = grad.u, grad.smallest_normal
    c_hat, e_c = cap_constant(cap, grad)
    r_hat, e_r = cap_constant(1.0 / cap, grad)
    rho = e_c * r_hat + cap * e_r
    sig_up, sig_err = slope.up, slope.err
    sig_used = sig_up + sig_err
    ds_used = ds_up + ds_err
    carried = (ds_err * sig_used + ds_up * sig_err) * (1 + rho) + ds_up * sig_up * rho
    magnitude = ds_used * c_hat * sig_used * r_hat
    own = compound(powers=((u_g, 3),)) * magnitude + eta_g * (
        sig_used * r_hat * (1 + u_g) ** 2 + r_hat * (1 + u_g) + 1
    )
    for stage, upper in (
        ("dS times the soft-cap", ds_used * c_hat * (1 + u_g) + eta_g),
        ("dS through the soft-cap's tanh", ds_used * c_hat * sig_used * (1 + u_g) ** 2 + 2 * eta_g),
    ):
        rng.check(upper, grad, stage, ("dq", "dk"))
    return ds_up * sig_up, carried + own


def _slope_a_priori(capped: CappedLogits, num: Numerics, grad: Format) -> _Q:
    """B.9 (b): ``σ = sech²(s/c) <= 1`` and ``σ̂ = fl_G(1 - fl_G(t̂_G²))`` from the capped
    logits' ``tanh`` (``|t̂ - tanh| <= e_τ``, ``|t̂| <= t_used``) read into the gradient format.

    B.7's ``|σ̂ - σ| <= e_g(2τ + e_g) + u_G(τ + e_g)² + u_G(1 + (τ + e_g)²) + 2η_G`` with
    ``τ + e_g`` no more than ``|t̂_G|``'s bound; and, since ``0 <= σ <= 1`` and rounding is
    monotone (``fl(t̂²) >= 0``, so ``σ̂ <= 1``; ``σ̂ >= -m``), ``|σ̂ - σ| <= 1 + m``."""
    fs = num.format_of("score")
    u_g, eta_g = grad.u, grad.smallest_normal
    tau = capped.tau
    read = float(np.max(_take(np.asarray(capped.t_used), fs, grad)))
    e_g = capped.e_tau + read
    t_g = min(tau + e_g, capped.t_used + read)  # >= |t̂_G|
    square = t_g**2 * (1 + u_g) + eta_g  # >= fl(t̂_G²) >= 0
    lipschitz = e_g * (2 * tau + e_g) + u_g * t_g**2 + eta_g + u_g * (1 + square) + eta_g
    below = max(0.0, square - 1) * (1 + u_g) + eta_g  # σ̂ >= -below
    err = min(lipschitz, 1 + below)
    return _Q(np.zeros(()), np.ones(()), np.asarray(err))


def _stored_weights(
    keep: np.ndarray,
    n: int,
    gap: np.ndarray,
    bits: tuple[int, int],
    eps_e: float,
    eps_div: float,
    u_p: float,
    num: Numerics,
) -> tuple[np.ndarray, np.ndarray]:
    """Step W of B.1: ``(P̂ᵐᵃˣ, W)`` with ``P̂_ij <= P̂ᵐᵃˣ_i`` and ``Σ_j P̂_ij <= W_i`` for the
    probabilities a safe softmax stores, whatever the logit errors (papers/attention.md, Lemma
    W: every computed exponential is at most ``1 + ε_e``, the row maximum's is 1, so the
    computed row sum is at least ``1 - T_0``; deterministic, so beside B.5's terms too)."""
    sm, prob = num.format_of("softmax"), num.format_of("prob")
    g_sum = exp_and_sum_factors(num, n, gap, None, bits)[2]
    n_live = keep.sum(axis=-1, keepdims=True)
    inv, row = safe_weight_sums(n_live, g_sum, eps_div, sm)
    entry = (inv * (1 + eps_e) + sm.smallest_normal) * (1 + u_p) + prob.smallest_normal
    return entry, row * (1 + u_p) + n_live * prob.smallest_normal


def _check_scope(num: Numerics, bw: Backward) -> None:
    bw.check_forward(num)
    if num.softmax_kind == "naive":
        msg = (
            "numerics.softmax: the backward bound covers the 'safe' and 'online(B)' softmax, "
            f"got {num.softmax!r}"
        )
        raise InvalidArgument(msg)
    if num.format_of("score").precision > num.format_of("softmax").precision:
        msg = (
            "numerics.score_format: the backward bound needs a score format no wider than the "
            f"softmax format, got {num.score_format} and {num.format_of('softmax').name}"
        )
        raise InvalidArgument(msg)


def _t(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _t_or_none(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else _t(x)


def _spread(
    ra: np.ndarray | None, b_up: np.ndarray, a_mid: np.ndarray, rb: np.ndarray | None
) -> np.ndarray | float:
    """``|a b - a* b*| <= r_a |b*| + |a| r_b`` for stand-ins ``a``, ``b`` within ``r_a``, ``r_b``
    of the exact ones (``|b*| <= b_up``); 0 when both are exact."""
    out: np.ndarray | float = 0.0
    if ra is not None:
        out = out + ra @ b_up
    if rb is not None:
        out = out + a_mid @ rb
    return out


def _head_chains(lq: int, n: int, d: int, dv: int, flash: bool, sink: bool) -> int:
    """The rounding chains of one attention's backward (Theorem B.5), one per term of every
    sum and dot (Theorem R.6's corollary: a dot's factor needs each of its terms' chains):
    ``q kᵀ`` (``L_q n d``), the softmax's row sums (``L_q n``), ``G Vᵀ`` (``L_q n d_v``), the
    sums of ``D`` (``L_q n``, FlashAttention-2 ``L_q d_v``), ``dQ``, ``dK``, ``dV`` (``L_q n
    (2d + d_v)``) and, with a sink, ``dsink`` (``L_q``); ``n`` counts the sink's key."""
    return lq * n * (3 * d + 2 * dv + 1) + lq * (dv if flash else n) + (lq if sink else 0)


@one_blas_thread
def attention_grad_bound(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    mask: Any = None,
    *,
    bias: Any = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    lam: float | None = None,
    probability: float | None = None,
    sink: Any = None,
    softcap: float | None = None,
) -> GradientBounds:
    """Componentwise bounds on the error of every gradient of attention (Theorems B.1, B.2).

    **Theorem B.1 (textbook) / B.2 (FlashAttention-2).** Let ``g`` be a gradient of
    ``<d_out, attention(q, k, v)>`` (exact: :func:`mhanum.reference.attention_grad`) and ``ĝ`` the
    one computed by :func:`mhanum.emulate.backward.attention_grad` with ``numerics`` and
    ``backward``, or by any kernel whose every stage rounds as they state, with the ``dQ``
    partials of B.2 added **in any order**. Under the assumptions listed in ``Bound.assumptions``,

    .. math::

        |\\hat g - g| \\le \\mathrm{total}

    entry by entry, where ``total`` is the propagation of papers/backward.md: the logits'
    error ``Δ`` (B.0 on ``q kᵀ``, the score rounding, the scale's and the bias's roundings);
    the probabilities within ``P·(e^R - 1) + A`` (``R = L + Δ_j + W``, ``W = min(max Δ,
    log Σ_k P̄_k e^{Δ_k})`` by Jensen, ``L`` the softmax's own log-ratio: exponentials, sum,
    division and the relative rounding into ``prob_format``; B.2: the stored log-sum-exp's error
    and the recomputed exponential; ``A`` the underflow allowance, with ``min(P̄, η_p)`` only
    where ``P`` may lie below ``prob_format``'s smallest normal number); ``dP``, ``D`` (textbook
    from ``dP`` and ``P``; B.2 from ``d_out`` and the forward output, whose error along each
    row of ``d_out`` is :func:`attention_bound_along`'s, Theorem A.1g), ``dP - D`` and ``dS``
    each with their rounding; and the last dots by B.0, of one chain (textbook) or of blocks
    whose results are added in any order (B.2: ``(1 + γ_B)(1 + u)^{n_b - 1} - 1``), then the
    scale and the output rounding. The textbook's ``dq`` also takes step 7': ``P̂``'s error
    kept coupled through ``D``, ``Σ_j π_j (t_j k_j - dP_j k̄)``, where that is smaller; B.2's
    ``dq`` step 7'': ``D̂``'s error is common to the row, ``e_D k̄`` through ``k``. The float64
    evaluation is widened by ``(1 + evaluation_rounding(n))^12``.

    **Theorem B.5 (probabilistic).** With ``lam=λ`` (or ``probability=P``, which solves for
    the least such ``λ``), every ``γ`` of a sum or dot chain is Theorem R.6's ``γ̃_h(λ)``:
    under the model that the rounding errors are independent and of mean zero, each chain
    stays within it with probability ``>= P(λ)``, and all of them together, by the union bound
    over the ``N = L_q L_k (3 d_k + 2 d_v + 1) + L_q L_k`` (FlashAttention-2: ``+ L_q d_v``)
    chains of each batch element, one per term of every sum and dot (``+ L_q`` with a sink),
    with probability ``>= 1 - N (1 - P(λ))`` (``Bound.probability``). The float64 evaluation,
    the forward output's bound (B.2's ``D``) and the roundings outside the chains stay
    deterministic. Tensor-core dots are refused (their model has no such factor).

    Args:
        q, k, v, d_out, mask, bias, scale, numerics, backward: as for
            :func:`mhanum.emulate.backward.attention_grad`.
        lam, probability: the probabilistic variant (Theorem B.5): ``λ > 0``, or the
            probability ``P`` in ``(0, 1)`` with which every bound holds under the model.
        sink: attention-sink logits, as for :func:`mhanum.emulate.backward.attention_grad`: the
            sink is one more key (B.1/B.2 hold with it), and ``dsink``, the sum of its column
            of ``dS`` added row after row in ``accum``, is bounded by that column's bounds, the
            sum's ``γ_{L_q - 1}`` and the output rounding.
        softcap: the logit soft-cap ``c``, as for :func:`mhanum.emulate.backward.attention_grad`
            (Theorem B.7): the capped logits' enclosure (step 2c) and ``dA = dS·σ`` through
            the computed slope ``σ̂ = fl(1 - fl(t̂²))`` (step 6c) for ``dq`` and ``dk``.

    Returns:
        :class:`GradientBounds`: ``dq``, ``dk``, ``dv``, ``dbias`` (each a :class:`Bound` with
        terms ``upstream`` (the error of the matrix the last dot reads first: ``dS``, or ``P``
        for ``dv``), ``inputs`` (the other operand's rounding), ``accumulation`` and ``output``
        (scale and rounding); ``dbias``: ``dS`` and ``output``), and ``stages``.

    Raises:
        InvalidArgument: for bad inputs (named), a row that attends no key, a finite masking
            constant with a mask, the naive softmax, or numerics the backward does not model.

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> q, k, v, g = (rng.standard_normal((8, 4)) for _ in range(4))
        >>> b = attention_grad_bound(q, k, v, g, numerics="fp32", backward="flash2")
        >>> b.dq.theorem, b.dq.total.shape, bool(np.max(b.dq.total) < 1e-4)
        ('B.2', (8, 4), True)
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    _check_scope(num, bw)
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, d_out=d_out
    )
    x = _inputs(problem, num)
    bw.key_blocks(x.k.shape[-2])
    lq, n, d, dv_ = x.q.shape[-2], x.k.shape[-2], x.q.shape[-1], x.v.shape[-1]
    flash = bw.algorithm == "flash2"
    chains = _head_chains(lq, n, d, dv_, flash, x.sink) * math.prod(x.q.shape[:-2])
    lam = lam_or_probability(lam, probability, chains, num)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        bounds, dsd = _bound(x, num, bw, lam, chains)
        if not x.sink:
            return bounds
        return _with_sink(bounds, dsd, num, bw, lam)


def _with_sink(
    b: GradientBounds, dsd: dict[str, np.ndarray], num: Numerics, bw: Backward, lam: Any
) -> GradientBounds:
    """The sink key's rows dropped from dk, dv and dbias, and ``dsink``'s bound added."""
    acc, out = num.format_of("accum"), num.format_of("output")
    grad, _ = bw.formats(num)
    up, err = dsd["ds_up"][..., :, -1], dsd["ds_err"][..., :, -1]
    lq = up.shape[-1]
    read = err + _take(up + err, grad, acc)
    factor = chain(lq, "sequential", acc.u, lam, products=False)
    ev = 1 + evaluation_rounding(lq)
    carried = read.sum(axis=-1) * ev
    accumulation = factor * (up + read).sum(axis=-1) * ev + lq * acc.smallest_normal
    total_up = up.sum(axis=-1) * ev + carried + accumulation
    output = _take(total_up, acc, out) + 0 * total_up
    total = carried + accumulation + output
    reasons = list(b.dq.reasons)
    for fmt in (acc, out):
        over = ~(total_up + output <= fmt.max_finite)
        if over.any():
            total = np.where(over, np.inf, total)
            reasons.append(
                f"dsink: values up to {float(np.max(total_up)):.4g} may overflow {fmt.name}"
            )
    dsink = dataclasses.replace(
        b.dq,
        total=total,
        terms={"dS": carried, "accumulation": accumulation, "output": output},
        reasons=tuple(reasons) if not np.isfinite(total).all() else (),
    )

    def drop(bound: Bound, rows: bool) -> Bound:
        def cut(x: Any) -> Any:
            x = np.asarray(x)
            return x[..., :-1, :] if rows else x[..., :-1]

        return dataclasses.replace(
            bound, total=cut(bound.total), terms={t: cut(x) for t, x in bound.terms.items()}
        )

    return b._replace(
        dk=drop(b.dk, True), dv=drop(b.dv, True), dbias=drop(b.dbias, False), dsink=dsink
    )


def _bound(
    x: _Inputs,
    num: Numerics,
    bw: Backward,
    lam: float | None = None,
    chains: int = 0,
) -> tuple[GradientBounds, dict[str, np.ndarray]]:
    """The bounds, and ``dS``'s enclosures: ``ds_up >= |dS|``, ``ds_err >= |dŜ - dS|`` and
    ``ds_used >= |dŜ|`` as the dots read it (Theorem B.3, the sink's gradient)."""
    fin, acc, sc = num.format_of("input"), num.format_of("accum"), num.format_of("score")
    sm, prob, out = num.format_of("softmax"), num.format_of("prob"), num.format_of("output")
    grad, dsf = bw.formats(num)
    flash = bw.algorithm == "flash2"
    rng = _Range()
    dot = _Dot(num)
    everything = ("dq", "dk", "dv", "dbias")
    lq, n, d, dv_ = x.q.shape[-2], x.k.shape[-2], x.q.shape[-1], x.v.shape[-1]
    keep = x.keep
    bits_in = operand_bits(num, fin)

    # Step 1: the inputs rounded into the input format
    e: dict[str, np.ndarray] = {}
    rad: dict[str, np.ndarray | None] = {}
    for i, (name, arr) in enumerate((("q", x.q), ("k", x.k), ("v", x.v), ("d_out", x.g))):
        if x.errors is None or x.given is None or x.sources is None:
            rad[name] = None
            rng.check(np.abs(arr), fin, f"{name} rounded to the input format", everything)
            e[name] = rounding_error(arr, fin)
        else:  # B.6: a computed operand, off the exact one by errors[i], read into fin
            rad[name] = x.given[i]
            used = np.abs(arr) + x.given[i] + x.errors[i]
            rng.check(used, fin, f"{name} read into the input format", everything)
            e[name] = x.errors[i] + _take(used, x.sources[i], fin)
    mq, mk, mv, mg = (np.abs(a) for a in (x.q, x.k, x.v, x.g))
    aq, ak, av, ag = (
        m if rad[name] is None else m + rad[name]
        for m, name in ((mq, "q"), (mk, "k"), (mv, "v"), (mg, "d_out"))
    )

    # Step 2: the logits  s = c·q kᵀ + b
    f, eta, _ = _dot_factor(num, d, None, (bits_in, bits_in), lam)
    t_a, t_b, t_acc = dot(aq, e["q"], _t(ak), _t(e["k"]), f, eta)
    t_mid = x.q @ _t(x.k)
    t_rad = _f64_dot(d) * (mq @ _t(mk)) + _spread(rad["q"], _t(ak), mq, _t_or_none(rad["k"]))
    t = _Q(t_mid, t_rad, t_a + t_b + t_acc)
    rng.operands(num, aq + e["q"], ak + e["k"], "q kᵀ", ("dq", "dk", "dv", "dbias"))
    rng.check(
        (1 + f) * ((aq + e["q"]) @ _t(ak + e["k"])) + eta, acc, "q kᵀ accumulated", everything
    )
    # the unscaled scores are rounded to the score format before the scale (a small scale
    # does not save a product that overflows there)
    rng.check(t.used, sc, "q kᵀ rounded to the score format", everything)
    t.err = t.err + _take(t.used, acc, sc)
    c, c64 = x.c64, x.c64
    c_hat, u_r, u_mul = scale_rounding(c64, sc)
    if not math.isfinite(c_hat):  # u_r is inf: so is every error the scale enters
        rng.check(np.inf, sc, f"the scale {c64:.6g} rounded to the score format", everything)
    theta = compound(x.u64, u_r)
    s_mid = c64 * t_mid
    s_rad = abs(c64) * t_rad * (1 + 2 * _U64) + (x.u64 + 2 * _U64) * np.abs(s_mid)
    s_err = abs(c) * (1 + theta) * t.err + theta * abs(c) * t.up
    s_err = s_err + u_mul * (1 + theta) * abs(c) * (t.up + t.err) + sc.smallest_normal
    slope: _Q | None = None
    if x.cap is not None:
        capped, slope = _softcap_stage(_Q(s_mid, s_rad, s_err), x.cap, num, grad, keep, rng)
        s_mid, s_rad, s_err = capped.mid, capped.rad, capped.err
    if x.bias is not None:
        s_mid = s_mid + x.bias
        s_rad = s_rad + _U64 * np.abs(s_mid)
        s_err = s_err + rounding_error(x.bias, sc)
        s_err = s_err + sc.u * (np.abs(s_mid) + s_rad + s_err) + sc.smallest_normal
    s = _Q(s_mid, s_rad, s_err)
    rng.check(np.where(keep, s.used, 0.0), sc, "the logits in the score format", everything)
    s.err = s.err + _take(s.used, sc, sm)

    # Step 3: the probabilities (masked keys are exactly 0 in the computation and exactly)
    live = np.where(keep, s.mid, -np.inf)
    m_mid = live.max(axis=-1, keepdims=True)
    centred = np.where(keep, s.mid - m_mid, -np.inf)
    p_mid = np.exp(centred)
    ell = p_mid.sum(axis=-1, keepdims=True)
    p_mid = p_mid / ell
    arg = np.where(keep, np.abs(s.mid - m_mid), 0.0)

    def worst(a: np.ndarray) -> np.ndarray:
        return np.where(keep, a, 0.0).max(axis=-1, keepdims=True)

    omega = (
        s.rad + worst(s.rad) + _U64 * (arg + worst(arg)) + 4 * _U64
        + chain(n, "sequential", _U64, None, products=False) + 2 * _U64
    )  # fmt: skip
    p_up = np.where(keep, p_mid * np.exp(omega), 0.0)
    delta = s.err  # |ŝ - s| (the computed logits against the exact ones)
    spread = s.err + s.rad
    gap = arg + spread + worst(spread)  # |ŝ_j - m̂| <= gap
    u_m, eta_m = sm.u, sm.smallest_normal
    bits_p = operand_bits(num, prob)
    xs, _, g_sum, _, _ = exp_and_sum_factors(num, n, gap, lam, (bits_p, bits_in))
    xs = np.broadcast_to(np.asarray(xs, np.float64), gap.shape)
    x_max = worst(xs)
    eps_e = math.expm1(2 * num.exp_ulps * math.log1p(u_m))
    ell_low = np.exp(-x_max) * (1 - g_sum) - n * eta_m * (1 + g_sum)
    if not flash:
        eps_div = division_error(num.div_ulps, u_m)
        u_p = prob.u if prob.precision < sm.precision else 0.0
        own = (
            _log_radius(np.expm1(xs)) + _log_radius(np.expm1(x_max)) + _log_radius(eps_div)
            + _log_radius(g_sum) + _log_radius(u_p)
        )  # fmt: skip
        flushed = (n + 1) * eta_m * (1 + g_sum) / np.maximum(ell_low, 0)
        absolute = (flushed * (1 + eps_div) + eta_m) * (1 + u_p)
        absolute = np.where(ell_low > 0, absolute, np.inf)
        if not (ell_low > 0).all():
            rng.reasons.append("the softmax's row sum may underflow: its lower bound is not > 0")
    else:
        # the stored log-sum-exp lse = fl(m̂ + fl(log ℓ̂)) against LSE(ŝ) = m̂ + log ℓ(ŝ)
        r_ell = np.expm1(x_max) * (1 + g_sum) + g_sum + n * eta_m * (1 + g_sum)
        lam_ell = _log_radius(r_ell)
        eps_log = eps_e
        log_up = math.log(n) + lam_ell
        lse_up = np.abs(m_mid) + worst(spread) + log_up
        err_lse = lam_ell + eps_log * log_up + eta_m + u_m * lse_up + eta_m
        gap2 = arg + math.log(n) + spread + worst(spread) + err_lse
        own_entry = u_m * gap2 + eta_m + _log_radius(eps_e)  # ŝ - lse's rounding, exp's
        own = err_lse + own_entry
        absolute = eta_m * np.ones_like(x_max)
    shift = _shift(p_up, delta, keep, worst(delta))
    big_r = own + delta + shift
    # P̂ before its rounding into prob_format is at least p_low, which flushes (§0) only where
    # that may lie below prob_format's smallest normal number
    p_low = p_mid * np.exp(-omega - big_r) - absolute
    normal_p = p_low >= prob.smallest_normal
    if not flash:
        below = np.minimum(p_up * np.exp(big_r) + absolute, _flush(sm, prob))
        absolute = absolute + np.where(normal_p, 0.0, below)
    with np.errstate(over="ignore", invalid="ignore"):
        eps_p = np.where(keep, p_up * np.expm1(big_r) + absolute, 0.0)
        p_used_up = np.where(keep, p_up * np.exp(big_r) + absolute, 0.0)
    if not flash:
        # Step 3′ (B.1): the logits' share λ_j = (P_j/Z)[(1 - P_j)(e^{δ_j} - 1)
        # - Σ_{l≠j} P_l (e^{δ_l} - 1)] (|log Z| <= W) keeps the 1 - P_j that e^{Δ_j + W} - 1
        # loses on a probable key; the softmax's own share μ as in step 5′
        with np.errstate(over="ignore", invalid="ignore"):
            w_k = np.where(keep, p_up * np.expm1(delta), 0.0)  # >= P_k |e^{δ_k} - 1|
            others = w_k.sum(axis=-1, keepdims=True) * (1 + evaluation_rounding(n)) - w_k
            p_lo = np.where(keep, p_mid * np.exp(-omega), 0.0)
            lam_k = p_up * (np.maximum(1 - p_lo, 0.0) * np.expm1(delta) + np.maximum(others, 0.0))
            # >= |μ_k| = |P̂_k - p_k(Ŝ)| (steps 5′, 6′ add P̂'s reading into the gradient format)
            mu_k = np.where(keep, p_up * np.exp(delta + shift) * np.expm1(own) + absolute, 0.0)
            split_p = (np.exp(shift) * lam_k + mu_k) * (1 + 8 * _U64)
            split_p = np.where(keep & ~np.isnan(split_p), split_p, np.where(keep, np.inf, 0.0))
        eps_p = np.fmin(eps_p, split_p)
        p_used_up = np.fmin(p_used_up, np.where(keep, p_up + eps_p, 0.0))
    whole = None
    if not flash and num.softmax_kind == "safe":
        # Step W (papers/backward.md): the stored P̂ of a safe softmax, whatever the logit errors
        whole = _stored_weights(keep, n, gap, (bits_p, bits_in), eps_e, eps_div, u_p, num)
        p_used_up = np.fmin(p_used_up, np.where(keep, whole[0], 0.0))
        eps_p = np.fmin(eps_p, np.where(keep, np.maximum(whole[0], p_up), 0.0))
    eps_pr = eps_p
    if flash:  # FlashAttention-2 rounds its recomputed P to the probability format for dV
        u_pr = prob.u if prob.precision < sm.precision else 0.0
        flush_pr = np.where(normal_p, 0.0, np.minimum(p_used_up, _flush(sm, prob)))
        eps_pr = eps_p + np.where(keep, u_pr * p_used_up + flush_pr, 0.0)

    # Step 4: dP = d_out vᵀ
    f, eta, _ = _dot_factor(num, dv_, None, (bits_in, bits_in), lam)
    dp_a, dp_b, dp_acc = dot(ag, e["d_out"], _t(av), _t(e["v"]), f, eta)
    dp_rad = _f64_dot(dv_) * (mg @ _t(mv)) + _spread(rad["d_out"], _t(av), mg, _t_or_none(rad["v"]))
    dp = _Q(x.g @ _t(x.v), dp_rad, dp_a + dp_b + dp_acc)
    rng.operands(num, ag + e["d_out"], av + e["v"], "d_out vᵀ", ("dq", "dk", "dbias"))
    rng.check((1 + f) * ((ag + e["d_out"]) @ _t(av + e["v"])) + eta, acc, "d_out vᵀ accumulated",
              ("dq", "dk", "dbias"))  # fmt: skip
    dp.err = dp.err + _take(dp.used, acc, grad)
    rng.check(dp.used, grad, "dP in the gradient format", ("dq", "dk", "dbias"))
    u_g, eta_g = grad.u, grad.smallest_normal

    # Step 5: D, the row vector (textbook rowsum(dP ∘ P); FlashAttention-2 rowsum(d_out ∘ O))
    if not flash:
        p_read = _take(p_used_up, prob, grad)  # P̂ read into the gradient format
        pe = eps_p + p_read
        g_d = chain(n, num.summation, u_g, lam, products=True)
        d_mid = (dp.mid * p_mid).sum(axis=-1, keepdims=True)
        d_rad = (dp.rad * p_up + np.abs(dp.mid) * (p_up - p_mid)).sum(axis=-1, keepdims=True)
        d_rad = d_rad + _f64_dot(n) * (np.abs(dp.mid) * p_mid).sum(axis=-1, keepdims=True)
        d_rest = (dp.err * (p_up + pe)).sum(axis=-1, keepdims=True)
        d_rest = d_rest + g_d * (dp.used * (p_up + pe)).sum(axis=-1, keepdims=True) + 2 * n * eta_g
        d_lin = (dp.up * pe).sum(axis=-1, keepdims=True)  # >= |Σ_k dP_k π_k|
        # Step 5': π = (p(Ŝ) - P) + (P̂' - p(Ŝ)). The logits' share sums to 0 over the row, so
        # Σ_k dP_k (p_k(Ŝ) - P_k) = Σ_k t_k P_k (e^{δ_k} - 1) / Σ_l P_l e^{δ_l} (t = dP - D,
        # Σ_k t_k P_k = 0), at most e^W Σ_k |t_k| P̄_k (e^{Δ_k} - 1); the rest keeps |dP|
        t_abs = (np.abs(dp.mid - d_mid) + dp.rad + d_rad) * (1 + 4 * _U64)  # >= |t|
        with np.errstate(over="ignore", invalid="ignore"):
            logits_share = np.where(keep, p_up * np.expm1(delta), 0.0)
            centred = np.exp(shift) * (t_abs * logits_share).sum(axis=-1, keepdims=True)
            rest_share = mu_k + p_read
            split = centred + (dp.up * rest_share).sum(axis=-1, keepdims=True)
        d_lin = np.fmin(d_lin, np.where(np.isnan(split), np.inf, split))
        d_upper = (dp.used * (p_up + pe)).sum(axis=-1, keepdims=True) * (1 + g_d)
        if whole is not None:
            # step W: Σ_k |P̂'_k - P_k||a_k| <= max_k |a_k|(W' + 1), Σ_k P̂'_k |a_k| <= max|a| W'
            # (P̂' = P̂ read into the gradient format, W' its row sum's bound)
            w_read = whole[1] * (1 + u_g) + n * eta_g
            d_lin = np.fmin(d_lin, worst(dp.up) * (w_read + 1))
            d_rest = np.fmin(
                d_rest, (worst(dp.err) + g_d * worst(dp.used)) * w_read + 2 * n * eta_g
            )
            d_upper = np.fmin(d_upper, worst(dp.used) * w_read * (1 + g_d) + 2 * n * eta_g)
        d_err = d_rest + d_lin
        p_x_err = pe
    else:
        if x.forward is None:
            # Theorem A.1g: the forward output's error along the exact d_out, row by row
            fwd, along = attention_bound_along(
                x.q, x.k, x.v, x.g, None if x.keep.all() else x.keep, g_error=rad["d_out"],
                bias=x.bias, scale=x.scale, numerics=num, softcap=x.cap,
            )  # fmt: skip
            eps_o, why = np.asarray(fwd.total, np.float64), fwd.reasons
            o_along = along[..., None]
        else:
            eps_o, why, given_along = x.forward
            o_along = (ag * eps_o).sum(axis=-1, keepdims=True) * (1 + evaluation_rounding(dv_))
            if given_along is not None:
                o_along = np.fmin(o_along, given_along[..., None])
        rng.reasons.extend(f"forward: {r}" for r in why)
        o_mid = p_mid @ x.v
        o_rad = (
            (p_up - p_mid) @ av + _f64_dot(n) * (p_mid @ mv) + _spread(None, av, p_mid, rad["v"])
        )
        o_up = np.abs(o_mid) + o_rad
        eg = e["d_out"] + _take(ag + e["d_out"], fin, grad)
        o_take = _take(o_up + eps_o, out, grad)  # Ô read into the gradient format
        eo = eps_o + o_take
        g_d = chain(dv_, num.summation, u_g, lam, products=True)
        d_mid = (x.g * o_mid).sum(axis=-1, keepdims=True)
        d_rad = ag * o_rad + (0.0 if rad["d_out"] is None else rad["d_out"] * np.abs(o_mid))
        d_rad = d_rad.sum(axis=-1, keepdims=True)
        d_rad = d_rad + _f64_dot(dv_) * (mg * np.abs(o_mid)).sum(axis=-1, keepdims=True)
        d_err = (eg * (o_up + eo) + ag * o_take).sum(axis=-1, keepdims=True) + o_along
        d_err = (
            d_err + g_d * ((ag + eg) * (o_up + eo)).sum(axis=-1, keepdims=True) + 2 * dv_ * eta_g
        )
        d_upper = ((ag + eg) * (o_up + eo)).sum(axis=-1, keepdims=True) * (1 + g_d)
        p_read = _take(p_used_up, sm, grad)  # P̂ read into the gradient format
        p_x_err = eps_p + p_read
    d_q = _Q(d_mid, d_rad, d_err)
    rng.check(d_upper, grad, "D in the gradient format", ("dq", "dk", "dbias"))

    # Step 6: t = dP - D, dS = P ∘ t, dS rounded for the dots
    t_mid2 = dp.mid - d_q.mid
    t_rad2 = dp.rad + d_q.rad + _U64 * np.abs(t_mid2)
    t_up = np.abs(t_mid2) + t_rad2
    t_err = dp.err + d_q.err
    rho_t = u_g * (t_up + t_err) + eta_g
    t_err = t_err + rho_t
    rng.check(t_up + t_err, grad, "dP - D in the gradient format", ("dq", "dk", "dbias"))
    ds_up = np.where(keep, p_up * t_up, 0.0)
    ds_err = p_x_err * t_up + p_up * t_err + p_x_err * t_err
    ds_err = ds_err + u_g * (p_up + p_x_err) * (t_up + t_err) + eta_g
    ds_err = np.where(keep, ds_err, 0.0)  # masked: P = 0 exactly, so dS = 0 exactly
    if not flash:
        # Step 6′ (B.1): π = λ + μ (step 5′) in dŜ_j - dS_j = λ_j t_j - P_j Σ_l t_l λ_l
        # + μ_j t_j - P_j Σ_l dP_l μ_l + Y_j (step 7′'s Y); the logits' part is
        # (P_j/Z)[t_j(1 - 2P_j)(e^{δ_j} - 1) - Σ_{l≠j} P_l (e^{δ_l} - 1)(t_j + t_l)]
        with np.errstate(over="ignore", invalid="ignore"):
            w_l = w_k * (1 + 4 * _U64)
            pairs = _pair_sums(w_l, np.where(keep, t_mid2, 0.0))
            pairs = pairs + t_rad2 * w_l.sum(axis=-1, keepdims=True)
            pairs = pairs + (w_l * t_rad2).sum(axis=-1, keepdims=True)
            lam_part = np.exp(shift) * p_up * (t_up * np.expm1(delta) + pairs)
            # μ's part μ_j t_j - P_j Σ_l dP_l μ_l: its j = l term joins the first, as
            # μ_j (t_j - P_j dP_j), enclosed from the float64 stand-ins
            a_l = dp.up * rest_share
            s_up = a_l.sum(axis=-1, keepdims=True) * (1 + evaluation_rounding(n))
            mu_part = rest_share * t_up + p_up * s_up
            own_j = np.abs(t_mid2 - p_mid * dp.mid) + t_rad2 + (p_up - p_mid) * np.abs(dp.mid)
            own_j = own_j + p_up * dp.rad + 4 * _U64 * (np.abs(t_mid2) + p_mid * np.abs(dp.mid))
            pairwise = rest_share * own_j + p_up * np.maximum(s_up - a_l * (1 - 4 * _U64), 0.0)
            mu_part = np.fmin(mu_part, pairwise)
            p_hat = p_up + p_x_err
            y_part = p_x_err * d_lin + p_hat * (dp.err + d_rest + rho_t)
            y_part = y_part + u_g * p_hat * (t_up + t_err) + eta_g
            alt = (lam_part + mu_part + y_part) * (1 + evaluation_rounding(n)) ** 2
        ds_err = np.fmin(ds_err, np.where(keep & ~np.isnan(alt), alt, np.where(keep, np.inf, 0.0)))
    # Step 6c: through the soft-cap, dA = fl(fl(fl(dS·ĉ)·σ̂)·r̂) for dq and dk
    da_up, da_err = ds_up, ds_err
    if slope is not None and x.cap is not None:
        da_up, da_err = _through_cap(ds_up, ds_err, slope, x.cap, grad, rng)
        da_up, da_err = np.where(keep, da_up, 0.0), np.where(keep, da_err, 0.0)
    ds_mid = None if slope is not None else np.where(keep, p_mid * t_mid2, 0.0)
    ds_low = None
    if ds_mid is not None:
        # |dŜ| >= |P̃t̃| - (P̄T̄ - |P̃t̃|) - err (step 8's enclosure), evaluated low: the rounding
        # into ds_format flushes nothing where that is at least its smallest normal number
        m_ds = np.abs(ds_mid)
        ds_low = (2 * m_ds - da_up - da_err) - 4 * _U64 * (2 * m_ds + da_up + da_err)
    ds_take = np.where(keep, _take(da_up + da_err, grad, dsf, ds_low), 0.0)
    ds_r_err = da_err + ds_take
    rng.check(da_up + da_err, dsf, f"dS rounded to {dsf.name}", ("dq", "dk", "dbias"))
    coupled: list[tuple[np.ndarray, np.ndarray]] = []
    if whole is not None and slope is None:
        # Step 3W for dQ: dŜ_j - dS_j = π_j t̂_j + P_j(t̂_j - t_j) + ρ_j with Σ_j |π_j| <= W' + 1
        # (π = P̂' - P), so Σ_j π_j t̂_j k_j is at most (W' + 1) max_j |t̂_j| max_j |k_j|
        t_hat = np.where(keep, t_up + t_err, 0.0)
        rest_w = p_up * t_err + u_g * (p_up + p_x_err) * (t_up + t_err) + eta_g
        rest_w = np.where(keep, rest_w, 0.0) + ds_take
        reach = (w_read + 1) * t_hat.max(axis=-1, keepdims=True) * (1 + 2 * _U64)
        coupled.append((rest_w, reach * ak.max(axis=-2, keepdims=True, initial=0.0)))
    if not flash and slope is None:
        # Step 7': dŜ - dS = π_j t_j - P_j Σ_k dP_k π_k + rest (π = P̂ - P), whose first part
        # carried through k is Σ_j π_j (t_j k_j - dP_j k̄), k̄ = Σ_j P_j k_j
        p_hat = p_up + p_x_err
        rest = p_x_err * d_lin + p_hat * (dp.err + d_rest + rho_t) + u_g * p_hat * (t_up + t_err)
        rest = np.where(keep, rest + eta_g, 0.0) + ds_take
        bound = _coupled_dq(
            p_mid, p_up, np.where(keep, p_x_err, 0.0), t_mid2, t_rad2, dp, x.k, rad["k"]
        )
        coupled.append((rest, bound))
    elif slope is None:
        # Step 7'' (B.2): D̂'s error e_D is common to the row, so its share -P_j e_D of
        # dŜ_j - dS_j is, carried through k, -e_D k̄ with k̄ = Σ_j P_j k_j
        rest = p_x_err * (t_up + t_err) + p_up * (dp.err + rho_t)
        rest = rest + u_g * (p_up + p_x_err) * (t_up + t_err)
        rest = np.where(keep, rest + eta_g, 0.0) + ds_take
        kbar, kbar_rad = _kbar(p_mid, p_up, x.k, rad["k"])
        e_d = d_q.err * (np.abs(kbar) + kbar_rad) * (1 + 4 * _U64)
        coupled.append((rest, e_d))
        # Step 7‴ (B.2): P̂_j = P_j e^{δ_j + ν_j - ω} + a_j with ω = lse - LSE(S), one number
        # per row (|ω| <= W + E), so π's share of Σ_j π_j t_j k_j through ω is
        # (e^{-ω} - 1) Σ_j P_j t_j k_j, dQ's own sum (step 8's signed enclosure)
        assert ds_mid is not None  # no soft-cap here
        common = shift + err_lse
        with np.errstate(over="ignore", invalid="ignore"):
            own_share = np.where(keep, (p_up * np.expm1(delta + own_entry) + absolute) * t_up, 0.0)
            signed = _signed_product(ds_mid, ds_up, x.k, ak)
            through = np.exp(common) * (own_share @ ak) + np.expm1(common) * signed
            through = through * (1 + evaluation_rounding(n)) ** 2
        rest3 = p_read * t_up + p_x_err * t_err + p_up * (dp.err + rho_t)
        rest3 = rest3 + u_g * (p_up + p_x_err) * (t_up + t_err)
        rest3 = np.where(keep, rest3 + eta_g, 0.0) + ds_take
        coupled.append((rest3, e_d + np.where(np.isnan(through), np.inf, through)))
    # Step 7: the gradients
    bits_ds = operand_bits(num, dsf)
    ev_all = (1 + evaluation_rounding(max(n, lq, d, dv_))) ** 12
    results: dict[str, Bound] = {}
    theorem = ("B.2" if flash else "B.1") if lam is None else "B.5"
    stated = 1.0 if lam is None else max(0.0, 1.0 - union_failure(lam, chains, num))
    assumptions = ASSUMPTIONS if lam is None else (*ASSUMPTIONS, PROBABILISTIC)

    def finish(name: str, terms: dict[str, np.ndarray]) -> Bound:
        shape = np.broadcast_shapes(*(np.shape(t) for t in terms.values()))
        terms = {key: np.broadcast_to(val, shape) * ev_all for key, val in terms.items()}
        total = sum(terms.values())
        total = np.where(np.isnan(total), np.inf, total)
        if rng.hit[name]:
            total = np.full(shape, np.inf)
        return Bound(
            total=total,
            terms=terms,
            theorem=theorem,
            assumptions=assumptions,
            source="dao2023",
            probability=stated,
            reasons=tuple(rng.reasons) if rng.hit[name] or not np.isfinite(total).all() else (),
            lam=lam,
        )

    def gradient(
        name: str,
        a_up: np.ndarray,
        a_err: np.ndarray,
        b_up: np.ndarray,
        b_err: np.ndarray,
        block: int | None,
        bits: tuple[int, int],
        scaled: bool,
        stage: str,
        coupled: list[tuple[np.ndarray, np.ndarray]] | None = None,
        mids: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """B.0 on the last dot, then the scale (dq, dk) and the output rounding. ``mids``: the
        float64 midpoints of ``a`` and ``b`` (``|a - a_mid| <= a_up - |a_mid|``, likewise
        ``b``), which enclose ``|a b|`` with its signs (step 8)."""
        f, eta, _ = _dot_factor(num, a_up.shape[-1], block if flash else None, bits, lam)
        from_a, from_b, accumulation = dot(a_up, a_err, b_up, b_err, f, eta, coupled)
        x_up = a_up @ b_up
        if mids is not None:  # step 8: the signed enclosure from the float64 midpoints
            signed = _signed_product(mids[0], a_up, mids[1], b_up)
            x_up = np.fmin(x_up, np.where(np.isnan(signed), np.inf, signed))
        rng.operands(num, a_up + a_err, b_up + b_err, stage, (name,))
        rng.check((1 + f) * ((a_up + a_err) @ (b_up + b_err)) + eta, acc, stage, (name,))
        err = from_a + from_b + accumulation
        ev_n = 1 + evaluation_rounding(a_up.shape[-1])
        ups[name] = x_up * ev_n * ((1 + x.u64 + 2 * _U64) * abs(c) if scaled else 1.0)
        if scaled:
            carried, own = _scaled_output(x_up, err, c, c64, x.u64, num)
            ratio = carried / np.where(err > 0, err, 1.0)
            y_up = abs(c) * x_up + carried + own
        else:
            ratio, own = np.ones(1), _plain_output(x_up, err, num)
            y_up = x_up + err + own
        rng.check(y_up, out, f"{name} rounded to the output format", (name,))
        terms = {"upstream": ratio * from_a, "inputs": ratio * from_b}
        results[name] = finish(name, {**terms, "accumulation": ratio * accumulation, "output": own})

    ups: dict[str, np.ndarray] = {}  # >= |g| for the exact gradients (B.6)
    bits = (bits_ds, bits_in)
    gradient(
        "dq", da_up, ds_r_err, ak, e["k"], bw.block_k, bits, True, "dS k accumulated", coupled,
        None if ds_mid is None else (ds_mid, x.k),
    )  # fmt: skip
    gradient(
        "dk", _t(da_up), _t(ds_r_err), aq, e["q"], bw.block_q, bits, True, "dSᵀ q accumulated",
        None, None if ds_mid is None else (_t(ds_mid), x.q),
    )  # fmt: skip
    bits = (bits_p, bits_in)
    gradient(
        "dv", _t(p_up), _t(eps_pr), ag, e["d_out"], bw.block_q, bits, False,
        "Pᵀ d_out accumulated", None, (_t(p_mid), x.g),
    )  # fmt: skip

    own_b = np.where(keep, _take(ds_up + ds_err, grad, out), 0.0)
    rng.check(ds_up + ds_err + own_b, out, "dbias rounded to the output format", ("dbias",))
    results["dbias"] = finish("dbias", {"dS": ds_err, "output": own_b})
    stages = {"P": eps_p, "dP": np.where(keep, dp.err, 0.0), "D": d_q.err, "dS": ds_err}
    stages = {key: val * ev_all for key, val in stages.items()}
    bounds = GradientBounds(results["dq"], results["dk"], results["dv"], results["dbias"], stages)
    dsd = {"ds_up": ds_up, "ds_err": ds_err, "ds_used": da_up + ds_r_err}
    return bounds, dsd | {f"{name}_up": up for name, up in ups.items()}


@one_blas_thread
def dq_order_difference(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    mask: Any = None,
    *,
    bias: Any = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    softcap: float | None = None,
) -> Bound:
    """A bound on ``|dq_a - dq_b|`` between two orders of FlashAttention-2's ``dQ`` additions.

    **Theorem B.3.** Let ``dq_a`` and ``dq_b`` be computed as in Theorem B.2 with the same
    inputs, numerics and blocks, their ``n_b = ceil(Lk/block_k)`` partials ``Π_j`` (each a dot
    from zero, the same in both runs) added in two orders. Both sums are within
    ``((1 + u)^{n_b - 1} - 1)·Σ_j|Π_j| + (n_b - 1)·2^emin`` of ``Σ_j Π_j``, so

    .. math::

        |\\hat a - \\hat b| \\le 2\\,((1 + u)^{n_b - 1} - 1)\\,\\sum_j |\\Pi_j| + 2(n_b - 1)\\eta,

    and the scaling and the output rounding add ``u_×|ĉ|(|â| + |b̂|)`` and ``u_out`` of each
    result. ``Σ_j|Π_j|`` is enclosed by ``(1 + γ_B)|dŜ||k̂|`` from B.2's enclosure of ``dŜ``
    (with a soft-cap, of ``dÂ = fl(fl(fl(dŜ·ĉ)·σ̂)·r̂)``, Theorem B.7's step 6c: the partials
    are dots of ``dÂ``). It is 0 for one key block, and for the textbook backward (one chain,
    no atomics).

    Args:
        q, k, v, d_out, mask, bias, scale, numerics, backward: as for
            :func:`attention_grad_bound`.
        softcap: the logit soft-cap ``c``, as for :func:`attention_grad_bound`; a bad one
            (not a finite number > 0) is refused by name.

    Returns:
        A :class:`Bound` shaped like ``dq``, terms ``additions`` and ``rounding``.

    Examples:
        >>> import numpy as np
        >>> from mhanum.numerics import Backward
        >>> rng = np.random.default_rng(0)
        >>> q, k, v, g = (rng.standard_normal((8, 4)) for _ in range(4))
        >>> b = dq_order_difference(q, k, v, g, numerics="fp32",
        ...                         backward=Backward("flash2", block_k=2))
        >>> b.theorem, bool(0 < np.max(b.total) < 1e-5)
        ('B.3', True)
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    _check_scope(num, bw)
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, d_out=d_out
    )
    x = _inputs(problem, num)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        full, dsd = _bound(x, num, bw)
        ds_used = dsd["ds_used"]
    n = x.k.shape[-2]
    count = len(bw.key_blocks(n))
    acc, out = num.format_of("accum"), num.format_of("output")
    shape = np.shape(full.dq.total)
    if bw.algorithm != "flash2" or count == 1:
        zero = np.zeros(shape)
        return Bound(zero, {"additions": zero, "rounding": zero}, "B.3", ASSUMPTIONS, "dao2023")
    with np.errstate(over="ignore", invalid="ignore"):
        _, dsf = bw.formats(num)
        ak = np.abs(x.k) + rounding_error(x.k, num.format_of("input"))
        u_op, eta_op = operand_error(num)
        ak = ak * (1 + u_op) + eta_op
        ds_used = ds_used * (1 + u_op) + eta_op
        bits = (operand_bits(num, dsf), operand_bits(num, num.format_of("input")))
        g_b = unit_factor(num, bw.block_k, None, bits=bits)
        parts = (1 + g_b) * (ds_used @ ak) + count * unit_eta(num, bw.block_k)
        parts = parts * (1 + evaluation_rounding(n))
        grow = chain(count, "sequential", acc.u, None, products=False)
        additions = 2 * grow * parts + 2 * count * acc.smallest_normal
        c_hat, _, u_mul = scale_rounding(x.c64, acc)
        a_up = (1 + grow) * parts + count * acc.smallest_normal
        y = abs(c_hat) * a_up * (1 + u_mul) + acc.smallest_normal
        rounding = 2 * u_mul * abs(c_hat) * a_up + 2 * acc.smallest_normal + 2 * _take(y, acc, out)
        scaled = abs(c_hat) * additions * (1 + 2.0**-50)
        total = np.where(np.isfinite(full.dq.total), scaled + rounding, np.inf)
    return Bound(
        total=total,
        terms={"additions": scaled, "rounding": rounding},
        theorem="B.3",
        assumptions=ASSUMPTIONS,
        source="dao2023",
        reasons=full.dq.reasons,
    )


def attention_grad_bound_a_priori(
    q_len: int,
    kv_len: int,
    d_k: int,
    d_v: int | None = None,
    *,
    q_norm: float,
    k_norm: float,
    v_max: float,
    d_out_max: float,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> GradientBounds:
    """Theorem B.4: a priori componentwise bounds on the error of every gradient.

    For every input ``q`` (``q_len × d_k``), ``k`` (``kv_len × d_k``), ``v`` (``kv_len × d_v``)
    and ``d_out`` (``q_len × d_v``) with ``‖q_i‖₂ <= q_norm``, ``‖k_j‖₂ <= k_norm``,
    ``|v_jl| <= v_max`` and ``|d_out_il| <= d_out_max`` (given as float64 numbers; their rounding
    into ``numerics.input`` is included) and any ``-inf`` mask that leaves every row a key,
    every gradient computed as Theorem B.1 (textbook) or B.2 (FlashAttention-2, any order of the
    ``dQ`` additions) states is within ``total`` of the exact one, entry by entry.

    ``total`` is B.1/B.2's propagation with every quantity replaced by its worst case over those
    inputs (papers/backward.md, B.4): the logits' error by Cauchy–Schwarz
    (``Σ|q_c||k_c| <= q_norm·k_norm``), the logit range ``2c·q_norm·k_norm + 2Δ``, ``P <= 1``
    and ``Σ_j P_ij = 1`` along a row, ``|dP| <= M = d_v·d_out_max·v_max``, ``|D| <= M``,
    ``|dP - D| <= 2M``; for ``dK`` and ``dV``, whose sums run down a column of ``P``, the
    column sum ``Σ_i P_ij <= q_len``. FlashAttention-2's ``D`` reads the forward output, whose
    error is Theorem A.4's (:func:`~mhanum.bounds.attention_bound_a_priori`).

    **Theorem B.9 (soft-capped).** With ``softcap=c`` the same holds for the capped logits
    ``a = c·tanh(s/c)`` (:func:`mhanum.emulate.backward.attention_grad`'s ``softcap``): they lie
    in ``[-c, c]`` whatever the norms, ``|a| <= c·tanh(c_s·q_norm·k_norm/c)``, so every logit
    gap is at most ``2c·tanh(·) + 2Δ_c``; their error ``Δ_c`` carries the scores' error through
    ``tanh`` (1-Lipschitz: at most ``min(w, 2)``), the roundings of ``fl(ŝ·r̂)``, of ``tanh``
    (``numerics.tanh_ulps``) and of ``fl(ĉ·t̂)``. ``dQ`` and ``dK`` read
    ``dÂ = fl(fl(fl(dŜ·ĉ)·σ̂)·r̂)`` with ``σ = sech²(s/c) <= 1`` and ``σ̂ = fl(1 - fl(t̂²))`` in
    the gradient format, within ``min(e_g(2τ + e_g) + u_G(τ + e_g)² + u_G(1 + (τ + e_g)²) +
    2η_G, 1 + m)`` of ``σ`` (``m``: how far ``σ̂`` can fall below 0); ``dB = dS``.
    FlashAttention-2's ``D`` reads A.4 with the capped logits.

    Args:
        q_len, kv_len, d_k, d_v: the shapes (``d_v`` defaults to ``d_k``).
        q_norm, k_norm: bounds on the Euclidean norms of the query and key rows.
        v_max, d_out_max: bounds on the magnitude of every entry of ``v`` and ``d_out``.
        numerics, backward, scale: as for :func:`attention_grad_bound`.
        softcap: the logit soft-cap ``c > 0`` (Theorem B.9), or ``None``.

    Returns:
        :class:`GradientBounds` whose totals have shapes ``(d_k,)`` (``dq``, ``dk``), ``(d_v,)``
        (``dv``) and ``()`` (``dbias``): the same bound for every row. ``stages`` holds the
        scalar bounds of ``P``, ``dP``, ``D`` and ``dS`` at one entry.

    Raises:
        InvalidArgument: for non-positive sizes, negative or non-finite norms, a soft-cap
            that is not a finite number > 0, or numerics outside the theorem's scope.

    Examples:
        >>> b = attention_grad_bound_a_priori(
        ...     64, 64, 16, q_norm=4.0, k_norm=4.0, v_max=3.0, d_out_max=3.0, numerics="fp32"
        ... )
        >>> b.dq.theorem, b.dq.total.shape, bool(0 < b.dq.total.max() < 1e-2)
        ('B.4', (16,), True)
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    _check_scope(num, bw)
    lq, n, d = (V.positive_int(x, name) for x, name in ((q_len, "q_len"), (kv_len, "kv_len"),
                                                          (d_k, "d_k")))  # fmt: skip
    dv_ = d if d_v is None else V.positive_int(d_v, "d_v")
    sizes = {"q_norm": q_norm, "k_norm": k_norm, "v_max": v_max, "d_out_max": d_out_max}
    for name, value in sizes.items():
        ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0:
            msg = f"{name}: expected a finite number >= 0, got {value!r}"
            raise InvalidArgument(msg)
    cap = V.softcap_value(softcap)
    if cap is not None:
        num.check_softcap()
    bw.key_blocks(n)
    c64 = V.scale_value(scale, d, placement=num.scale)
    u64 = 0.0
    if scale is None and not is_power_of_four(d):
        u64 = compound(_U64, over=(_U64,))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _a_priori(lq, n, d, dv_, sizes, num, bw, scale, c64, u64, cap)


def _a_priori(
    lq: int,
    n: int,
    d: int,
    dv_: int,
    sizes: dict[str, float],
    num: Numerics,
    bw: Backward,
    scale: float | None,
    c64: float,
    u64: float,
    cap: float | None = None,
) -> GradientBounds:
    fin, acc, sc = num.format_of("input"), num.format_of("accum"), num.format_of("score")
    sm, prob, out = num.format_of("softmax"), num.format_of("prob"), num.format_of("output")
    grad, dsf = bw.formats(num)
    flash = bw.algorithm == "flash2"
    rng = _Range()
    everything = ("dq", "dk", "dv", "dbias")
    qn, kn = float(sizes["q_norm"]), float(sizes["k_norm"])
    vm, gm = float(sizes["v_max"]), float(sizes["d_out_max"])
    u_op, eta_op = operand_error(num)
    anchor = tensor_core_anchor(num)
    bits_in = operand_bits(num, fin)
    u_i, eta_i = fin.u, fin.smallest_normal

    def entry_err(x: float) -> float:
        """``>= |x̂_op - x|`` for an entry ``|x| <= x`` rounded to the input and operand formats."""
        e = u_i * x + eta_i
        return e + u_op * (x + e) + eta_op

    def norm_err(norm: float, width: int) -> float:
        """The same for the 2-norm of a row of ``width`` entries."""
        e = u_i * norm + eta_i * math.sqrt(width)
        return e + u_op * (norm + e) + eta_op * math.sqrt(width)

    for name, value in (("q", qn), ("k", kn), ("v", vm), ("d_out", gm)):
        rng.check(value, fin, f"{name} rounded to the input format", everything)

    # Step 2: the logits (Cauchy–Schwarz on every dot of length d)
    f, eta, _ = _dot_factor(num, d, None, (bits_in, bits_in))
    eq, ek = norm_err(qn, d), norm_err(kn, d)
    t_up = qn * kn
    t_err = eq * (kn + ek) + qn * ek + f * (qn + eq) * (kn + ek) + eta
    if anchor:
        t_err += f * anchor * (math.sqrt(d) * (qn + eq + kn + ek) + d * anchor)
    rng.operands(num, qn * (1 + u_i) + eta_i, kn * (1 + u_i) + eta_i, "q kᵀ", everything)
    rng.check((1 + f) * (qn + eq) * (kn + ek) + eta, acc, "q kᵀ accumulated", everything)
    rng.check(t_up + t_err, sc, "q kᵀ rounded to the score format", everything)
    t_err += float(_take(np.asarray(t_up + t_err), acc, sc))
    c = abs(c64)
    _, u_r, u_mul = scale_rounding(c64, sc)
    theta = compound(u64, u_r)
    s_up = c * t_up
    delta = c * (1 + theta) * t_err + theta * s_up + u_mul * (1 + theta) * c * (t_up + t_err)
    delta += sc.smallest_normal
    rng.check(s_up + delta, sc, "the logits in the score format", everything)
    capped: CappedLogits | None = None
    if cap is not None:  # Theorem B.9 (a): |a| <= c·tanh(s_up/c), within Δ_c

        def check(upper: float, fmt: Format, stage: str) -> None:
            rng.check(upper, fmt, stage, everything)

        capped = softcap_a_priori(s_up, delta, cap, num, check)
        s_up, delta = capped.reach, capped.delta
    delta += float(_take(np.asarray(s_up + delta), sc, sm))

    # Step 3: the probabilities (P <= 1, Σ_j P_ij = 1)
    u_m, eta_m = sm.u, sm.smallest_normal
    gap = 2 * s_up + 2 * delta
    bits_p = operand_bits(num, prob)
    xs, _, g_sum, _, _ = exp_and_sum_factors(num, n, gap, None, (bits_p, bits_in))
    x_max = float(np.max(xs))
    eps_e = math.expm1(2 * num.exp_ulps * math.log1p(u_m))
    ell_low = math.exp(-x_max) * (1 - g_sum) - n * eta_m * (1 + g_sum)
    if not flash:
        eps_div = division_error(num.div_ulps, u_m)
        u_p = prob.u if prob.precision < sm.precision else 0.0
        own = float(
            2 * _log_radius(np.expm1(x_max)) + _log_radius(eps_div) + _log_radius(g_sum)
            + _log_radius(u_p)
        )  # fmt: skip
        absolute = (
            ((n + 1) * eta_m * (1 + g_sum) / ell_low) * (1 + eps_div) * (1 + u_p)
            + eta_m * (1 + u_p)
            + _flush(sm, prob)
        )
        if not ell_low > 0:
            absolute = math.inf
            rng.reasons.append("the softmax's row sum may underflow: its lower bound is not > 0")
    else:
        r_ell = float(np.expm1(x_max)) * (1 + g_sum) + g_sum + n * eta_m * (1 + g_sum)
        lam_ell = float(_log_radius(r_ell))
        log_up = math.log(n) + lam_ell
        err_lse = lam_ell + eps_e * log_up + 2 * eta_m + u_m * (s_up + delta + log_up)
        gap2 = 2 * s_up + math.log(n) + 2 * delta + err_lse
        own = err_lse + u_m * gap2 + eta_m + float(_log_radius(eps_e))
        absolute = eta_m
    big_r = own + 2 * delta
    growth = float(np.expm1(big_r))  # inf past float64's range, not an exception
    eps_p = growth + absolute  # entry (P <= 1)
    sum_eps = growth + n * absolute  # along a row (Σ P = 1)
    p_used = growth + 1 + absolute
    pr_extra = float(_take(np.asarray(p_used), sm, prob)) if flash else 0.0

    # Step 4: dP = d_out vᵀ (|dP| <= M)
    f, eta, _ = _dot_factor(num, dv_, None, (bits_in, bits_in))
    eg, ev = entry_err(gm), entry_err(vm)
    big_m = dv_ * gm * vm
    dp_err = dv_ * (eg * (vm + ev) + gm * ev + f * (gm + eg) * (vm + ev)) + eta
    if anchor:
        dp_err += f * anchor * (dv_ * (gm + eg + vm + ev) + dv_ * anchor)
    rng.operands(num, gm * (1 + u_i) + eta_i, vm * (1 + u_i) + eta_i, "d_out vᵀ",
                 ("dq", "dk", "dbias"))  # fmt: skip
    rng.check(dv_ * (1 + f) * (gm + eg) * (vm + ev) + eta, acc, "d_out vᵀ accumulated",
              ("dq", "dk", "dbias"))  # fmt: skip
    dp_err += float(_take(np.asarray(big_m + dp_err), acc, grad))
    rng.check(big_m + dp_err, grad, "dP in the gradient format", ("dq", "dk", "dbias"))
    u_g, eta_g = grad.u, grad.smallest_normal

    # Step 5: D
    if not flash:
        take_p = float(_take(np.asarray(p_used), prob, grad))
        g_d = chain(n, num.summation, u_g, None, products=True)
        sum_pe = sum_eps + n * take_p
        d_err = dp_err * (1 + sum_pe) + big_m * sum_pe
        d_err += g_d * (big_m + dp_err) * (1 + sum_pe) + 2 * n * eta_g
        p_x = eps_p + take_p
        sum_px = sum_pe
    else:
        fwd = attention_bound_a_priori(
            lq, n, d, dv_, q_norm=qn, k_norm=kn, v_max=vm, numerics=num, scale=scale,
            softcap=cap,
        )  # fmt: skip
        eps_o = float(np.max(fwd.total))
        rng.reasons.extend(f"forward: {r}" for r in fwd.reasons)
        eg_g = u_i * gm + eta_i + float(_take(np.asarray(gm * (1 + u_i) + eta_i), fin, grad))
        eo = eps_o + float(_take(np.asarray(vm + eps_o), out, grad))
        g_d = chain(dv_, num.summation, u_g, None, products=True)
        d_err = dv_ * (eg_g * vm + gm * eo + eg_g * eo) + g_d * dv_ * (gm + eg_g) * (vm + eo)
        d_err += 2 * dv_ * eta_g
        take_p = float(_take(np.asarray(p_used), sm, grad))
        p_x = eps_p + take_p
        sum_px = sum_eps + n * take_p
        if not math.isfinite(eps_o):
            d_err = math.inf
    rng.check(big_m + d_err, grad, "D in the gradient format", ("dq", "dk", "dbias"))

    # Step 6: t = dP - D (|t| <= 2M), dS = P t
    t_err = dp_err + d_err
    t_err += u_g * (2 * big_m + t_err) + eta_g
    rng.check(2 * big_m + t_err, grad, "dP - D in the gradient format", ("dq", "dk", "dbias"))
    t_up = 2 * big_m
    ds_entry = p_x * t_up + t_err + p_x * t_err + u_g * (1 + p_x) * (t_up + t_err) + eta_g
    ds_row = sum_px * t_up + t_err + sum_px * t_err + u_g * (1 + sum_px) * (t_up + t_err)
    ds_row += n * eta_g
    da_entry, da_row = ds_entry, ds_row
    if capped is not None and cap is not None:  # B.9 (b): dA = dS·σ, σ <= 1, for dq and dk
        slope = _slope_a_priori(capped, num, grad)
        da_entry = float(
            _through_cap(np.asarray(t_up), np.asarray(ds_entry), slope, cap, grad, rng)[1]
        )
        # along a row: linear in (Σ|dS|, Σ err) plus one rounding floor per entry
        floor = float(_through_cap(np.zeros(()), np.zeros(()), slope, cap, grad, _Range())[1])
        row = _through_cap(np.asarray(t_up), np.asarray(ds_row), slope, cap, grad, _Range())[1]
        da_row = float(row) + (n - 1) * floor
    rng.check(t_up + da_entry, dsf, f"dS rounded to {dsf.name}", ("dq", "dk", "dbias"))
    take_ds = float(_take(np.asarray(t_up + da_entry), grad, dsf))
    dsr_entry = da_entry + take_ds
    dsr_row = da_row + float(_take(np.asarray(t_up + da_row), grad, dsf)) + n * take_ds

    ev_all = (1 + evaluation_rounding(max(n, lq, d, dv_))) ** 12
    theorem = "B.4"
    results: dict[str, Bound] = {}

    def finish(name: str, width: int | None, terms: dict[str, float]) -> Bound:
        shape = () if width is None else (width,)
        arrays = {key: np.full(shape, val * ev_all) for key, val in terms.items()}
        total = sum(arrays.values())
        total = np.where(np.isnan(total), np.inf, total)
        if rng.hit[name]:
            total = np.full(shape, np.inf)
        return Bound(
            total=np.asarray(total, np.float64),
            terms=arrays,
            theorem=theorem,
            assumptions=ASSUMPTIONS,
            source="dao2023",
            reasons=tuple(rng.reasons) if not np.isfinite(total).all() else (),
        )

    def last(
        name: str,
        count: int,
        block: int,
        mag_sum: float,
        err_sum: float,
        b_up: float,
        bits: tuple[int, int],
        scaled: bool,
        width: int,
    ) -> None:
        """B.0 on ``Σ_l a_l b_l`` over ``count`` terms with ``Σ|a| <= mag_sum``,
        ``Σ err_a <= err_sum`` and ``|b| <= b_up`` (each ``b`` an input entry)."""
        f, eta, _ = _dot_factor(num, count, block if flash else None, bits)
        a_e = err_sum + u_op * (mag_sum + err_sum) + count * eta_op
        b_e = entry_err(b_up)
        from_a = a_e * (b_up + b_e)
        from_b = mag_sum * b_e
        accumulation = f * (mag_sum + a_e) * (b_up + b_e) + eta
        if anchor:
            accumulation += f * anchor * (mag_sum + a_e + count * (b_up + b_e) + count * anchor)
        x_up = mag_sum * b_up
        rng.operands(num, mag_sum + err_sum, b_up * (1 + u_i) + eta_i, f"{name}'s dot", (name,))
        rng.check((1 + f) * (mag_sum + a_e) * (b_up + b_e) + eta, acc, f"{name}'s dot accumulated",
                  (name,))  # fmt: skip
        err = from_a + from_b + accumulation
        if scaled:
            carried, own_ = _scaled_output(np.asarray(x_up), np.asarray(err), c64, c64, u64, num)
            ratio = float(carried) / err if err > 0 else 1.0
            y_up = c * x_up + float(carried) + float(own_)
            own_out = float(own_)
        else:
            ratio, own_out = 1.0, float(_take(np.asarray(x_up + err), acc, out))
            y_up = x_up + err + own_out
        rng.check(y_up, out, f"{name} rounded to the output format", (name,))
        results[name] = finish(
            name, width,
            {"upstream": ratio * from_a, "inputs": ratio * from_b,
             "accumulation": ratio * accumulation, "output": own_out},
        )  # fmt: skip

    bits = (operand_bits(num, dsf), bits_in)
    # dq_i = c Σ_j dS_ij k_j: along a row, Σ_j |dS_ij| <= 2M, |k_jc| <= k_norm
    last("dq", n, bw.block_k, t_up, dsr_row, kn, bits, True, d)
    # dk_j = c Σ_i dS_ij q_i: down a column, Σ_i |dS_ij| <= q_len·2M
    last("dk", lq, bw.block_q, lq * t_up, lq * dsr_entry, qn, bits, True, d)
    # dv_j = Σ_i P_ij d_out_i: Σ_i P_ij <= q_len
    bits = (bits_p, bits_in)
    last("dv", lq, bw.block_q, lq * 1.0, lq * (eps_p + pr_extra), gm, bits, False, dv_)
    own_b = float(_take(np.asarray(t_up + ds_entry), grad, out))
    rng.check(t_up + ds_entry + own_b, out, "dbias rounded to the output format", ("dbias",))
    results["dbias"] = finish("dbias", None, {"dS": ds_entry, "output": own_b})
    stages = {
        "P": np.asarray(eps_p * ev_all),
        "dP": np.asarray(dp_err * ev_all),
        "D": np.asarray(d_err * ev_all),
        "dS": np.asarray(ds_entry * ev_all),
    }
    return GradientBounds(results["dq"], results["dk"], results["dv"], results["dbias"], stages)


class MHAGradientBounds(NamedTuple):
    """The bounds of one multi-head backward pass (Theorem B.6), one :class:`Bound` per
    gradient of :class:`mhanum.gradients.MHAGradients`: ``dx_q``, ``dx_kv``, ``params`` (a dict
    from the parameter's name, ``"wq"`` ... ``"bo"``, to its gradient's bound; the layer's
    biases only) and ``dbias`` ``(..., H, Lq, Lk)``."""

    dx_q: Bound
    dx_kv: Bound
    params: dict[str, Bound]
    dbias: Bound
    dsink: Bound | None = None


def _rows(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


@one_blas_thread
def mha_grad_bound(
    x_q: Any,
    x_kv: Any,
    params: Any,
    num_heads: int,
    d_out: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    backward: Backward | str | None = None,
    sink: Any = None,
    softcap: float | None = None,
    num_kv_heads: int | None = None,
    lam: float | None = None,
    probability: float | None = None,
) -> MHAGradientBounds:
    """Componentwise bounds on the error of every gradient of multi-head attention (Theorems B.6,
    B.8).

    **Theorem B.6.** Let ``g`` be a gradient of ``<d_out, multi_head_attention(x_q, x_kv,
    params, H)>`` (exact: :func:`mhanum.reference.mha_grad`) and ``ĝ`` the one
    :func:`mhanum.emulate.backward.mha_grad` computes with ``numerics`` and ``backward``, or any
    kernel that rounds as they state (``dQ``'s partials added in any order). Under the
    assumptions of Theorems B.1/B.2 (``Bound.assumptions``), ``|ĝ - g| <= total`` entry by
    entry, where ``total`` composes, each step from the enclosures of the one before:

    (a) the forward projections by Theorem A.2 (a) (float64 stand-ins ``q, k, v`` within
    ``given`` of the exact ones; the computed ones within ``fixed + κ e_x·slope``);
    (b) ``dO = fl_out(Ĝ Ŵ_oᵀ)`` by Theorem B.0 and the output rounding;
    (c) every head's backward by Theorem B.1 / B.2 on those enclosures (the operands are read
    into the input format from their storage formats; B.2's ``D`` reads the heads' forward
    output, bounded by A.1 on the same enclosures); with ``num_kv_heads``, a shared key/value
    head's ``dK``, ``dV`` the sum of its group's ``g = H / H_kv`` stored gradients in ``accum``,
    bounded for any order of the additions by

    .. math::

        \\sum_h r_h + \\gamma_{g-1}(u_a) \\sum_h (|dK_h| + r_h) + g\\,2^{e_{min}} + \\text{output
        rounding},\\quad r_h = e_h + \\text{read}(F_{out} \\to F_a);

    (d) ``dx_q = fl_out(dQ̂ Ŵ_qᵀ)``, ``dx_kv = fl_out([dK̂ dV̂] [Ŵ_k Ŵ_v]ᵀ)``, every weight's
    gradient (one dot over the batch's rows: ``x̂ᵀ dQ̂``, ``Ôᵀ Ĝ``) by B.0, and every bias's
    gradient (a sum over the rows in ``accum``, in the numerics' summation order) by Theorem
    S.0, each with its output rounding.

    Every stage's range is a hypothesis checked on the enclosures: a gradient a stage that may
    overflow reaches is ``inf``, with the reason in ``Bound.reasons``.

    **Theorem B.8 (probabilistic).** With ``lam=λ`` (or ``probability=P``, which solves for the
    least ``λ`` with the call's own chain count), every ``γ`` of a sum or dot chain is Theorem
    R.6's ``γ̃_m(λ)``. Under the model that the rounding errors are independent and of mean zero
    (``Bound.assumptions``; exact for stochastic rounding, a model for round to nearest), every
    bound holds at once with probability ``>= 1 - N (1 - P(λ))`` (``Bound.probability``, the
    same on every gradient), ``N`` the union bound's chains, one per term of every sum and dot:
    the forward projections of the grouped weights, ``G W_oᵀ``, every head's B.5 chains, the
    groups' sums, ``dx_q``, ``dx_kv`` and the weights' and biases' gradients. The float64
    evaluation, B.2's forward output, the exponentials, divisions and single roundings stay
    deterministic. Tensor-core dots are refused.

    Args:
        x_q, x_kv, params, num_heads, d_out, mask, bias, scale: as for
            :func:`mhanum.emulate.backward.mha_grad`.
        numerics, backward: as for :func:`mhanum.emulate.backward.mha_grad`.
        sink, softcap: as for :func:`mhanum.emulate.backward.mha_grad`: a sink is one more key
            of every head (B.1/B.2 with it; ``dsink`` bounded as in
            :func:`attention_grad_bound`), a soft-cap enters every head by Theorem B.7.
        num_kv_heads: grouped-query attention, as for
            :func:`mhanum.emulate.backward.mha_grad`: the bounds of ``dx_kv`` and of the grouped
            weights' gradients, through the groups' sums.
        lam, probability: the probabilistic variant (Theorem B.8): ``λ > 0``, or the
            probability ``P`` in ``(0, 1)`` with which every bound holds under the model.

    Returns:
        :class:`MHAGradientBounds` (``dsink``: the sinks' bound, ``(..., H)``, with sinks). Each :class:`Bound`'s terms: ``upstream`` (the error of the
        gradient the last dot reads: ``dQ``, ``dK``/``dV``, ``G``), ``inputs`` (the other
        operand's: weights, inputs, the forward output), ``accumulation`` and ``output``;
        ``dbias`` as :func:`attention_grad_bound`'s.

    Raises:
        InvalidArgument: for bad inputs (named), a row that attends no key in some head, a
            finite masking constant with a mask, the naive softmax, numerics the backward does
            not model, a bad ``num_kv_heads`` (as :meth:`mhanum.MHAParams.expand_kv_heads`),
            both ``lam`` and ``probability``, or ``lam`` with tensor-core dots.

    Examples:
        >>> import numpy as np
        >>> from mhanum import MHAParams
        >>> params = MHAParams.random(8, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((5, 8))
        >>> b = mha_grad_bound(x, x, params, 2, np.ones((5, 8)), numerics="fp32")
        >>> b.dx_q.theorem, b.dx_q.total.shape, sorted(b.params)
        ('B.6', (5, 8), ['bk', 'bo', 'bq', 'bv', 'wk', 'wo', 'wq', 'wv'])
        >>> p = mha_grad_bound(x, x, params, 2, np.ones((5, 8)), numerics="fp32", probability=0.99)
        >>> p.dx_q.theorem, p.dx_q.probability >= 0.99, bool((p.dx_q.total <= b.dx_q.total).all())
        ('B.8', True, True)

    References:
        dao2023; higham2019; papers/backward.md Theorems B.6 and B.8.
    """
    num = resolve(numerics)
    bw = resolve_backward(backward)
    _check_scope(num, bw)
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, scale=scale, sink=sink,
        softcap=softcap, num_kv_heads=num_kv_heads, d_out=d_out,
    )  # fmt: skip
    num.check_problem(p)
    full, heads, cap, batch, target = p.params, p.num_heads, p.softcap, p.batch, p.scores
    group = 1 if p.num_kv_heads is None else heads // p.num_kv_heads
    lq = target[-2]
    mask, bias = p.mask, p.bias
    if p.sink is not None:  # one more key per head: zero key and value, bias σ, never masked
        mask, bias, target = masks.head_sinks(mask, bias, p.sink, target)
        batch = tuple(target[:-3])
    xq, xkv, g = (
        np.broadcast_to(np.asarray(a, np.float64), (*batch, *a.shape[-2:]))
        for a in (p.x_q, p.x_kv, p.d_out)
    )
    n_keys = target[-1]
    bw.key_blocks(n_keys)
    chains = _mha_chains(params, heads, group, (lq, n_keys), math.prod(batch), bw, sink is not None)
    lam = lam_or_probability(lam, probability, chains, num)
    if lam is not None and num.dot_kind not in ("ieee", "split"):
        msg = "lam: the probabilistic bound (Theorem B.8) does not cover tensor-core dot units"
        raise InvalidArgument(msg)
    # the mask and the bias, checked as for one attention
    dummy = np.zeros((*target[:-1], 1))
    keys = np.zeros((*target[:-2], n_keys, 1))
    x0 = _inputs(AttentionProblem.of(dummy, keys, keys, mask=mask, bias=bias, d_out=dummy), num)
    c64 = V.scale_value(scale, params.qk_width // heads, placement=num.scale)
    u64 = 0.0
    if scale is None and not is_power_of_four(params.qk_width // heads):
        u64 = compound(_U64, over=(_U64,))
    # the forward projections of the expanded layer: a grouped key/value head's columns repeated
    # for each query head of its group, the same dots of the same operands (papers/attention.md)
    w: dict[str, Any] = {
        f.name: None if getattr(full, f.name) is None else np.asarray(getattr(full, f.name), np.float64)
        for f in dataclasses.fields(full)
    }  # fmt: skip
    fin, out = num.format_of("input"), num.format_of("output")
    wt = {n: np.asarray(getattr(params, n), np.float64) for n in ("wq", "wk", "wv", "wo")}
    storage = num.storage_format
    names = ["dx_q", "dx_kv", *(n for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
             if w[n] is not None), "dbias"]  # fmt: skip
    hit = dict.fromkeys(names, False)
    reasons: list[str] = []

    def fail(why: list[str] | tuple[str, ...], reaches: tuple[str, ...] | list[str]) -> None:
        if why:
            reasons.extend(r for r in why if r not in reasons)
            for n in reaches:
                hit[n] = True

    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        # (a) the forward projections
        proj = {}
        e_in = {"x_q": rounding_error(xq, fin), "x_kv": rounding_error(xkv, fin)}
        for name, xn, wn, bn in (("q", "x_q", "wq", "bq"), ("k", "x_kv", "wk", "bk"),
                                 ("v", "x_kv", "wv", "bv")):  # fmt: skip
            x64 = xq if xn == "x_q" else xkv
            lin = linear(x64, np.zeros_like(x64), w[wn], w[bn], num, storage, lam)
            _, why = linear_overflow(
                lin, x64, e_in[xn], w[wn], w[bn], num, storage, f"{name} projection"
            )
            if not (np.abs(x64) + e_in[xn] <= fin.max_finite).all():
                why = [f"{xn}: values may overflow the input format {fin.name}", *why]
            fail(why, names)
            proj[name] = tuple(
                split_heads(a, heads) for a in (lin.y, lin.given, lin.error(e_in[xn]))
            )
        # (b) dO = fl_out(Ĝ Ŵoᵀ)
        e_g = rounding_error(g, fin)
        ag, awo, e_wo = np.abs(g), np.abs(wt["wo"]).T, rounding_error(wt["wo"], fin).T
        fail([] if (ag + e_g <= fin.max_finite).all() else
             [f"d_out: values may overflow the input format {fin.name}"], names)  # fmt: skip
        do_err = sum(
            _grad_dot(num, ag, e_g, awo, e_wo, (fin, fin), "d_out woᵀ", fail, names, lam).values()
        )
        do_mid = g @ wt["wo"].T
        do_rad = _f64_dot(params.d_out) * (ag @ awo)
        # (c) every head's backward, on those enclosures
        if sink is not None:  # the sink's key and value: exact zeros
            for n in "kv":
                proj[n] = tuple(masks.zero_key(np.broadcast_to(a, (*target[:-2], *a.shape[-2:])))
                                for a in proj[n])  # fmt: skip
            proj["q"] = tuple(np.broadcast_to(a, (*target[:-2], *a.shape[-2:])) for a in proj["q"])
            do_mid, do_rad, do_err = (
                np.broadcast_to(a, (*target[:-3], *np.shape(a)[-2:]))
                for a in (do_mid, do_rad, np.asarray(do_err))
            )
        (q, rq, eq), (k, rk, ek), (v, rv, ev) = (proj[n] for n in "qkv")
        keep, hb = x0.keep, x0.bias
        keep = np.broadcast_to(keep, target)
        hb = None if hb is None else np.broadcast_to(hb, target)
        # the heads' forward output: B.2's D reads it from operands in the input format, the
        # output projection's gradient from the storage format; the larger errors cover both
        rq_, rk_, rv_ = (
            np.asarray(e + _take(np.abs(m) + r + e, storage, fin))
            for m, r, e in ((q, rq, eq), (k, rk, ek), (v, rv, ev))
        )
        read = (rq_, rk_, rv_)
        g_mid, g_rad = split_heads(do_mid, heads), split_heads(do_rad, heads)
        # B.2's D: the heads' forward error along their d_out (Theorem A.1g)
        along = (g_mid, np.abs(g_mid) + g_rad) if bw.algorithm == "flash2" else None
        fwd = head_output_bound(
            q, k, v, keep, hb, num, c64, scale is None, read, (rq, rk, rv), cap, along
        )
        eps_o, o_mid, o_given, fwd_why, o_along = fwd
        fail(fwd_why, names)
        heads_in = _Inputs(
            q, k, v, g_mid, keep, hb, c64, u64,
            given=(rq, rk, rv, g_rad),
            errors=(eq, ek, ev, split_heads(np.asarray(do_err), heads)),
            sources=(storage, storage, storage, out),
            forward=(eps_o, fwd_why, o_along), sink=sink is not None, cap=cap, scale=p.scale,
        )  # fmt: skip
        gb, dsd = _bound(heads_in, num, bw, lam, chains)
        if sink is not None:  # the sink's row of dk and dv, and its column of dbias, dropped
            gb = _with_sink(gb, dsd, num, bw, lam)
            dsd = {**dsd, "dk_up": dsd["dk_up"][..., :-1, :], "dv_up": dsd["dv_up"][..., :-1, :]}
        for n, reach in (("dq", ("dx_q", "wq", "bq")), ("dk", ("dx_kv", "wk", "bk")),
                         ("dv", ("dx_kv", "wv", "bv")), ("dbias", ("dbias",))):  # fmt: skip
            b = getattr(gb, n)
            if not np.isfinite(b.total).all():
                fail(b.reasons or (f"{n}: infinite",), [r for r in reach if r in hit])
        dq = (merge_heads(dsd["dq_up"]), merge_heads(np.asarray(gb.dq.total)))
        dk, dv = (
            tuple(merge_heads(a) for a in _group_sum(
                dsd[f"{n}_up"], np.asarray(getattr(gb, n).total), group, num, lam, n, fail,
                tuple(r for r in ("dx_kv", f"w{n[1]}", f"b{n[1]}") if r in hit),
            ))
            for n in ("dk", "dv")
        )  # fmt: skip
        # (d) the inputs' and the parameters' gradients
        ws = {n: (np.abs(wt[n]).T, rounding_error(wt[n], fin).T) for n in ("wq", "wk", "wv")}
        results = {
            "dx_q": _grad_dot(num, *dq, *ws["wq"], (out, fin), "dQ wqᵀ", fail, ("dx_q",)),
            "dx_kv": _grad_dot(
                num, np.concatenate([dk[0], dv[0]], -1), np.concatenate([dk[1], dv[1]], -1),
                np.concatenate([ws["wk"][0], ws["wv"][0]], 0),
                np.concatenate([ws["wk"][1], ws["wv"][1]], 0), (out, fin), "[dK dV] [wk wv]ᵀ",
                fail, ("dx_kv",),
            ),
        }  # fmt: skip
        o_up = merge_heads(np.abs(o_mid) + o_given)
        o_err = merge_heads(eps_o)
        for n, a, a_err, b_, where in (
            ("wq", np.abs(xq), e_in["x_q"], dq, "x_qᵀ dQ"),
            ("wk", np.abs(xkv), e_in["x_kv"], dk, "x_kvᵀ dK"),
            ("wv", np.abs(xkv), e_in["x_kv"], dv, "x_kvᵀ dV"),
            ("wo", o_up, o_err, (ag, e_g), "Oᵀ G"),
        ):
            fmts = (fin, out) if n != "wo" else (out, fin)
            results[n] = _grad_dot(
                num, _rows(a).T, _rows(a_err).T, _rows(b_[0]), _rows(b_[1]), fmts, where, fail, (n,),
                lam, swap=True,
            )  # fmt: skip
        for n, grad in (("bq", dq), ("bk", dk), ("bv", dv), ("bo", (ag, e_g))):
            if w[n] is not None:
                results[n] = _grad_sum(num, _rows(grad[0]), _rows(grad[1]), n, fail, lam)
        own_b = np.asarray(gb.dbias.terms.get("output", 0.0))
        results["dbias"] = {"dS": np.asarray(gb.dbias.terms.get("dS", 0.0)), "output": own_b}
    bounds = {}
    theorem = "B.6" if lam is None else "B.8"
    stated = 1.0 if lam is None else max(0.0, 1.0 - union_failure(lam, chains, num))
    assumptions = ASSUMPTIONS if lam is None else (*ASSUMPTIONS, PROBABILISTIC)
    for n, terms in results.items():
        terms = {t: np.asarray(val, np.float64) for t, val in terms.items()}
        total = sum(terms.values())
        total = np.where(np.isnan(total), np.inf, total)
        if hit[n]:
            total = np.full(np.shape(total), np.inf)
        bounds[n] = Bound(
            total=total,
            terms=terms,
            theorem=theorem,
            assumptions=assumptions,
            source="dao2023",
            probability=stated,
            reasons=tuple(reasons) if not np.isfinite(total).all() else (),
            lam=lam,
        )
    dsink = None if sink is None else _finite_or_hit(gb.dsink, hit["dbias"], reasons)
    if dsink is not None:  # one event covers every gradient, the sinks' included
        dsink = dataclasses.replace(
            dsink, theorem=theorem, assumptions=assumptions, probability=stated, lam=lam
        )
    return MHAGradientBounds(
        bounds["dx_q"],
        bounds["dx_kv"],
        {n: bounds[n] for n in names if n not in ("dx_q", "dx_kv", "dbias")},
        bounds["dbias"],
        dsink,
    )


def _finite_or_hit(bound: Bound | None, hit: bool, reasons: list[str]) -> Bound | None:
    """A head stage's bound (``dsink``), infinite where a stage before the heads may overflow."""
    if bound is None or not hit:
        return bound
    total = np.full(np.shape(bound.total), np.inf)
    return dataclasses.replace(bound, total=total, reasons=tuple(reasons), theorem="B.6")


def _grad_dot(
    num: Numerics,
    a_up: np.ndarray,
    a_err: np.ndarray,
    b_up: np.ndarray,
    b_err: np.ndarray,
    fmts: tuple[Format, Format],
    stage: str,
    fail: Any,
    reaches: tuple[str, ...] | list[str],
    lam: float | None = None,
    swap: bool = False,
) -> dict[str, np.ndarray]:
    """B.0 for ``fl_out(Â B̂)``, ``|Â - A| <= a_err``, ``|A| <= a_up`` (B likewise), read from
    the formats ``fmts``; the terms ``upstream`` (the gradient operand's error: ``a``'s, or
    ``b``'s with ``swap``), ``inputs``, ``accumulation`` and ``output``."""
    acc, out = num.format_of("accum"), num.format_of("output")
    n = a_up.shape[-1]
    bits = (operand_bits(num, fmts[0]), operand_bits(num, fmts[1]))
    f, eta, _ = _dot_factor(num, n, None, bits, lam)
    from_a, from_b, accumulation = _Dot(num)(a_up, a_err, b_up, b_err, f, eta)
    rng = _Range()
    rng.operands(num, a_up + a_err, b_up + b_err, stage, ("dq",))
    rng.check(
        (1 + f) * ((a_up + a_err) @ (b_up + b_err)) + eta, acc, f"{stage} accumulated", ("dq",)
    )
    up = (a_up @ b_up) * (1 + evaluation_rounding(n))
    err = from_a + from_b + accumulation
    own = _take(up + err, acc, out) + 0 * up
    rng.check(up + err + own, out, f"{stage} rounded to {out.name}", ("dq",))
    fail(rng.reasons, reaches)
    upstream, inputs = (from_b, from_a) if swap else (from_a, from_b)
    return {"upstream": upstream, "inputs": inputs, "accumulation": accumulation, "output": own}


def _grad_sum(
    num: Numerics, up: np.ndarray, err: np.ndarray, name: str, fail: Any, lam: float | None = None
) -> dict[str, np.ndarray]:
    """Theorem S.0 for a bias's gradient ``fl_out(Σ_rows x̂)``: the stored gradients ``x̂``
    (``|x̂ - x| <= err``, ``|x| <= up``, ``(N, n)``) read into ``accum`` and summed over the
    ``N`` rows in the numerics' order."""
    acc, out = num.format_of("accum"), num.format_of("output")
    rows = up.shape[0]
    read = err + _take(up + err, out, acc)
    factor = chain(rows, num.summation, acc.u, lam, products=False)
    ev = 1 + evaluation_rounding(rows)
    carried = read.sum(axis=0) * ev
    accumulation = factor * (up + read).sum(axis=0) * ev + rows * acc.smallest_normal
    total_up = up.sum(axis=0) * ev
    own = _take(total_up + carried + accumulation, acc, out) + 0 * total_up
    why = []
    for fmt in (acc, out):
        if not (total_up + carried + accumulation + own <= fmt.max_finite).all():
            why.append(f"{name}: the sum over the rows may overflow {fmt.name}")
    fail(why, (name,))
    return {"upstream": carried, "accumulation": accumulation, "output": own}


def _group_sum(
    up: np.ndarray,
    err: np.ndarray,
    group: int,
    num: Numerics,
    lam: float | None,
    name: str,
    fail: Any,
    reaches: tuple[str, ...],
) -> tuple[np.ndarray, np.ndarray]:
    """A shared key/value head's gradient ``fl_out(Σ_h x̂_h)`` over its ``group`` query heads
    (``(..., H, L, d)`` to ``(..., H / group, L, d)``): the stored ``x̂_h`` (``|x̂_h - x_h| <=
    err``, ``|x_h| <= up``) read into ``accum`` and added **in any order**, each through at most
    ``group - 1`` additions (``γ_{group-1}``), then rounded to ``output_format``. ``(up, err)``
    of the sums; one head per group is no sum."""
    if group == 1:
        return up, err
    acc, out = num.format_of("accum"), num.format_of("output")

    def split(x: np.ndarray) -> np.ndarray:
        return x.reshape(*x.shape[:-3], x.shape[-3] // group, group, *x.shape[-2:])

    up, err = split(up), split(err)
    read = err + _take(up + err, out, acc)
    factor = chain(group, "sequential", acc.u, lam, products=False)
    ev = 1 + evaluation_rounding(group)
    total_up = up.sum(axis=-3) * ev
    carried = read.sum(axis=-3) * ev
    accumulation = factor * (up + read).sum(axis=-3) * ev + group * acc.smallest_normal
    own = _take(total_up + carried + accumulation, acc, out) + 0 * total_up
    why = []
    for fmt in (acc, out):
        if not (total_up + carried + accumulation + own <= fmt.max_finite).all():
            why.append(f"{name}: the sum over a key/value head's group may overflow {fmt.name}")
    fail(why, reaches)
    return total_up, carried + accumulation + own


def _mha_chains(
    params: Any,
    heads: int,
    group: int,
    lengths: tuple[int, int],
    batch: int,
    bw: Backward,
    sink: bool,
) -> int:
    """The rounding chains of a multi-head backward pass (Theorem B.8), one per term of every
    sum and dot: the forward projections of the grouped weights (``x_q W_q``, ``x_kv W_k``,
    ``x_kv W_v``), ``G W_oᵀ``, every head's (:func:`_head_chains`, ``lengths`` = ``(L_q, n)``
    with ``n`` the keys, a sink's included), the groups' sums of ``dK`` and ``dV``, ``dx_q``,
    ``dx_kv``, the weights' gradients (dots over the batch's rows) and the biases'."""
    lq, n = lengths
    keys = n - 1 if sink else n
    d_q, d_kv, d_o = params.d_q, params.d_kv, params.d_out
    qk, v_w = params.qk_width, np.shape(params.wo)[0]
    kv_qk, kv_v = np.shape(params.wk)[-1], np.shape(params.wv)[-1]
    per_row = (
        lq * qk * d_q  # q projection
        + keys * (kv_qk + kv_v) * d_kv  # k, v projections
        + lq * v_w * d_o  # dO = G W_oᵀ
        + heads * _head_chains(lq, n, qk // heads, v_w // heads, bw.algorithm == "flash2", sink)
        + (keys * (kv_qk + kv_v) * group if group > 1 else 0)  # the groups' sums
        + lq * d_q * qk  # dx_q
        + keys * d_kv * (kv_qk + kv_v)  # dx_kv
    )
    weights = lq * (d_q * qk + v_w * d_o) + keys * d_kv * (kv_qk + kv_v)
    biases = {"bq": lq * qk, "bk": keys * kv_qk, "bv": keys * kv_v, "bo": lq * d_o}
    sums = sum(c for b, c in biases.items() if getattr(params, b) is not None)
    return int(batch * (per_row + weights + sums))
