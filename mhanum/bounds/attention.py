"""A posteriori componentwise bound on the error of ``mhanum.attention``: papers/attention.md A.1.

:func:`attention_bound` evaluates Theorem A.1 on the given inputs and returns its total and its
terms (logits, softmax, probability rounding, operand rounding, ``P V``, output, and ``mask``
for the leakage of a finite masking constant), so that a user sees which source dominates. It
covers the configurations the theorem covers and refuses the others with
:class:`~mhanum.InvalidArgument` rather than answer outside its hypotheses: masks applied with
``-inf`` (a fully-masked row gets an infinite bound, with the reason) or a finite constant
(``fill`` or ``add``; a fully-masked row is then compared with the leaky problem's own value, and
a masked logit that overflows to ``-inf`` drops its key where that is certain), a bias that stays finite in the score format,
a score format no wider than the softmax format, and for the online softmax an accumulation
format no wider than the softmax format. The scale may sit on the scores, on ``q`` or on ``q``
and ``k``. Every sum and dot enters through the factor of its summation order (Theorem S.0: the
height of the summation tree, or Kahan's constant).
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Any

import numpy as np

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.bounds._result import Bound, where_smaller
from mhanum.bounds.factors import (
    F64_DOT,
    LOG2E,
    compound,
    conversion_eta,
    evaluation_rounding,
    exp_and_sum_factors,
    gamma,
    is_power_of_four,
    lam_or_probability,
    linear,
    linear_overflow,
    operand_bits,
    operand_error,
    power_of_two,
    rounding_error,
    safe_weight_sums,
    scale_rounding,
    step_w_output,
    tensor_core_anchor,
    union_failure,
    unit_eta,
    unit_factor,
)
from mhanum.bounds.softmax import division_error
from mhanum.formats import Format, get_format, round_to
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams
from mhanum.problem import AttentionProblem, MHAProblem

__all__ = ["attention_bound", "head_output_bound", "mha_bound"]

ASSUMPTIONS = (
    "round-to-nearest; a rounding into F is x(1+δ)+η, |δ| <= u_F, |η| <= 2^emin_F (flush-to-zero)",
    "exp in the softmax format within exp_ulps ulps, division within div_ulps ulps",
    "sums and dots in numerics.summation: tree orders γ_h, Kahan as Theorem R.4 (Theorem S.0)",
    (
        "no overflow: proved on the given values stage by stage (papers/attention.md, R); where it "
        "cannot be, the entries it reaches are inf (terms overflow, vacuous) with Bound.reasons"
    ),
)


PROBABILISTIC = (
    "probabilistic (lam): the rounding errors of sums and dots are independent, mean-zero random "
    "variables (Higham & Mary 2019, Theorem 2.4; exact for stochastic rounding, a model for "
    "round to nearest); the bound holds with probability >= Bound.probability (union bound)"
)


def _check_scope(num: Numerics) -> None:
    if num.softmax_kind == "online" and (
        num.format_of("accum").precision > num.format_of("softmax").precision
    ):
        msg = (
            "numerics.softmax_format: Theorem A.1 needs, for the online softmax, a softmax "
            f"format at least as precise as accum, got {num.format_of('softmax').name} and "
            f"{num.format_of('accum').name}"
        )
        raise InvalidArgument(msg)
    if num.format_of("score").precision > num.format_of("softmax").precision:
        msg = (
            "numerics.score_format: Theorem A.1 needs a score format no wider than the softmax "
            f"format, got {num.format_of('score').name} and {num.format_of('softmax').name}"
        )
        raise InvalidArgument(msg)


def _scale_operands(
    q: np.ndarray,
    k: np.ndarray,
    errors: tuple[Any, Any, Any],
    given: tuple[Any, Any, Any] | None,
    num: Numerics,
    scale: float,
    default_scale: bool,
    ranges: _Ranges,
) -> tuple[np.ndarray, np.ndarray, tuple[Any, Any, Any], tuple[Any, Any, Any] | None]:
    """Step 2' (scale on ``q``, or ``sqrt(scale)`` on ``q`` and ``k``): the scaled operands.

    The factor ``f`` (``c`` or ``sqrt(c)``) is the float64 number ``f64`` (relative error ``u64``
    against the exact factor: the default scale's two float64 roundings, and the float64 square
    root), rounded once into the scale format to ``f̂`` (relative ``u_r``; 1 when ``f̂`` is
    subnormal, since it may be read as zero). The operand, stored in the storage format, is
    first read into the scale format (relative ``u_t`` when that format is less precise, and
    an absolute ``η`` for its range), and the product ``fl(x̃ f̂)`` is rounded in that format
    (``u_mul``, zero when ``f̂`` is a normal power of two). The stand-in of the exact scaled
    operand is the float64 product ``f64·x``; the errors against it, and of it against the
    exact ``f·x*`` (``given``), are those of papers/attention.md step 2'. Operands whose
    enclosure leaves the scale format's range are recorded in ``ranges``.
    """
    fmt = num.format_of("scale")
    source = num.storage_format
    u64 = 0.0
    if default_scale and not is_power_of_four(q.shape[-1]):
        u64 = compound(2.0**-53, over=(2.0**-53,))
    f64 = scale
    if num.scale == "qk":
        f64 = math.sqrt(scale)
        if fractions.Fraction(f64) ** 2 != fractions.Fraction(scale):
            u64 = compound(u64, 2.0**-53)
    f_hat, u_r, u_mul = scale_rounding(f64, fmt)
    u_t = fmt.u if fmt.precision < source.precision else 0.0
    theta = compound(u_r, u_t, u_mul)
    up = abs(f64) * (1 + 2.0**-52)
    eta = fmt.smallest_normal * (1 + up * (1 + u_r) * (1 + u_mul))
    exact_product = power_of_two(f64)
    g_prev = given if given is not None else (np.zeros_like(q), np.zeros_like(k), 0.0)

    def scaled(x: np.ndarray, e: Any, g: Any, name: str) -> tuple[np.ndarray, Any, Any]:
        xs = f64 * x
        # the float64 product may itself be subnormal: an absolute 2^-1074 at most
        rounding = (0.0 if exact_product else 2.0**-53 * np.abs(xs)) + 2.0**-1074
        stored = np.abs(x) + e
        ranges.check(stored, fmt, f"{name} read into the scale format", rows=name)
        ranges.check(
            abs(f_hat) * stored * (1 + u_t) + fmt.smallest_normal,
            fmt,
            f"{name} times the scale factor {f_hat:.4g}",
            rows=name,
        )
        e_new = up * (theta * np.abs(x) + (1 + theta) * e) + rounding + eta
        g_new = up * g / (1 - u64) + (u64 / (1 - u64)) * up * np.abs(x) + rounding
        return xs, e_new, g_new

    q, e_q, g_q = scaled(q, errors[0], g_prev[0], "q")
    e_k, g_k = errors[1], g_prev[1]
    if num.scale == "qk":
        k, e_k, g_k = scaled(k, e_k, g_k, "k")
    return q, k, (e_q, e_k, errors[2]), (g_q, g_k, g_prev[2])


class _Ranges:
    """Where one head's computation may leave a format's range, and why (papers/attention.md, R).

    Every check takes an enclosure ``upper >= |value|`` of the exact value a stage rounds (so
    that ``upper <= max_finite`` proves the rounding to nearest stays finite) and marks the
    output entries the stage feeds: a query row's outputs (``rows="q"``, or a boolean per row),
    every output of the head (``rows="k"``), a value column (``cols``), or single entries.
    """

    def __init__(self, rows: int, cols: int) -> None:
        self.shape = (rows, cols)
        self.where: dict[str, np.ndarray] = {}
        self.reasons: list[str] = []
        self.hits: dict[str, tuple[str, np.ndarray]] = {}  # reason -> (term, entries)

    def check(
        self,
        upper: Any,
        fmt: Format,
        stage: str,
        *,
        rows: str | None = None,
        cols: bool = False,
        entries: bool = False,
    ) -> None:
        upper = np.atleast_2d(np.asarray(upper, np.float64))
        bad = ~(upper <= fmt.max_finite)  # NaN counts as bad
        if not bad.any():
            return
        if rows == "q":
            hit = np.broadcast_to(bad.any(axis=-1)[:, None], self.shape)
        elif rows == "k":
            hit = np.ones(self.shape, bool)
        elif cols:
            hit = np.broadcast_to(bad.any(axis=0)[None, :], self.shape)
        elif entries:
            hit = np.broadcast_to(bad, self.shape)
        else:  # a per-logit flag (rows × keys): the row's outputs
            hit = np.broadcast_to(bad.any(axis=-1, keepdims=True), self.shape)
        worst = float(np.max(np.where(np.isnan(upper), np.inf, upper)[bad]))
        self.flag(
            hit,
            f"{stage}: values up to {worst:.4g} may overflow {fmt.name} "
            f"(largest finite {fmt.max_finite:.6g})",
        )

    def flag(self, hit: Any, reason: str, term: str = "overflow") -> None:
        """Mark the output entries ``hit`` infinite in ``term``, for ``reason``."""
        hit = np.broadcast_to(np.asarray(hit, bool), self.shape)
        if hit.any():
            self.where[term] = self.where.get(term, np.zeros(self.shape, bool)) | hit
            if reason not in self.reasons:
                self.reasons.append(reason)
            seen = self.hits.get(reason, (term, np.zeros(self.shape, bool)))[1]
            self.hits[reason] = (term, seen | hit)

    def merge(self, other: _Ranges, keep: Any) -> None:
        """Take ``other``'s flags on the entries ``keep`` (with their reasons)."""
        for reason, (term, hit) in other.hits.items():
            self.flag(hit & np.asarray(keep, bool), reason, term)

    def terms(self) -> dict[str, np.ndarray]:
        """``inf`` where flagged, per term (``overflow``, ``vacuous``)."""
        return {name: np.where(hit, np.inf, 0.0) for name, hit in self.where.items()}


def _on(where: np.ndarray, x: Any, other: float) -> Any:
    """``np.where(where, x, other)``, and ``x`` itself (no pass over it) where ``where`` holds
    everywhere: the same values, since ``x`` broadcasts to ``where``'s shape."""
    if where.all() and np.shape(x) == np.broadcast_shapes(np.shape(x), where.shape):
        return x
    return np.where(where, x, other)


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b``, with no product where the (thin) factor ``b`` is zero."""
    if np.any(b):
        return a @ b
    return np.zeros((*a.shape[:-1], b.shape[-1]))


def _log_expm1_upper(x: np.ndarray) -> np.ndarray:
    """An upper bound on ``log(e^x - 1)`` for ``x > 0`` that does not overflow."""
    small = np.minimum(x, 30.0)
    with np.errstate(divide="ignore"):
        return np.where(x > 30.0, x, np.log(np.expm1(small)))


def _times_expm1(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``a·(e^y - 1)`` for ``0 <= a <= 1`` and ``y >= 0``, without ``0·inf``."""
    if np.max(y, initial=0.0) <= 1.0:  # (NaN fails the test)
        return a * np.expm1(y)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = a * np.expm1(np.minimum(y, 1.0))
        big = y > 1.0
        if big.any():
            out = np.where(big, np.exp(np.log(a) + y), out)
    return out


def _weighted_expm1(a: np.ndarray, x: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``Σ_j a_j (e^{x_j} - 1)`` over the live keys of each row (keepdims), ``0 <= a <= 1``,
    ``x >= 0``; in log space for a row with an ``x_j > 30`` (the sum may overflow)."""
    if np.max(x, initial=0.0) <= 30.0:  # (NaN fails the test)
        return _on(live, a * np.expm1(x), 0.0).sum(axis=-1, keepdims=True)
    out = _on(live, a * np.expm1(np.minimum(x, 30.0)), 0.0).sum(axis=-1, keepdims=True)
    big = (x > 30.0).any(axis=-1)
    if big.any():
        with np.errstate(divide="ignore", over="ignore"):
            log_r = _log_expm1_upper(np.maximum(x[big], 1e-300))
            terms = np.where(live[big], np.log(a[big]) + log_r, -np.inf)
            out[big] = np.exp(_logsumexp(terms))
    return out


def _extremes(
    sc: np.ndarray, delta: np.ndarray, live: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step 4's probabilities and their extremes over the box ``|ε_l| <= δ_l``.

    For logits ``sc`` shifted by the row maximum (``-inf`` where not live): ``p``, the extremes
    ``p̃_j = p_j e^{±δ_j} / (p_j e^{±δ_j} + Σ_{l≠j} p_l e^{∓δ_l})`` (Lemma 4; the upper one at
    most 1, both 0 off the live keys) and ``log Σ_l e^{sc_l - δ_l}`` per row. Rows whose
    errors are at most 1 are evaluated directly (every exponential is within ``e^{±1}`` of
    ``e^{sc}``, whose largest is 1); the others, and rows without a live key, in log space.
    """
    fast = _direct_rows(delta, live)
    if fast.all():
        return _extremes_direct(sc, delta, live)
    p = np.zeros(sc.shape)
    hi, lo = np.zeros(sc.shape), np.zeros(sc.shape)
    log_sum = np.zeros((*sc.shape[:-1], 1))
    for rows, how in ((fast, _extremes_direct), (~fast, _extremes_log)):
        if rows.any():
            p[rows], hi[rows], lo[rows], log_sum[rows] = how(sc[rows], delta[rows], live[rows])
    return p, hi, lo, log_sum


def _direct_rows(delta: np.ndarray, live: np.ndarray) -> np.ndarray:
    """The rows :func:`_extremes` evaluates directly: a live key, and errors at most 1."""
    return live.any(axis=-1) & (_on(live, delta, 0.0).max(axis=-1) <= 1.0)


def _rest(e: np.ndarray, total: np.ndarray) -> np.ndarray:
    """``Σ_{l≠j} e_l`` for every ``j``: ``total - e_j`` where ``e_j`` is at most half the total
    (no cancellation), the direct sum over the others for the one key that may exceed it."""
    rest = total - e
    dominant = e > 0.5 * total
    if dominant.any():
        others = np.where(dominant, 0.0, e).sum(axis=-1, keepdims=True)
        rest = np.where(dominant, others, rest)
    return rest


def _extremes_direct(
    sc: np.ndarray, delta: np.ndarray, live: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_extremes` for rows with a live key and ``δ <= 1``: linear arithmetic."""
    e = np.exp(sc)  # 0 off the live keys, 1 at the row maximum
    grow = np.exp(delta)
    e_hi, e_lo = e * grow, e / grow
    s_lo = e_lo.sum(axis=-1, keepdims=True)
    s_hi = e_hi.sum(axis=-1, keepdims=True)
    p = e / e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p_hi = np.minimum(e_hi / (e_hi + _rest(e_lo, s_lo)), 1.0)
        p_lo = e_lo / (e_lo + _rest(e_hi, s_hi))
    p_hi = _on(live, p_hi, 0.0)
    p_lo = _on(live, p_lo, 0.0)
    return p, p_hi, p_lo, np.log(s_lo)


def _extremes_log(
    sc: np.ndarray, delta: np.ndarray, live: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_extremes` in log space: any ``δ``, rows without a live key."""
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = sc - np.log(np.exp(sc).sum(axis=-1, keepdims=True))
        a_lo, a_hi = log_p - delta, log_p + delta
        log_pt_hi = a_hi - np.logaddexp(a_hi, _log_sum_excluding(a_lo))
        log_pt_lo = a_lo - np.logaddexp(a_lo, _log_sum_excluding(a_hi))
    log_pt_hi = np.where(live, np.minimum(log_pt_hi, 0.0), -np.inf)  # p̃_j <= 1
    log_pt_lo = np.where(live, log_pt_lo, -np.inf)
    return np.exp(log_p), np.exp(log_pt_hi), np.exp(log_pt_lo), _logsumexp(sc - delta)


LN2 = math.log(2.0)


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


def _softcap_logits(
    s: np.ndarray,
    sources: dict[str, np.ndarray],
    s_upper: np.ndarray,
    eps64: np.ndarray,
    cap: float,
    num: Numerics,
    ranges: _Ranges,
    used: np.ndarray,
) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Step 3c (papers/attention.md): the scores capped at ``c·tanh(s/c)`` in the score format.

    The kernel computes ``x̂ = fl(ŝ·r̂)``, ``t̂ = fl(T(x̂))`` and ``fl(ĉ·t̂)`` with ``ĉ = fl(c)``,
    ``r̂ = fl(1/c)`` and ``T`` the carrier's ``tanh`` (within ``tanh_ulps``). With ``|ŝ - s| <= δ``,
    ``|x̂ - s/c| <= w = δ/c + |ŝ||r̂ - 1/c| + u_s|ŝ|r̂ + η_s``, and ``tanh`` moves by at most
    ``D = sinh(w)/(cosh(s/c)·cosh(||s/c| - w|))`` (far beyond the cap, far less than ``w``).
    Returns the capped float64 logits, their error sources (the incoming ones carried through
    ``tanh`` by their share of ``w``, and ``softcap``: the division's, ``tanh``'s and the
    product's roundings), the bound on the capped scores' magnitude and the float64 error.
    """
    fs = num.format_of("score")
    u_s, eta_s = fs.u, fs.smallest_normal
    carrier = fs if fs.name in ("float32", "float64") else get_format("float32")
    narrow = carrier.name != fs.name
    u_t, eta_t = 2 * num.tanh_ulps * carrier.u, carrier.smallest_normal
    c_hat, r_hat = float(round_to(cap, fs)), float(round_to(1.0 / cap, fs))
    if not (math.isfinite(c_hat) and math.isfinite(r_hat) and c_hat > 0 and r_hat > 0):
        ranges.flag(
            True,
            f"softcap: the cap {cap:g} or its reciprocal does not fit the score format "
            f"{fs.name} (rounds to {c_hat:g} and {r_hat:g})",
        )
        c_hat, r_hat = cap, 1.0 / cap  # evaluated on these, then infinite
    e_c = float(abs(fractions.Fraction(c_hat) - fractions.Fraction(cap))) * (1 + 2.0**-52)
    e_r = float(abs(fractions.Fraction(r_hat) - 1 / fractions.Fraction(cap))) * (1 + 2.0**-52)
    # any reciprocal within two roundings of 1/c (fl(1/fl(c)), a compiler's folded constant) or
    # a division by ĉ (|fl(ŝ/ĉ) - ŝ/c| is within the same w) is covered, not only this r̂
    e_r = max(e_r, (2 * u_s + 2 * u_s * u_s) / cap * (1 + 2.0**-50))
    # a subnormal constant may be read as zero (XLA's flush of denormal inputs)
    if c_hat < fs.smallest_normal:
        e_c = max(e_c, cap)
    if r_hat < fs.smallest_normal:
        e_r = max(e_r, (1 / cap) * (1 + 2.0**-52))
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
    return s_c, capped, s_upper, eps64


def _head(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keep: np.ndarray,
    bias: np.ndarray | None,
    num: Numerics,
    scale: float,
    default_scale: bool,
    errors: tuple[Any, Any, Any],
    given: tuple[Any, Any, Any] | None = None,
    lam: float | None = None,
    masked: np.ndarray | None = None,
    replaced: np.ndarray | None = None,
    softcap: float | None = None,
    loose_constant: bool = False,
    project: tuple[np.ndarray, np.ndarray] | None = None,
    along: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, dict[str, np.ndarray], _Ranges]:
    """The terms of Theorem A.1 for one head, the float64 output ``o = p v``, ``|o - o*|``, the
    logits term apportioned to the sources of the logit errors (``Bound.parts``) and the output
    entries the range checks (papers/attention.md, R) cannot prove finite.

    2-D inputs; ``keep`` marks the attended keys (the exact attention's), ``bias`` is finite
    where ``keep``. ``masked`` (only for a finite masking constant) marks the keys the mask
    excludes: their computed logits are the constant (``fill``) or the logit plus the constant
    (``add``), a leakage the term ``mask`` bounds (step 3'). ``replaced`` marks the logits the
    mask replaces by a constant (their computed scores never reach the softmax). ``errors``
    bound ``|q_used - q|`` etc., the operands the dots read before any operand-format rounding
    (step 1). ``given`` bounds the errors of the float64 ``q, k, v`` themselves against the
    exact values the reference uses (A.2: float64 projections; the scale on q and k); their
    effect on the exact output is the term ``evaluation``. The float64 logits the bound is
    evaluated on are off the exact ones by at most ``ε64`` (step 0); that is added to the
    logits' errors and, as a perturbation of the target, to ``evaluation``. ``softcap`` (step
    3c) caps the scaled scores at ``c·tanh(s/c)`` before the bias. ``loose_constant`` (fp8
    descaling) charges the scale constant as up to three roundings of its format, and its
    product as rounded, whatever value the kernel's constant takes.
    """
    ev_rel = evaluation_rounding(k.shape[-2])  # float64 sums over the keys
    ranges = _Ranges(q.shape[-2], v.shape[-1])
    store = num.storage_format
    # R.1: the stored operands (the inputs rounded to the input format, or the projections)
    for x, e, name, how in ((q, errors[0], "q", "q"), (k, errors[1], "k", "k")):
        ranges.check(np.abs(x) + e, store, f"{name} in the input format", rows=how)
    ranges.check(np.abs(v) + errors[2], store, "v in the input format", cols=True)
    if num.scale != "scores":
        q, k, errors, given = _scale_operands(
            q, k, errors, given, num, scale, default_scale, ranges
        )
        scale, default_scale = 1.0, False
    d_k, n = q.shape[-1], k.shape[-2]
    fmts = {r: num.format_of(r) for r in ("score", "softmax", "prob", "accum")}
    acc = fmts["accum"]
    u_s, eta_s = fmts["score"].u, fmts["score"].smallest_normal
    # Step 1. Operands: |q_used - q| <= e_q, then the rounding into the operand format (TF32)
    # and the reading into the accumulation format.
    u_op, eta_op = operand_error(num)
    op = num.operand_rounding
    fin = num.format_of("input")
    f_q = num.format_of("scale") if num.scale != "scores" else store
    f_k = num.format_of("scale") if num.scale == "qk" else store
    bits_qk = (operand_bits(num, f_q), operand_bits(num, f_k))
    bits_pv = (operand_bits(num, fmts["prob"]), operand_bits(num, fin))
    conv = {f: conversion_eta(num, op or f) for f in (f_q, f_k, store)}
    e_q, e_k, e_v = errors
    q_abs, k_abs = np.abs(q), np.abs(k)
    q_used, k_used = q_abs + e_q, k_abs + e_k
    e_q_op = e_q + u_op * q_used + eta_op + conv[f_q]
    e_k_op = e_k + u_op * k_used + eta_op + conv[f_k]
    v_abs = (1 + u_op) * (np.abs(v) + e_v) + eta_op + conv[store]
    if op is not None:
        # an operand the dot uses exactly (no error before the conversion) converts by its own
        # rounding into the operand format: none for a value of that format (fp8 inputs at 448)
        e_q_op = np.where(e_q == 0, rounding_error(q, op) + conv[f_q], e_q_op)
        e_k_op = np.where(e_k == 0, rounding_error(k, op) + conv[f_k], e_k_op)
        v_abs = np.where(e_v == 0, np.abs(v) + rounding_error(v, op) + conv[store], v_abs)
    q_op, k_op = q_abs + e_q_op, k_abs + e_k_op
    # R.2: the operands read into the operand and accumulation formats
    for fmt, where in ((op, "the dot's operand format"), (acc, "the accumulation format")):
        if fmt is not None:
            ranges.check(q_op, fmt, f"q read into {where}", rows="q")
            ranges.check(k_op, fmt, f"k read into {where}", rows="k")
            ranges.check(v_abs, fmt, f"v read into {where}", cols=True)
    u_div = division_error(num.div_ulps, fmts["softmax"].u)
    # Step 2. The constant: the float64 value of 1/sqrt(d_k) (two float64 roundings unless
    # d_k = 4^m) or the given scale, rounded once into the score format; the product by it is
    # exact when it is a normal power of two; a subnormal constant may be read as zero.
    folded = num.folds_scale
    if folded:
        # Step 2''. c2 = fl_m(scale·log2(e)): the float64 product (one rounding), then rounded
        # into the softmax format; no product with the scores is stored (they stay unscaled).
        # exp2-scaled: the kernel's own fl_m(fl_m(scale)·fl_m(log2 e)), three roundings.
        if num.exp_form == "exp2-scaled":
            s_hat, u_s1, _ = scale_rounding(scale, fmts["softmax"])
            l_hat, u_l, _ = scale_rounding(LOG2E, fmts["softmax"])
            c2_hat, u_p, _ = scale_rounding(s_hat * l_hat, fmts["softmax"])
            u_c = compound(u_s1, u_l, u_p)
            tiny_factor = min(abs(s_hat), abs(scale)) < fmts["softmax"].smallest_normal
        else:
            c2_hat, u_c, _ = scale_rounding(scale * LOG2E, fmts["softmax"])
            tiny_factor = False
        u_c = compound(2.0**-53, u_c)
        c_hat, u_mul = c2_hat / LOG2E, 0.0
        form = num.exp_form
        if c2_hat < 0:
            # the shift is the maximum of the unscaled scores: the largest logit only for a
            # positive scale; a masked or padding key's -inf·c2 is +inf
            ranges.flag(
                True,
                f"{form} with the negative scale {scale:.4g}: the shift is the maximum of "
                "the unscaled scores, and -inf·c2 is +inf",
            )
        elif tiny_factor or abs(c2_hat) < fmts["softmax"].smallest_normal:
            # R.3'': a c2 (or, exp2-scaled, its factor fl(scale)) that may be read as zero
            # makes -inf·c2 (a masked or padding key) NaN, as in the kernels
            ranges.flag(
                True,
                f"{form}: c2 = {c2_hat:.4g} or its factor fl(scale) is subnormal or zero in "
                f"{fmts['softmax'].name} and may be read as zero: -inf·c2 is NaN",
            )
        elif not math.isfinite(c2_hat):
            ranges.flag(True, f"{form}: c2 = fl(scale·log2 e) overflows {fmts['softmax'].name}")
    else:
        c_hat, u_c, u_mul = scale_rounding(scale, fmts["score"])
    if default_scale and not is_power_of_four(d_k):
        # irrational: fl(1/fl(sqrt(d))) = c(1+δ2)/(1+δ1) in float64, then rounded into F_score
        u_c = compound(2.0**-53, u_c, over=(2.0**-53,))
    if loose_constant:
        # the kernel forms its constant itself (scale·d_q·d_k, in float32): any value within three
        # roundings of the exact one, and the product by it rounded
        u_f = fmts["softmax"].u if folded else fmts["score"].u
        u_c = max(u_c, compound(powers=((u_f, 3), (2.0**-53, 3))))
        u_mul = u_mul if folded else u_f
    theta = compound(u_s, u_c, u_mul)

    # Step 3. The logits' errors δ_ij.
    t = q @ k.T
    qk_abs = q_abs @ k_abs.T
    # e_q|k| + |q|e_k + e_q e_k (no product for operands read exactly)
    operands = np.zeros_like(t)
    if np.any(e_q_op):
        operands = e_q_op @ k_op.T
    if np.any(e_k_op):
        operands = operands + q_abs @ e_k_op.T
    f_qk, anchor = unit_factor(num, d_k, lam, bits=bits_qk), tensor_core_anchor(num)
    # (operands read exactly: q_op = |q|, k_op = |k|, the product already taken)
    qk_op = qk_abs if not (np.any(e_q_op) or np.any(e_k_op)) else q_op @ k_op.T
    unit = f_qk * qk_op + unit_eta(num, d_k)
    if anchor:
        sums = q_op.sum(axis=-1)[:, None] + k_op.sum(axis=-1)[None, :] + d_k * anchor
        unit = unit + f_qk * anchor * sums
    # Step 0. The float64 logits s = c·t (+ b) are off the exact ones by at most eps64.
    eps64 = F64_DOT * (d_k + 2) * abs(scale) * qk_abs
    # the sources of δ (they add up to it), to apportion the logits term: Bound.parts
    sources = {
        "operands": abs(scale) * operands * (1 + theta),
        "qk_dot": abs(scale) * unit * (1 + theta),
        "scale": abs(scale) * theta * np.abs(t) + (abs(c_hat) * (1 + u_s) + 2) * eta_s + eps64,
    }
    # R.3: QKᵀ in the accumulation format, rounded to the score format, scaled there
    used = np.ones_like(keep) if replaced is None else ~replaced
    acc_upper = _on(used, qk_op + unit, 0.0)
    ranges.check(acc_upper, acc, "QKᵀ accumulated")
    ranges.check(acc_upper, fmts["score"], "QKᵀ rounded to the score format")
    s_upper = abs(c_hat) * ((1 + u_s) * acc_upper + eta_s) * (1 + u_s) + eta_s
    if folded:
        # R.3'': the products t·c2 and m·c2 in the softmax format (m is one of the t)
        t_c2 = abs(c2_hat) * ((1 + u_s) * acc_upper + eta_s) * (1 + fmts["softmax"].u)
        ranges.check(t_c2, fmts["softmax"], f"the scores times c2 = {c2_hat:.4g} ({num.exp_form})")
    elif num.scale == "scores":
        ranges.check(s_upper, fmts["score"], f"the scores times the scale {c_hat:.4g}")
    delta = sum(sources.values())
    s = scale * t
    if softcap is not None:
        s, sources, s_upper, eps64 = _softcap_logits(
            s, sources, s_upper, eps64, softcap, num, ranges, used
        )
        delta = sum(sources.values())
    if bias is not None:
        b0 = np.where(np.isfinite(bias), bias, 0.0)
        e_b = rounding_error(b0, fmts["score"])
        s = s + b0
        # adding a zero bias is exact (fl(x + 0) = x, in float64 too): no rounding there
        added = b0 != 0
        k_add = np.where(added, 1 + u_s, 1.0)
        eps_b = np.where(added, 2.0**-53 * np.abs(s), 0.0)
        sources = {name: k_add * x for name, x in sources.items()}
        sources["bias"] = np.where(added, (1 + u_s) * e_b + u_s * np.abs(s) + eta_s, 0.0)
        sources["scale"] = sources["scale"] + eps_b
        eps64 = eps64 + eps_b
        delta = sum(sources.values())
        s_upper = s_upper + np.abs(b0) + e_b
        ranges.check(_on(used, s_upper, 0.0), fmts["score"], "the scores plus the bias")
    # R.4: the scores read into the softmax format (and its smallest normal); folded, the
    # unscaled ones (no bias, no cap): with c2 < 1 they reach further than their products
    read = (1 + u_s) * acc_upper + eta_s if folded else s_upper
    ranges.check(_on(used, read, 0.0), fmts["softmax"], "the scores read into the softmax format")
    if fmts["softmax"].smallest_normal > fmts["score"].smallest_normal:
        sources["scale"] = sources["scale"] + fmts["softmax"].smallest_normal
        delta = sum(sources.values())
    # Step 3'. A finite masking constant M: the computed logits are those of the leaky problem
    # (the masked keys keep the logit M (fill) or s + M (add)); ``live`` marks its keys. R.4':
    # a masked logit the score or softmax format cannot hold is read as -inf: the key drops out
    # (p = 0 exactly, as under -inf masking) where that is certain, and the row's outputs are
    # infinite where it is not, or where it leaves a row that attends no key without a finite
    # logit (NaN) or without the leaky problem's value.
    live, exclude = keep, np.zeros_like(keep)
    lift_arg = None  # prob_offset: the largest argument of a lifted exponential (natural units)
    nan_row = False  # an overflow of the masked logits is NaN (flagged), not -inf
    if masked is not None:
        const = num.mask_constant()
        open_bias = np.ones_like(keep) if bias is None else ~np.isneginf(bias)
        narrow = min((fmts["score"], fmts["softmax"]), key=lambda f: f.max_finite)
        empty_row = ~keep.any(axis=-1, keepdims=True)
        if num.mask_mode == "fill":
            # M is exact in the score format and the softmax format is at least as precise:
            # its read is M or, past the softmax format's range, -inf
            read = float(round_to(const, fmts["softmax"]))
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
            if not (fmts["score"].has_inf and fmts["softmax"].has_inf):
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
        exclude = live & ~keep
    fold = None
    if folded:
        # Step 3''. The exponent's argument fl(fl(t·c2) - fl(m·c2)) (base 2; natural units
        # below, times ln 2): the product t_j·c2 is rounded (u_m|s_j|), and so is the shift
        # m_b·c2 of each block (u_m|m_b·c|, |m_b·c| <= R, the row's largest |s| + δ: under the
        # online softmax the blocks' shifts differ and do not cancel), with an underflow η_m
        # each; the subtraction's rounding is step 5's (on an argument up to gap + this term).
        u_m, eta_m = fmts["softmax"].u, fmts["softmax"].smallest_normal
        s_abs = np.where(live, np.abs(s) + delta, 0.0)
        r_row = s_abs.max(axis=-1, keepdims=True)
        fold = np.where(live, u_m * (1 + u_c) * (s_abs + r_row) + 2 * eta_m, 0.0)
        if num.prob_offset:
            # FlashAttention-3's offset: fl(fl(m·c2) - k), one more rounding of a value at most
            # (|m·c2| + k) in base 2, (1 + u_c)(1 + u_m)R + k·ln 2 in natural units
            k_ln2 = num.prob_offset * math.log(2.0)
            lifted_by = u_m * ((1 + u_c) * (1 + u_m) * r_row + k_ln2) + eta_m
            fold = fold + np.where(live, lifted_by, 0.0)
            # R.5, lifted: fl(t·c2) <= fl(m·c2) for t <= m, so the computed argument is at most
            # (k·ln 2 + that rounding)(1 + u_m), not k·ln 2: the exponentials' largest value
            lift_arg = (k_ln2 + lifted_by) * (1 + u_m)
        sources["exp_fold"] = fold
        delta = delta + fold
    elif num.exp2:
        # Step 3'' (exp2): the logits, as under exp, taken into base 2 by x = fl(ŝ·L̂) with
        # L̂ = fl_m(log2 e): a relative (1 + u_L)(1 + u_m) - 1 of each |ŝ| (natural units), an
        # underflow η_m; the shifts are x values themselves, and the rescalings' excess over
        # u_m(2 + u_m)·gap is at most 2u_m²R (papers/attention.md, step 3'', exp2)
        u_m, eta_m = fmts["softmax"].u, fmts["softmax"].smallest_normal
        u_l = compound(2.0**-53, u_m)
        s_abs = np.where(live, np.abs(s) + delta, 0.0)
        r_row = s_abs.max(axis=-1, keepdims=True)
        ranges.check(
            s_abs * LOG2E * (1 + u_l) * (1 + u_m), fmts["softmax"], "the logits times fl(log2 e)"
        )
        rel = compound(u_l, u_m)
        fold = np.where(live, rel * s_abs + 2 * u_m**2 * (1 + rel) * r_row + 2 * eta_m, 0.0)
        sources["exp_fold"] = fold
        delta = delta + fold
    across: list[tuple[np.ndarray, np.ndarray]] | None = None
    if (
        lam is not None
        and num.dot_kind == "ieee"
        and masked is None
        and not num.exp2
        and not softcap
    ):
        # Theorem A.3': the QKᵀ dots' roundings as one martingale across the keys. A dot's
        # error is Σ_k δ_k T_k over its roundings: at most d_k of products and d_k - 1 of sums
        # (each twice in the native order of a format XLA may carry in float32), in any order;
        # the later roundings of the logit (1 + θ, the bias's) and the dots' underflow stay
        # deterministic.
        u_a = acc.u
        g_det = unit_factor(num, d_k, None, bits=bits_qk)
        twice = 2 if num.summation_kind == "native" and u_a > 2.0**-24 else 1
        b_dot = abs(scale) * u_a * _dot_increments(q_op, k_op, t, operands, qk_op, g_det, twice)
        k_b = (1 + theta) * (k_add if bias is not None else 1.0)
        rest = (
            delta
            - sources["qk_dot"]
            + abs(scale) * k_b * unit_eta(num, d_k)
            + abs(scale) * (k_b - 1) * g_det * qk_op
        )
        across = [(b_dot, np.where(live, np.maximum(rest, 0.0), 0.0))]
        if bias is None and num.scale == "scores":
            # the roundings of each key's score (QKᵀ into the score format, then its product
            # by the scale) may join the martingale: ŝ_j = c(1 + δ_c)(1 + δ_s)(1 + δ_mul)·t̂_j,
            # the increments c·t̂_j·δ_s and c·t̂_j·δ_mul with |t̂_j| <= T_j, the rest of θ (δ_c,
            # common to the row, and the products of δs) deterministic: θ - u_s - u_mul
            t_hat = np.abs(t) + operands + g_det * qk_op + unit_eta(num, d_k)
            b_score = np.sqrt(b_dot**2 + (abs(scale) * math.hypot(u_s, u_mul) * t_hat) ** 2)
            rest_score = rest - abs(scale) * (u_s + u_mul) * t_hat
            across.append((b_score, np.where(live, np.maximum(rest_score, 0.0), 0.0)))
    delta = _on(live, delta, 0.0)
    s = _on(live, s, -np.inf)
    direct = None
    if num.kv_splits is None:
        terms, p, _, direct = _softmax_pv(
            s, delta, v, v_abs, live, num, lam, bits_pv, anchor, u_div, ranges, fold, across,
            lift_arg, project, along,
        )  # fmt: skip
    else:
        # folded: a split's lse is fl(fl(m·ĉ) + log ℓ) with ĉ = fl(scale), while its exponents
        # scale by c2 = fl(scale·log2 e): the two constants differ by u_m + u_c (and float64's)
        u_m = fmts["softmax"].u
        lse_scale = compound(u_m, u_m, u_c, 2.0**-51) if folded else 0.0
        terms, p, _ = _split_pv(
            s, delta, v, v_abs, live, num, lam, bits_pv, anchor, u_div, ranges, fold, across,
            lse_scale, lift_arg,
        )  # fmt: skip
    plain = terms.pop(_PLAIN)
    projected = terms.pop(_PROJECTED, None)
    along_rows = terms.pop(_ALONG, None)
    whole = terms.pop(_WHOLE, None)
    # The logits term apportioned to the sources of δ by their p-weighted share in each row.
    row_delta = (p * delta).sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = {
            name: np.where(
                row_delta > 0, (p * _on(live, x, 0.0)).sum(-1, keepdims=True) / row_delta, 0.0
            )
            for name, x in sources.items()
        }
    parts = {name: share * terms["logits"] * (1 + ev_rel) for name, share in shares.items()}
    parts[_PLAIN] = plain * (1 + ev_rel)
    if projected is not None:
        parts[_PROJECTED] = projected * (1 + ev_rel)
    if along_rows is not None:
        parts[_ALONG] = along_rows
    # The target: the exact attention over the attended keys; in a row with none, the leaky
    # problem itself (fill: uniform over the keys; add: the unmasked softmax).
    empty = ~keep.any(axis=-1, keepdims=True)
    target = np.where(empty, live, keep)
    if direct is not None and masked is None:
        # target = keep = live: the softmax _softmax_pv evaluated, on every row
        p_t, (o, pv_abs) = p, direct
    else:
        s_t = np.where(target, s, -np.inf)
        p_t = np.exp(s_t - s_t.max(axis=-1, keepdims=True))
        p_t /= p_t.sum(axis=-1, keepdims=True)
        o, pv_abs = p_t @ v, p_t @ np.abs(v)
    if exclude.any():
        leak = np.where(exclude & ~empty, p, 0.0)
        spread = np.abs(v)[None, :, :] + np.abs(o)[:, None, :]
        floor = np.where(empty, 0.0, n * 2.0**-1022 * spread.max(axis=1))
        terms["mask"] = np.einsum("ij,ijl->il", leak, spread) + floor
    # The float64 logits' own error eps64 moves the target (Theorem S.4).
    big = np.max(_on(target, eps64, 0.0), axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        evaluation = np.expm1(2 * big) * pv_abs
    o_error = ev_rel * pv_abs + evaluation
    if given is not None:
        given_error = _given_error(q_abs, k_abs, v, p_t, pv_abs, target, scale, given)
        evaluation = evaluation + given_error
        o_error = o_error + given_error
    if given is not None or num.scale != "scores" or np.any(evaluation > 0):
        terms["evaluation"] = evaluation
    terms = {name: value * (1 + ev_rel) for name, value in terms.items()}
    # R.6: the output, |o_hat| <= |o| + the bound, in the output format (online: and the
    # softmax format it is divided in)
    upper = np.abs(o) + sum(terms.values())
    if whole is not None:
        upper = np.fmin(upper, whole)
    ranges.check(upper, num.format_of("output"), "the output", entries=True)
    if whole is not None:
        # |o*| <= max_j |v*_j| too: the target is a convex combination of the exact values
        v_star = np.abs(v) if given is None else np.abs(v) + np.asarray(given[2])
        o_star = np.fmin(np.abs(o) + o_error, v_star.max(axis=0, initial=0.0))
        terms = _at_most_magnitudes(terms, parts, whole + o_star * (1 + ev_rel))
    if num.softmax_kind == "online":
        ranges.check(
            upper, fmts["softmax"], "the output divided in the softmax format", entries=True
        )
    return terms, o, o_error, parts, ranges


def _at_most_magnitudes(
    terms: dict[str, np.ndarray], parts: dict[str, Any], magnitudes: np.ndarray
) -> dict[str, np.ndarray]:
    """Step W: ``|ô - o| <= |ô| + |o|`` (``magnitudes``) replaces the terms of the entries where
    it is smaller than their sum (term ``magnitudes``). The logits' parts there are 0, and the
    rows with such an entry drop A.2 (c')'s and A.1g's coupled forms (``parts``, in place),
    which bound the logits' part of every entry of the row together."""
    kept, take = where_smaller(terms, magnitudes, "magnitudes")
    if take is None:
        return kept
    rows = take.any(axis=-1, keepdims=True)
    for name, x in parts.items():
        if name == _PLAIN:
            continue
        if name in (_PROJECTED, _ALONG):
            parts[name] = np.where(rows, np.inf, x)
        else:
            parts[name] = np.where(take, 0.0, x)
    return kept


_CHUNK = 2**18  # logits per chunk of query rows: the float64 temporaries stay small
_PLAIN = "output:plain"  # the plain output term, carried with the logits' parts out of _head
# A.2: the logits term through the output projection's weights (step (c')), carried likewise
_PROJECTED = "logits:projected"
# Theorem A.1g: the output's error along a direction g per row, less its entrywise form
_ALONG = "along:coupled"
_TINY = 2.0**-1074  # float64's smallest subnormal number
# Step W: the computed output's magnitude, whatever the logit errors (safe softmax)
_WHOLE = "output:whole"


def _head_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keep: np.ndarray,
    bias: np.ndarray | None,
    num: Numerics,
    scale: float,
    default_scale: bool,
    errors: tuple[Any, Any, Any],
    given: tuple[Any, Any, Any] | None = None,
    lam: float | None = None,
    masked: np.ndarray | None = None,
    replaced: np.ndarray | None = None,
    softcap: float | None = None,
    loose_constant: bool = False,
    project: tuple[np.ndarray, np.ndarray] | None = None,
    along: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, dict[str, np.ndarray], _Ranges]:
    """:func:`_head`, evaluated on chunks of query rows.

    Every quantity of Theorem A.1 belongs to one query row (the keys and values enter each
    row alike), so the chunks' terms, outputs and range flags are those of the whole head,
    stacked; the chunks only keep the ``rows × keys`` temporaries small.
    """
    rows = q.shape[-2]
    step = max(1, _CHUNK // max(1, k.shape[-2]))
    if rows <= step:
        return _head(
            q,
            k,
            v,
            keep,
            bias,
            num,
            scale,
            default_scale,
            errors,
            given,
            lam,
            masked,
            replaced,
            softcap,
            loose_constant,
            project,
            along,
        )

    def cut(x: Any, sl: slice) -> Any:
        if isinstance(x, np.ndarray) and x.ndim >= 2 and x.shape[-2] == rows:
            return x[..., sl, :]
        return x

    parts = []
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        parts.append(
            _head(
                cut(q, sl),
                k,
                v,
                cut(keep, sl),
                cut(bias, sl),
                num,
                scale,
                default_scale,
                (cut(errors[0], sl), errors[1], errors[2]),
                None if given is None else (cut(given[0], sl), given[1], given[2]),
                lam,
                cut(masked, sl),
                cut(replaced, sl),
                softcap,
                loose_constant,
                project,
                None if along is None else (cut(along[0], sl), cut(along[1], sl)),
            )
        )
    ranges = _Ranges(rows, v.shape[-1])
    for name in dict.fromkeys(n for part in parts for n in part[4].where):
        ranges.where[name] = np.concatenate(
            [part[4].where.get(name, np.zeros(part[4].shape, bool)) for part in parts]
        )
    ranges.reasons = list(dict.fromkeys(r for part in parts for r in part[4].reasons))

    shapes = [part[1].shape for part in parts]

    def stack(dicts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        names = dict.fromkeys(n for d in dicts for n in d)
        return {
            n: np.concatenate(
                [
                    d[n] if n in (_PROJECTED, _ALONG) else np.broadcast_to(d.get(n, 0.0), shape)
                    for d, shape in zip(dicts, shapes, strict=True)
                ]
            )
            for n in names
        }

    o = np.concatenate([part[1] for part in parts])
    o_error = np.concatenate([np.broadcast_to(part[2], part[1].shape) for part in parts])
    return stack([p[0] for p in parts]), o, o_error, stack([p[3] for p in parts]), ranges


def _softmax_pv(
    s: np.ndarray,
    delta: np.ndarray,
    v: np.ndarray,
    v_abs: np.ndarray,
    live: np.ndarray,
    num: Numerics,
    lam: float | None,
    bits_pv: tuple[int, int],
    anchor: float,
    u_div: float,
    ranges: _Ranges,
    fold: np.ndarray | None = None,
    across: list[tuple[np.ndarray, np.ndarray]] | None = None,
    lift_arg: np.ndarray | None = None,
    project: tuple[np.ndarray, np.ndarray] | None = None,
    along: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """Steps 4-7 of A.1 for logits ``s`` (``-inf`` where not live) off by at most ``delta``.

    ``fold`` (``exp_form="exp2-folded"``) is the part of ``delta`` that the exponent's argument
    may carry beyond ``|ŝ_j - m|`` (step 3''): its rounding is charged on ``gap + fold``.
    ``across`` (Theorem A.3', with ``lam``) lists splits ``(b, δ')`` of the logits' errors: the
    roundings in a martingale across the keys (increments bounded by ``b_ij``), and the rest of
    each logit's error, at most ``δ'_ij``; the logits term is then the smallest of step 4's and
    A.3''s for each split. The choice, entry by entry, depends on the inputs only, not on the
    roundings, so each entry's bound is still one event. ``lift_arg`` (``prob_offset = k``) is
    each row's largest argument of a lifted exponential, natural units: ``k·ln 2`` and the
    rounding of ``fl(m·c2) - k`` (step 3''), which the ranges of step R.5 take. ``project``
    (A.2, step (c')) is ``(B, W)``: ``B_jm >= |v_j·ŵ_m - c_m|`` for the output projection's
    weights ``ŵ`` as the kernel reads them and a constant ``c_m``, and ``W >= |ŵ|``; the terms
    then carry ``Λ = L B + (κ - 1)(L|v|) W`` (``L`` the logits' per-key deviations of step 4,
    ``κ`` the output's rounding factor), a bound on ``|Σ_l (ô - o)^logits_l ŵ_lm|``.
    ``along`` (Theorem A.1g, deterministic only) is ``(g, ḡ)``, one direction per query row
    with ``ḡ >= |g*|`` for the exact one: the terms then carry, per row, the coupled bound on
    ``|Σ_c g*_c (ô_c - o_c)|`` less its entrywise form ``Σ_c ḡ_c (terms)_c`` (``_ALONG``).

    Returns the terms (against the exact attention of these logits), its probabilities, the
    computed row sum's relative error ``T`` (step 5; ``inf`` in a vacuous row), and ``(p v,
    p|v|)`` where ``p`` was evaluated directly on every row (else ``None``); rows whose
    softmax sum may be off by 100%, or (naive) may overflow or flush its reciprocal, and
    sums that may overflow their format are recorded in ``ranges``. Everything is evaluated on
    the logits shifted by the row maximum, so the float64 evaluation does not lose accuracy
    with the logits' magnitude.
    """
    ev_rel = evaluation_rounding(s.shape[-1])  # float64 sums over the keys
    n = s.shape[-1]
    fmts = {r: num.format_of(r) for r in ("softmax", "prob", "output", "accum")}
    u_p, u_o = fmts["prob"].u, fmts["output"].u
    eta_m, eta_p, eta_o = (fmts[r].smallest_normal for r in ("softmax", "prob", "output"))
    u_op, eta_op = operand_error(num)
    eta_op = eta_op + conversion_eta(num, num.operand_rounding or fmts["prob"])
    # Step 4 (per key, Lemma 4). p̃_j = p_j e^{ε_j} / Σ_l p_l e^{ε_l}, |ε_l| <= δ_l, grows
    # with ε_j and falls with every other ε_l, so its extremes over the box are
    # p_j e^{±δ_j} / (p_j e^{±δ_j} + Σ_{l≠j} p_l e^{∓δ_l}).
    top = s.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        sc = _on(live, s - np.where(np.isfinite(top), top, 0.0), -np.inf)
    p, p_tilde_hi, p_tilde_lo, log_sum_lo = _extremes(sc, delta, live)
    logits = np.maximum(p_tilde_hi - p, p - p_tilde_lo)
    # Step 5. |ŝ_j - m| <= G_j for the computed maximum m in [lo, hi] (safe, online).
    lo = _on(live, sc - delta, -np.inf).max(axis=-1, keepdims=True)
    hi = _on(live, sc + delta, -np.inf).max(axis=-1, keepdims=True)
    gap = _on(live, np.maximum(hi - sc + delta, np.abs(sc + delta - lo)), 0.0)
    if fold is not None:
        gap = gap + fold
    kind = num.softmax_kind
    online = kind == "online"
    x, blocks, g_sum, g_pv, eta_pv = exp_and_sum_factors(num, n, gap, lam, bits_pv)
    # prob_offset k: the unnormalised weights and their sums carry 2^k (the division cancels
    # it), so every absolute underflow against them shrinks by 2^-k and every range grows by 2^k
    lift = 2.0**num.prob_offset
    x = np.broadcast_to(x, s.shape)
    with np.errstate(invalid="ignore"):
        if kind == "naive":
            log_s_lo = top + log_sum_lo
        else:
            log_s_lo = np.maximum(0.0, log_sum_lo - np.where(np.isfinite(hi), hi, 0.0))
    # R_j = e^{x_j} - 1: the relative error of the computed (rescaled) exponential of key j.
    x = _on(live, x, 0.0)
    with np.errstate(over="ignore"):
        r_mean = _weighted_expm1(p_tilde_hi, x, live)
        r_max = np.expm1(x.max(axis=-1, keepdims=True))
    r_bar = np.minimum(r_mean, r_max)
    with np.errstate(over="ignore"):
        underflow = n * eta_m * np.exp(-log_s_lo) / lift
        t_sum = compound(r_bar + underflow, g_sum) + underflow
    vacuous = ~np.isfinite(t_sum) | (t_sum >= 1)
    # Step W: the safe softmax's output is bounded whatever the logit errors; a row whose
    # row sum step 5 cannot bound keeps that bound alone (its softmax term infinite)
    whole = None
    rescued: Any = False
    if kind == "safe":  # (prob_offset is online only)
        # (deterministic: it holds with probability 1, so also beside A.3's terms)
        factors = (g_sum, g_pv, eta_pv)
        if lam is not None:
            factors = exp_and_sum_factors(num, n, gap, None, bits_pv)[2:]
        g_w, g_pv_w, eta_pv_w = factors
        n_live = live.sum(axis=-1, keepdims=True)
        _, row = safe_weight_sums(n_live, g_w, u_div, fmts["softmax"])
        whole = step_w_output(
            row, n_live, n, v_abs.max(axis=0, initial=0.0), v_abs.sum(axis=0), g_pv_w,
            eta_pv_w, num,
        )  # fmt: skip
        rescued = vacuous & np.isfinite(whole[1]).all(axis=-1, keepdims=True)
        # R.5: the row sum of the computed exponentials, each at most 1 + ε_e (Lemma W), in
        # F_m (a pairwise sum of 2^16 float16 ones reaches inf; the output is then 0)
        e_top = 1 + 2 * num.exp_ulps * fmts["softmax"].u
        sum_upper = n_live * e_top * (1 + g_w) + n_live * fmts["softmax"].smallest_normal
        ranges.check(sum_upper, fmts["softmax"], "the softmax's row sum", rows="q")
    ranges.flag(
        vacuous & ~rescued,
        "softmax: the computed row sum may be off by 100% (its error factor T >= 1)",
        "vacuous",
    )
    fm = fmts["softmax"]
    if kind == "naive":
        # No shift: exp or the row sum may overflow F_m, and XLA divides by the row sum as a
        # product with its reciprocal, which flushes to zero once the sum exceeds 2^-emin of
        # its carrier (papers/attention.md, step 5). Each makes the row vacuous.
        log_sum = top + _logsumexp(sc + delta) + math.log(2)
        carrier_emin = -1022 if fm.name == "float64" else -126  # the reciprocal's format
        flush = log_sum >= -carrier_emin * math.log(2) - 1
        over = (top + hi >= math.log(fm.max_finite) - 1) | (log_sum >= math.log(fm.max_finite))
        ranges.flag(
            over,
            f"naive softmax: exp of an unshifted logit or the row sum may overflow {fm.name} "
            f"(largest finite {fm.max_finite:.6g})",
            "vacuous",
        )
        ranges.flag(
            flush & ~over,
            "naive softmax: the row sum may exceed 2^-emin of the reciprocal's format, which "
            "then flushes to zero",
            "vacuous",
        )
        vacuous = vacuous | flush | over
    sound = ~vacuous
    t_safe = _on(sound, t_sum, 0.0)
    per_sum = np.exp(_on(sound, -log_s_lo, 0.0)) / (1 - t_safe)

    y = x + math.log1p(u_div) - np.log1p(-t_safe)
    soft = _on(sound, _times_expm1(p_tilde_hi, y), 0.0)  # vacuous rows: flagged
    eta_soft = eta_m * (1 + u_div) * per_sum / lift + eta_m
    soft += eta_soft
    # Step 5' (papers/attention.md): p̂_j = p̃_j(1 + ρ_j)(1 + ε_j)/(1 + τ) with the row sum's
    # error τ common to the row, so its share of Σ_j (p̂_j - p̃_j) v_j is at most
    # T/(1 - T)·|Σ_j p̃_j ṽ_j|, not T/(1 - T)·Σ_j p̃_j |ṽ_j|. Online there is no per-key
    # division: the output's one division is charged in scale_out and the output term.
    rel = _on(sound, _times_expm1(p_tilde_hi, x + math.log1p(0.0 if online else u_div)), 0.0)
    p_hat_hi = p_tilde_hi + soft
    rounding_keys: tuple[np.ndarray, float, np.ndarray, float] | None = None
    if online:
        prob = u_p * p_hat_hi + (eta_p * per_sum + blocks * eta_m * per_sum) / lift
    else:
        # Step 6: an absolute min(p̂_j, η_p) only where p̂_j may lie below F_p's smallest
        # normal number (0 is a candidate of the rounding there)
        p_hat_lo = p_tilde_lo * (1 - ev_rel) - soft
        normal_p = p_hat_lo >= eta_p
        # (x + 0 = x: no pass where every p̂_j is normal)
        below = np.where(normal_p, 0.0, np.minimum(p_hat_hi, eta_p))
        prob = u_p * p_hat_hi if normal_p.all() else u_p * p_hat_hi + below
        if lam is not None and num.dot_kind == "ieee":
            # Theorem A.3'' (papers/attention.md): the relative roundings of p̂_j into F_p and
            # the operand format, keys in their normal ranges, as one martingale per output
            # entry with increments at most u·p̂_j·v̄_j; the other keys stay deterministic.
            op_fmt = num.operand_rounding
            normal = live & normal_p
            if op_fmt is not None:
                normal = normal & (p_hat_lo * (1 - u_p) >= op_fmt.smallest_normal)
            eta_conv = eta_op - (op_fmt.smallest_normal if op_fmt is not None else 0.0)
            rounding_keys = (
                np.where(normal, p_hat_hi, 0.0),
                u_p**2 + (u_op * (1 + u_p)) ** 2,
                normal,
                eta_conv,
            )
    p_hat_hi = p_hat_hi + prob
    operand_p = u_op * p_hat_hi + eta_op
    p_hat_hi = p_hat_hi + operand_p
    p_hat_v = p_hat_hi @ v_abs  # (the products below are taken once, while their factors hold)
    if anchor:
        # the P·V unit reads p̂ (online: unnormalised weights <= 1, divided by the sum later)
        weights = n if online else p_hat_hi.sum(axis=-1, keepdims=True)
        eta_pv = eta_pv + g_pv * anchor * (weights + v_abs.sum(axis=0) + n * anchor)
    # R.5: the sums. Online: every rescaled exponential is at most (1 + ε_e)(1 + u_m) per
    # block, so the running sum is below n·growth·(1 + g) and every partial P·V sum below
    # growth·(1 + g_pv)·Σ_j |v_j|; safe and naive: the P·V partial sums stay below
    # (1 + g_pv)·p̂|v| + η.
    rows_live = live.any(axis=-1, keepdims=True)
    if online:
        eps_e = 2 * num.exp_ulps * fm.u
        growth = ((1 + eps_e) * (1 + fm.u) * (1 + fmts["accum"].u) ** 2) ** (blocks + 1)
        # prob_offset: a computed exponential is at most e^lift_arg·(1 + ε_e), more than 2^k
        # where fl(fl(m·c2) - k) rounds (|m·c2| past 2^p·k)
        with np.errstate(over="ignore"):
            lift_hi = lift if lift_arg is None else np.exp(lift_arg)
        ranges.check(
            np.where(rows_live, lift_hi * n * growth * (1 + g_sum) + n * blocks * eta_m, 0.0),
            fm,
            "online softmax: the running sum",
        )
        if num.prob_offset:
            # the lifted weights in the probability format, then the dot's operand format
            lifted = np.where(rows_live, lift_hi * growth * (1 + u_p), 0.0)
            for fmt in (fmts["prob"], num.operand_rounding):
                if fmt is not None:
                    ranges.check(
                        lifted * (1 + u_op),
                        fmt,
                        f"the exponentials lifted by 2^{num.prob_offset} (prob_offset)",
                    )
        acc_upper = lift_hi * growth * (1 + u_p) * (1 + g_pv) * v_abs.sum(axis=0) + eta_pv
        for fmt in (fmts["accum"], fm):
            ranges.check(
                np.where(rows_live, acc_upper, 0.0),
                fmt,
                "online softmax: the unnormalised P·V accumulator",
                entries=True,
            )
    else:
        pv_upper = (1 + g_pv) * (p_hat_v if sound.all() else np.where(sound, p_hat_hi, 0.0) @ v_abs)
        pv_upper = pv_upper + eta_pv
        if whole is not None:
            pv_upper = np.fmin(pv_upper, whole[0])
        ranges.check(pv_upper, fmts["accum"], "P·V accumulated", entries=True)
    pl = _on(live, p, 0.0)
    with np.errstate(invalid="ignore"):
        o = pl @ v
    v_extra = v_abs - np.abs(v)  # the values' errors (0 for values the dot reads exactly)
    pv_abs = pl @ np.abs(v)
    ev = ev_rel * pv_abs
    # Σ_j (p̃_j - p_j) = 0: the logits' part of the output is Σ_j (p̃_j - p_j)(v_j - c) for
    # the keys' median c, at most Σ_j L_j |v_j - c| (step 4, centred)
    v_dev = _centred(v, v_extra)
    with np.errstate(over="ignore", invalid="ignore"):
        # |Σ_j p̃_j ṽ_j| <= |o| + Σ_j |p̃_j - p_j| |v_j - c| + Σ_j p_j (v̄_j - |v_j|)
        logits_v = logits @ v_dev
        o_tilde = (np.abs(o) + ev + logits_v + _dot(pl, v_extra)) * (1 + ev_rel)
        o_tilde = np.minimum(o_tilde, p_tilde_hi @ v_abs)
        inv = 1 / (1 - t_safe)
        soft_term = (rel @ v_abs) * inv + t_safe * inv * o_tilde + eta_soft * v_abs.sum(axis=0)
    soft_term = np.fmin(soft_term, soft @ v_abs)

    scale_out = (1 + u_o) * ((1 + u_div) if online else 1.0)
    u_last: Any = u_div  # the online softmax's final division
    single = live.sum(axis=-1, keepdims=True) == 1
    one_key = kind != "naive" and single.any() and not num.prob_offset
    if one_key:
        # (with prob_offset the one key's weight is exp2(k), which XLA need not return exactly)
        # A row with one live key: ŝ_j - m = 0 exactly, exp(0) = 1 (assumption E of M.5), the
        # sum is 1 and 1/1 = 1, so p̂_j = 1, and P·V sums the one exact product 1·v_j with
        # zeros (a split dot still drops v_j's last piece: its factor stays).
        logits, soft, prob, operand_p = (
            np.where(single, 0.0, x) for x in (logits, soft, prob, operand_p)
        )
        if rounding_keys is not None:
            w_keys, c2, normal, eta_conv = rounding_keys
            rounding_keys = (np.where(single, 0.0, w_keys), c2, normal & ~single, eta_conv)
        soft_term = np.where(single, 0.0, soft_term)
        p_hat_hi = np.where(single, np.where(live, 1.0, 0.0), p_hat_hi)
        u_last = np.where(single, 0.0, u_div)  # acc / 1
        if num.dot_kind != "split":
            eta_pv = np.where(single, 0.0, eta_pv)  # type: ignore[assignment]
            g_row: Any = np.where(single, 0.0, g_pv)
        else:
            g_row = g_pv
    else:
        g_row = g_pv
    if one_key:  # the factors changed on the one-key rows
        logits_v, p_hat_v = logits @ v_dev, p_hat_hi @ v_abs
    prob_v = prob @ v_abs
    # (no product where the operand format reads p̂ exactly: operand_p is 0 then)
    op_v = operand_p @ v_abs if u_op or np.any(eta_op) else np.zeros_like(prob_v)
    terms = {
        "logits": scale_out * logits_v,
        "softmax": scale_out * soft_term,
        "probability_rounding": scale_out * prob_v,
        "operands": scale_out * (op_v + _dot(p_hat_hi, v_extra)),
        "pv": scale_out * (g_row * p_hat_v + (eta_pv * per_sum / lift if online else eta_pv)),
        "output": (
            u_o * np.abs(o) + eta_o + ((1 + u_o) * (u_last * np.abs(o) + eta_m) if online else 0.0)
        ),
    }
    if rounding_keys is not None and lam is not None:
        # A.3'': where the martingale is smaller, it replaces the keys' relative roundings, and
        # the two terms share it as they share the deterministic charge (the choice depends on
        # the inputs only: one event per entry)
        w_keys, c2, normal, eta_conv = rounding_keys
        with np.errstate(over="ignore", invalid="ignore"):
            mart = lam * np.sqrt(c2 * ((w_keys * w_keys) @ (v_abs * v_abs)))
            kept_prob = np.where(normal, 0.0, prob) @ v_abs
            kept_op = np.where(normal, eta_conv, operand_p) @ v_abs
            det_prob, det_op = prob_v, op_v
            det = det_prob + det_op
            alt = (mart + kept_prob + kept_op) * (1 + ev_rel)
            share = np.where(det > 0, det_prob / det, 1.0)
        choose = alt < det
        rest_v = _dot(p_hat_hi, v_extra)
        terms["probability_rounding"] = scale_out * np.where(choose, alt * share, det_prob)
        terms["operands"] = scale_out * (np.where(choose, alt * (1 - share), det_op) + rest_v)
    if across is not None and lam is not None:
        # the output's rounding carries this error as it carries the others (scale_out)
        kept = terms["logits"]
        for split in across:
            across_keys = _logits_across_keys(p, delta, v, v_abs, live, logits, split, lam)
            kept = np.fmin(kept, scale_out * across_keys)
        terms["logits"] = np.where(np.isnan(terms["logits"]), np.nan, kept)
    # Step 7'. The last rounding is to nearest: the computed x (|x - o*| <= E, the other terms)
    # rounds to a value at least as close to x as any value r of the format (plus η for a
    # flush to zero), and r = fl(o) is within |fl(o) - o| + ε + E of x (ε: o's own float64
    # error). Where o is (nearly) a value of the format and E is below half its spacing, this
    # is far below u|o| (papers/attention.md, step 7').
    e_other = sum(terms[n] for n in terms if n != "output")
    off_o = np.abs(round_to(o, fmts["output"]) - o) + ev
    # a flush to zero departs from the nearest value only below the smallest normal number
    low = np.abs(o) - ev - e_other  # <= |x|
    if online:  # y = fl_m(x), x = acc/l, then z = fl_o(y)
        off_m = np.abs(round_to(o, fm) - o) + ev
        flush_m = np.where(low < eta_m, eta_m, 0.0)
        y_off = off_m + 2 * e_other + flush_m  # >= |y - o*|
        flush_o = np.where(np.abs(o) - ev - y_off < eta_o, eta_o, 0.0)
        nearest = off_o + 2 * y_off - e_other + flush_o
    else:
        nearest = off_o + e_other + np.where(low < eta_o, eta_o, 0.0)
    # the last rounding's plain bound (u_o|o| + η_o, and the online division's), which bounds
    # |fl(x) - x| by itself: Theorem A.5' (shared logits) needs it; removed by _head
    terms[_PLAIN] = terms["output"]
    terms["output"] = np.fmin(terms["output"], nearest)
    # p = e/Σe on every row (the direct evaluation) is the exact softmax of these logits
    # evaluated as _head evaluates it: its products with v and |v| are the head's
    direct = (o, pv_abs) if _direct_rows(delta, live).all() else None
    if along is not None and lam is None:
        # (online: the logits' bracket only)
        rounding = np.zeros_like(prob) if online else prob + operand_p
        terms[_ALONG] = _along(along, v, v_abs, logits, rounding, logits_v)
    if whole is not None:
        terms[_WHOLE] = whole[1]
        if np.any(rescued):
            terms["softmax"] = np.where(rescued, np.inf, terms["softmax"])
    if project is not None:
        # A.2 (c'): Σ_j (p̃_j - p_j) = 0, so the logits' part of the output, through the
        # projection, is Σ_j (p̃_j - p_j)(v_j·ŵ_m - c_m), each output entry's rounding
        # (1 + δ_l) apart: at most L B + (κ - 1) Σ_l (L|v|)_l |ŵ_lm|
        b_proj, w_abs = project
        with np.errstate(over="ignore", invalid="ignore"):
            terms[_PROJECTED] = logits @ b_proj + (scale_out - 1) * (logits_v @ w_abs)
    return terms, p, np.where(vacuous, np.inf, t_safe), direct


def _along(
    along: tuple[np.ndarray, np.ndarray],
    v: np.ndarray,
    v_abs: np.ndarray,
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
        tiny = 4 * (v.shape[-2] + 1) * (v.shape[-1] + 1) * _TINY
        return coupled * (1 + ev) - linear * (1 - ev) + tiny


def _centred(v: np.ndarray, v_extra: np.ndarray) -> np.ndarray:
    """``|v_j - c| + e_j`` (with the float64 subtraction's rounding) for ``c`` the median of
    ``v`` over the keys, per column: a bound on ``|ṽ_j - c|`` for any ``|ṽ_j - v_j| <= e_j``.
    Every ``c`` will do where the weights' deviations sum to zero (step 4); the median makes
    ``Σ_j |v_j - c|`` least, and removes what the values share (a bias of the projection)."""
    with np.errstate(invalid="ignore"):
        finite = np.where(np.isfinite(v), v, 0.0)
        centre = np.median(finite, axis=-2, keepdims=True)
        return np.abs(v - centre) * (1 + 2.0**-51) + v_extra


def _split_pv(
    s: np.ndarray,
    delta: np.ndarray,
    v: np.ndarray,
    v_abs: np.ndarray,
    live: np.ndarray,
    num: Numerics,
    lam: float | None,
    bits_pv: tuple[int, int],
    anchor: float,
    u_div: float,
    ranges: _Ranges,
    fold: np.ndarray | None = None,
    across: list[tuple[np.ndarray, np.ndarray]] | None = None,
    lse_scale: float = 0.0,
    lift_arg: np.ndarray | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Theorem A.6 (papers/attention.md): :func:`_softmax_pv` under split-KV.

    Each split ``σ`` is steps 4-7 on its own keys with its output in ``accum`` (``B_σ``, against
    its exact attention ``o_σ``); its computed log-sum-exp is within ``ε_σ`` of the exact one
    (the logits' ``max δ``, the row sum's ``-log(1 - T)``, the ``log`` and the addition); the
    merge weights ``π̂_σ = softmax(lse)_σ`` of the computed log-sum-exps lie in the box of
    Lemma 4 around the exact weights ``π_σ``, and the merge's own roundings (``exp``, ``log``,
    the sum ``W`` of ``r`` weights, the subtractions, ``Σ α_σ o_σ`` in ``accum``) move each
    ``α̂_σ`` by at most ``A_σ``. Then, with ``Σ π̂ = Σ π = 1``,

        |ô - o| <= Σ π̂⁺ B_σ + Σ (π̂⁺ - π̂⁻)|o_σ - o| + Σ A_σ|ô_σ| + γ_r Σ α̂_σ|ô_σ| + output.

    The per-split terms keep their names (weighted by ``π̂⁺``); ``split_lse`` and
    ``split_merge`` are the second and the next two. Returns the terms, the row's
    probabilities and (unused) zeros for the row sum's error. ``lse_scale`` (the folded exp2)
    is the relative difference between a split's lse factor ``fl(m·ĉ)`` and its exponents'
    scale, charged on the split's largest ``|ŝ|``.
    """
    ev_rel = evaluation_rounding(s.shape[-1])  # float64 sums over the keys
    n = s.shape[-1]
    size = num.kv_split_size(n)
    cuts = [slice(a, min(a + size, n)) for a in range(0, n, size)]
    part = num.replace(output_format=num.accum, kv_splits=None)
    fm, fa, fo = num.format_of("softmax"), num.format_of("accum"), num.format_of("output")
    u_m, eta_m = fm.u, fm.smallest_normal
    eps_e = 2 * num.exp_ulps * u_m  # exp and log within exp_ulps ulps
    with np.errstate(invalid="ignore"):
        top = np.where(live, s, -np.inf).max(axis=-1, keepdims=True)
        p = np.where(live, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    p = p / np.where(p.sum(axis=-1, keepdims=True) > 0, p.sum(axis=-1, keepdims=True), 1.0)
    o = p @ v
    ev = ev_rel * (p @ np.abs(v))
    split_terms, outs, bounds, lse, eps, attended = [], [], [], [], [], []
    for cut in cuts:
        ls = live[:, cut]
        some = ls.any(axis=-1, keepdims=True)
        mine = _Ranges(*ranges.shape)  # this split's flags, kept only for rows it attends
        terms, p_s, t_s, _ = _softmax_pv(
            s[:, cut],
            delta[:, cut],
            v[cut],
            v_abs[cut],
            ls,
            part,
            lam,
            bits_pv,
            anchor,
            u_div,
            mine,
            None if fold is None else fold[:, cut],
            None if across is None else [(b[:, cut], d[:, cut]) for b, d in across],
            lift_arg,
        )
        ranges.merge(mine, some)  # a split a row does not attend is exact (lse -inf, o 0)
        terms.pop(_PLAIN)
        terms.pop(_WHOLE, None)
        terms = {name: np.where(some, x, 0.0) for name, x in terms.items()}
        split_terms.append(terms)
        bounds.append(sum(terms.values()))
        p_s = np.where(ls, p_s, 0.0)
        outs.append((p_s @ v[cut], ev_rel * (p_s @ np.abs(v[cut]))))
        # the split's exact log-sum-exp (float64 logits) and the computed one's distance ε_σ
        with np.errstate(invalid="ignore", divide="ignore"):
            m_s = np.where(ls, s[:, cut], -np.inf).max(axis=-1, keepdims=True)
            m0 = np.where(np.isfinite(m_s), m_s, 0.0)
            lse_s = m0 + np.log(np.where(ls, np.exp(s[:, cut] - m0), 0.0).sum(-1, keepdims=True))
            tau = -np.log1p(-np.minimum(t_s, 1.0))
        d_s = np.where(ls, delta[:, cut], 0.0).max(axis=-1, keepdims=True)
        keys = np.maximum(ls.sum(axis=-1, keepdims=True), 1)
        lse_abs = np.where(some, np.abs(lse_s), 0.0)
        log_l = lse_abs + d_s + tau if num.softmax_kind == "naive" else np.log(keys) + tau
        err_log = eps_e * log_l + eta_m
        mag = lse_abs + d_s + tau + err_log  # >= |m̂ + fl(log ℓ̂)|
        # the float64 lse: n + 2 relative roundings of the sum of exps, then log and add
        eval64 = (keys + 4) * 2.0**-52 + 2.0**-51 * (lse_abs + np.log(keys) + 1)
        shift = 0.0
        if lse_scale:
            top_s = np.where(ls, np.abs(s[:, cut]) + delta[:, cut], 0.0).max(axis=-1, keepdims=True)
            shift = lse_scale * top_s + eta_m
            mag = mag + shift
        eps.append(np.where(some, d_s + tau + err_log + u_m * mag + eta_m + eval64 + shift, 0.0))
        lse.append(np.where(some, lse_s, -np.inf))
        attended.append(some)
        ranges.check(np.where(some, mag * (1 + u_m) + eta_m, 0.0), fm, "split-KV: a split's lse")
    big_l, big_e, on = (np.concatenate(x, axis=-1) for x in (lse, eps, attended))
    r = on.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        m_l = np.where(on, big_l, -np.inf).max(axis=-1, keepdims=True)
        sc = np.where(on, big_l - np.where(np.isfinite(m_l), m_l, 0.0), -np.inf)
    _, pi_hi, pi_lo, _ = _extremes(sc, big_e, on)
    e_max = np.where(on, big_e, 0.0).max(axis=-1, keepdims=True)
    # The merge: W = Σ fl(exp(fl(lse_σ - M))) is within τ_W of Σ e^{lse_σ - M} >= 1
    gap = np.where(on, np.abs(sc) + big_e + e_max, 0.0)  # >= |lse_σ - M|
    grow = np.where(on, _times_expm1(pi_hi, math.log1p(eps_e) + u_m * gap + eta_m), 0.0)
    tau1 = grow.sum(axis=-1, keepdims=True) + r * eta_m
    tau_w = compound(gamma(max(len(cuts) - 1, 0), u_m), tau1)
    ranges.flag(tau_w >= 1, "split-KV: the merge's sum of weights may be off by 100%", "vacuous")
    tau_w = np.minimum(tau_w, 0.5)
    log_w = np.log(np.maximum(r, 1)) + np.log1p(tau_w)  # >= log Ŵ >= 0
    m_abs = np.abs(np.where(np.isfinite(m_l), m_l, 0.0)) + e_max
    big_k = (
        -np.log1p(-tau_w)
        + eps_e * log_w
        + eta_m
        + u_m * (m_abs + log_w * (1 + eps_e) + eta_m)
        + eta_m
    )  # >= |Λ̂ - log Σ e^{lse_σ}|
    with np.errstate(invalid="ignore"):
        lse_all = np.where(np.isfinite(m_l), m_l, 0.0) + np.log(
            np.where(on, np.exp(sc), 0.0).sum(axis=-1, keepdims=True)
        )
        b = np.where(on, np.abs(big_l - lse_all) + big_e + e_max + big_k, 0.0)
    moved = np.where(
        on, _times_expm1(pi_hi, math.log1p(eps_e) + big_k + u_m * b + eta_m) + eta_m, 0.0
    )  # >= |α̂_σ - π̂_σ|
    # Assemble
    names = split_terms[0].keys()
    terms = {
        name: sum(pi_hi[:, [i]] * t[name] for i, t in enumerate(split_terms)) for name in names
    }
    spread = np.zeros_like(o)
    weights = np.zeros_like(o)
    merge_w = np.zeros_like(o)
    for i, ((o_s, ev_s), b_s) in enumerate(zip(outs, bounds, strict=True)):
        o_hat = np.abs(o_s) + ev_s + b_s  # >= |ô_σ|
        spread = spread + (pi_hi[:, [i]] - pi_lo[:, [i]]) * (np.abs(o_s - o) + ev_s + ev)
        merge_w = merge_w + moved[:, [i]] * o_hat
        weights = weights + (pi_hi[:, [i]] + moved[:, [i]]) * o_hat
    terms["split_lse"] = spread
    # r products and r - 1 additions in F_a, and α̂ read into F_a (a rounding where F_m is wider)
    terms["split_merge"] = (
        merge_w + gamma(len(cuts) + 1, fa.u) * weights + 2 * r * fa.smallest_normal
    )
    inside = fo.precision >= fa.precision and fo.emin <= fa.emin and fo.emax >= fa.emax
    upper = np.abs(o) + ev + sum(terms.values())
    ranges.check(upper, fa, "split-KV: the merged output accumulated", entries=True)
    if not inside:
        terms["output"] = terms["output"] + fo.u * upper + fo.smallest_normal
    terms[_PLAIN] = terms["output"]
    return terms, p, np.zeros_like(r, dtype=np.float64)


def _dot_increments(
    q_op: np.ndarray,
    k_op: np.ndarray,
    t: np.ndarray,
    operands: np.ndarray,
    qk_op: np.ndarray,
    g_det: float,
    twice: int,
) -> np.ndarray:
    """``(Σ_k T̄_k²)^½`` over one QKᵀ dot's roundings ``fl(T_k) = T_k(1 + δ_k)``, any order.

    A product's ``|T| <= (1 + u)|q̂_t k̂_t|``; a sum's value is the exact sum of a subset of
    the products, which lies in ``[-N, P]`` (``P``, ``N`` the sums of the positive and of the
    negative products, ``max(P, N) = (Σ|q̂_t k̂_t| + |q̂·k̂|)/2``), plus its operands' errors,
    at most ``g·Σ|q̂||k̂|``, times ``(1 + u)`` for a second rounding (papers/attention.md,
    A.3'); ``|q̂·k̂| <= |t| + operands`` and float64's error of ``t``. Each is also at most the
    cruder ``(1 + g)Σ|q̂||k̂|``, and the smaller is taken. ``1 + u <= 1 + g``.
    """
    d_k = q_op.shape[-1]
    exact = np.abs(t) + operands + F64_DOT * (d_k + 2) * qk_op
    subset = 0.5 * (qk_op + exact)
    sums = math.sqrt(d_k - 1) * (1 + g_det) * np.minimum(qk_op, subset + g_det * qk_op)
    # (Σ_t q_t² k_t²)^½ with the rows scaled to at most 1 first, and the root-sum-square as a
    # hypot, so that no square overflows where the values themselves do not
    rows_q = q_op.max(axis=-1, keepdims=True, initial=0.0)
    rows_k = k_op.max(axis=-1, keepdims=True, initial=0.0)
    rows_q, rows_k = np.where(rows_q > 0, rows_q, 1.0), np.where(rows_k > 0, rows_k, 1.0)
    unit_q, unit_k = q_op / rows_q, k_op / rows_k
    products = np.sqrt((unit_q * unit_q) @ (unit_k * unit_k).T) * rows_q * rows_k.T
    return math.sqrt(twice) * np.hypot((1 + g_det) * products, sums)


def _logits_across_keys(
    p: np.ndarray,
    delta: np.ndarray,
    v: np.ndarray,
    v_abs: np.ndarray,
    live: np.ndarray,
    per_key: np.ndarray,
    across: tuple[np.ndarray, np.ndarray],
    lam: float,
) -> np.ndarray:
    """Theorem A.3' (papers/attention.md): the logits term with the dots' errors summed across keys.

    ``Σ_j (p̃_j - p_j) v_j = (1/Z) Σ_j p_j (ε_j + r_j)(v_j - o)`` with ``Z >= e^{-max δ}`` and
    ``|r_j| <= e^{δ_j} - 1 - δ_j``. The dots' part of ``ε_j`` is ``Σ_k δ_k T_k`` over their
    roundings, a martingale whose increments ``p_j (v_j - o) δ_k T_k`` are bounded by
    ``p_j |v_j - o| b_j``: by Azuma-Hoeffding ``|Σ| <= λ (Σ_j (p_j (v_j - o) b_j)²)^½`` but with
    probability ``2 exp(-λ²/2)`` per output. The rest of ``ε_j`` is at most ``δ'_j``, and
    ``Σ_j (p̃_j - p_j)(v̂_j - v_j)`` at most the per-key deviations times ``v_abs - |v|``.
    """
    ev_rel = evaluation_rounding(p.shape[-1])  # float64 sums over the keys
    b, rest = across
    pl = np.where(live, np.nan_to_num(p), 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        o = pl @ v
        w = (pl * b) ** 2
        w_v2, w_v, w_0 = w @ (v * v), w @ v, w.sum(axis=-1, keepdims=True)
        var = w_v2 - 2 * o * w_v + o * o * w_0  # Σ_j (p_j b_j)² (v_j - o)², cancellation below
        slack = 2.0**-49 * (w_v2 + 2 * np.abs(o) * (w @ np.abs(v)) + o * o * w_0)
        martingale = lam * np.sqrt(np.maximum(var + slack, 0.0))
        d = np.where(live, delta, 0.0)
        second = np.expm1(d) - d  # |e^ε - 1 - ε| for |ε| <= δ
        spread = np.abs(v)
        det = (pl * rest) @ spread + np.abs(o) * (pl * rest).sum(axis=-1, keepdims=True)
        det = det + (pl * second) @ spread + np.abs(o) * (pl * second).sum(axis=-1, keepdims=True)
        z_inv = np.exp(d.max(axis=-1, keepdims=True))
        used = per_key @ (v_abs - np.abs(v))
        return (z_inv * (martingale + det) + used) * (1 + ev_rel)


def _log_sum_excluding(a: np.ndarray) -> np.ndarray:
    """``log Σ_{l≠j} e^{a_l}`` over the last axis, for every ``j`` (``-inf`` for a lone key).

    ``log Σ - log(1 - share_j)`` loses no accuracy while ``share_j <= 1/2``; at most one key
    per row has a larger share, and its sum is taken directly over the other keys.
    """
    total = _logsumexp(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(np.isfinite(a), np.exp(a - total), 0.0)
        rest = total + np.log1p(-np.minimum(share, 0.5))
        dominant = share > 0.5
        if dominant.any():
            others = _logsumexp(np.where(dominant, -np.inf, a))
            rest = np.where(dominant, others, rest)
    return rest


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """``log Σ_j e^{x_j}`` over the last axis (keepdims), ``-inf`` for an all ``-inf`` row."""
    top = x.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(x - safe).sum(axis=-1, keepdims=True))


def _given_error(
    q_abs: np.ndarray,
    k_abs: np.ndarray,
    v: np.ndarray,
    p: np.ndarray,
    pv_abs: np.ndarray,
    keep: np.ndarray,
    scale: float,
    given: tuple[Any, Any, Any],
) -> np.ndarray:
    """``|p v - p* v*|`` for inputs off the exact ones by ``given`` (Theorem S.4 for ``p``);
    ``pv_abs = p |v|``.

    The logits move by at most ``|c|(g_q|k| + |q|g_k + g_q g_k)`` (each term non-negative);
    its largest entry in a row is at most ``|c| Σ_d (g_q (K + G) + |q| G)_d`` with ``K_d`` and
    ``G_d`` the largest ``|k_jd|`` and ``(g_k)_jd`` over every key (the same for every chunk of
    rows): ``O(L d)`` instead of an ``L × L × d`` product.
    """
    g_q, g_k, g_v = given
    g_k = np.broadcast_to(np.asarray(g_k, np.float64), k_abs.shape)
    k_top, g_top = k_abs.max(axis=0, initial=0.0), g_k.max(axis=0, initial=0.0)
    moved = (np.asarray(g_q) * (k_top + g_top) + q_abs * g_top).sum(axis=-1, keepdims=True)
    big = np.where(keep.any(axis=-1, keepdims=True), abs(scale) * moved, 0.0)
    return np.expm1(2 * big) * pv_abs + np.exp(2 * big) * (p @ (g_v * np.ones_like(v)))


@one_blas_thread
def attention_bound(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    bias: Any = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    lam: float | None = None,
    probability: float | None = None,
    sink: Any = None,
    softcap: float | None = None,
    descale: Any = None,
) -> Bound:
    """Theorem A.1: a componentwise bound on ``|attention(q, k, v, mask, numerics) − exact|``.

    The exact value is the attention of the given (float64) inputs with the exact scale
    (``mhanum.reference.attention``). With ``t = q·k``, ``s = scale·t`` and ``p = softmax(s)``:

    .. math::

        |\\hat o - o| \\le \\underbrace{(e^{2\\Delta} - 1)\\,p\\,|V|}_{\\text{logits}}
          + \\underbrace{\\mathrm{dev}_{\\mathrm{softmax}}\\,|V|}_{\\text{softmax}}
          + \\dots + \\underbrace{\\gamma_{n}(u_a)\\,\\hat p\\,|V|}_{PV}
          + \\underbrace{u_o |o| + \\eta_o}_{\\text{output}},

    where ``Δ_i = max_j |ŝ_ij − s_ij|`` is bounded from the dot factor of ``d_k`` terms times
    ``|q|·|k|``, the scale and bias roundings, and the softmax deviation follows Blanchard, Higham
    & Higham (2021) made rigorous, with the online rescalings counted (papers/attention.md gives
    every term and the proof). The logit term is evaluated per key (Lemma 4: ``p̃_j = p_j
    e^{δ_j}/Σ_l p_l e^{δ_l}``), which is at most ``(e^{2Δ}-1)p``, and the softmax sum's error is
    the ``p̃``-weighted mean of the keys' exponential errors.

    A finite masking constant ``M`` (``numerics.mask_value``) makes the computed output that of
    the *leaky problem* (masked logits ``M`` or ``s + M``, step 3'); the term ``mask`` bounds its
    distance ``Σ_{masked j} p^L_j(|v_j| + |o|)`` to the exact masked attention. A fully-masked
    row's target is the leaky problem's value: the mean of ``v`` (``fill``,
    ``reference.attention(..., fully_masked="uniform")``) or the unmasked attention (``add``).

    Assumptions: round-to-nearest with an absolute underflow term ``2^emin`` per rounding (so
    XLA's flush-to-zero is covered); ``exp`` within ``numerics.exp_ulps`` ulps and division within
    ``numerics.div_ulps`` ulps of the softmax format (division: relative
    ``(1 + u)^(2·div_ulps) - 1``); ``n·u < 1``. *No overflow* is not assumed but proved on the
    given values, stage by stage (papers/attention.md, section R): the stored operands, their
    reads into the operand and accumulation formats, ``Q Kᵀ``, the scale, the bias, the read
    into the softmax format, the sums of the softmax and of ``P V`` and the output. Entries that
    a stage which may overflow reaches get an infinite bound (term ``overflow``), as do rows
    whose computed softmax sum may be off by 100% (term ``vacuous``) unless the softmax is safe;
    ``Bound.reasons`` says why, one sentence per cause, and ``str(bound)`` shows it. Large
    logits are not refused: the float64 evaluation's own error is part of the bound (step 0).
    With the safe softmax, step W bounds the output whatever the logit errors: ``|ô - o| <=
    |ô| + |o|``, ``|ô|`` from the computed weights' sum alone, replaces the terms of an entry
    where it is smaller (term ``magnitudes``, papers/attention.md).

    Args:
        q, k, v: 2-D or batched inputs as for :func:`mhanum.attention` (float64 values; if they
            are not values of ``numerics.input`` their rounding is included).
        mask: optional boolean mask (True = attend), applied as ``numerics`` says (``mask_mode``,
            ``mask_value``), or a :class:`mhanum.masks.Band` (causal, sliding window).
        bias: optional additive float bias broadcastable to ``(..., Lq, Lk)``; ``-inf`` entries
            exclude keys. Its rounding into the score format is included.
        numerics: a :class:`Numerics` or preset name.
        scale: the logit scale; default ``1/sqrt(d_k)``.
        lam: if given, the probabilistic variant: every sum and dot factor ``γ_h`` becomes
            Higham & Mary's ``γ̃_h(λ) = exp(λ√h·u + hu²/(1-u)) - 1`` (Theorem R.6), and
            ``Bound.probability`` is ``1 - N·2exp(-λ²(1-u)²/2)`` for the ``N`` product chains
            (union bound). Exp, division and single roundings stay deterministic. The
            independence of the rounding errors is a model: on inputs whose roundings all go
            one way (sums of equal values just above half an ulp) the error is ``~h·u`` and
            exceeds this bound (papers/attention.md, A.3); use ``lam=None`` for adversarial or
            structured data.
        probability: instead of ``lam``, the probability the bound should state: ``λ`` is
            solved from the union bound over this call's chains (``Bound.lam`` holds it), so
            ``Bound.probability >= probability``. At most one of ``lam`` and ``probability``.
        sink: optional attention-sink logits, one per batch element or head (broadcast
            against the batch dimensions): ``e^σ`` joins every row's normaliser, as one more
            key with value 0 that no mask excludes (:func:`mhanum.masks.with_sink`); the
            bound is the theorem's for that key, whose score is exactly 0 and bias ``σ``.
        softcap: optional logit soft-cap ``c > 0`` (``c·tanh(s/c)`` before the bias, as in
            :func:`mhanum.attention`): step 3c carries each logit's error through ``tanh``
            (by at most ``sinh(w)/(cosh(s/c)·cosh(||s/c| - w|))`` for an argument off by ``w``:
            errors in scores far beyond the cap are squashed) and charges the division by the
            cap, ``tanh`` (``numerics.tanh_ulps``) and the product by the cap (the logits
            source ``softcap`` of ``Bound.parts``).
        descale: fp8 descaling ``(d_q, d_k, d_v)`` as FlashAttention-3 applies it (see
            :func:`mhanum.attention`): the exact attention is that of ``d_q q``, ``d_k k``,
            ``d_v v``. The bound is Theorem A.1 of the scores' constant ``scale·d_q·d_k`` (charged
            as up to three roundings of its format, however the kernel forms it), with its output
            left in the format the last division or dot leaves it, then times ``d_v`` and
            rounded twice (term ``descale``; papers/attention.md, step 7'').

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has the output's shape, ``inf`` exactly
        where ``Bound.reasons`` says.

    Raises:
        InvalidArgument: outside the theorem's scope (a score format wider than the softmax
            format, a finite bias that overflows it to inf or NaN, a masking constant that
            becomes NaN in the score format), or for shapes, dtypes or values that do not fit.
            A fully-masked row under ``-inf`` and masked logits that may overflow the score or
            softmax format are not refused: the rows they reach are infinite, with the reason.

    References:
        blanchard2021; higham2002 (§3.1); papers/attention.md Theorem A.1.
    """
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, descale=descale
    )
    bound, _ = _attention_bound(problem, resolve(numerics), lam, probability, None)
    return bound


@one_blas_thread
def attention_bound_along(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    mask: Any = None,
    *,
    g_error: Any = None,
    bias: Any = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    sink: Any = None,
    softcap: float | None = None,
) -> tuple[Bound, np.ndarray]:
    """Theorem A.1g: Theorem A.1's bound, and a bound on the output's error along ``g``,
    ``|Σ_c g_ic (ô_ic − o_ic)|`` for every query row ``i``.

    ``g`` is one direction per query row, of the output's shape, for instance the gradient of
    a loss with respect to the attention's output, whose first-order change is then
    ``Σ_c g_ic (ô_ic − o_ic)``; FlashAttention-2's backward reads it as ``D = rowsum(g ∘ ô)``.
    The entrywise bound gives ``Σ_c |g_ic| total_ic``. A.1g keeps two of its brackets coupled
    over the keys instead of over the output's columns: the logits' share
    ``Σ_j (p̃_j − p_j) ṽ_j`` of the output's error, whose weights sum to zero, is at most
    ``Σ_j L_j |g·ṽ_j − c_i|`` along ``g`` (``L`` step 4's per-key deviations, ``c_i`` the row's
    median of ``g·v_j``), and the roundings ``r_j`` of the probabilities into the probability
    and operand formats (safe and naive softmax) at most ``Σ_j |r_j| |g·ṽ_j|``; every other
    term is carried entrywise, as is the output rounding's share of these two. Where the
    ``g·v_j`` cancel (``|g·v_j| ≪ Σ_c |g_c||v_jc|``, as for random directions), this is several
    times below ``Σ_c |g_ic| total_ic``, which it never exceeds beyond that sum's float64 rounding
    (the smaller of the two is returned).

    Assumptions, range checks and reasons are Theorem A.1's (:func:`attention_bound`, which
    this calls with ``lam=None``: the bound is deterministic); a row with an infinite entry
    along a nonzero ``g`` gets ``inf`` (``Bound.reasons`` says why), as does a row whose bound
    along ``g`` exceeds float64's largest finite number. A float64 product or sum that
    underflows is charged ``2^-1074`` each. Split-KV numerics (``kv_splits``) carry the
    entrywise form only.

    Args:
        q, k, v, mask, bias, numerics, scale, sink, softcap: as for :func:`attention_bound`.
        g: the directions, float64, broadcastable to the output's shape ``(..., Lq, d_v)``.
        g_error: optional bound on ``|g − g*|`` for the exact directions ``g*`` (a computed
            gradient, say), broadcastable likewise; default 0.

    Returns:
        ``(bound, along)``: A.1's :class:`~mhanum.bounds.Bound`, and ``along`` of shape
        ``(..., Lq)``, ``>= |Σ_c g*_ic (ô_ic − o_ic)|``.

    Example:
        >>> import numpy as np
        >>> from mhanum.bounds import attention_bound_along
        >>> rng = np.random.default_rng(0)
        >>> q, k, v, g = (rng.standard_normal((16, 8)) for _ in range(4))
        >>> b, along = attention_bound_along(q, k, v, g, numerics="bf16-fp32acc")
        >>> along.shape, bool((along <= (np.abs(g) * b.total).sum(-1)).all())
        ((16,), True)

    References:
        papers/attention.md Theorem A.1g.
    """
    problem = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap
    )
    bound, along = _attention_bound(problem, resolve(numerics), None, None, (g, g_error))
    assert along is not None
    return bound, along


def _attention_bound(
    p: AttentionProblem,
    num: Numerics,
    lam: float | None,
    probability: float | None,
    direction: tuple[Any, Any] | None,
) -> tuple[Bound, np.ndarray | None]:
    """:func:`attention_bound` of the problem ``p``; with ``direction = (g, g_error)``, also
    A.1g's per-row bound (:func:`attention_bound_along`)."""
    _check_scope(num)
    num.check_problem(p)
    q, k, v = (np.asarray(x, np.float64) for x in (p.q, p.k, p.v))
    cap, factors, mask, bias, batch = p.softcap, p.descale, p.mask, p.bias, p.batch
    num_y = num if factors is None else num.replace(output_format=num.descale_format.name)
    if p.sink is not None:
        b64 = None if bias is None else np.asarray(bias, np.float64)
        k, v, mask, bias = masks.with_sink(q, k, v, mask, b64, p.sink)
        batch = k.shape[:-2]
    rows, keys = q.shape[-2], k.shape[-2]
    keep, masked, b, replaced = _keep_and_bias(mask, bias, (*batch, rows, keys), num)
    dead = _dead_rows(keep, masked)
    keep = keep | dead  # evaluated as unmasked, then infinite with the reason
    c = p.scale_value(num.scale)
    if factors is not None:
        c = c * factors[0] * factors[1]  # the loose constant charges its float64 roundings too
    # every chain's event, and two martingale events per output entry (A.3', A.3'')
    chains = math.prod(batch) * rows * (keys * (q.shape[-1] + 1 + v.shape[-1]) + 2 * v.shape[-1])
    chains *= _split_count(num, keys)
    lam = lam_or_probability(lam, probability, chains, num)
    qb, kb, vb = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    out_shape = (*batch, rows, v.shape[-1])
    gb = gu = None
    if direction is not None:
        gb, gu = _directions(direction, out_shape)
    fmt_in = num.format_of("input")
    errors = tuple(rounding_error(x, fmt_in) for x in (qb, kb, vb))
    with _quiet():  # overflow in the float64 evaluation is caught by the range checks
        heads = [
            _head_rows(
                qb[i],
                kb[i],
                vb[i],
                keep[i],
                None if b is None else b[i],
                num_y,
                c,
                p.scale is None and factors is None,
                (errors[0][i], errors[1][i], errors[2][i]),
                given=None if factors is None else _constant_given(qb[i], kb[i], vb[i], p.scale),
                lam=lam,
                masked=None if masked is None else masked[i],
                replaced=None if replaced is None else replaced[i],
                softcap=cap,
                loose_constant=factors is not None,
                along=None if gb is None or gu is None or factors else (gb[i], gu[i]),
            )
            for i in np.ndindex(*batch)
        ]
    coupled = [h[3].pop(_ALONG, None) for h in heads]
    if factors is not None:
        heads = [_descaled(h, factors[2], num, num_y) for h in heads]
    terms = _stack([{**h[0], **h[4].terms()} for h in heads], out_shape)
    stacked = _stack([h[3] for h in heads], out_shape)
    plain = stacked.pop(_PLAIN)
    parts = {
        "logits": stacked,
        "output": {"rounding": plain, "to_nearest": terms["output"] - plain},
    }
    reasons = _reasons(h[4] for h in heads)
    if dead.any():
        terms["fully_masked"] = np.broadcast_to(np.where(dead, np.inf, 0.0), out_shape)
        reasons = (*reasons, _DEAD)
    total = sum(terms.values())
    theorem = "A.1" if num.kv_splits is None else "A.6"
    bound = _result(total, terms, theorem, num, lam, chains, parts, reasons)
    if gu is None:
        return bound, None
    present = [c for c in coupled if c is not None]
    adjust = None
    if len(present) == len(coupled):
        adjust = np.stack(present).reshape((*out_shape[:-1], 1))
    with _quiet():
        return bound, _along_rows(gu, bound.total, adjust)


def _along_rows(g_up: np.ndarray, total: np.ndarray, adjust: np.ndarray | None) -> np.ndarray:
    """Theorem A.1g per row: ``Σ_c ḡ_c total_c`` rounded up, less the coupled brackets' gain
    ``adjust`` (``_ALONG``, ``(..., Lq, 1)``) where that is smaller (the first where NaN)."""
    ev = evaluation_rounding(total.shape[-1])
    # a product or sum that underflows float64 loses up to 2^-1075 (relative errors: ev)
    plain = (g_up * total).sum(axis=-1) * (1 + ev) + (2 * total.shape[-1] + 2) * _TINY
    if adjust is None:
        return plain
    return np.fmin(plain, plain * (1 + ev) + adjust[..., 0])


def _directions(direction: tuple[Any, Any], shape: tuple[int, ...]) -> tuple[Any, Any]:
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


def _constant_given(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: Any) -> tuple[Any, ...]:
    """The float64 product ``scale·d_q·d_k`` is off the exact one by two roundings (four with
    the irrational default scale): an error of the exact logits, carried as one of q's."""
    rel = (6 if scale is None else 3) * 2.0**-53
    return rel * np.abs(q), np.zeros_like(k), np.zeros_like(v)


def _descaled(head: Any, d_v: float, num: Numerics, num_y: Numerics) -> Any:
    """Step 7'' (papers/attention.md): one head's A.1 (output ``y`` left in ``num_y``'s output
    format, ``|y - o| <= A``) carried through ``z = fl_y(y·d_v)`` and ``fl_o(z)``:
    ``|fl_o(z) - d_v o| <= (1 + u_o)((1 + u_y)|d_v|A + u_y|d_v o| + η_y) + u_o|d_v o| + η_o``."""
    terms, o, o_error, parts, ranges = head
    f_y, f_o = num_y.format_of("output"), num.format_of("output")
    u_y, u_o = f_y.u, f_o.u
    grow = (1 + u_o) * (1 + u_y) * abs(d_v)
    scaled = {name: grow * x for name, x in terms.items()}
    d_o = abs(d_v) * (np.abs(o) + o_error)
    scaled["descale"] = (
        (1 + u_o) * (u_y * d_o + f_y.smallest_normal) + u_o * d_o + f_o.smallest_normal
    )
    upper = d_o + abs(d_v) * sum(terms.values()) * (1 + u_y)
    ranges.check(upper, f_y, f"the output times d_v = {d_v:.4g}", entries=True)
    ranges.check(upper * (1 + u_y), f_o, "the descaled output", entries=True)
    parts = {name: grow * x for name, x in parts.items()}
    return scaled, d_v * o, abs(d_v) * o_error, parts, ranges


def _split_count(num: Numerics, keys: int) -> int:
    """The splits of split-KV over ``keys`` keys (1 unsplit): each repeats the chains' events."""
    return -(-keys // num.kv_split_size(keys))


def _quiet() -> Any:
    """Floating-point warnings off: the range checks catch what overflows in float64."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore")


_NAN = "the float64 evaluation of the bound overflowed (NaN): nothing is proved for these entries"


def _reasons(per_head: Any) -> tuple[str, ...]:
    """The heads' reasons for infinite entries, each once, in order of appearance."""
    return tuple(dict.fromkeys(r for ranges in per_head for r in ranges.reasons))


def _stack(per_head: list[dict[str, np.ndarray]], shape: tuple[int, ...]) -> dict[str, Any]:
    """Per-head dicts of ``(rows, d)`` arrays to one dict of ``shape`` arrays (0 where absent)."""
    names = sorted({name for head in per_head for name in head})
    zeros = np.zeros(shape[-2:])
    return {n: np.stack([h.get(n, zeros) for h in per_head]).reshape(shape) for n in names}


def _result(
    total: Any,
    terms: dict[str, Any],
    theorem: str,
    num: Numerics,
    lam: float | None,
    chains: int,
    parts: dict[str, dict[str, Any]] | None = None,
    reasons: tuple[str, ...] = (),
) -> Bound:
    """The :class:`Bound`; with ``lam``, the probability of the union of the ``chains`` events.

    A NaN that the float64 evaluation produced (inf - inf, 0·inf where a range check already
    made an entry infinite, or an overflow no check caught) is an infinite bound: nothing is
    proved there, and an entry no other reason covers gets its own.
    """
    parts = parts or {}
    total = np.asarray(total, np.float64)
    nan = np.isnan(total)
    if nan.any():
        covered = np.zeros_like(nan)
        for t in terms.values():
            covered |= np.broadcast_to(np.isinf(t), nan.shape)
        terms = {n: np.where(np.isnan(t), np.inf, t) for n, t in terms.items()}
        if (nan & ~covered).any():
            terms["vacuous"] = np.where(nan & ~covered, np.inf, terms.get("vacuous", 0.0))
            reasons = (*reasons, _NAN)
        total = np.where(nan, np.inf, total)
    if lam is None:
        return Bound(
            total, terms, theorem, ASSUMPTIONS, "blanchard2021", parts=parts, reasons=reasons
        )
    assumptions = (*ASSUMPTIONS, PROBABILISTIC)
    probability = max(0.0, 1.0 - union_failure(lam, chains, num))
    return Bound(total, terms, theorem, assumptions, "higham2019", probability, parts, reasons, lam)


def _keep_and_bias(
    mask: Any, bias: Any, target: tuple[int, ...], num: Numerics
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The attended keys (mask True, bias not ``-inf``), the masked keys when the masking
    constant is finite (else ``None``), the bias (``-inf`` entries kept), and the logits the
    mask replaces by a constant (``fill`` mode; else ``None``), whose scores are never used.

    The mask and the bias are those of a checked problem (:mod:`mhanum.problem`).

    Raises:
        InvalidArgument: for a bias that overflows the score format, or a row that attends no
            key while the masking constant is finite and the bias excludes every key.
    """
    keep = np.ones(target, bool)
    masked = replaced = None
    if mask is not None:
        m = masks.dense(mask, target)
        keep = keep & m
        if num.mask_mode == "fill":
            replaced = ~np.broadcast_to(m, target)
        if num.mask_constant() != -math.inf:
            masked = ~np.broadcast_to(m, target)
    b = None
    if bias is not None:
        b = np.broadcast_to(np.asarray(bias, np.float64), target)
        keep = keep & ~np.isneginf(b)
        _check_bias_fits(b, ~np.isneginf(b), num.format_of("score"))
    if masked is not None:
        live = (
            keep | masked
            if num.mask_mode == "fill"
            else keep | (masked & ~np.isneginf(b if b is not None else 0.0))
        )
        if not live.any(axis=-1).all():
            msg = (
                "bias: expected at least one key per row whose logit is finite, got a row with none"
            )
            raise InvalidArgument(msg)
    return keep, masked, b, replaced


def _dead_rows(keep: np.ndarray, masked: np.ndarray | None) -> np.ndarray:
    """Rows that attend no key while masked logits are ``-inf`` (keepdims): their output is the
    path's fully-masked convention (NaN in ``mhanum.attention``), not a rounding of the exact
    attention, which is undefined there."""
    if masked is not None:
        return np.zeros((*keep.shape[:-1], 1), bool)
    return np.asarray(~keep.any(axis=-1, keepdims=True))


_DEAD = (
    "fully-masked rows: a row that attends no key under -inf masking has no exact attention "
    "(its output is the path's convention: NaN in mhanum.attention, 0 in some kernels)"
)


def _check_bias_fits(b: np.ndarray, keep: np.ndarray, fmt: Format) -> None:
    """A finite bias that overflows the score format is a masking constant: outside A.1."""
    overflow = keep & ~np.isfinite(round_to(np.where(keep, b, 0.0), fmt))
    if overflow.any():
        index = tuple(int(i) for i in np.argwhere(overflow)[0])
        msg = (
            f"bias: expected values finite in the score format {fmt.name}, got {b[index]} at "
            f"index {index}, which overflows to inf or NaN (see mhanum.bounds.analyze_mask)"
        )
        raise InvalidArgument(msg)


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """``(..., L, H·d)`` to ``(..., H, L, d)``."""
    return np.swapaxes(x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads), -2, -3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """``(..., H, L, d)`` to ``(..., L, H·d)``."""
    x = np.swapaxes(x, -2, -3)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


@one_blas_thread
def head_output_bound(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keep: np.ndarray,
    bias: np.ndarray | None,
    num: Numerics,
    scale: float,
    default_scale: bool,
    errors: tuple[np.ndarray, np.ndarray, np.ndarray],
    given: tuple[np.ndarray, np.ndarray, np.ndarray],
    softcap: float | None = None,
    along: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...], np.ndarray | None]:
    """Theorem A.1 for heads whose operands are themselves computed (A.2, step (b)).

    ``q, k, v`` ``(..., L, d)`` (any batch of heads) stand in for the exact operands within
    ``given``; the computed ones the kernel reads are within ``errors`` of the exact ones;
    ``keep`` ``(..., Lq, Lk)`` marks the attended keys (every row attends one), ``bias`` is
    finite where ``keep``; ``softcap`` as for :func:`attention_bound`; ``along = (g, ḡ)``
    (``(..., Lq, d_v)``), Theorem A.1g's directions (:func:`attention_bound_along`). Returns
    ``(err, o, o_given, reasons, along)``: ``|Ô - O*| <= err`` (``inf`` where a stage may
    overflow, with the reasons), the float64 output ``o``, ``|o - O*| <= o_given`` and
    ``(..., Lq)`` bounds on ``|Σ_c g*_c (Ô_c - O*_c)|`` (``None`` without ``along``).
    """
    batch = keep.shape[:-2]
    rows = q.shape[-2]
    err = np.zeros((*batch, rows, v.shape[-1]))
    out, out_given = np.zeros_like(err), np.zeros_like(err)
    rows_along = None if along is None else np.zeros((*batch, rows))
    reasons: list[Any] = []
    for i in np.ndindex(*batch):
        with _quiet():
            terms, o, o_given, parts, ranges = _head_rows(
                q[i], k[i], v[i], keep[i], None if bias is None else bias[i], num, scale,
                default_scale, (errors[0][i], errors[1][i], errors[2][i]),
                (given[0][i], given[1][i], given[2][i]), softcap=softcap,
                along=None if along is None else (along[0][i], along[1][i]),
            )  # fmt: skip
            total = np.sum(list(terms.values()), axis=0)
            for name in ("overflow", "vacuous"):
                hit = ranges.where.get(name)
                if hit is not None:
                    total = np.where(hit, np.inf, total)
            total = np.where(np.isnan(total), np.inf, total)
            if along is not None and rows_along is not None:
                rows_along[i] = _along_rows(along[1][i], total, parts.get(_ALONG))
        err[i], out[i], out_given[i] = total, o, o_given
        reasons.append(ranges)
    return err, out, out_given, tuple(dict.fromkeys(_reasons(reasons))), rows_along


_INPUT_ROUNDING = ("auto", "exact", "bounded")
_EXACT_LOGITS = 2**20  # "auto": the reference's cost, logits per call


def _rounded_inputs(
    x_q: Any, x_kv: Any, params: MHAParams, num: Numerics, how: str, scale: Any, heads: Any
) -> tuple[np.ndarray, np.ndarray, MHAParams] | None:
    """The inputs and weights rounded into ``numerics.input``, where A.2 takes their rounding
    exactly (``input_rounding``); ``None`` where it bounds it instead: nothing rounds, a custom
    scale (the reference's is ``1/sqrt(d_k)``), a rounded value that is not finite, or (auto)
    more than ``2^20`` logits. Checks nothing else: the bound's own checks follow."""
    if scale is not None:
        return None
    fmt = num.format_of("input")
    try:
        xs = [np.asarray(x, np.float64) for x in (x_q, x_kv)]
        if min(x.ndim for x in xs) < 2:
            return None
        weights = {
            f.name: np.asarray(getattr(params, f.name), np.float64)
            for f in dataclasses.fields(params)
            if getattr(params, f.name) is not None
        }
        outer = np.broadcast_shapes(xs[0].shape[:-2], xs[1].shape[:-2])
        logits = math.prod(outer) * xs[0].shape[-2] * xs[1].shape[-2] * int(heads)
    except (TypeError, ValueError):
        return None  # the bound's checks name the argument
    if how == "auto" and logits > _EXACT_LOGITS:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        rx = [round_to(x, fmt).astype(np.float64) for x in xs]
        rw = {n: round_to(a, fmt).astype(np.float64) for n, a in weights.items()}
    values = [*rx, *rw.values()]
    if not all(np.isfinite(a).all() for a in values):
        return None
    originals = [*xs, *weights.values()]
    if all(np.array_equal(a, b) for a, b in zip(values, originals, strict=True)):
        return None
    return rx[0], rx[1], dataclasses.replace(params, **rw)


def _rounding_effect(
    given: tuple[Any, Any, MHAParams],
    rounded: tuple[np.ndarray, np.ndarray, MHAParams],
    heads: int,
    options: dict[str, Any],
) -> np.ndarray:
    """``|y(x̂, ŵ) - y(x, w)|``, bounded above: two certified references, each the exact
    value rounded to float64 (within ``2^-53`` relative, and 0 only where it is exactly),
    their difference and its rounding; 0 on a fully masked row (the bound is inf there)."""
    from mhanum import reference  # the certified exact values (no attention of mhanum's)

    ys = [
        np.asarray(
            reference.multi_head_attention(x, x_kv, p, heads, fully_masked="zero", **options),
            np.float64,
        )
        for x, x_kv, p in (rounded, given)
    ]
    return (np.abs(ys[0] - ys[1]) + 2.0**-52 * (np.abs(ys[0]) + np.abs(ys[1]))) * (1 + 2.0**-50)


def _projected_values(v: np.ndarray, given: Any, wo: np.ndarray, num: Numerics) -> np.ndarray:
    """A.2 (c'): ``B_jm >= |v*_j·ŵ_op,m - c_m|`` for one head's values ``v`` (float64, off the
    exact ones by at most ``given``) and its rows ``wo`` of the output projection's weights as
    rounded to the input format, read through the operand format (``ŵ_op``), with
    ``c_m`` the median over the keys of ``v_j·ŵ_m`` (any constant will do: the deviations of the
    probabilities sum to zero)."""
    u_op, eta_op = operand_error(num)
    vw = v @ wo
    centre = np.median(vw, axis=0, keepdims=True)
    v_abs, w_abs = np.abs(v), np.abs(wo)
    # the float64 product's rounding, the values' own error and the operand rounding of ŵ
    spread = evaluation_rounding(v.shape[-1]) * v_abs + np.broadcast_to(given, v.shape)
    extra = spread @ ((1 + u_op) * w_abs + eta_op)
    if u_op or eta_op:
        extra = extra + v_abs @ (u_op * w_abs + eta_op)
    return np.abs(vw - centre) * (1 + 2.0**-51) + extra


def _logits_through_projection(
    term: np.ndarray, linear: np.ndarray, projected: np.ndarray, ev: float
) -> np.ndarray:
    """A.2 (c'): the logits term ``κ (t L|v|) |ŵ|`` of step (c), with its linear part
    ``Σ_l t_l|ŵ_lm|`` (``linear``) replaced where the heads' ``Λ`` (``projected``, step (c'))
    is smaller: ``term - (linear - Λ)``, the factor ``κ >= 1`` kept on the rest. ``ev`` is the
    float64 evaluation's relative rounding of both."""
    with np.errstate(invalid="ignore", over="ignore"):
        gain = np.where(
            np.isfinite(linear) & np.isfinite(projected),
            np.fmax(linear * (1 - ev) - projected * (1 + ev), 0.0),
            0.0,
        )
        return np.where(gain > 0, (term - gain) * (1 + 2.0**-51), term)


@one_blas_thread
def mha_bound(
    x_q: Any,
    x_kv: Any,
    params: MHAParams,
    num_heads: int,
    *,
    mask: Any = None,
    bias: Any = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    lam: float | None = None,
    probability: float | None = None,
    num_kv_heads: int | None = None,
    sink: Any = None,
    softcap: float | None = None,
    input_rounding: str = "auto",
) -> Bound:
    """Theorem A.2: a componentwise bound on ``|multi_head_attention(...) − exact|``.

    The exact value is ``mhanum.reference.multi_head_attention`` of the given (float64) inputs and
    weights. The bound composes three steps (papers/attention.md, Theorem A.2):

    (a) each projection ``y = x w + b``, computed as ``fl_st(fl_a(fl_a(x̂ ŵ) + b̂))`` with the
    inputs and weights rounded to ``numerics.input`` and the dot in ``numerics.summation``:

    .. math::

        |\\hat y - y| \\le u_{st}|y| + (1 + u_{st})\big[(1 + u_a)\big(E_{xw} + |\\hat b - b|\big)
          + u_a|y| + \\eta_a\big] + \\eta_{st},\\quad
        E_{xw} \\le e_x|w| + |x|e_w + e_x e_w + G_d(u_a)(|x| + e_x)(|w| + e_w) + 2d\\eta_a;

    (b) Theorem A.1 for every head, with its operands off the exact projections by the bounds of
    (a) (A.1, step 1) and a term ``evaluation`` for the float64 stand-ins of the exact ones;

    (c) the output projection as in (a), with the per-head outputs off by the totals of (b);
    (c') the logits term of (b) through the weights: the probabilities' deviations sum to zero,
    so their part of the output is ``Σ_j (p̃_j - p_j)(v_j ŵ_o - c)``, at most
    ``Σ_j L_j|v_j ŵ_o - c|`` (``L`` step 4's deviations) where that is smaller than (c)'s.

    With ``input_rounding="exact"`` the rounding of the inputs and weights into
    ``numerics.input`` is not bounded but computed: the bound is A.2 for the rounded inputs
    and weights (what the computation reads, exactly) plus the term ``input_rounding``,
    ``|y(x̂, ŵ) - y(x, w)|`` of two certified references (each within ``2^-53`` relative).
    That costs two evaluations of :func:`mhanum.reference.multi_head_attention`; the
    default ``"auto"`` takes it where something rounds and there are at most ``2^20``
    logits, ``"bounded"`` never.

    The terms are those of A.1 propagated through the output projection
    (``attention.logits``, ``attention.softmax``, ...) and ``output_projection``, the error of
    (c) with exact per-head outputs. The q/k/v projection errors act through ``attention.logits``
    (q, k) and ``attention.operands`` (v).

    Assumptions: those of Theorem A.1 (round to nearest with an absolute underflow term per
    rounding, ``exp`` and division within ``numerics.exp_ulps``/``div_ulps`` ulps, sums in the
    numerics' order with the factors of Theorem S.0, no overflow, ``n·u < 1``) and its scope
    (as :func:`attention_bound`: masks with ``-inf`` or a finite constant, scale anywhere).

    Args:
        x_q: query input ``(..., Lq, d_q)``.
        x_kv: key/value input ``(..., Lk, d_kv)``.
        params: the weights (float64 values; their rounding into ``numerics.input`` is included).
        num_heads: number of heads.
        num_kv_heads: grouped-query attention, as in :func:`mhanum.multi_head_attention`.
        sink: attention sinks, one per head, as in :func:`mhanum.multi_head_attention`; the
            sink's key and value are exact zeros after the projections.
        softcap: the logit soft-cap of every head, as in :func:`attention_bound` (step 3c).
        mask: optional boolean mask broadcastable to ``(..., H, Lq, Lk)``, True = attend, or a
            :class:`mhanum.masks.Band`.
        bias: optional additive bias broadcastable to ``(..., H, Lq, Lk)``.
        numerics: a :class:`Numerics` or preset name.
        scale: the logit scale; default ``1/sqrt(d_k)``.
        lam: the probabilistic variant, as for :func:`attention_bound` (the projections' chains
            are counted in ``Bound.probability``).
        probability: instead of ``lam``, the probability the bound should state, as for
            :func:`attention_bound`.
        input_rounding: ``"auto"``, ``"exact"`` or ``"bounded"``: how the rounding of the
            inputs and weights into ``numerics.input`` is charged (above). ``"exact"`` needs
            the default scale and falls back to ``"bounded"`` where a rounded value is not
            finite (the range check then says so).

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has the output's shape ``(..., Lq, d_out)``.

    Raises:
        InvalidArgument: outside the theorem's scope (as :func:`attention_bound`) or for inputs
            that do not fit the parameters.

    References:
        higham2002 (§3.1); blanchard2021; papers/attention.md Theorems A.1 and A.2.
    """
    num = resolve(numerics)
    if input_rounding not in _INPUT_ROUNDING:
        msg = f"input_rounding: expected one of {_INPUT_ROUNDING}, got {input_rounding!r}"
        raise InvalidArgument(msg)
    if not isinstance(params, MHAParams):
        msg = f"params: expected an MHAParams, got {type(params).__name__}"
        raise InvalidArgument(msg)
    if input_rounding != "bounded":
        rounded = _rounded_inputs(x_q, x_kv, params, num, input_rounding, scale, num_heads)
        if rounded is not None:
            options = {"mask": mask, "bias": bias, "num_kv_heads": num_kv_heads, "sink": sink}
            options["softcap"] = softcap
            inner = mha_bound(
                *rounded, num_heads, numerics=num, lam=lam, probability=probability,
                input_rounding="bounded", **options,
            )  # fmt: skip
            effect = _rounding_effect((x_q, x_kv, params), rounded, num_heads, options)
            return dataclasses.replace(
                inner,
                total=inner.total + effect,
                terms={**inner.terms, "input_rounding": effect},
            )
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, scale=scale, sink=sink,
        softcap=softcap, num_kv_heads=num_kv_heads,
    )  # fmt: skip
    _check_scope(num)
    num.check_problem(p)
    params, heads, cap, outer = p.params, p.num_heads, p.softcap, p.batch
    xs = {"x_q": np.asarray(p.x_q, np.float64), "x_kv": np.asarray(p.x_kv, np.float64)}
    mask, bias, scores = p.mask, p.bias, p.scores
    rows, keys = scores[-2:]
    if p.sink is not None:
        mask, bias, scores = masks.head_sinks(mask, bias, p.sink, scores)
        outer, keys = tuple(scores[:-3]), keys + 1
    d_v = params.v_width // heads
    chains = math.prod(outer) * (
        heads
        * rows
        * (keys * (params.qk_width // heads + 1 + d_v) + 2 * d_v)
        * _split_count(num, keys)
        + rows * params.qk_width * params.d_q
        + keys * (params.qk_width + params.v_width) * params.d_kv
        + rows * params.d_out * params.v_width
    )
    lam = lam_or_probability(lam, probability, chains, num)
    keep, masked, b, replaced = _keep_and_bias(mask, bias, (*outer, heads, rows, keys), num)
    dead = _dead_rows(keep, masked)
    keep = keep | dead
    w: dict[str, Any] = {
        f.name: None if getattr(params, f.name) is None else np.asarray(getattr(params, f.name))
        for f in dataclasses.fields(params)
    }
    w = {name: None if a is None else a.astype(np.float64) for name, a in w.items()}
    fmt_in, storage = num.format_of("input"), num.storage_format
    proj = {}
    # R.7: rows of the output that an overflow may reach (a query row: that row; a key or
    # value anywhere: every row of the batch element), and why
    bad_rows = np.zeros((*outer, rows, 1), bool)
    reasons: list[str] = []
    for name, x, wn, bn in (
        ("q", "x_q", "wq", "bq"),
        ("k", "x_kv", "wk", "bk"),
        ("v", "x_kv", "wv", "bv"),
    ):
        x64 = np.broadcast_to(xs[x], (*outer, *xs[x].shape[-2:]))
        lin = linear(x64, np.zeros_like(x64), w[wn], w[bn], num, storage, lam)
        e_in = rounding_error(x64, fmt_in)
        used = lin.error(e_in)
        bad_in = np.asarray(~(np.abs(x64) + e_in <= fmt_in.max_finite))
        bad, why = linear_overflow(lin, x64, e_in, w[wn], w[bn], num, storage, f"{name} projection")
        if bad_in.any():
            why = [f"{x}: values may overflow the input format {fmt_in.name}", *why]
            bad = bad | bad_in.any(axis=-1, keepdims=True)
        reasons += why
        hit = np.asarray(np.asarray(bad).any(axis=-1, keepdims=True))
        if name != "q":
            hit = np.broadcast_to(hit.any(axis=-2, keepdims=True), bad_rows.shape)
        bad_rows = bad_rows | hit
        proj[name] = (
            split_heads(lin.y, heads),
            split_heads(used + lin.given, heads),
            split_heads(lin.given, heads),
        )
        if sink is not None and name != "q":  # the sink's key and value: exact zeros
            proj[name] = tuple(masks.zero_key(x) for x in proj[name])
    c = p.scale_value(num.scale)
    d_v = params.v_width // heads
    wo_hat = round_to(w["wo"], fmt_in).astype(np.float64)  # the weights the kernel reads
    u_op, eta_op = operand_error(num)
    wo_slope = (1 + u_op) * np.abs(wo_hat) + eta_op  # >= |ŵ_op|
    results = {}
    for i in np.ndindex(*outer, heads):
        (q, eq, gq), (k, ek, gk), (v, ev, gv) = (proj[n] for n in "qkv")
        cols = slice(i[-1] * d_v, (i[-1] + 1) * d_v)
        with _quiet():
            project = None
            if num.kv_splits is None:
                project = (_projected_values(v[i], gv[i], wo_hat[cols], num), wo_slope[cols])
            results[i] = _head_rows(
                q[i],
                k[i],
                v[i],
                keep[i],
                None if b is None else b[i],
                num,
                c,
                scale is None,
                (eq[i], ek[i], ev[i]),
                (gq[i], gk[i], gv[i]),
                lam,
                None if masked is None else masked[i],
                None if replaced is None else replaced[i],
                cap,
                project=project,
            )
    shape = (*outer, heads, rows, d_v)

    def gather(pick: Any) -> np.ndarray:
        return merge_heads(
            np.stack([pick(results[i]) for i in np.ndindex(*outer, heads)]).reshape(shape)
        )

    names = sorted({name for r in results.values() for name in r[0]})
    head_terms = {n: gather(lambda r, n=n: r[0].get(n, np.zeros_like(r[1]))) for n in names}
    sources = sorted({name for r in results.values() for name in r[3]} - {_PLAIN, _PROJECTED})
    head_parts = {n: gather(lambda r, n=n: r[3].get(n, np.zeros_like(r[1]))) for n in sources}
    o, o_given = gather(lambda r: r[1]), gather(lambda r: r[2])
    out = linear(o, o_given, w["wo"], w["bo"], num, num.format_of("output"), lam)
    head_bad = {
        n: gather(lambda r, n=n: r[4].where.get(n, np.zeros(r[4].shape, bool)))
        for n in ("overflow", "vacuous")
    }
    reasons += _reasons(r[4] for r in results.values())
    o_err = np.sum(list(head_terms.values()), axis=0)
    bad_out, why = linear_overflow(
        out, o, o_err, w["wo"], w["bo"], num, num.format_of("output"), "output projection"
    )
    reasons += why
    terms = {f"attention.{n}": out.kappa * (t @ out.slope) for n, t in head_terms.items()}
    logits = {n: out.kappa * (t @ out.slope) for n, t in head_parts.items()}
    if num.kv_splits is None and "logits" in head_terms:
        kept = _logits_through_projection(
            terms["attention.logits"],
            head_terms["logits"] @ out.slope,
            np.sum([results[i][3][_PROJECTED] for i in np.ndindex(heads)], axis=0)
            if not outer
            else np.stack([results[i][3][_PROJECTED] for i in np.ndindex(*outer, heads)])
            .reshape(*outer, heads, rows, -1)
            .sum(axis=-3),
            evaluation_rounding(max(params.v_width, keys)),
        )
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(terms["attention.logits"] > 0, kept / terms["attention.logits"], 0.0)
        logits = {n: np.where(np.isfinite(share), share * x, x) for n, x in logits.items()}
        terms["attention.logits"] = kept
    terms["output_projection"] = out.fixed
    full = terms["output_projection"].shape
    overflow = (
        np.broadcast_to(bad_rows | head_bad["overflow"].any(axis=-1, keepdims=True), full) | bad_out
    )
    vacuous = np.broadcast_to(head_bad["vacuous"].any(axis=-1, keepdims=True), full)
    dead_rows = np.broadcast_to(dead.any(axis=-3), full)  # any head's row reaches the output row
    if dead_rows.any():
        reasons.append(_DEAD)
    for n, hit in (("overflow", overflow), ("vacuous", vacuous), ("fully_masked", dead_rows)):
        if hit.any():
            terms[n] = np.where(hit, np.inf, 0.0)
    total = sum(terms.values())
    reasons = list(dict.fromkeys(reasons))
    return _result(
        total, terms, "A.2", num, lam, chains, {"attention.logits": logits}, tuple(reasons)
    )
