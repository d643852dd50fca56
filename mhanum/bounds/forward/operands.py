"""Steps 1, 2 and 2' of Theorem A.1 (papers/attention.md): the stored operands and their range
(R.1, R.2), the scale on ``q`` or on ``q`` and ``k``, the operands as the dots read them, and
the scale constant (step 2'' when it is folded into the exponent)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mhanum.bounds.factors import (
    LOG2E,
    compound,
    conversion_eta,
    operand_bits,
    operand_error,
    rounding_error,
    tensor_core_anchor,
)
from mhanum.bounds.forward.centring import column_median
from mhanum.bounds.forward.ranges import Found, Ranges, finding
from mhanum.bounds.forward.stage import Head, Setting, Values
from mhanum.bounds.forward.through_weights import Through, through_keys
from mhanum.bounds.scale import OperandScale, is_power_of_four, operand_scale, scale_rounding
from mhanum.formats import Format, representable, round_to
from mhanum.numerics import Numerics

__all__ = [
    "Constant",
    "Keys",
    "Operands",
    "constant_step",
    "keys_step",
    "operands_step",
    "read_by_the_dot",
    "stored_operands",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Operands:
    """Step 1: ``|q|``, ``|k|``, the operands as the dot reads them (``q_op >= |q̂|``, with
    errors ``e_q_op``, ``e_k_op``), ``v_abs >= |ṽ|`` and the operand bits of ``Q Kᵀ`` and
    ``P·V``."""

    q_abs: np.ndarray
    k_abs: np.ndarray
    q_op: np.ndarray
    k_op: np.ndarray
    e_q_op: Any
    e_k_op: Any
    v_abs: np.ndarray
    bits_qk: tuple[int, int]
    bits_pv: tuple[int, int]
    some_errors: tuple[bool, bool]


@dataclasses.dataclass(frozen=True)
class Constant:
    """Step 2 (2''): the scale constant ``ĉ`` in the score format (or ``ĉ2 = fl(c·log2 e)``
    in the softmax format, ``folded``), its relative error ``u_c``, the product's ``u_mul``
    and ``θ``, the logits' relative error from the scale."""

    c_hat: float
    c2_hat: float
    u_c: float
    u_mul: float
    theta: float
    folded: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Keys:
    """Steps R.1, 2' and 1 on a head's keys and values: the same for every chunk of its query
    rows, so taken once for the head (:func:`keys_step`). ``k`` holds the keys as the dots'
    operands stand in for them (scaled by step 2' where the scale is on ``q`` and ``k``), within
    ``e_k`` of the computed ones and ``g_k`` of the exact ones (``None`` where the scale is on
    the scores); ``k_abs``, ``k_op`` and ``e_k_op`` are :class:`Operands`'; ``values`` the
    values as ``P·V`` reads them. ``found``: the range checks' findings by stage, which each
    chunk's record takes where its own stages check (:meth:`Ranges.take`), so that a chunk
    records what it would alone, in the same order; ``some_error``: whether ``e_k_op`` has an
    entry other than zero; ``through``: A.2's steps (c') and (c'') on the keys, where the head
    carries the output projection's weights (:func:`through_keys`)."""

    k: np.ndarray
    e_k: Any
    g_k: Any
    k_abs: np.ndarray
    e_k_op: Any
    k_op: np.ndarray
    values: Values
    found: Mapping[str, Found]
    some_error: bool
    through: Through | None = None


def keys_step(head: Head, setting: Setting) -> Keys:
    """R.1 on the keys and values, step 2' on the keys where the scale is on ``q`` and ``k``,
    step 1 (the operands as the dots read them) and R.2 on both: :class:`Keys`."""
    num, k, v, errors = setting.num, head.k, head.v, head.errors
    store = num.storage_format
    found = {
        "k": finding(np.abs(k) + errors[1], store, "k in the input format", rows="k"),
        "v": finding(np.abs(v) + errors[2], store, "v in the input format", cols=True),
    }
    e_k, g_k = errors[1], None
    if num.scale != "scores":
        g_k = np.zeros_like(k) if head.given is None else head.given[1]
    if num.scale == "qk":
        sc = operand_scale(setting.scale, k.shape[-1], setting.default_scale, num)
        found["k read"], found["k scaled"] = _scale_findings(sc, k, e_k, "k")
        k, e_k, g_k = sc.applied(k, e_k, g_k)
    f_k = num.format_of("scale") if num.scale == "qk" else store
    k_abs, e_k_op = _operand_read(k, e_k, f_k, num)
    k_op = k_abs + e_k_op
    v_abs = _values_read(v, errors[2], num)
    for fmt, where in _read_formats(num):
        found[f"k {where}"] = finding(k_op, fmt, f"k read into {where}", rows="k")
        found[f"v {where}"] = finding(v_abs, fmt, f"v read into {where}", cols=True)
    bits_pv = (operand_bits(num, num.format_of("prob")), operand_bits(num, num.format_of("input")))
    values = Values(v, v_abs, bits_pv, tensor_core_anchor(num), column_median(v))
    some = bool(np.any(e_k_op))
    through = None if head.project is None else through_keys(head.project, values.extra)
    return Keys(k, e_k, g_k, k_abs, e_k_op, k_op, values.evaluated(), found, some, through)


def stored_operands(
    head: Head, setting: Setting, ranges: Ranges, keys: Keys
) -> tuple[Head, Setting]:
    """R.1: the stored operands in the input format; then step 2' where the scale is on ``q``
    (or ``sqrt(scale)`` on ``q`` and ``k``): the head of the scaled operands, whose scale is 1.
    The keys' side is ``keys``' (:func:`keys_step`)."""
    num, q, errors = setting.num, head.q, head.errors
    ranges.check(np.abs(q) + errors[0], num.storage_format, "q in the input format", rows="q")
    ranges.take(keys.found["k"])
    ranges.take(keys.found["v"])
    if num.scale == "scores":
        return head, setting
    sc = operand_scale(setting.scale, q.shape[-1], setting.default_scale, num)
    g_prev = head.given if head.given is not None else (np.zeros_like(q), None, 0.0)
    for found in _scale_findings(sc, q, errors[0], "q"):
        ranges.take(found)
    q, e_q, g_q = sc.applied(q, errors[0], g_prev[0])
    if num.scale == "qk":
        ranges.take(keys.found["k read"])
        ranges.take(keys.found["k scaled"])
    head = dataclasses.replace(
        head, q=q, k=keys.k, errors=(e_q, keys.e_k, errors[2]), given=(g_q, keys.g_k, g_prev[2])
    )
    return head, dataclasses.replace(setting, scale=1.0, default_scale=False)


def _scale_findings(
    sc: OperandScale, x: np.ndarray, e: np.ndarray | float, name: str
) -> tuple[Found, Found]:
    """Step 2' (scale on ``q``, or ``sqrt(scale)`` on ``q`` and ``k``): the operand ``x``
    (within ``e``) read into the scale format, and its product by the factor ``f̂`` there.

    The factor ``f`` (``c`` or ``sqrt(c)``) is the float64 number ``f64`` (relative error ``u64``
    against the exact factor: the default scale's two float64 roundings, and the float64 square
    root), rounded once into the scale format to ``f̂`` (relative ``u_r``; 1 when ``f̂`` is
    subnormal, since it may be read as zero). The operand, stored in the storage format, is
    first read into the scale format (relative ``u_t`` when that format is less precise, and
    an absolute ``η`` for its range), and the product ``fl(x̃ f̂)`` is rounded in that format
    (``u_mul``, zero when ``f̂`` is a normal power of two). The stand-in of the exact scaled
    operand is the float64 product ``f64·x``; the errors against it, and of it against the
    exact ``f·x*`` (``given``), are those of papers/attention.md step 2'
    (:meth:`~mhanum.bounds.scale.OperandScale.applied`).
    """
    fmt, f_hat = sc.fmt, sc.f_hat
    stored = np.abs(x) + e
    return (
        finding(stored, fmt, f"{name} read into the scale format", rows=name),
        finding(
            abs(f_hat) * stored * (1 + sc.u_t) + fmt.smallest_normal,
            fmt,
            f"{name} times the scale factor {f_hat:.4g}",
            rows=name,
        ),
    )


def operands_step(head: Head, num: Numerics, ranges: Ranges, keys: Keys) -> Operands:
    """Step 1. Operands: ``|q_used - q| <= e_q``, then the rounding into the operand format
    (TF32) and the reading into the accumulation format; R.2: the operands read into the
    operand and accumulation formats. ``head`` holds the (scaled) operands of step 2'; the
    keys' and values' side is ``keys``' (:func:`keys_step`)."""
    store = num.storage_format
    f_q = num.format_of("scale") if num.scale != "scores" else store
    f_k = num.format_of("scale") if num.scale == "qk" else store
    q_abs, e_q_op = _operand_read(head.q, head.errors[0], f_q, num)
    q_op = q_abs + e_q_op
    for fmt, where in _read_formats(num):
        ranges.check(q_op, fmt, f"q read into {where}", rows="q")
        ranges.take(keys.found[f"k {where}"])
        ranges.take(keys.found[f"v {where}"])
    bits_qk = (operand_bits(num, f_q), operand_bits(num, f_k))
    return Operands(
        q_abs, keys.k_abs, q_op, keys.k_op, e_q_op, keys.e_k_op, keys.values.v_abs, bits_qk,
        keys.values.bits_pv, (bool(np.any(e_q_op)), keys.some_error),
    )  # fmt: skip


def _operand_read(
    x: np.ndarray, e: np.ndarray | float, fmt: Format, num: Numerics
) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 on an operand of ``Q Kᵀ`` held in ``fmt``, within ``e`` of the one used: ``|x|``
    and ``e_op``, its error as the dot reads it (the rounding into the operand format, TF32,
    and the conversion into the accumulation format)."""
    u_op, eta_op = operand_error(num)
    op = num.operand_rounding
    conv = conversion_eta(num, op or fmt)
    x_abs = np.abs(x)
    e_op = e + u_op * (x_abs + e) + eta_op + conv
    if op is not None:
        # an operand the dot uses exactly (no error before the conversion) converts by its own
        # rounding into the operand format: none for a value of that format (fp8 inputs at 448)
        e_op = np.where(e == 0, rounding_error(x, op) + conv, e_op)
    return x_abs, e_op


def _values_read(v: np.ndarray, e_v: np.ndarray | float, num: Numerics) -> np.ndarray:
    """Step 1 on the values: ``v_abs >= |ṽ|``, the values as ``P·V`` reads them."""
    u_op, eta_op = operand_error(num)
    op = num.operand_rounding
    conv = conversion_eta(num, op or num.storage_format)
    v_abs = (1 + u_op) * (np.abs(v) + e_v) + eta_op + conv
    if op is not None:
        v_abs = np.where(e_v == 0, np.abs(v) + rounding_error(v, op) + conv, v_abs)
    return v_abs


def _read_formats(num: Numerics) -> list[tuple[Format, str]]:
    """R.2: the formats the operands are read into, and how a reason names each."""
    named = ((num.operand_rounding, "the dot's operand format"),
             (num.format_of("accum"), "the accumulation format"))  # fmt: skip
    return [(fmt, where) for fmt, where in named if fmt is not None]


def read_by_the_dot(x: np.ndarray, num: Numerics) -> np.ndarray:
    """Step 1k (papers/attention.md): ``x``, values of the input format that a dot reads
    directly, with each entry replaced by the value the dot reads, ``fl_op(x)`` (its rounding
    to nearest into the operand format ``F_op``), where that value is known: not at a tie of
    ``F_op`` (any tie rule), ``x`` and ``fl_op(x)`` at least ``F_op``'s smallest normal number
    (a smaller one may be read as zero), ``fl_op(x)`` finite and a value of the input format.
    Elsewhere ``x`` stays, and step 1 charges its rounding as before. The dot's read of the
    value returned is then the value itself: the kernel reads the same operands from ``x``
    and from what this returns. Unchanged without an IEEE dot's operand rounding.

    Examples:
        >>> num = Numerics(input="float32", accum="float32", operand_format="tf32")
        >>> x = np.array([1 + 2.0**-12, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-130])
        >>> read_by_the_dot(x, num).tolist() == [1.0, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-130]
        True
    """
    op = num.operand_rounding
    if op is None or num.dot_kind != "ieee":
        return x
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        near = round_to(x, op)
        down = round_to(x, op, mode="toward_zero")
        binade = np.frexp(x)[1]  # |x| = m 2^e, m in [1/2, 1): F_op's spacing there 2^(e - p)
        tie = np.abs(x - down) == np.ldexp(1.0, binade - op.precision - 1)
        known = (
            np.isfinite(near)
            & (np.abs(x) >= op.smallest_normal)
            & (np.abs(near) >= op.smallest_normal)
            & ~tie
            & representable(np.where(np.isfinite(near), near, 0.0), num.format_of("input"))
        )
    return np.where(known, near, x)


def constant_step(setting: Setting, d_k: int, ranges: Ranges) -> Constant:
    """Step 2. The constant: the float64 value of ``1/sqrt(d_k)`` (two float64 roundings unless
    ``d_k = 4^m``) or the given scale, rounded once into the score format; the product by it
    is exact when it is a normal power of two; a subnormal constant may be read as zero.
    Folded (step 2''), ``c2 = fl_m(scale·log2 e)`` (:func:`_folded_constant`)."""
    num, scale = setting.num, setting.scale
    f_s, f_m = num.format_of("score"), num.format_of("softmax")
    folded = num.folds_scale
    c2_hat = math.nan
    if folded:
        c2_hat, u_c = _folded_constant(num, scale, ranges)
        c_hat, u_mul = c2_hat / LOG2E, 0.0
    else:
        c_hat, u_c, u_mul = scale_rounding(scale, f_s)
    if setting.default_scale and not is_power_of_four(d_k):
        # irrational: fl(1/fl(sqrt(d))) = c(1+δ2)/(1+δ1) in float64, then rounded into F_score
        u_c = compound(2.0**-53, u_c, over=(2.0**-53,))
    if setting.loose_constant:
        # the kernel forms its constant itself (scale·d_q·d_k, in float32): any value within three
        # roundings of the exact one, and the product by it rounded
        u_f = f_m.u if folded else f_s.u
        u_c = max(u_c, compound(powers=((u_f, 3), (2.0**-53, 3))))
        u_mul = u_mul if folded else u_f
    theta = compound(f_s.u, u_c, u_mul)
    return Constant(c_hat, c2_hat, u_c, u_mul, theta, folded)


def _folded_constant(num: Numerics, scale: float, ranges: Ranges) -> tuple[float, float]:
    """Step 2''. ``c2 = fl_m(scale·log2(e))``: the float64 product (one rounding), then rounded
    into the softmax format; no product with the scores is stored (they stay unscaled). The
    error also covers a kernel that rounds the scale into the softmax format first
    (FlashAttention-2's ``scale_softmax_log2`` from its float32 ``softmax_scale``,
    flash_api.cpp): one more rounding. exp2-scaled: the kernel's own
    ``fl_m(fl_m(scale)·fl_m(log2 e))``, three roundings. Returns ``c2`` and its relative error;
    R.3'' flags a constant that breaks the kernel."""
    f_m = num.format_of("softmax")
    if num.exp_form == "exp2-scaled":
        s_hat, u_s1, _ = scale_rounding(scale, f_m)
        l_hat, u_l, _ = scale_rounding(LOG2E, f_m)
        c2_hat, u_p, _ = scale_rounding(s_hat * l_hat, f_m)
        u_c = compound(u_s1, u_l, u_p)
        tiny_factor = min(abs(s_hat), abs(scale)) < f_m.smallest_normal
    else:
        c2_hat, u_c, _ = scale_rounding(scale * LOG2E, f_m)
        u_c = compound(scale_rounding(scale, f_m)[1], u_c)  # fl_m(scale) first, or not
        tiny_factor = False
    u_c = compound(2.0**-53, u_c)
    form = num.exp_form
    if c2_hat < 0:
        # the shift is the maximum of the unscaled scores: the largest logit only for a
        # positive scale; a masked or padding key's -inf·c2 is +inf
        ranges.flag(
            True,
            f"{form} with the negative scale {scale:.4g}: the shift is the maximum of "
            "the unscaled scores, and -inf·c2 is +inf",
        )
    elif tiny_factor or abs(c2_hat) < f_m.smallest_normal:
        # R.3'': a c2 (or, exp2-scaled, its factor fl(scale)) that may be read as zero
        # makes -inf·c2 (a masked or padding key) NaN, as in the kernels
        ranges.flag(
            True,
            f"{form}: c2 = {c2_hat:.4g} or its factor fl(scale) is subnormal or zero in "
            f"{f_m.name} and may be read as zero: -inf·c2 is NaN",
        )
    elif not math.isfinite(c2_hat):
        ranges.flag(True, f"{form}: c2 = fl(scale·log2 e) overflows {f_m.name}")
    return c2_hat, u_c
