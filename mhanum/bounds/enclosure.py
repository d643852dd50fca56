"""The enclosure algebra every bound stage uses (papers/backward.md, §0).

A quantity of a bound's derivation is carried as an :class:`Enclosure`: its float64 stand-in
``mid``, ``rad >= |mid - exact|`` and ``err >= |computed - exact|``, componentwise. A stage that
may overflow records which gradients it reaches in a :class:`Ranges`; a dot on the numerics'
unit from enclosed operands is Theorem B.0's :class:`Dot`. The helpers below read a value into
another format (:func:`read_error`), bound products of enclosed matrices (:func:`product_spread`,
:func:`signed_product`, :func:`kbar_enclosure`) and the float64 evaluation (:func:`f64_dot`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum.bounds.factors import (
    F64_DOT,
    chain,
    compound,
    evaluation_rounding,
    gamma,
    native_unit,
    operand_error,
    tensor_core_anchor,
    unit_eta,
    unit_factor,
)
from mhanum.bounds.scale import scale_rounding
from mhanum.formats import Format
from mhanum.numerics import Numerics

__all__ = [
    "GRADIENTS",
    "U64",
    "Dot",
    "Enclosure",
    "OneSigned",
    "Ranges",
    "dot_factor",
    "f64_dot",
    "flush_floor",
    "kbar_enclosure",
    "log_radius",
    "one_signed_dot_error",
    "one_signed_sizes",
    "one_signed_total",
    "plain_output",
    "product_spread",
    "read_error",
    "scaled_output",
    "signed_product",
    "transpose",
    "transpose_or_none",
]

U64 = 2.0**-53
"""The unit roundoff of float64, in which every bound is evaluated."""

GRADIENTS = ("dq", "dk", "dv", "dbias")
"""The gradients of one attention, each of which a stage that may overflow can reach."""


@dataclasses.dataclass
class Enclosure:
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


class Ranges:
    """Which gradients a stage that may overflow reaches, and why."""

    def __init__(self) -> None:
        self.hit: dict[str, bool] = dict.fromkeys(GRADIENTS, False)
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


class Dot:
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


def dot_factor(
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


def one_signed_total(absolute: np.ndarray, signed: np.ndarray, n: int) -> np.ndarray:
    """``C >= max(P, N)``, the larger of the sums of the positive and of the negative products
    of a dot of ``n`` terms: ``(Σ|y_k| + |Σ y_k|)/2``, at most ``Σ|y_k|``. ``absolute >= Σ|y_k|``
    and ``signed >= |Σ y_k|`` (the exact dot's magnitude), both evaluated in float64, whose
    rounding of ``absolute`` (at most ``n + 2`` operations) is charged to both."""
    absolute = absolute * (1 + F64_DOT * (n + 2))
    return np.minimum(absolute, 0.5 * (absolute + signed))


def one_signed_dot_error(
    num: Numerics,
    n: int,
    bits: tuple[int, int],
    absolute: np.ndarray,
    one_signed: np.ndarray,
    lam: float | None = None,
) -> np.ndarray | None:
    """Theorem R.8 (papers/summation.md): the error of a dot of ``n`` products ``y_k`` on
    ``num``'s IEEE unit, in any tree order, through the one-signed total ``C = max(P, N)``.

    Every addition rounds the exact sum of a subset of the computed products, plus its
    operands' errors, and a subset's exact sum lies in ``[-N, P]``. So each of the ``n - 1``
    additions rounds a value of magnitude at most ``T = C + κA + Jη``, and

    ``|fl(Σ y_k) - Σ y_k| <= u_×A + (n - 1)u_*T + (2n - 1)η``

    with ``A = Σ|y_k|`` (``absolute``), ``C`` (``one_signed``: :func:`one_signed_total`),
    ``u_*`` an addition's unit (``u'`` where a format narrower than float32 may be carried in
    float32), ``u_×`` the products' (0 when exact), ``η`` the accumulation format's smallest
    normal number (a flushed result), ``κ = u_× + γ_{n-2}(u_*)(1 + u_×)`` and ``J = n(1 +
    γ_{n-2}(u_*)) + (n - 2)(1 + u_*)^{n-2}``. With ``lam`` (Theorem R.8', the model of R.6: the
    relative roundings independent and of mean zero) the roundings' part is one martingale,
    ``λ((u_×A)² + (n - 1)(u_*T)²)^½``, which fails with probability at most ``2e^{-λ²/2}``
    (one event per dot). ``None`` where the theorem does not apply: a split or tensor-core
    unit, a compensated order, ``γ_{n-2}(u_*)`` infinite, and (with ``lam``) a format carried
    in float32 (two roundings per addition).
    """
    sizes = one_signed_sizes(num, n, bits, absolute, one_signed)
    return None if sizes is None else sizes.error(lam)


@dataclasses.dataclass(frozen=True)
class OneSigned:
    """Theorem R.8's sizes of a dot of ``n`` products: the accumulation format's smallest normal
    number ``eta`` and unit ``u_acc``, each addition's unit ``u_add`` (``u_*``), the products'
    ``u_mul`` (``u_×``), ``κ``, ``absolute >= Σ|y_k|`` (with its float64 rounding), ``rounded >= |T_v|``
    (``C + κA + Jη``, the value every addition rounds) and ``growth``, by how much the bound
    ``u_×A + (n - 1)u_*T`` grows per unit more of ``A`` and ``C`` (``u_× + (n - 1)u_*(1 + κ)``)."""

    n: int
    eta: float | np.ndarray
    u_acc: float
    u_add: float
    u_mul: float
    kappa: float
    absolute: np.ndarray
    rounded: np.ndarray
    growth: float

    def error(self, lam: float | None = None) -> np.ndarray | None:
        """R.8's bound ``u_×A + (n - 1)u_*T + (2n - 1)η``, or with ``lam`` R.8''s
        ``λ((u_×A)² + (n - 1)(u_*T)²)^½ + (2n - 1)η`` (``None`` where additions round twice)."""
        if lam is None:
            return self.deterministic()
        spread = self.spread()
        return None if spread is None else lam * spread + self.underflow()

    def deterministic(self) -> np.ndarray:
        """R.8's bound ``u_×A + (n - 1)u_*T + (2n - 1)η``."""
        bound = self._products() + (self.n - 1) * self.u_add * self.rounded
        return (bound + (2 * self.n - 1) * self.eta) * (1 + 2.0**-40)

    def spread(self) -> np.ndarray | None:
        """R.8''s ``((u_×A)² + (n - 1)(u_*T)²)^½``, at least the root-sum-square of the bounds
        on the martingale's increments (``None`` where additions round twice: a format carried
        in float32)."""
        if self.u_add != self.u_acc:
            return None
        return np.hypot(self._products(), math.sqrt(self.n - 1) * self.u_add * self.rounded) * (
            1 + 2.0**-40
        )

    def underflow(self) -> float | np.ndarray:
        """R.8's underflow part ``(2n - 1)η``, with probability 1."""
        return (2 * self.n - 1) * self.eta * (1 + 2.0**-40)

    def _products(self) -> np.ndarray:
        a = self.absolute
        return self.u_mul * a if self.u_mul else np.zeros_like(a)  # (no 0·inf)


def one_signed_sizes(
    num: Numerics,
    n: int,
    bits: tuple[int, int],
    absolute: np.ndarray,
    one_signed: np.ndarray,
    eta_scale: float | np.ndarray = 1.0,
) -> OneSigned | None:
    """Theorem R.8's sizes (:class:`OneSigned`) of a dot of ``n`` products on ``num``'s unit, or
    ``None`` outside it (a split or tensor-core unit, a compensated order, ``n < 2``,
    ``γ_{n-2}(u_*)`` infinite). ``eta_scale``: the dot's sizes are given divided by a factor
    ``>= 1/eta_scale`` (the online softmax's unnormalised weights over the row sum), so its
    underflow ``η`` is taken as ``η·eta_scale``."""
    order, acc = num.order, num.format_of("accum")
    if num.dot_kind != "ieee" or not order.tree or n < 2:
        return None
    u_add = native_unit(acc.u) if order.carried else acc.u
    u_mul = 0.0 if sum(bits) <= acc.precision else acc.u
    g = gamma(n - 2, u_add)
    if not math.isfinite(g):
        return None
    kappa = u_mul + g * (1 + u_mul)
    j = n * (1 + g) + (n - 2) * (1 + u_add) ** (n - 2)
    a = absolute * (1 + F64_DOT * (n + 2))
    eta = acc.smallest_normal * eta_scale
    rounded = one_signed + kappa * a + j * eta
    growth = u_mul + (n - 1) * u_add * (1 + kappa)
    return OneSigned(n, eta, acc.u, u_add, u_mul, kappa, a, rounded, growth)


def f64_dot(n: int) -> float:
    """The float64 evaluation factor of a dot of length ``n`` (any order)."""
    return chain(n, "sequential", U64, None, products=True)


def read_error(
    upper: np.ndarray, src: Format, dst: Format, lower: np.ndarray | None = None
) -> np.ndarray | float:
    """The error of reading a value of ``src`` (``|x| <= upper``) into ``dst``: ``u|x|`` in
    ``dst``'s normal range; below it at most ``min(|x|, η)`` (flushed or rounded to a
    subnormal number, 0 being a candidate), ``η`` ``dst``'s smallest normal number. With
    ``lower <= |x|``, the second part only where ``lower < η`` (the value may lie below it)."""
    if dst.precision >= src.precision and dst.smallest_normal <= src.smallest_normal:
        return 0.0
    u = dst.u if dst.precision < src.precision else 0.0
    flush = np.minimum(upper, flush_floor(src, dst))
    if lower is not None:
        flush = np.where(lower >= flush_floor(src, dst), 0.0, flush)
    return u * upper + flush


def flush_floor(src: Format, dst: Format) -> float:
    """The absolute part ``η`` of reading a value of ``src`` into ``dst`` (its relative part
    ``u`` is carried as a ratio): ``dst``'s smallest normal number where that is above
    ``src``'s, else 0."""
    return dst.smallest_normal if dst.smallest_normal > src.smallest_normal else 0.0


def log_radius(r: Any) -> Any:
    """``-log(1 - r)``: a ratio within ``1 ± r`` is within ``e^{±ρ}`` (``inf`` for ``r >= 1``)."""
    r = np.asarray(r, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(r < 1, -np.log1p(-np.minimum(r, 0.5 + 0.5 * (r < 1))), np.inf)


def product_spread(
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


def signed_product(
    a_mid: np.ndarray, a_up: np.ndarray, b_mid: np.ndarray, b_up: np.ndarray
) -> np.ndarray:
    """Step 8: ``>= |a b|`` for ``|a - a_mid| <= a_up - |a_mid|``, ``|b - b_mid| <= b_up -
    |b_mid|``: ``|a_mid b_mid| + (a_up - |a_mid|) b_up + |a_mid| (b_up - |b_mid|)``, the float64
    product of the midpoints within ``γ_n`` of ``a_up b_up``; NaN where an operand is not
    finite."""
    n = a_up.shape[-1]
    m_a, m_b = np.abs(a_mid), np.abs(b_mid)
    with np.errstate(invalid="ignore", over="ignore"):
        signed = np.abs(a_mid @ b_mid) + f64_dot(n) * (a_up @ b_up)
        signed = signed + (a_up - m_a) @ b_up + m_a @ (b_up - m_b)
        return signed * (1 + evaluation_rounding(n))


def kbar_enclosure(
    p_mid: np.ndarray, p_up: np.ndarray, k: np.ndarray, k_rad: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(p_mid k, rad)`` with ``|Σ_j P_ij k_jc - (p_mid k)_ic| <= rad`` for
    ``|P - p_mid| <= p_up - p_mid`` and ``k`` within ``k_rad`` of the float64 stand-in:
    ``(p_up - p_mid)(|k| + r) + p_mid r + γ p_mid|k|``."""
    ka = np.abs(k)
    kbar = p_mid @ k
    rad = f64_dot(p_mid.shape[-1]) * (p_mid @ ka)
    if k_rad is None:
        return kbar, rad + (p_up - p_mid) @ ka
    return kbar, rad + (p_up - p_mid) @ (ka + k_rad) + p_mid @ k_rad


def scaled_output(
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
    rounding = read_error(y_up + y_err, acc, out)
    return carried, own + rounding


def plain_output(x_up: np.ndarray, x_err: np.ndarray, num: Numerics) -> np.ndarray:
    """The output rounding of an accumulated ``X̂`` (``|X| <= x_up``, ``|X̂ - X| <= x_err``),
    shaped like ``x_up``."""
    return read_error(x_up + x_err, num.format_of("accum"), num.format_of("output")) + 0 * x_up


def transpose(x: np.ndarray) -> np.ndarray:
    """The last two axes swapped."""
    return np.swapaxes(x, -1, -2)


def transpose_or_none(x: np.ndarray | None) -> np.ndarray | None:
    """:func:`transpose`, or ``None`` for an exact operand (no radius)."""
    return None if x is None else transpose(x)
