"""A priori componentwise bounds for attention and MHA from sizes and norms: papers/attention.md A.4.

:func:`attention_bound_a_priori` needs no inputs, only their shapes and bounds on their sizes
(the Euclidean norms of the query and key rows and the largest value entry); it bounds the error
of every output component of every input that satisfies them. :func:`mha_bound_a_priori` does
the same for a multi-head layer from its weights and a bound on the entries of its inputs. Both
are for planning and reports: the a posteriori bounds (A.1, A.2) are smaller on any given input.

Each step of A.1 is replaced by its worst case over the admissible inputs: ``|q_i|·|k_j| <=
‖q_i‖‖k_j‖`` (Cauchy–Schwarz), every logit error by one ``Δ``, the logit range by ``2c|q||k|``,
``Σ_j p̃_j <= e^{2Δ}`` and ``Σ_j p_j |v_j| <= max |v|``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.attention import (
    _EVALUATION,
    ASSUMPTIONS,
    _anchor,
    _exp_and_sum_factors,
    _is_power_of_four,
    _linear,
    _operand_bits,
    _operand_error,
    _power_of_two,
    _unit_eta,
    _unit_factor,
)
from mhanum.formats import round_to
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams

__all__ = ["attention_bound_a_priori", "mha_bound_a_priori"]

A_PRIORI = (
    "a priori: every input satisfies the stated size bounds (row norms of q and k, entries of v "
    "or of x); no bias; masks with -inf (at least min_keys attended keys per row)"
)


@dataclasses.dataclass(frozen=True)
class _Operand:
    """Bounds on a dot operand's rows: ``|x| <= size`` entrywise (a vector over the row) or, for
    the norm form, ``‖x‖ <= norm``; its error ``|x_used - x| <= rel·|x| + err`` entrywise."""

    size: np.ndarray | None
    norm: float
    rel: float
    err: np.ndarray

    def sums(self, d: int) -> float:
        """A bound on ``Σ_t |x_t|``."""
        return float(self.size.sum()) if self.size is not None else math.sqrt(d) * self.norm


def _pair(a: _Operand, b: _Operand) -> float:
    """A bound on ``|a|·|b|`` (Cauchy–Schwarz in the norm form)."""
    if a.size is not None and b.size is not None:
        return float(a.size @ b.size)
    return a.norm * b.norm


def _err_pair(ea: np.ndarray, b: _Operand, d: int) -> float:
    """A bound on ``e_a·|b|`` for an error vector ``ea`` (a scalar spread over ``d`` entries)."""
    if b.size is not None:
        return float(np.broadcast_to(ea, (d,)) @ b.size)
    return float(np.linalg.norm(np.broadcast_to(ea, (d,)))) * b.norm


def _logit_error(
    qo: _Operand, ko: _Operand, d_k: int, num: Numerics, scale: float, default_scale: bool
) -> tuple[float, float]:
    """``(Δ, c·max|q||k|)``: A.1 step 3 at its worst over the admissible inputs (A.4)."""
    fin = num.format_of("input")
    f_q = num.format_of("scale") if num.scale != "scores" else fin
    f_k = num.format_of("scale") if num.scale == "qk" else fin
    if num.scale != "scores":
        qo, ko = _scaled_bounds(qo, ko, d_k, num, scale, default_scale)
        scale, default_scale = 1.0, False
    score = num.format_of("score")
    u_s, eta_s = score.u, score.smallest_normal
    u_op, eta_op = _operand_error(num)
    pq = _pair(qo, ko)
    # e_op = e + u_op(|x| + e) + η_op with e = rel|x| + err: relative part a, absolute part b
    a_q, a_k = qo.rel + u_op * (1 + qo.rel), ko.rel + u_op * (1 + ko.rel)
    b_q, b_k = (1 + u_op) * qo.err + eta_op, (1 + u_op) * ko.err + eta_op
    cross = _err_pair(b_q, ko, d_k) + _err_pair(b_k, qo, d_k)
    bb = float(np.broadcast_to(b_q, (d_k,)) @ np.broadcast_to(b_k, (d_k,)))
    dot = (a_q + a_k + a_q * a_k) * pq + (1 + a_k) * _err_pair(b_q, ko, d_k)
    dot += (1 + a_q) * _err_pair(b_k, qo, d_k) + bb
    op_pair = (1 + a_q) * (1 + a_k) * pq + (1 + max(a_q, a_k)) * cross + bb
    bits = (_operand_bits(num, f_q), _operand_bits(num, f_k))
    f_qk, anchor = _unit_factor(num, d_k, None, bits=bits), _anchor(num)
    dot += f_qk * op_pair + _unit_eta(num, d_k)
    if anchor:
        sums = (1 + a_q) * qo.sums(d_k) + (1 + a_k) * ko.sums(d_k)
        sums += float(np.sum(np.broadcast_to(b_q, (d_k,))) + np.sum(np.broadcast_to(b_k, (d_k,))))
        dot += f_qk * anchor * (sums + d_k * anchor)
    c_hat = float(round_to(scale, score))
    if default_scale and not _is_power_of_four(d_k):
        u_c = (1 + 2.0**-53) / (1 - 2.0**-53) * (1 + u_s) - 1
    else:
        u_c = 0.0 if c_hat == scale else u_s
    u_mul = 0.0 if _power_of_two(c_hat) else u_s
    theta = (1 + u_s) * (1 + u_c) * (1 + u_mul) - 1
    delta = scale * (dot * (1 + theta) + theta * pq) + (abs(c_hat) * (1 + u_s) + 2) * eta_s
    return delta, scale * pq


def _scaled_bounds(
    qo: _Operand, ko: _Operand, d_k: int, num: Numerics, scale: float, default_scale: bool
) -> tuple[_Operand, _Operand]:
    """Step 2' at its worst: the scaled operands ``f·x`` and their errors (as in A.1)."""
    fmt = num.format_of("scale")
    u64 = 0.0
    if default_scale and not _is_power_of_four(d_k):
        u64 = (1 + 2.0**-53) / (1 - 2.0**-53) - 1
    f64 = scale if num.scale == "q" else math.sqrt(scale)
    if num.scale == "qk":
        u64 = (1 + u64) * (1 + 2.0**-53) - 1
    f_hat = float(round_to(f64, fmt))
    u_r = 0.0 if f_hat == f64 else fmt.u
    theta = (1 + u_r) * (1 + (0.0 if _power_of_two(f_hat) else fmt.u)) - 1
    up = abs(f64) * (1 + 2.0**-52) / (1 - u64)

    def scaled(x: _Operand) -> _Operand:
        size = None if x.size is None else up * x.size
        rel = theta + (1 + theta) * x.rel + 2.0**-53 + u64 / (1 - u64)
        return _Operand(size, up * x.norm, rel, up * (1 + theta) * x.err + fmt.smallest_normal)

    return scaled(qo), (scaled(ko) if num.scale == "qk" else ko)


def _softmax_pv(
    delta: float,
    reach: float,
    n: int,
    min_keys: int,
    v_abs: np.ndarray,
    v_bar: np.ndarray,
    num: Numerics,
) -> dict[str, np.ndarray]:
    """A.1 steps 4-7 at their worst over the admissible inputs (A.4): vectors over ``d_v``.

    ``delta`` bounds every logit error, ``reach`` every ``|s_ij|``; ``v_abs`` bounds ``|v_jl|``
    and ``v_bar`` the entries the ``P V`` unit reads.
    """
    fmts = {r: num.format_of(r) for r in ("softmax", "prob", "output")}
    u_m, u_p, u_o = (fmts[r].u for r in ("softmax", "prob", "output"))
    eta_m, eta_p, eta_o = (fmts[r].smallest_normal for r in ("softmax", "prob", "output"))
    u_op, eta_op = _operand_error(num)
    u_div = 2 * num.div_ulps * u_m
    kind = num.softmax_kind
    bits_pv = (_operand_bits(num, fmts["prob"]), _operand_bits(num, num.format_of("input")))
    online = kind == "online"
    gap = 2 * reach + 2 * delta
    x, blocks, g_sum, g_pv, eta_pv = _exp_and_sum_factors(num, n, gap, None, bits_pv)
    log_s_lo = math.log(min_keys) - reach - delta if kind == "naive" else 0.0
    inf = np.full_like(v_abs, np.inf)
    vacuous = {"vacuous": inf}
    if x > 700 or 2 * delta > 700 or -log_s_lo > 700:
        return vacuous
    r = math.expm1(x)
    underflow = n * eta_m * math.exp(-log_s_lo)
    t_sum = (1 + r + underflow) * (1 + g_sum) - 1 + underflow
    if t_sum >= 1:
        return vacuous
    if kind == "naive":
        fm = fmts["softmax"]
        log_sum = math.log(n) + reach + delta + math.log(2)
        carrier_emin = -1022 if fm.name == "float64" else -126
        flush = log_sum >= -carrier_emin * math.log(2) - 1
        if flush or reach + delta >= math.log(fm.max_finite) - 1:
            return vacuous
    per_sum = math.exp(-log_s_lo) / (1 - t_sum)
    mass = math.exp(2 * delta)  # Σ_j p̃_j <= Σ_j p_j e^{2Δ}
    y = x + math.log1p(u_div) - math.log1p(-t_sum)
    soft = mass * math.expm1(y) + n * (eta_m * (1 + u_div) * per_sum + eta_m)
    p_hat = mass + soft
    prob = u_p * p_hat + n * (eta_p * per_sum + blocks * eta_m * per_sum if online else eta_p)
    p_hat += prob
    operand_p = u_op * p_hat + n * eta_op
    p_hat += operand_p
    anchor = _anchor(num)
    pv_eta: Any = eta_pv
    if anchor:
        weights = n if online else p_hat
        pv_eta = eta_pv + g_pv * anchor * (weights + n * v_bar + n * anchor)
    scale_out = (1 + u_o) * ((1 + u_div) if online else 1.0)
    return {
        "logits": scale_out * math.expm1(2 * delta) * v_bar,
        "softmax": scale_out * soft * v_bar,
        "probability_rounding": scale_out * prob * v_bar,
        "operands": scale_out * (operand_p * v_bar + p_hat * (v_bar - v_abs)),
        "pv": scale_out * (g_pv * p_hat * v_bar + (pv_eta * per_sum if online else pv_eta)),
        "output": u_o * v_abs + eta_o + ((1 + u_o) * (u_div * v_abs + eta_m) if online else 0.0),
    }


def _check_a_priori_scope(num: Numerics) -> None:
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


def _total(terms: dict[str, np.ndarray], theorem: str) -> Bound:
    terms = {name: np.asarray(t, np.float64) * (1 + _EVALUATION) for name, t in terms.items()}
    total = sum(terms.values())
    return Bound(total, terms, theorem, (*ASSUMPTIONS, A_PRIORI), "blanchard2021")


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
) -> Bound:
    """Theorem A.4: an a priori componentwise bound on the error of ``mhanum.attention``.

    For every input ``q`` (``q_len × d_k``), ``k`` (``kv_len × d_k``), ``v`` (``kv_len × d_v``)
    with ``‖q_i‖₂ <= q_norm``, ``‖k_j‖₂ <= k_norm``, ``|v_jl| <= v_max``, given as float64
    numbers (their rounding into ``numerics.input`` is included) and any mask applied with
    ``-inf`` that leaves at least ``min_keys`` keys per row,

    .. math::

        |\\hat o_{il} - o_{il}| \\le \\text{total}\\quad\\text{for every } i, l,

    where ``total`` is Theorem A.1 evaluated at its worst over those inputs: every logit error by
    ``Δ = c(G_{d_k}(1+θ)+θ)·q_norm·k_norm + ...`` (A.1 step 3 with Cauchy–Schwarz), the logit
    range by ``2c·q_norm·k_norm + 2Δ``, ``Σ_j p̃_j <= e^{2Δ}``, ``Σ_j p_j|v_jl| <= v_max``
    (papers/attention.md, Theorem A.4). The bound does not depend on ``q_len``; on ``kv_len``
    through the summation factors and underflow terms.

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

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has shape ``(d_v,)`` (the same bound for
        every row); ``terms`` as for :func:`~mhanum.bounds.attention_bound`.

    Raises:
        InvalidArgument: for non-positive sizes, negative or non-finite norms, or numerics
            outside the theorem's scope.

    References:
        blanchard2021; higham2002 (§3.1); papers/attention.md Theorem A.4.

    Examples:
        >>> b = attention_bound_a_priori(64, 64, 64, q_norm=8.0, k_norm=8.0, v_max=3.0,
        ...                              numerics="fp32")
        >>> bool(b.total.max() < 1e-4)
        True
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
    fin = num.format_of("input")
    c = V.scale_value(scale, d_k)
    # |x̃ - x| <= u_in|x| + η_in for unrounded inputs (A.1 step 1)
    qo = _Operand(None, qn, fin.u, np.full(d_k, fin.smallest_normal))
    ko = _Operand(None, kn, fin.u, np.full(d_k, fin.smallest_normal))
    delta, reach = _logit_error(qo, ko, d_k, num, c, scale is None)
    u_op, eta_op = _operand_error(num)
    v_abs = np.full(d_v, vm)
    v_bar = (1 + u_op) * ((1 + fin.u) * v_abs + fin.smallest_normal) + eta_op
    return _total(_softmax_pv(delta, reach, n, least, v_abs, v_bar, num), "A.4")


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
) -> Bound:
    """Theorem A.4 for multi-head attention: a bound from the weights and ``max |x|`` only.

    For every input with ``|x_q| <= x_max`` and ``|x_kv| <= x_kv_max`` entrywise (float64 values,
    rounded into ``numerics.input``), the error of every output component of
    ``mhanum.multi_head_attention(x_q, x_kv, params, num_heads, mask=..., numerics=...)`` is at
    most ``total[l]``. The projections follow A.2 (a) evaluated at ``|x| = x_max``, ``|w|`` and
    ``|b|`` (every term is nondecreasing in them), which bounds each projected entry and its
    error coordinatewise; each head is then A.4 with ``|q_i|·|k_j| <= Σ_t Q_t K_t`` for those
    coordinate bounds, and the output projection is A.2 (c) at ``|o_l| <= max |v_l|``.

    Args:
        params: the layer's weights.
        num_heads: number of heads.
        q_len, kv_len: sequence lengths.
        x_max: a bound on ``|x_q|`` entries; ``x_kv_max`` on ``|x_kv|`` (default ``x_max``).
        numerics, scale, min_keys: as for :func:`attention_bound_a_priori`.

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has shape ``(d_out,)``.

    References:
        papers/attention.md Theorems A.2 and A.4.
    """
    num = resolve(numerics)
    _check_a_priori_scope(num)
    if not isinstance(params, MHAParams):
        msg = f"params: expected an MHAParams, got {type(params).__name__}"
        raise InvalidArgument(msg)
    heads = V.positive_int(num_heads, "num_heads")
    params.validate(heads)
    V.positive_int(q_len, "q_len")
    n = V.positive_int(kv_len, "kv_len")
    least = n if min_keys is None else V.positive_int(min_keys, "min_keys")
    xq = _nonnegative(x_max, "x_max")
    xkv = xq if x_kv_max is None else _nonnegative(x_kv_max, "x_kv_max")
    fin, storage = num.format_of("input"), num.storage_format
    w: dict[str, Any] = {
        f.name: None if getattr(params, f.name) is None else np.abs(getattr(params, f.name))
        for f in dataclasses.fields(params)
    }
    w = {k: None if a is None else np.asarray(a, np.float64) for k, a in w.items()}
    bounds = {}
    for name, x, width in (("q", xq, params.d_q), ("k", xkv, params.d_kv), ("v", xkv, params.d_kv)):
        x64 = np.full((1, width), x)
        lin = _linear(x64, np.zeros_like(x64), w[f"w{name}"], w[f"b{name}"], num, storage)
        err = lin.error(fin.u * x64 + fin.smallest_normal)[0]
        bounds[name] = (lin.y[0], err)
    d_k, d_v = params.qk_width // heads, params.v_width // heads
    c = V.scale_value(scale, d_k)
    u_op, eta_op = _operand_error(num)
    per_head = []
    for h in range(heads):
        qs, ks, vs = (slice(h * d, (h + 1) * d) for d in (d_k, d_k, d_v))
        qo = _Operand(bounds["q"][0][qs], 0.0, 0.0, bounds["q"][1][qs])
        ko = _Operand(bounds["k"][0][ks], 0.0, 0.0, bounds["k"][1][ks])
        delta, reach = _logit_error(qo, ko, d_k, num, c, scale is None)
        v_abs = bounds["v"][0][vs]
        v_bar = (1 + u_op) * (v_abs + bounds["v"][1][vs]) + eta_op
        per_head.append(_softmax_pv(delta, reach, n, least, v_abs, v_bar, num))
    names = sorted({name for t in per_head for name in t})
    merged = {
        name: np.concatenate([t.get(name, np.zeros(d_v)) for t in per_head]) for name in names
    }
    o_abs = bounds["v"][0][None, :]
    out = _linear(o_abs, np.zeros_like(o_abs), w["wo"], w["bo"], num, num.format_of("output"))
    terms = {f"attention.{name}": out.kappa * (t @ out.slope) for name, t in merged.items()}
    terms["output_projection"] = out.fixed[0]
    return _total(terms, "A.4")
