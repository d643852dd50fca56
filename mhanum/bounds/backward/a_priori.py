"""Theorems B.4 and B.9: a priori bounds on the error of every gradient of attention, from
the sizes and norms of the inputs alone (papers/backward.md)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.a_priori import CappedLogits, attention_bound_a_priori, softcap_a_priori
from mhanum.bounds.backward.scope import (
    ASSUMPTIONS,
    GradientBounds,
    check_scope,
    check_scores_placement,
)
from mhanum.bounds.backward.softcap import slope_a_priori, through_cap
from mhanum.bounds.enclosure import (
    GRADIENTS,
    U64,
    Ranges,
    dot_factor,
    flush_floor,
    log_radius,
    read_error,
    scaled_output,
)
from mhanum.bounds.factors import (
    chain,
    compound,
    division_error,
    evaluation_rounding,
    exp_and_sum_factors,
    operand_bits,
    operand_error,
    tensor_core_anchor,
)
from mhanum.bounds.scale import is_power_of_four, scale_rounding
from mhanum.formats import Format
from mhanum.numerics import Backward, Numerics, resolve, resolve_backward

__all__ = ["attention_grad_bound_a_priori"]


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
    check_scope(num, bw, "B.4")
    check_scores_placement(num, bw, "B.4")
    if bw.dp_format is not None:
        msg = f"backward.dp_format: expected None for Theorem B.4, got {bw.dp_format!r}"
        raise InvalidArgument(msg)
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
        u64 = compound(U64, over=(U64,))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        norms = (float(q_norm), float(k_norm), float(v_max), float(d_out_max))
        st = _Setting((lq, n, d, dv_), norms, scale, c64, u64, cap, num, bw, Ranges())
        return _a_priori(st)


@dataclasses.dataclass(frozen=True)
class _Setting:
    """Theorem B.4's problem: the sizes ``(L_q, n, d_k, d_v)``, the norms ``q_norm``,
    ``k_norm``, ``v_max``, ``d_out_max``, the scale as given and its float64 value ``c64``
    (within ``u64``), the soft-cap; the numerics, the backward and the ranges every step
    records into."""

    sizes: tuple[int, int, int, int]
    norms: tuple[float, float, float, float]
    scale: float | None
    c64: float
    u64: float
    cap: float | None
    num: Numerics
    bw: Backward
    rng: Ranges

    @property
    def flash(self) -> bool:
        """FlashAttention-2 (B.2's propagation), or the textbook backward (B.1's)."""
        return self.bw.algorithm == "flash2"

    def fmt(self, role: str) -> Format:
        """The numerics' format of ``role``."""
        return self.num.format_of(role)


def _entry_err(x: float, num: Numerics) -> float:
    """``>= |x̂_op - x|`` for an entry ``|x| <= x`` rounded to the input and operand formats."""
    fin = num.format_of("input")
    u_op, eta_op = operand_error(num)
    e = fin.u * x + fin.smallest_normal
    return e + u_op * (x + e) + eta_op


def _norm_err(norm: float, width: int, num: Numerics) -> float:
    """The same for the 2-norm of a row of ``width`` entries."""
    fin = num.format_of("input")
    u_op, eta_op = operand_error(num)
    e = fin.u * norm + fin.smallest_normal * math.sqrt(width)
    return e + u_op * (norm + e) + eta_op * math.sqrt(width)


def _logits(st: _Setting) -> tuple[float, float, CappedLogits | None]:
    """B.4's step 2: ``(|s| <= s_up, Δ, the capped logits or None)``, the logits' error by
    Cauchy–Schwarz on every dot of length ``d``; B.9 (a) with a soft-cap; read into the softmax
    format."""
    num, rng = st.num, st.rng
    fin, acc, sc, sm = st.fmt("input"), st.fmt("accum"), st.fmt("score"), st.fmt("softmax")
    d = st.sizes[2]
    qn, kn = st.norms[0], st.norms[1]
    anchor = tensor_core_anchor(num)
    bits_in = operand_bits(num, fin)
    u_i, eta_i = fin.u, fin.smallest_normal
    f, eta, _ = dot_factor(num, d, None, (bits_in, bits_in))
    eq, ek = _norm_err(qn, d, num), _norm_err(kn, d, num)
    t_up = qn * kn
    t_err = eq * (kn + ek) + qn * ek + f * (qn + eq) * (kn + ek) + eta
    if anchor:
        t_err += f * anchor * (math.sqrt(d) * (qn + eq + kn + ek) + d * anchor)
    rng.operands(num, qn * (1 + u_i) + eta_i, kn * (1 + u_i) + eta_i, "q kᵀ", GRADIENTS)
    rng.check((1 + f) * (qn + eq) * (kn + ek) + eta, acc, "q kᵀ accumulated", GRADIENTS)
    rng.check(t_up + t_err, sc, "q kᵀ rounded to the score format", GRADIENTS)
    t_err += float(read_error(np.asarray(t_up + t_err), acc, sc))
    c = abs(st.c64)
    _, u_r, u_mul = scale_rounding(st.c64, sc)
    theta = compound(st.u64, u_r)
    s_up = c * t_up
    delta = c * (1 + theta) * t_err + theta * s_up + u_mul * (1 + theta) * c * (t_up + t_err)
    delta += sc.smallest_normal
    rng.check(s_up + delta, sc, "the logits in the score format", GRADIENTS)
    capped: CappedLogits | None = None
    if st.cap is not None:  # Theorem B.9 (a): |a| <= c·tanh(s_up/c), within Δ_c

        def check(upper: float, fmt: Format, stage: str) -> None:
            rng.check(upper, fmt, stage, GRADIENTS)

        capped = softcap_a_priori(s_up, delta, st.cap, num, check)
        s_up, delta = capped.reach, capped.delta
    delta += float(read_error(np.asarray(s_up + delta), sc, sm))
    return s_up, delta, capped


class _Probabilities(NamedTuple):
    """B.4's step 3: ``|P̂ - P|`` at one entry (``P <= 1``) and along a row (``Σ P = 1``),
    ``>= |P̂|``, B.2's rounding of ``P`` into ``prob_format`` for ``dV``, ``P``'s operand
    bits."""

    eps_p: float
    sum_eps: float
    p_used: float
    pr_extra: float
    bits_p: int


def _probabilities(st: _Setting, s_up: float, delta: float) -> _Probabilities:
    """B.4's step 3: the probabilities (``P <= 1``, ``Σ_j P_ij = 1``) for logits within ``s_up``
    of 0 and ``Δ = delta`` of the computed ones."""
    num, n = st.num, st.sizes[1]
    sm, prob = st.fmt("softmax"), st.fmt("prob")
    u_m, eta_m = sm.u, sm.smallest_normal
    gap = 2 * s_up + 2 * delta
    bits_p, bits_in = operand_bits(num, prob), operand_bits(num, st.fmt("input"))
    xs, _, g_sum, _, _ = exp_and_sum_factors(num, n, gap, None, (bits_p, bits_in))
    x_max = float(np.max(xs))
    eps_e = math.expm1(2 * num.exp_ulps * math.log1p(u_m))
    ell_low = math.exp(-x_max) * (1 - g_sum) - n * eta_m * (1 + g_sum)
    if not st.flash:
        eps_div = division_error(num.div_ulps, u_m)
        u_p = prob.u if prob.precision < sm.precision else 0.0
        own = float(
            2 * log_radius(np.expm1(x_max)) + log_radius(eps_div) + log_radius(g_sum)
            + log_radius(u_p)
        )  # fmt: skip
        absolute = (
            ((n + 1) * eta_m * (1 + g_sum) / ell_low) * (1 + eps_div) * (1 + u_p)
            + eta_m * (1 + u_p)
            + flush_floor(sm, prob)
        )
        if not ell_low > 0:
            absolute = math.inf
            st.rng.reasons.append("the softmax's row sum may underflow: its lower bound is not > 0")
    else:
        r_ell = float(np.expm1(x_max)) * (1 + g_sum) + g_sum + n * eta_m * (1 + g_sum)
        lam_ell = float(log_radius(r_ell))
        log_up = math.log(n) + lam_ell
        err_lse = lam_ell + eps_e * log_up + 2 * eta_m + u_m * (s_up + delta + log_up)
        gap2 = 2 * s_up + math.log(n) + 2 * delta + err_lse
        own = err_lse + u_m * gap2 + eta_m + float(log_radius(eps_e))
        absolute = eta_m
    big_r = own + 2 * delta
    growth = float(np.expm1(big_r))  # inf past float64's range, not an exception
    eps_p = growth + absolute  # entry (P <= 1)
    sum_eps = growth + n * absolute  # along a row (Σ P = 1)
    p_used = growth + 1 + absolute
    pr_extra = float(read_error(np.asarray(p_used), sm, prob)) if st.flash else 0.0
    return _Probabilities(eps_p, sum_eps, p_used, pr_extra, bits_p)


def _dp(st: _Setting) -> tuple[float, float]:
    """B.4's step 4: ``dP = d_out vᵀ``, ``|dP| <= M = d_v·d_out_max·v_max``: ``(M, err)``."""
    num, rng, dv_ = st.num, st.rng, st.sizes[3]
    fin, acc, grad = st.fmt("input"), st.fmt("accum"), st.bw.formats(num)[0]
    vm, gm = st.norms[2], st.norms[3]
    u_i, eta_i = fin.u, fin.smallest_normal
    anchor = tensor_core_anchor(num)
    bits_in = operand_bits(num, fin)
    f, eta, _ = dot_factor(num, dv_, None, (bits_in, bits_in))
    eg, ev = _entry_err(gm, num), _entry_err(vm, num)
    big_m = dv_ * gm * vm
    dp_err = dv_ * (eg * (vm + ev) + gm * ev + f * (gm + eg) * (vm + ev)) + eta
    if anchor:
        dp_err += f * anchor * (dv_ * (gm + eg + vm + ev) + dv_ * anchor)
    rng.operands(num, gm * (1 + u_i) + eta_i, vm * (1 + u_i) + eta_i, "d_out vᵀ",
                 ("dq", "dk", "dbias"))  # fmt: skip
    rng.check(dv_ * (1 + f) * (gm + eg) * (vm + ev) + eta, acc, "d_out vᵀ accumulated",
              ("dq", "dk", "dbias"))  # fmt: skip
    dp_err += float(read_error(np.asarray(big_m + dp_err), acc, grad))
    rng.check(big_m + dp_err, grad, "dP in the gradient format", ("dq", "dk", "dbias"))
    return big_m, dp_err


def _d(st: _Setting, pr: _Probabilities, big_m: float, dp_err: float) -> tuple[float, float, float]:
    """B.4's step 5: ``D`` (B.1: from ``dP`` and ``P``; B.2: from ``d_out`` and the forward
    output, Theorem A.4): ``(err_D, |P̂' - P| at one entry, along a row)``."""
    num, rng = st.num, st.rng
    lq, n, d, dv_ = st.sizes
    qn, kn, vm, gm = st.norms
    fin, sm, prob, out = st.fmt("input"), st.fmt("softmax"), st.fmt("prob"), st.fmt("output")
    grad = st.bw.formats(num)[0]
    u_g, eta_g, u_i, eta_i = grad.u, grad.smallest_normal, fin.u, fin.smallest_normal
    if not st.flash:
        take_p = float(read_error(np.asarray(pr.p_used), prob, grad))
        g_d = chain(n, num.summation, u_g, None, products=True)
        sum_pe = pr.sum_eps + n * take_p
        d_err = dp_err * (1 + sum_pe) + big_m * sum_pe
        d_err += g_d * (big_m + dp_err) * (1 + sum_pe) + 2 * n * eta_g
        p_x = pr.eps_p + take_p
        sum_px = sum_pe
    else:
        fwd = attention_bound_a_priori(
            lq, n, d, dv_, q_norm=qn, k_norm=kn, v_max=vm, numerics=num, scale=st.scale,
            softcap=st.cap,
        )  # fmt: skip
        eps_o = float(np.max(fwd.total))
        rng.reasons.extend(f"forward: {r}" for r in fwd.reasons)
        eg_g = u_i * gm + eta_i + float(read_error(np.asarray(gm * (1 + u_i) + eta_i), fin, grad))
        eo = eps_o + float(read_error(np.asarray(vm + eps_o), out, grad))
        g_d = chain(dv_, num.summation, u_g, None, products=True)
        d_err = dv_ * (eg_g * vm + gm * eo + eg_g * eo) + g_d * dv_ * (gm + eg_g) * (vm + eo)
        d_err += 2 * dv_ * eta_g
        take_p = float(read_error(np.asarray(pr.p_used), sm, grad))
        p_x = pr.eps_p + take_p
        sum_px = pr.sum_eps + n * take_p
        if not math.isfinite(eps_o):
            d_err = math.inf
    rng.check(big_m + d_err, grad, "D in the gradient format", ("dq", "dk", "dbias"))
    return d_err, p_x, sum_px


class _ScoreGradient(NamedTuple):
    """B.4's step 6: ``|t| <= t_up``, ``|dŜ - dS|`` at one entry (``ds_entry``), and the last
    dots' operand rounded to ``ds_format`` at one entry and along a row."""

    t_up: float
    ds_entry: float
    dsr_entry: float
    dsr_row: float


def _ds(
    st: _Setting,
    capped: CappedLogits | None,
    big_m: float,
    t_err: float,
    p_x: float,
    sum_px: float,
) -> _ScoreGradient:
    """B.4's step 6: ``t = dP - D`` (``|t| <= 2M``, ``t_err`` its error before its rounding),
    ``dS = P t``; B.9 (b): ``dA = dS·σ``, ``σ <= 1``, for ``dq`` and ``dk``; then the rounding
    into ``ds_format``."""
    rng, n = st.rng, st.sizes[1]
    grad, dsf = st.bw.formats(st.num)
    u_g, eta_g = grad.u, grad.smallest_normal
    t_err += u_g * (2 * big_m + t_err) + eta_g
    rng.check(2 * big_m + t_err, grad, "dP - D in the gradient format", ("dq", "dk", "dbias"))
    t_up = 2 * big_m
    ds_entry = p_x * t_up + t_err + p_x * t_err + u_g * (1 + p_x) * (t_up + t_err) + eta_g
    ds_row = sum_px * t_up + t_err + sum_px * t_err + u_g * (1 + sum_px) * (t_up + t_err)
    ds_row += n * eta_g
    da_entry, da_row = ds_entry, ds_row
    if capped is not None and st.cap is not None:  # B.9 (b): dA = dS·σ, σ <= 1, for dq and dk
        cap = st.cap
        slope = slope_a_priori(capped, st.num, grad)
        da_entry = float(
            through_cap(np.asarray(t_up), np.asarray(ds_entry), slope, cap, grad, rng)[1]
        )
        # along a row: linear in (Σ|dS|, Σ err) plus one rounding floor per entry
        floor = float(through_cap(np.zeros(()), np.zeros(()), slope, cap, grad, Ranges())[1])
        row = through_cap(np.asarray(t_up), np.asarray(ds_row), slope, cap, grad, Ranges())[1]
        da_row = float(row) + (n - 1) * floor
    rng.check(t_up + da_entry, dsf, f"dS rounded to {dsf.name}", ("dq", "dk", "dbias"))
    take_ds = float(read_error(np.asarray(t_up + da_entry), grad, dsf))
    dsr_entry = da_entry + take_ds
    dsr_row = da_row + float(read_error(np.asarray(t_up + da_row), grad, dsf)) + n * take_ds
    return _ScoreGradient(t_up, ds_entry, dsr_entry, dsr_row)


def _finish(
    st: _Setting, name: str, width: int | None, terms: dict[str, float], ev: float
) -> Bound:
    """The bound of the gradient ``name``: every entry of a row (``width``, or a scalar) the
    same, its terms widened by ``ev``; ``inf`` where a stage that reaches it may overflow."""
    shape = () if width is None else (width,)
    arrays = {key: np.full(shape, val * ev) for key, val in terms.items()}
    total = sum(arrays.values())
    total = np.where(np.isnan(total), np.inf, total)
    if st.rng.hit[name]:
        total = np.full(shape, np.inf)
    return Bound(
        total=np.asarray(total, np.float64),
        terms=arrays,
        theorem="B.4",
        assumptions=ASSUMPTIONS,
        source="dao2023",
        reasons=tuple(st.rng.reasons) if not np.isfinite(total).all() else (),
    )


@dataclasses.dataclass(frozen=True)
class _LastDot:
    """B.4's last dot ``Σ_l a_l b_l`` of the gradient ``name`` over ``count`` terms (in
    ``block``s, B.2) with ``Σ|a| <= mag_sum``, ``Σ err_a <= err_sum`` and ``|b| <= b_up`` (each
    ``b`` an input entry), the operands' bits, whether the scale multiplies it, and the
    gradient's row width."""

    name: str
    count: int
    block: int
    mag_sum: float
    err_sum: float
    b_up: float
    bits: tuple[int, int]
    scaled: bool
    width: int


def _last(st: _Setting, g: _LastDot, ev: float) -> Bound:
    """B.4's step 7: B.0 on the last dot, then the scale (``dq``, ``dk``) and the output
    rounding."""
    num, rng = st.num, st.rng
    fin, acc, out = st.fmt("input"), st.fmt("accum"), st.fmt("output")
    u_op, eta_op = operand_error(num)
    anchor = tensor_core_anchor(num)
    u_i, eta_i = fin.u, fin.smallest_normal
    c64, c = st.c64, abs(st.c64)
    name, count, mag_sum, err_sum, b_up = g.name, g.count, g.mag_sum, g.err_sum, g.b_up
    f, eta, _ = dot_factor(num, count, g.block if st.flash else None, g.bits)
    a_e = err_sum + u_op * (mag_sum + err_sum) + count * eta_op
    b_e = _entry_err(b_up, num)
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
    if g.scaled:
        carried, own_ = scaled_output(np.asarray(x_up), np.asarray(err), c64, c64, st.u64, num)
        ratio = float(carried) / err if err > 0 else 1.0
        y_up = c * x_up + float(carried) + float(own_)
        own_out = float(own_)
    else:
        ratio, own_out = 1.0, float(read_error(np.asarray(x_up + err), acc, out))
        y_up = x_up + err + own_out
    rng.check(y_up, out, f"{name} rounded to the output format", (name,))
    return _finish(
        st, name, g.width,
        {"upstream": ratio * from_a, "inputs": ratio * from_b,
         "accumulation": ratio * accumulation, "output": own_out},
        ev,
    )  # fmt: skip


def _a_priori(st: _Setting) -> GradientBounds:
    """Theorem B.4's propagation, step by step (papers/backward.md)."""
    num, rng, bw = st.num, st.rng, st.bw
    lq, n, d, dv_ = st.sizes
    qn, kn, _, gm = st.norms
    grad, dsf = bw.formats(num)
    out = st.fmt("output")
    for name, value in zip(("q", "k", "v", "d_out"), st.norms, strict=True):
        rng.check(value, st.fmt("input"), f"{name} rounded to the input format", GRADIENTS)
    s_up, delta, capped = _logits(st)
    pr = _probabilities(st, s_up, delta)
    big_m, dp_err = _dp(st)
    d_err, p_x, sum_px = _d(st, pr, big_m, dp_err)
    ds = _ds(st, capped, big_m, dp_err + d_err, p_x, sum_px)
    t_up, ds_entry = ds.t_up, ds.ds_entry
    ev_all = (1 + evaluation_rounding(max(n, lq, d, dv_))) ** 12
    results: dict[str, Bound] = {}
    bits_in = operand_bits(num, st.fmt("input"))
    bits = (operand_bits(num, dsf), bits_in)
    # dq_i = c Σ_j dS_ij k_j: along a row, Σ_j |dS_ij| <= 2M, |k_jc| <= k_norm
    last = _LastDot("dq", n, bw.block_k, t_up, ds.dsr_row, kn, bits, True, d)
    results["dq"] = _last(st, last, ev_all)
    # dk_j = c Σ_i dS_ij q_i: down a column, Σ_i |dS_ij| <= q_len·2M
    last = _LastDot("dk", lq, bw.block_q, lq * t_up, lq * ds.dsr_entry, qn, bits, True, d)
    results["dk"] = _last(st, last, ev_all)
    # dv_j = Σ_i P_ij d_out_i: Σ_i P_ij <= q_len
    bits = (pr.bits_p, bits_in)
    err_v = lq * (pr.eps_p + pr.pr_extra)
    results["dv"] = _last(
        st, _LastDot("dv", lq, bw.block_q, lq * 1.0, err_v, gm, bits, False, dv_), ev_all
    )
    own_b = float(read_error(np.asarray(t_up + ds_entry), grad, out))
    rng.check(t_up + ds_entry + own_b, out, "dbias rounded to the output format", ("dbias",))
    results["dbias"] = _finish(st, "dbias", None, {"dS": ds_entry, "output": own_b}, ev_all)
    stages = {
        "P": np.asarray(pr.eps_p * ev_all),
        "dP": np.asarray(dp_err * ev_all),
        "D": np.asarray(d_err * ev_all),
        "dS": np.asarray(ds_entry * ev_all),
    }
    return GradientBounds(results["dq"], results["dk"], results["dv"], results["dbias"], stages)
