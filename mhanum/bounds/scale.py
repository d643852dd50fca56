"""The scale constants of Theorem A.1 (papers/attention.md, steps 2 and 2'): a scale rounded into
a format (:func:`scale_rounding`), and the factor a kernel multiplies its operands by when the
scale sits on ``q`` or, split as its square root, on ``q`` and ``k`` (:class:`OperandScale`,
shared by A.1, A.4 and the backward's step 2')."""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Any

import numpy as np

from mhanum.bounds.factors import compound
from mhanum.formats import Format, round_to
from mhanum.numerics import Numerics

__all__ = ["OperandScale", "is_power_of_four", "operand_scale", "power_of_two", "scale_rounding"]


def is_power_of_four(d: int) -> bool:
    return d & (d - 1) == 0 and (d.bit_length() - 1) % 2 == 0


def power_of_two(x: float) -> bool:
    return x != 0 and math.frexp(x)[0] in (0.5, -0.5)


def scale_rounding(f64: float, fmt: Format) -> tuple[float, float, float]:
    """``(f̂, u_r, u_mul)`` of a scale factor rounded into ``fmt`` (steps 2 and 2').

    ``f̂`` is ``f64`` rounded into ``fmt``; ``|f̂_used - f64| <= u_r|f64|`` for the factor the
    computation uses, and a product by it is rounded with relative ``u_mul``. A factor that is
    subnormal in ``fmt`` (or rounds to zero) may be read as zero (XLA treats denormals as zero),
    so ``u_r = 1`` and its product, if not flushed, is rounded like any other (``u_mul = u``).
    A factor past ``fmt``'s range rounds to ``inf``: ``u_r = inf``, and every error it enters
    is infinite (the stages' range checks then name it).
    """
    f_hat = float(round_to(f64, fmt))
    if not math.isfinite(f_hat):
        return f_hat, math.inf, fmt.u
    if min(abs(f_hat), abs(f64)) < fmt.smallest_normal:  # subnormal, or rounded up to 2^emin
        return f_hat, 1.0, fmt.u
    u_r = 0.0 if f_hat == f64 else fmt.u
    u_mul = 0.0 if power_of_two(f_hat) else fmt.u
    return f_hat, u_r, u_mul


@dataclasses.dataclass(frozen=True)
class OperandScale:
    """The scale factor of step 2' (papers/attention.md), applied to ``q`` (and ``k``).

    Attributes:
        fmt: the scale format the product is taken in.
        f64: the float64 factor: the scale, or its square root when it is split over q and k.
        u64: the relative error of ``f64`` against the exact factor (the default scale's two
            float64 roundings unless ``d_k = 4^m``; the square root's, unless exact).
        f_hat, u_r, u_mul: :func:`scale_rounding` of ``f64`` into ``fmt``.
        u_t: the rounding of an operand of the storage format read into ``fmt`` (0 when
            ``fmt`` is at least as precise).
        theta: the compound relative error ``(1 + u_r)(1 + u_t)(1 + u_mul) - 1``.
        up: a bound on ``|fl64(f64·x)| / |x|``.
        eta: the read's underflow, times ``f̂`` and rounded in the product, then the product's.
    """

    fmt: Format
    f64: float
    u64: float
    f_hat: float
    u_r: float
    u_mul: float
    u_t: float
    theta: float
    up: float
    eta: float

    def applied(self, x: np.ndarray, e: Any, g: Any) -> tuple[np.ndarray, Any, Any]:
        """Step 2' on one operand (papers/attention.md): ``(x_s, e_s, g_s)``: the float64
        stand-in ``x_s = fl64(f64·x)`` of the scaled operand, ``e_s >= |fl(fl(x̂)·f̂) - x_s|``
        for the computed one (``x̂`` within ``e`` of ``x``) and ``g_s >= |x_s - f·x*|`` for the
        exact one (``x`` within ``g`` of the exact ``x*``).

        Examples:
            >>> s = operand_scale(0.25, 16, False, Numerics(scale="qk"))
            >>> xs, e_s, g_s = s.applied(np.array([3.0]), 0.0, 0.0)
            >>> float(xs[0]), bool(e_s[0] <= 2 * s.eta), bool(g_s[0] < 1e-300)  # exact: underflow only
            (1.5, True, True)
        """
        xs = self.f64 * x
        # the float64 product may itself be subnormal: an absolute 2^-1074 at most
        rounding = (0.0 if power_of_two(self.f64) else 2.0**-53 * np.abs(xs)) + 2.0**-1074
        theta, up, u64 = self.theta, self.up, self.u64
        e_s = up * (theta * np.abs(x) + (1 + theta) * e) + rounding + self.eta
        g_s = up * g / (1 - u64) + (u64 / (1 - u64)) * up * np.abs(x) + rounding
        return xs, e_s, g_s


def operand_scale(scale: float, d_k: int, default_scale: bool, num: Numerics) -> OperandScale:
    """Step 2' (papers/attention.md): the factor a kernel applies to its operands when the
    scale sits on ``q`` (or, split as its square root, on ``q`` and ``k``), with its roundings.

    Examples:
        >>> s = operand_scale(0.25, 16, False, Numerics(scale="qk"))
        >>> s.f64, s.u64, s.theta
        (0.5, 0.0, 0.0)
    """
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
    u_t = fmt.u if fmt.precision < num.storage_format.precision else 0.0
    up = abs(f64) * (1 + 2.0**-52)
    eta = fmt.smallest_normal * (1 + up * (1 + u_r) * (1 + u_mul))
    return OperandScale(fmt, f64, u64, f_hat, u_r, u_mul, u_t, compound(u_r, u_t, u_mul), up, eta)
