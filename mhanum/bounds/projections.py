"""Theorem A.2 (a) (papers/attention.md): the projections ``y = x w + b`` of multi-head attention
in float64, with the bounds of their computed values (:func:`linear`) and the ranges they are
proved in (:func:`linear_overflow`); read by A.2, A.4's multi-head form and B.6."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from mhanum._threads import map_threads
from mhanum.bounds.enclosure import one_signed_sizes, one_signed_total
from mhanum.bounds.factors import (
    chain_dot_factor,
    evaluation_rounding,
    operand_bits,
    operand_error,
    rounding_error,
    tensor_core_anchor,
    unit_eta,
    unit_factor,
)
from mhanum.formats import Format
from mhanum.numerics import Numerics

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = ["BLOCK", "Linear", "Roundings", "linear", "linear_overflow"]

BLOCK = 2**17  # the outputs of a block of rows (linear): 256 rows of 512


@dataclasses.dataclass(frozen=True)
class Linear:
    """Theorem A.2 (a): ``y = x w + b`` in float64 and the bounds of the computed ``ŷ``.

    ``|y - y*| <= given`` (float64 evaluation); ``|ŷ - y*| <= fixed + kappa·(e_x @ slope)`` for
    an operand read with ``|x̂ - x*| <= e_x``. ``rounded`` is what Theorem A.3‴ reads
    (:meth:`roundings`): the part of the error that is not a relative rounding of the
    accumulation or the storage (``fixed, slope factor``), and the bound on those roundings'
    increments (``(Σ T²)^½``, ``fixed, slope factor``), ``None`` where it does not apply
    (tensor-core dots, a compensated sum).
    """

    y: np.ndarray
    given: np.ndarray
    fixed: np.ndarray
    slope: np.ndarray
    kappa: float
    given_x: np.ndarray
    rounded: Roundings | None = None

    def error(self, e_x: np.ndarray) -> np.ndarray:
        return self.fixed + self.kappa * (e_x @ self.slope)

    def roundings(self, e_x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Theorem A.3‴: ``(moved, sigma)`` for an operand within ``e_x``. ``ŷ - y*`` is
        ``Σ_r δ_r T_r`` over the dot's, the bias's and the storage's relative roundings plus a
        rest at most ``error - moved`` (the inputs' and weights' rounding, underflow);
        ``moved`` bounds the sum, ``sigma >= (Σ_r |T_r|²)^½`` times their unit roundoffs."""
        r = self.rounded
        if r is None:
            return None
        e = e_x @ self.slope
        before = r.before[0] + r.before[1] * e  # E_2, the bound before the last rounding
        # the last rounding's underflow only where the value may be below the normal range
        low = np.abs(self.y) - self.given - before < r.eta_last[0]
        rest = r.rest[0] + r.rest[1] * e + np.where(low, r.eta_last[1], 0.0)
        return np.maximum(self.error(e_x) - rest, 0.0), r.sigma[0] + r.sigma[1] * e


@dataclasses.dataclass(frozen=True)
class Roundings:
    """Theorem A.3‴'s split of A.2 (a), each part affine in ``e_x @ slope`` (``(c_0, c_1)``):
    the rest but the last rounding's underflow, the increments' root-sum-square, ``E_2``
    before the last rounding, and that rounding's smallest normal number and underflow."""

    rest: tuple[np.ndarray, float]
    sigma: tuple[np.ndarray, float]
    before: tuple[np.ndarray, float]
    eta_last: tuple[float, float]

    def scaled(self, scale: float) -> Roundings:
        """Every bound times ``scale`` (the float64 sums' rounding)."""
        return Roundings(
            (self.rest[0] * scale, self.rest[1] * scale),
            (self.sigma[0] * scale, self.sigma[1] * scale),
            (self.before[0] * scale, self.before[1] * scale),
            (self.eta_last[0], self.eta_last[1] * scale),
        )


@np.errstate(invalid="ignore", over="ignore")
def linear(
    x: np.ndarray,
    x_given: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    num: Numerics,
    out: Format,
    lam: float | None = None,
    x_exact: bool = False,
) -> Linear:
    """A.2 (a) for ``fl_out(fl_a(fl_a(op(x̂) op(ŵ)) + b̂))``, ``w`` and ``b`` rounded to the input format.

    ``x`` stands in for the exact operand ``x*`` with ``|x - x*| <= x_given``. Values that
    overflow float64 give ``inf`` bounds, which :func:`linear_overflow` explains.
    ``x_exact``: ``x`` is the layer's input, which the kernel holds as ``fl_in(x)`` (exactly
    ``x`` where ``x`` is a value of the input format); a computed ``x`` is not.

    Every bound belongs to one row of ``x`` (the weights enter each row alike), so the rows are
    evaluated in blocks of about :data:`BLOCK` outputs, side by side
    (:func:`mhanum._threads.map_threads`), and stacked: the blocks are fixed by the shapes, so
    the result does not depend on the number of threads.
    """
    rows = x.shape[-2] if x.ndim >= 2 else 1
    step = max(1, BLOCK // max(1, w.shape[-1]))
    if x.ndim >= 2 and rows > step:
        given = np.broadcast_to(x_given, x.shape)
        cuts = [slice(a, a + step) for a in range(0, rows, step)]

        def block(cut: slice) -> Linear:
            return linear(x[..., cut, :], given[..., cut, :], w, b, num, out, lam, x_exact)

        return _stacked(map_threads(block, cuts), x_given)
    fmt_in, acc = num.format_of("input"), num.format_of("accum")
    u_op, eta_op = operand_error(num)
    d = x.shape[-1]
    bits = operand_bits(num, fmt_in)
    g = unit_factor(num, d, lam, bits=(bits, bits))
    x_bar = np.abs(x) + x_given
    e_w = rounding_error(w, fmt_in)
    e_w_op = e_w + u_op * (np.abs(w) + e_w) + eta_op
    # x̂ = x* + e: its operand rounding adds u_op|x̂| + η_op, |x̂| <= x_bar + e_x
    e0 = u_op * x_bar + eta_op
    op = num.operand_rounding
    if op is not None and num.dot_kind == "ieee":
        # an operand the kernel holds exactly (a value of the input format, no error before
        # the read) is read with its own rounding into the operand format: none for a normal
        # value of it (step 1k passes such values; A.1's step 1 does the same). The weights
        # always; x where it is the layer's input (``x_exact``), not a computed value
        e_w_op = np.where(e_w == 0, rounding_error(w, op), e_w_op)
        if x_exact:
            held = (x_given == 0) & (rounding_error(x, fmt_in) == 0)
            e0 = np.where(held, rounding_error(x, op), e0)
    slope = np.abs(w) + e_w_op
    if u_op == 0 and eta_op == 0:  # no operand rounding: e0 = 0 (a product of zeros is 0)
        fixed = x_bar @ e_w_op
    else:
        fixed = e0 @ np.abs(w) + x_bar @ e_w_op + e0 @ e_w_op
    f64 = chain_dot_factor(d + 1, "sequential", 2.0**-53)
    y = x @ w
    y_given = f64 * (np.abs(x) @ np.abs(w))
    # >= |x̃·w̃| at e_x = 0, the exact dot of the operands as read (Theorem R.8's signed sum)
    signed = np.abs(y) + y_given + (x_given + e0) @ slope + np.abs(x) @ e_w_op
    a0 = (x_bar + e0) @ slope
    accumulation, growth = _accumulation(num, (d, bits), a0, signed, g)
    fixed = fixed + accumulation
    anchor = tensor_core_anchor(num)
    if anchor:
        fixed = fixed + g * anchor * (
            (x_bar + e0).sum(axis=-1, keepdims=True) + slope.sum(axis=0) + d * anchor
        )
    kappa = (1 + u_op) * (1 + growth)
    if np.any(x_given):  # (an exact operand adds nothing)
        y_given = x_given @ np.abs(w) + y_given
    if b is not None:
        y = y + b
        y_given = y_given + f64 * np.abs(b)
        e_b = rounding_error(b, fmt_in)
        y_bar = np.abs(y) + y_given
        fixed = (1 + acc.u) * (fixed + e_b) + acc.u * y_bar + acc.smallest_normal
        kappa *= 1 + acc.u
    y_bar = np.abs(y) + y_given
    rounded = _roundings((x_bar, e0), e_w_op, slope, b, num, out, (y_bar, fixed, kappa), signed)
    fixed = out.u * y_bar + (1 + out.u) * fixed + out.smallest_normal
    kappa *= 1 + out.u
    scale = 1 + evaluation_rounding(x.shape[-1])  # the float64 sums over the inputs
    return Linear(
        y, y_given * scale, fixed * scale, slope, kappa * scale, x_given,
        None if rounded is None else rounded.scaled(scale),
    )  # fmt: skip


def _stacked(blocks: list[Linear], x_given: np.ndarray) -> Linear:
    """One :class:`Linear` from its blocks of rows (in order): the row-shaped bounds stacked,
    the weights' ``slope`` and the constants (the same in every block) kept."""

    def rows(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts, axis=-2)

    first, rounded = blocks[0], [b.rounded for b in blocks]
    together = None
    if first.rounded is not None:
        r = [x for x in rounded if x is not None]
        together = Roundings(
            (rows([x.rest[0] for x in r]), first.rounded.rest[1]),
            (rows([x.sigma[0] for x in r]), first.rounded.sigma[1]),
            (rows([x.before[0] for x in r]), first.rounded.before[1]),
            first.rounded.eta_last,
        )
    return Linear(
        rows([b.y for b in blocks]), rows([b.given for b in blocks]),
        rows([b.fixed for b in blocks]), first.slope, first.kappa, x_given, together,
    )  # fmt: skip


def _accumulation(
    num: Numerics, dot: tuple[int, int], a0: np.ndarray, signed: np.ndarray, g: float
) -> tuple[np.ndarray, float]:
    """A.2 (a)'s accumulation error at ``e_x = 0`` and its growth per unit more of ``Σ|x̃||w̃|``:
    ``g·Σ|x̃||w̃|`` and the underflow (Theorem S.0, R.5), or where smaller Theorem R.8's through
    the one-signed total (``signed >= |x̃·w̃|``), which grows by ``OneSigned.growth`` at most
    (``A`` and ``C`` each by at most the extra ``Σ|x̃||w̃|``); ``dot = (d, operand bits)``."""
    d, bits = dot
    plain = g * a0 + unit_eta(num, d)
    if tensor_core_anchor(num):
        return plain, g
    sizes = one_signed_sizes(num, d, (bits, bits), a0, one_signed_total(a0, signed, d))
    r8 = None if sizes is None else sizes.error()
    if sizes is None or r8 is None:
        return plain, g
    return np.fmin(plain, r8), max(g, sizes.growth)


def _roundings(
    x_read: tuple[np.ndarray, np.ndarray],
    e_w: np.ndarray,
    slope: np.ndarray,
    b: np.ndarray | None,
    num: Numerics,
    out: Format,
    before: tuple[np.ndarray, np.ndarray, float],
    signed: np.ndarray,
) -> Roundings | None:
    """Theorem A.3‴'s split of A.2 (a), each part affine in ``e_x @ slope`` (``(c_0, c_1)``).

    ``ŷ - y* = (x̃ - x*)w̃ + x*(w̃ - w) + (b̂ - b) + Σ_r δ_r T_r + η`` (``x̃``, ``w̃`` the
    operands as the dot reads them): with ``x_read = (x̄, e_0)``, ``|x̃ - x̂| <= e_0 + u_op e_x``
    (the read into the operand format; ``e_0 = 0`` without one) and ``|w̃ - w| <= e_w``, the
    rest is at most ``e_0|w̃| + (1 + u_op)e_x|w̃| + x̄ e_w + |b̂ - b| + η`` (the dot's, the
    sum's and the storage's underflow); the relative roundings are at most ``2d - 1`` of the
    dot's, ``|T| <= (1 + g)Σ|x̃||w̃|`` (``g`` the deterministic factor; twice each where the
    backend may carry a narrower format), the bias's on ``|ỹ| <= ȳ + E`` and the storage's on
    ``|ỹ| <= ȳ + E_2`` (``before``: ``ȳ`` and ``E_2 = fixed + kappa·(e_x @ slope)`` before the
    last rounding)."""
    if num.dot_kind != "ieee" or num.order.compensated:
        return None
    x_bar, e0 = x_read
    u_op = operand_error(num)[0]
    acc = num.format_of("accum")
    d = x_bar.shape[-1]
    y_bar, fixed, kappa = before
    twice = 2 if num.order.carried and acc.u > 2.0**-24 else 1
    g_det = unit_factor(num, d, None, bits=(operand_bits(num, num.format_of("input")),) * 2)
    rest_0 = x_bar @ e_w + unit_eta(num, d)
    if np.any(e0):
        rest_0 = rest_0 + e0 @ slope
    if b is not None:
        rest_0 = rest_0 + rounding_error(b, num.format_of("input")) + acc.smallest_normal
    dot = acc.u * (1 + g_det) * math.sqrt(twice * (2 * d - 1))
    # (Σ T²)^½ <= dot·(x̄ + e_0 + (1 + u_op)e_x)|w̃| + u_a(ȳ + E_2) [bias] + u_F(ȳ + E_2)
    last = (acc.u if b is not None else 0.0) + out.u
    bits = operand_bits(num, num.format_of("input"))
    sums = _dot_spread(num, (d, bits), (x_bar + e0) @ slope, signed, dot)
    sig_0 = sums + last * (y_bar + fixed)
    return Roundings(
        (rest_0, 1.0 + u_op),
        (sig_0, dot * (1 + u_op) + last * kappa),
        (fixed, kappa),
        (out.smallest_normal, out.smallest_normal),
    )


def _dot_spread(
    num: Numerics, dot_shape: tuple[int, int], a0: np.ndarray, signed: np.ndarray, dot: float
) -> np.ndarray:
    """``(Σ_r T_r²)^½`` over the dot's relative roundings at ``e_x = 0``: ``dot·Σ|x̂||ŵ|``, or
    where smaller Theorem R.8's sizes (one rounding per addition): the products' ``T_k``
    have ``Σ T_k² <= (Σ|x̂_k ŵ_k|)²`` (none where exact), each of the ``d - 1`` additions rounds
    ``|T_v| <= C + κA + Jη`` (``C`` the one-signed total), so ``((u_×A)² + (d - 1)(u_a T)²)^½``.
    That grows by at most ``u_a((u_×/u_a)² + (d - 1)(1 + κ)²)^½`` per unit more of
    ``Σ|x̂||ŵ|`` (``A`` and ``C`` each by at most that much), below ``dot``, which stays the
    slope; ``dot_shape = (d, operand bits)``."""
    d, bits = dot_shape
    plain = dot * a0
    u_a = num.format_of("accum").u
    sizes = one_signed_sizes(num, d, (bits, bits), a0, one_signed_total(a0, signed, d))
    if sizes is None or sizes.u_add != u_a:  # (two roundings per addition: the plain form)
        return plain
    slope = math.hypot(sizes.u_mul, u_a * math.sqrt(d - 1) * (1 + sizes.kappa))
    if slope > dot:
        return plain
    spread = np.hypot(sizes.u_mul * sizes.absolute, u_a * math.sqrt(d - 1) * sizes.rounded)
    return np.fmin(plain, spread)


def linear_overflow(
    lin: Linear,
    x: np.ndarray,
    e_x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    num: Numerics,
    out: Format,
    name: str,
) -> tuple[np.ndarray, list[str]]:
    """R.7: the entries of ``ŷ = fl_out(x̂ ŵ + b̂)`` that may overflow, and why.

    With ``x̂`` off ``x`` by at most ``e_x``: the operands read into the operand and
    accumulation formats, every partial sum of the dot (below ``(1 + g)·Σ|x̂||ŵ| + η``, and
    with the bias), and the rounding into ``out`` (``|ŷ| <= |y| + given + error``).
    """
    fmt_in, acc = num.format_of("input"), num.format_of("accum")
    op = num.operand_rounding
    u_op, eta_op = operand_error(num)
    x_op = (1 + u_op) * (np.abs(x) + lin.given_x + e_x) + eta_op
    d = x.shape[-1]
    bits = operand_bits(num, fmt_in)
    g = unit_factor(num, d, None, bits=(bits, bits))
    bad = np.zeros(np.broadcast_shapes((*x.shape[:-1], 1), (w.shape[-1],)), bool)
    reasons: list[str] = []

    def check(upper: ArrayLike, fmt: Format, stage: str) -> None:
        nonlocal bad
        hit = ~(np.asarray(upper, np.float64) <= fmt.max_finite)
        if hit.any():
            bad = bad | np.broadcast_to(hit, bad.shape)
            worst = float(np.max(np.where(np.isnan(upper), np.inf, upper)[hit]))
            reason = (
                f"{stage}: values up to {worst:.4g} may overflow {fmt.name} "
                f"(largest finite {fmt.max_finite:.6g})"
            )
            if reason not in reasons:
                reasons.append(reason)

    w_upper = np.abs(w) + rounding_error(w, fmt_in)
    check(
        np.broadcast_to(w_upper.max(axis=0), bad.shape),
        fmt_in,
        f"{name}: the weights in the input format",
    )
    for fmt, where in ((op, "the dot's operand format"), (acc, "the accumulation format")):
        if fmt is not None:
            check(x_op.max(axis=-1, keepdims=True), fmt, f"{name}: the operand read into {where}")
            check(
                np.broadcast_to(lin.slope.max(axis=0), bad.shape),
                fmt,
                f"{name}: the weights read into {where}",
            )
    dot = (1 + g) * (x_op @ lin.slope) + unit_eta(num, d)
    check(dot, acc, f"{name}: the product accumulated")
    if b is not None:
        check(
            dot + (np.abs(b) + rounding_error(b, fmt_in)) * (1 + acc.u) + acc.smallest_normal,
            acc,
            f"{name}: the product plus the bias",
        )
    check(
        np.abs(lin.y) + lin.given + lin.error(e_x), out, f"{name}: the result rounded to {out.name}"
    )
    return bad, reasons
