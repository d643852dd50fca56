"""The factor algebra every bound uses: γ, tree heights, Kahan's constant, the probabilistic γ̃,
the per-unit sum and dot factors (IEEE, split bfloat16 passes, tensor cores), scale and operand
roundings, and the exp/sum factors of the softmax.

Each function is a lemma of papers/summation.md (R.1-R.7), papers/tensorcore.md (T.2) or
papers/attention.md (steps 0-7); the theorems that compose them live in the modules beside this
one (:mod:`~mhanum.bounds.summation`, :mod:`~mhanum.bounds.softmax`,
:mod:`~mhanum.bounds.forward`, :mod:`~mhanum.bounds.a_priori`, :mod:`~mhanum.bounds.heads`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.formats import Format, representable
from mhanum.numerics import Numerics
from mhanum.units import (
    SummationOrder,
    summation_order,
    summation_order_spellings,
    summation_orders,
)
from mhanum.units.tensorcore import TensorCoreModel, get_model

if TYPE_CHECKING:
    from mhanum._types import NumpyArray

__all__ = [
    "EVALUATION",
    "F64_DOT",
    "LOG2E",
    "chain",
    "chain_dot_factor",
    "check_count",
    "check_lam",
    "compound",
    "conversion_eta",
    "division_error",
    "evaluation_rounding",
    "exp_and_sum_factors",
    "gamma",
    "kahan_constants",
    "kahan_factor",
    "native_unit",
    "operand_bits",
    "operand_error",
    "operand_error_of",
    "order_of",
    "parse_order",
    "probabilistic_gamma",
    "product_gamma",
    "rounding_error",
    "safe_weight_sums",
    "split_constants",
    "step_w_output",
    "sum_factor",
    "summation_gamma",
    "tensor_core_anchor",
    "tensor_core_eta",
    "tensor_core_factor",
    "tree_height",
    "unit_eta",
    "unit_factor",
]

_U_CARRIER = 2.0**-24  # float32, which carries every accumulation format narrower than it


def check_count(n: object, name: str = "n", minimum: int = 1) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < minimum:
        msg = f"{name}: expected an integer >= {minimum}, got {n!r}"
        raise InvalidArgument(msg)
    return int(n)


def _check_unit(u: Any) -> float:
    ok = isinstance(u, (int, float, np.floating)) and not isinstance(u, bool)
    if not ok or not (0 < float(u) <= 0.25):
        msg = f"u: expected a unit roundoff in (0, 1/4], got {u!r}"
        raise InvalidArgument(msg)
    return float(u)


def order_of(order: object) -> SummationOrder:
    """The registered summation order written ``order`` (:func:`mhanum.units.summation_order`),
    whose fields the bounds read: its tree height, compensated nature and roundings.

    Raises:
        InvalidArgument: naming ``order``, for one that is not registered.
    """
    try:
        return summation_order(order)
    except InvalidArgument as err:
        listed = summation_order_spellings(" with ")
        msg = (
            f"order: expected a summation order as in numerics.summation ({listed}), got {order!r}"
        )
        raise InvalidArgument(msg) from err


def parse_order(order: object) -> tuple[str, int | None]:
    """``(kind, block)`` of a summation order written as in :attr:`mhanum.Numerics.summation`."""
    unit = order_of(order)
    return unit.kind, unit.block


def check_lam(lam: Any, name: str = "probabilistic") -> float:
    ok = isinstance(lam, (int, float, np.floating)) and not isinstance(lam, bool)
    if not ok or not (math.isfinite(lam) and lam > 0):
        msg = f"{name}: expected a finite λ > 0 (or None), got {lam!r}"
        raise InvalidArgument(msg)
    return float(lam)


def gamma(n: int, u: float) -> float:
    """``γ_n = nu/(1 - nu)`` (Theorem R.1; Higham 2002, Lemma 3.1), ``inf`` when ``nu >= 1``.

    If ``|δ_i| <= u`` and ``ρ_i = ±1`` then ``Π_{i<=n} (1 + δ_i)^{ρ_i} = 1 + θ_n`` with
    ``|θ_n| <= γ_n`` whenever ``nu < 1``. For ``nu >= 1`` no finite bound follows and ``inf``
    is returned (every bound built on it is then ``inf``, not an error).

    Args:
        n: number of factors, ``>= 0``.
        u: unit roundoff, ``0 < u <= 1/4``.

    Raises:
        InvalidArgument: for ``n < 0`` or a ``u`` outside ``(0, 1/4]``.

    Examples:
        >>> gamma(2, 0.5**24) == 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
        True
        >>> gamma(256, 2.0**-8)
        inf
    """
    k, uu = check_count(n, "n", 0), _check_unit(u)
    return math.inf if k * uu >= 1 else k * uu / (1 - k * uu)


def tree_height(n: int, order: str) -> int:
    """The largest number of additions on a term's path to the result (Theorem R.2).

    Additions of an exact zero (the implementation starts each running sum from 0 and pads
    incomplete blocks with zeros) are exact and are not counted.

    ============  ===========================================
    order         height ``h``
    ============  ===========================================
    native        ``n - 1`` (any tree with ``n`` leaves)
    sequential    ``n - 1``
    pairwise      ``⌈log2 n⌉``
    blocked(b)    ``(min(b, n) - 1) + (⌈n/b⌉ - 1)``
    ============  ===========================================

    Args:
        n: number of terms, ``>= 1``.
        order: a summation order as in :attr:`mhanum.Numerics.summation`, not ``"kahan"``
            (compensated summation is no tree; see :func:`kahan_factor`).

    Raises:
        InvalidArgument: for ``n < 1``, an unknown order or ``"kahan"``.

    Examples:
        >>> [tree_height(n, "pairwise") for n in (1, 2, 3, 4, 5, 8, 9)]
        [0, 1, 2, 2, 3, 3, 4]
    """
    n = check_count(n)
    unit = order_of(order)
    if unit.tree:
        return unit.height(n)
    msg = f"order: expected a summation tree order (not {str(unit)!r}; see kahan_factor), got {order!r}"
    raise InvalidArgument(msg)


def native_unit(u: float) -> float:
    """``u'`` of a native addition: formats narrower than float32 may be carried in float32."""
    return u + _U_CARRIER + _U_CARRIER * u if u > _U_CARRIER else u


def kahan_constants(n: int, u: float) -> tuple[float, float, float, float]:
    """``(K, K', S, S')`` of Theorem R.4.

    The error is at most ``K·X + K'·η`` and every running sum at most ``S·X + S'·η`` in
    magnitude, for terms of absolute sum ``X`` and an underflow error ``η`` per operation.
    """
    if n == 1:
        return 0.0, 1.0, 1.0, 1.0
    beta = 2 * u + u * u
    den = 1 - 2 * u - u * u - n * u * beta
    if den <= 0:
        return math.inf, math.inf, math.inf, math.inf
    kappa = u * (2 + beta + u) / den
    kappa_eta = 3 * (1 + n * u) / den
    ell = u * (n * beta + 1) + beta * (n - 1)
    k_x = u * (1 + beta) + beta + kappa * ell
    k_eta = 1 + 3 * n * (1 + u) + kappa_eta * ell
    s_x = 1 + beta + (n * beta + 1) * kappa
    s_eta = 3 * n + (n * beta + 1) * kappa_eta
    return k_x, k_eta, s_x, s_eta


def kahan_factor(n: int, u: float) -> float:
    """Theorem R.4: the relative constant of Kahan's compensated sum of ``n`` terms.

    For ``s = Σ x_i`` computed by ``y = x_k - c; t = s + y; c = (t - s) - y; s = t`` (from
    ``s = c = 0``) in a binary format with round to nearest and no underflow,

    .. math::

        |\\hat s - s| \\le K_n \\sum_i |x_i|, \\qquad
        K_n = u(1+\\beta) + \\beta + \\kappa\\,(u(n\\beta + 1) + \\beta(n - 1))
            = 3u + 4nu^2 + O(u^2 + n^2u^3),

    with ``β = 2u + u²``, ``κ = u(2 + β + u)/(1 - 2u - u² - nuβ)``, valid while the denominator
    is positive (``nu·β < 1 - 2u - u²``, about ``n < 1/(2u²)``); ``K_1 = 0``. Otherwise ``inf``.
    The proof (papers/summation.md §R.4) rests on the identity ``ŝ - s = b_n + Σ_k a_k -
    Σ_{k<n} d_k`` (errors of ``s``, ``y`` and ``t``), Dekker's exactness of ``c`` when
    ``|s| >= |y|`` and ``|d_k| <= u|y_k|`` otherwise. Its leading constant is ``3u``; Knuth and
    Higham (2002, §4.3, eq. (4.8)) give ``2u + O(nu²)`` without an explicit second-order term.
    Underflow adds ``K'_n η`` (see :func:`sum_bound`).

    Raises:
        InvalidArgument: for ``n < 1`` or a ``u`` outside ``(0, 1/4]``.

    Examples:
        >>> round(kahan_factor(100, 2.0**-24) / 2.0**-24, 4)
        3.0
    """
    return kahan_constants(check_count(n), _check_unit(u))[0]


def sum_factor(n: int, order: str, u: float) -> float:
    """The relative constant of a sum of ``n`` terms in ``order`` (Theorems R.3, R.4).

    ``|ŝ - Σ x_i| <= sum_factor(n, order, u) · Σ|x_i|`` without underflow, for terms that are
    values of the accumulation format with unit roundoff ``u``: ``γ_h`` with ``h``
    :func:`tree_height` for the tree orders, ``γ_{n-1}(u')`` for ``native`` (``u' = u + 2^-24 +
    2^-24·u`` when ``u > 2^-24``: the format may be carried in float32), :func:`kahan_factor`
    for ``kahan``. ``inf`` when no finite bound follows (``hu >= 1``).

    Raises:
        InvalidArgument: for ``n < 1``, an unknown order or a bad ``u``.

    Examples:
        >>> sum_factor(256, "pairwise", 2.0**-24) == gamma(8, 2.0**-24)
        True
    """
    n, uu = check_count(n), _check_unit(u)
    unit = order_of(order)
    if unit.compensated:
        return kahan_constants(n, uu)[0]
    return gamma(unit.height(n), native_unit(uu) if unit.carried else uu)


_BF16_HEAD = 1 + 2.0**-8  # |piece_1| <= (1 + 2^-8)|a|: a truncated or a rounded leading piece
_BF16_REST = 2.0**-7  # |a - (piece_1 + ... + piece_i)| <= (2^-7)^i |a|, truncated or rounded
_SPLIT_PASSES = {1: ((0, 0),), 3: ((0, 0), (0, 1), (1, 0)),
                 6: ((0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (2, 0))}  # fmt: skip


def split_constants(passes: int) -> tuple[float, float]:
    """``(c_P, τ_P)`` of a float32 dot run as ``passes`` bfloat16 passes (Theorem R.7).

    Each float32 ``a`` is split into ``m`` bfloat16 pieces (``m = 1, 2, 3`` for 1, 3, 6 passes),
    each piece the remainder truncated (XLA) or rounded (Henry et al.) to 8 bits, so that
    ``|a_1| <= (1 + 2^-8)|a|``, ``|a_i| <= (1 + 2^-8) β^{i-1} |a|`` and the remainder after ``m``
    pieces ``|ρ_m| <= β^m |a|`` with ``β = 2^-7`` (``ρ_3 = 0``: three pieces hold 24 bits).
    The passes are the products ``a_i b_j`` with ``(i, j)`` in the pass set ``P``, and

    .. math::

        \\sum_{(i,j) \\in P} |a_i||b_j| \\le c_P |a||b|, \\qquad
        \\Bigl|ab - \\sum_{(i,j) \\in P} a_i b_j\\Bigr| \\le \\tau_P |a||b|,

    ``c_P = Σ_P κ_i κ_j`` and ``τ_P = Σ_{(i,j) ∉ P, i,j <= m} κ_i κ_j + 2ρ(1 + ρ) + ρ²`` with
    ``κ_i = (1 + 2^-8)β^{i-1}`` and ``ρ = β^m`` (0 for ``m = 3``). Away from underflow.

    Raises:
        InvalidArgument: for ``passes`` other than 1, 3 or 6.

    Examples:
        >>> c, tau = split_constants(6)
        >>> tau < 2**-19
        True
    """
    if passes not in _SPLIT_PASSES:
        msg = f"passes: expected 1, 3 or 6, got {passes!r}"
        raise InvalidArgument(msg)
    pieces = {1: 1, 3: 2, 6: 3}[passes]
    kappa = [_BF16_HEAD * _BF16_REST**i for i in range(pieces)]
    used = _SPLIT_PASSES[passes]
    c = sum(kappa[i] * kappa[j] for i, j in used)
    dropped = sum(
        kappa[i] * kappa[j] for i in range(pieces) for j in range(pieces) if (i, j) not in used
    )
    rho = 0.0 if pieces == 3 else _BF16_REST**pieces
    return c, dropped + 2 * rho * (1 + rho) + rho * rho


def probabilistic_gamma(n: int, u: float, lam: float) -> tuple[float, float]:
    """Theorem R.6 (Higham & Mary 2019, Theorem 2.4): ``(γ̃_n(λ), P(λ))``.

    If ``δ_1, ..., δ_n`` are independent random variables of mean zero with ``|δ_i| <= u`` and
    ``ρ_i = ±1``, then ``Π (1 + δ_i)^{ρ_i} = 1 + θ_n`` with

    .. math::

        |\\theta_n| \\le \\tilde\\gamma_n(\\lambda) = \\exp\\Big(\\lambda\\sqrt{n}\\,u
            + \\frac{nu^2}{1-u}\\Big) - 1 \\quad\\text{with probability at least}\\quad
        P(\\lambda) = 1 - 2\\exp\\big(-\\lambda^2(1-u)^2/2\\big)

    (returned clamped to ``>= 0``). This is a statement about a *probabilistic model*: it holds
    for stochastic rounding and is only a model of round to nearest, whose errors are
    deterministic functions of the data. Proof via Hoeffding's inequality in
    papers/summation.md §R.6.

    Raises:
        InvalidArgument: for ``n < 0``, a bad ``u`` or ``λ <= 0``.

    Examples:
        >>> g, p = probabilistic_gamma(10**6, 2.0**-24, 4.0)
        >>> g < gamma(10**6, 2.0**-24) / 200, round(p, 6)
        (True, 0.999329)
    """
    k, uu, lm = check_count(n, "n", 0), _check_unit(u), check_lam(lam)
    g = math.expm1(lm * math.sqrt(k) * uu + k * uu * uu / (1 - uu))
    p = 1 - 2 * math.exp(-((lm * (1 - uu)) ** 2) / 2)
    return g, max(p, 0.0)


LOG2E = math.log2(math.e)  # the float64 log2(e) kernels fold into the scale (exp_form)
EVALUATION = 2.0**-40  # relative rounding of evaluating the bound in float64 (see A.1, step 0)
F64_DOT = 2.0**-52  # per-operation relative error of the float64 logits, with margin (step 0)


def evaluation_rounding(n: int) -> float:
    """The relative rounding of evaluating a bound's sums over ``n`` keys in float64: ``2^-40``,
    or past about 4,000 keys ``(2n + 512)·2^-53`` (``γ_n`` of the sums, with margin: a BLAS
    product or a sum of ``n`` terms is not bounded by a constant for every ``n``)."""
    return max(EVALUATION, (2 * n + 512) * 2.0**-53)


def _chain_sum_factor(n: int, order: str, u: float, lam: float | None = None) -> float:
    """Relative error of a sum of ``n`` terms in ``order`` (Theorem S.0); refuses ``nu >= 1``.

    With ``lam``, the probabilistic factor ``γ̃_h(λ)`` of Theorem R.6 for a tree of height ``h``
    (Kahan's sum keeps its deterministic constant).
    """
    return chain(n, order, u, lam, products=False)


def chain_dot_factor(n: int, order: str, u: float, lam: float | None = None) -> float:
    """Relative error of a dot of length ``n``: each product rounded, then summed in ``order``."""
    return chain(n, order, u, lam, products=True)


def compound(
    *rels: Any, powers: tuple[tuple[Any, int], ...] = (), over: tuple[Any, ...] = ()
) -> Any:
    """``Π(1 + r_i) · Π(1 + r_j)^k_j / Π(1 - s_l) - 1``, rounded up, for ``r >= 0``,
    ``0 <= s < 1`` (floats or arrays).

    Evaluated as ``expm1`` of a sum of ``log1p``: the plain product ``(1 + r)(1 + r') - 1``
    loses every ``r`` below ``2^-53`` to the rounding of ``1 + r``, so float64's own unit
    roundoff would read as 0. Within a few ulps, then rounded up by ``2^-50`` relative.

    Examples:
        >>> compound(2.0**-53, 2.0**-53) >= 2.0**-52  # (1 + 2^-53)**2 - 1 == 0.0 in float64
        True
        >>> compound(powers=((2.0**-24, 3),)) >= (1 + 2.0**-24) ** 3 - 1
        True
    """
    with np.errstate(over="ignore", invalid="ignore"):
        log = sum((np.log1p(r) for r in rels), start=np.float64(0.0))
        log = log + sum((k * np.log1p(r) for r, k in powers), start=np.float64(0.0))
        log = log - sum((np.log1p(-s) for s in over), start=np.float64(0.0))
        out = np.expm1(log) * (1 + 2.0**-50)
    return float(out) if np.ndim(out) == 0 else out


def product_gamma(n: int, u: float) -> float:
    """A factor for ``n`` roundings ``1 + δ_i`` with no division (Corollary R.1'), every ``n``.

    ``|Π_{i<=n} (1 + δ_i) - 1| <= (1 + u)^n - 1 <= γ_n`` for ``|δ_i| <= u``; the result is
    ``γ_n`` while ``γ_n < 1`` (the form Theorems R.3 and A.1 state) and ``(1 + u)^n - 1``
    beyond, finite for every ``n``.

    Examples:
        >>> product_gamma(8, 2.0**-24) == gamma(8, 2.0**-24)
        True
        >>> round(product_gamma(256, 2.0**-8), 4)  # γ_256 is infinite for bfloat16
        1.713
    """
    k, uu = check_count(n, "n", 0), _check_unit(u)
    g = gamma(k, uu)
    if g < 1:
        return g
    # k·log1p(u) and expm1 in float64, each widened past its rounding (a few ulps)
    log_growth = k * math.log1p(uu) * (1 + 2.0**-50)
    return math.expm1(log_growth) * (1 + 2.0**-50) if log_growth < 709 else math.inf


def chain(
    n: int, order: str, u: float, lam: float | None, *, products: bool, extra: int = 0
) -> float:
    """The factor of a sum (or dot) of ``n`` terms followed by ``extra`` further roundings.

    ``γ_h`` of :func:`summation_gamma` while ``γ_h < 1``; beyond (``hu >= 1/2``, e.g. 256
    bfloat16 terms) :func:`product_gamma`'s ``(1 + u)^h - 1``, which holds for every ``h`` (each
    term reaches the sum through at most ``h`` roundings ``1 + δ``, and no division; Corollary
    R.1'): a factor of 1 or more gives a large bound, or a vacuous one with its reason
    downstream, not a refusal. Kahan's constant has no such form: ``InvalidArgument`` beyond
    its validity (about ``n >= 1/(2u²)``).
    """
    n = max(n, 1)
    unit = order_of(order)
    g_det = summation_gamma(n, order, u)
    if unit.tree and not g_det < 1:
        g_det = product_gamma(unit.height(n), native_unit(u) if unit.carried else u)
    g = compound(g_det, powers=((u, extra + int(products)),))
    if lam is not None and unit.tree:
        length = unit.height(n) + extra + int(products)
        if unit.carried and u > 2.0**-24:
            length *= 2  # partial sums may be rounded to float32 first, then to the format
        # the deterministic factor holds always, so the event |θ| <= min(both) has the
        # probability of |θ| <= γ̃ (Theorem A.3): short chains keep γ, long ones get γ̃
        g_prob = probabilistic_gamma(length, u, lam)[0]
        g = g_prob if not (math.isfinite(g) and 0 <= g < 1) else min(g, g_prob)
    if not math.isfinite(g):
        why = (
            "n·u·(2u + u²) < 1 - 2u - u² for Kahan's sum (Theorem R.4)"
            if unit.compensated
            else "(1 + u)^n below the largest float64 (Corollary R.1')"
        )
        msg = f"numerics: expected {why}, got n = {n} with u = {u}"
        raise InvalidArgument(msg)
    return g


_SPLIT_FLUSH = 2.0**-125  # a bf16 piece below 2^-126 may be flushed: |a - Σ pieces| gains < 2^-125


def operand_error(num: Numerics) -> tuple[float, float]:
    """``(u_op, η_op)``: ``|a_used - a| <= u_op|a| + η_op`` for a dot operand (A.1, step 1)."""
    if num.dot_kind == "split":
        return 0.0, _SPLIT_FLUSH
    op = num.operand_rounding
    return (op.u, op.smallest_normal) if op is not None else (0.0, 0.0)


def operand_error_of(num: Numerics, fmt: Format) -> tuple[float, float]:
    """:func:`operand_error` for an operand held in ``fmt``: no relative error where the operand
    format holds every value of ``fmt`` (a bfloat16 probability read by a bfloat16 tensor core),
    whose read is then exact but for a flush below the operand format's smallest normal number
    (``η_op``, kept)."""
    u_op, eta_op = operand_error(num)
    op = num.operand_rounding
    if (
        op is not None
        and num.dot_kind != "split"
        and op.precision >= fmt.precision
        and op.emin <= fmt.emin
        and op.max_finite >= fmt.max_finite
    ):
        return 0.0, eta_op
    return u_op, eta_op


def operand_bits(num: Numerics, fmt: Format) -> int:
    """Significant bits of a dot operand stored in ``fmt`` after the operand rounding."""
    op = num.operand_rounding
    return min(fmt.precision, op.precision) if op is not None else fmt.precision


def unit_factor(
    num: Numerics, n: int, lam: float | None, *, bits: tuple[int, int], extra: int = 0
) -> float:
    """Relative error of a dot of length ``n`` on ``num``'s dot unit, then ``extra`` roundings.

    ``|computed - Σ a_k b_k| <= factor · Σ |a_k||b_k|`` (plus the underflow terms of
    :func:`unit_eta`) for the operands ``a, b`` the unit reads. ``bits`` are the operands'
    significant bits: products are exact when they sum to at most the accumulation precision
    (Theorem R.5). A split dot (Theorem R.7) sums ``P`` passes of exact products: the tree of
    each pass and ``P - 1`` additions of passes, times ``c_P``, plus the dropped pieces ``τ_P``.
    """
    order, acc = num.summation, num.format_of("accum")
    kind = num.dot_kind
    if kind == "ieee":
        exact = sum(bits) <= acc.precision
        return chain(n, order, acc.u, lam, products=not exact, extra=extra)
    if kind == "split":
        c, tau = split_constants(num.dot_passes)
        g = chain(n, order, acc.u, lam, products=False, extra=num.dot_passes - 1)
        return compound(g * c + tau, powers=((acc.u, extra),))
    if lam is not None:
        msg = "lam: the probabilistic bound (Theorem A.3) does not cover tensor-core dot units"
        raise InvalidArgument(msg)
    model = get_model(num.dot_model or "")
    f = tensor_core_factor(model, max(n, 1), order=num.summation)
    return compound(f, powers=((acc.u, extra),))


def tensor_core_anchor(num: Numerics) -> float:
    """``2^emin`` of a tensor core's input format, else 0 (Theorem A.1, step 3, tensor cores).

    Theorem T.2 assumes normal inputs. A product with a subnormal factor ``b`` is aligned as if
    ``|b|`` were ``2^emin``, so it can raise a step's alignment exponent to at most
    ``2^emin·|a|``: counting ``2^emin (|a_k| + |b_k| + 2^emin)`` as an extra addend of every
    product keeps T.2's proof valid. The dot's error gains
    ``factor · 2^emin · Σ_k (|a_k| + |b_k| + 2^emin)``.
    """
    op = num.operand_rounding
    return op.smallest_normal if num.dot_kind == "tensor-core" and op is not None else 0.0


def unit_eta(num: Numerics, n: int) -> float:
    """Absolute underflow allowance of one dot of length ``n`` (flushed products and sums)."""
    eta_a = num.format_of("accum").smallest_normal
    if num.dot_kind == "tensor-core":
        model = get_model(num.dot_model or "")
        return tensor_core_eta(model, max(n, 1), order=num.summation)
    return 2 * n * num.dot_passes * eta_a


def conversion_eta(num: Numerics, fmt: Format) -> float:
    """``η`` of reading a value of ``fmt`` into the accumulation format (A.1, step 1).

    The accumulation format is at least as precise as every operand (``Numerics`` checks it),
    but its normal range may start higher (bfloat16 operands accumulated in float16): a value
    below its smallest normal is then subnormal or flushed, an absolute error below ``2^emin``.
    """
    acc = num.format_of("accum")
    return acc.smallest_normal if acc.smallest_normal > fmt.smallest_normal else 0.0


def exp_and_sum_factors(
    num: Numerics, n: int, gap: float | NumpyArray, lam: float | None, bits_pv: tuple[int, int]
) -> tuple[Any, int, float, float, float]:
    """A.1 step 5: ``(x, K, g_sum, g_pv, eta_pv)`` for keys ``|ŝ_j - m| <= gap``.

    ``e^x - 1`` bounds the relative error of a key's computed exponential (naive: the argument
    is exact; online: its own exp and the rescalings of the ``K - 1`` later blocks, whose
    arguments telescope to ``gap``), ``g_sum`` and ``g_pv`` are the factors of the softmax sum
    and of ``P V`` (online: within a block, then ``K`` cross-block additions) and ``eta_pv`` the
    absolute underflow of ``P V``. ``K = 0`` unless online.
    """
    fm, acc = num.format_of("softmax"), num.format_of("accum")
    u_m, eta_m, u_a, eta_a = fm.u, fm.smallest_normal, acc.u, acc.smallest_normal
    own = eta_m + math.log1p(2 * num.exp_ulps * u_m)
    order = num.summation
    if num.softmax_kind != "online":
        x = own if num.softmax_kind == "naive" else u_m * gap + own
        g_sum, g_pv = _chain_sum_factor(n, order, u_m, lam), unit_factor(num, n, lam, bits=bits_pv)
        return x, 0, g_sum, g_pv, unit_eta(num, n)
    assert num.softmax_block is not None
    # exp2-folded: each rescaling's argument fl(fl(m - m')·c2) is rounded twice, and the
    # arguments still telescope to gap (papers/attention.md, step 3'')
    # exp2-scaled: each rescaling's argument fl(M - M') is rounded once, but the scaled maxima
    # telescope to at most gap + 2·u_m·R (R the row's largest |s|), whose excess u_m²·2R lies
    # within the shift term u_m·R that step 3'' charges each key and exp2-scaled never incurs
    # (its shifts are the x_k themselves: papers/attention.md, step 3'')
    arg = u_m * (2 + u_m) if num.exp2 else u_m
    width = min(num.softmax_block, n)
    blocks = -(-n // num.softmax_block)
    if num.online_sums == "running":
        # One chain over every key (papers/attention.md, step 5, running sums): a key passes
        # through its block's additions and, inside the carried sum, through every later
        # block's, at most n - 1 in all in the native or sequential order (each block's tree on
        # its w_b keys and the carried term has height <= w_b); a tensor core restarts its
        # groups at each block: at most blocks more steps, n + blocks·g products' worth.
        model = (
            get_model(num.dot_model) if num.dot_kind == "tensor-core" and num.dot_model else None
        )
        chain_n = n + blocks * model.group if model is not None else n
        x = arg * gap + blocks * own + (blocks - 1) * (math.log1p(u_m) + 2 * math.log1p(u_a))
        x = x + _lifted_argument(num)
        g_sum = chain(n, order, u_m, lam, products=False, extra=blocks)
        g_pv = unit_factor(num, chain_n, lam, bits=bits_pv, extra=blocks)
        return x, blocks, g_sum, g_pv, unit_eta(num, chain_n) + 2 * blocks * eta_a
    x = arg * gap + blocks * own + (blocks - 1) * (math.log1p(u_m) + 2 * math.log1p(u_a))
    x = x + _lifted_argument(num)
    g_sum = chain(width, order, u_m, lam, products=False, extra=blocks)
    g_pv = unit_factor(num, width, lam, bits=bits_pv, extra=blocks)
    return x, blocks, g_sum, g_pv, blocks * unit_eta(num, width) + 2 * blocks * eta_a


def _lifted_argument(num: Numerics) -> float:
    """``prob_offset = k``: the exponent's argument ``fl(fl(t·c2) - fl(fl(m·c2) - k))`` is up to
    ``k`` larger (base 2), and its rounding up to ``u_m·k·ln 2`` (natural units) more."""
    u_m = num.format_of("softmax").u
    return u_m * (1 + u_m) * num.prob_offset * math.log(2.0)


def safe_weight_sums(
    n: int | NumpyArray, g_sum: float | NumpyArray, u_div: float, fm: Format
) -> tuple[Any, Any]:
    """Lemma W (papers/attention.md, step W): the safe softmax's computed weights over ``n``
    live keys, whatever the logit errors: ``(inv, row)`` with every quotient
    ``fl_m(ê_j/Ŝ) <= inv·ê_j/Σ_l ê_l + η_m`` and their sum at most ``row = inv + n·η_m``.

    Every computed exponential ``ê_j = fl(exp(fl(ŝ_j - m̂)))`` is at most ``1 + ε_e`` (its
    argument is at most 0) and the row maximum's is ``exp(0) = 1`` (assumption E of M.5), so
    ``Σ_j ê_j >= 1`` and the computed row sum (factor ``g_sum``) is
    ``Ŝ >= (1 - T_0)·Σ_j ê_j``, ``T_0 = (1 + nη_m)(1 + g_sum) - 1 + nη_m``; the division within
    ``u_div``: ``inv = (1 + u_div)/(1 - T_0)``, ``inf`` where ``T_0 >= 1``. ``n`` and ``g_sum``
    may be arrays (per row)."""
    eta = fm.smallest_normal
    t_0 = compound(n * eta, g_sum) + n * eta
    with np.errstate(divide="ignore"):
        inv = np.where(t_0 < 1, (1 + u_div) / (1 - t_0), np.inf)
    return inv, inv + n * eta


def step_w_output(
    row: float | NumpyArray,
    n: int | NumpyArray,
    keys: int,
    v_top: float | NumpyArray,
    v_sum: float | NumpyArray,
    g_pv: float | NumpyArray,
    eta_pv: float | NumpyArray,
    num: Numerics,
) -> tuple[Any, Any]:
    """Lemma W's output bound: ``(acc, out)`` with ``acc >= |P·V accumulated|`` (every partial
    sum) and ``out >= |ô|``, for divided weights of ``n`` live keys summing to at most ``row``
    (:func:`safe_weight_sums`), rounded into the probability and operand formats, against
    values ``|v̄_jl| <= v_top_l``; ``v_sum_l >= Σ_j |v̄_jl|`` over the ``keys`` keys enters a
    tensor core's anchor term. ``g_pv``, ``eta_pv``: step 7's factor and underflow."""
    fp, fo = num.format_of("prob"), num.format_of("output")
    u_op, eta_op = operand_error(num)
    eta_op += conversion_eta(num, num.operand_rounding or fp)
    w_row = (1 + u_op) * ((1 + fp.u) * row + n * fp.smallest_normal) + n * eta_op
    anchor = tensor_core_anchor(num)
    with np.errstate(invalid="ignore", over="ignore"):
        if anchor:
            eta_pv = eta_pv + g_pv * anchor * (w_row + v_sum + keys * anchor)
        acc = (1 + g_pv) * w_row * v_top + eta_pv
    return acc, (1 + fo.u) * acc + fo.smallest_normal


def division_error(div_ulps: float, u: float) -> float:
    """``ε_div = (1 + u)^(2·div_ulps) - 1``: the relative error of a division within ``div_ulps``.

    ``div_ulps = 1/2`` is a correctly rounded quotient (``u``); ``div_ulps = 1`` is a product
    with a correctly rounded reciprocal, ``fl(a·fl(1/b)) = (a/b)(1 + δ1)(1 + δ2)``, which is
    what XLA computes for a division by a broadcast row sum (measured on the CPU: up to
    ``1.95u`` relative). The form is at least ``2·div_ulps·u``, the error of ``div_ulps`` ulps.

    Examples:
        >>> division_error(1.0, 2.0**-24) == (1 + 2.0**-24) ** 2 - 1
        True
    """
    return math.expm1(2 * div_ulps * math.log1p(u))


def summation_gamma(n: int, order: str, u: float) -> float:
    """The relative error bound of a sum of ``n`` terms in ``order`` (Theorem S.0).

    Delegates to :func:`mhanum.bounds.summation.sum_factor` (papers/summation.md, R.3-R.4):

    .. math::

        |\\hat s - s| \\le \\gamma \\sum_j |a_j|, \\qquad \\gamma = \\gamma_h = \\frac{hu}{1-hu}

    with ``h`` the height of the summation tree: ``n - 1`` (sequential; native, any order, with
    ``u`` replaced by ``u + 2^-24 + 2^-24·u`` for formats narrower than float32, which XLA may
    carry in float32), ``⌈log2 n⌉`` (pairwise), ``(min(b, n) - 1) + (⌈n/b⌉ - 1)`` (blocked(b));
    Kahan's compensated sum the constant of Theorem R.4, ``3u + 4nu^2 + O(u^2)``, valid while
    ``nuβ < 1 - 2u - u²`` (``β = 2u + u²``). ``inf`` where no finite bound follows.

    Args:
        n: number of terms (``>= 1``).
        order: a summation order as in :attr:`mhanum.Numerics.summation`.
        u: unit roundoff of the accumulation format.

    Raises:
        InvalidArgument: for ``n < 1`` or an unknown order.

    References:
        Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002, §4.2-4.3;
        papers/summation.md.
    """
    return sum_factor(n, order, u)


def _tensor_core_height(model: TensorCoreModel, n: int, order: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        msg = f"n: expected a non-negative integer, got {n!r}"
        raise InvalidArgument(msg)
    unit = order_of(order)
    if unit.carried:
        return n
    if unit.running:
        return -(-n // model.group)
    resumable = tuple(str(o) for cls in summation_orders() for o in cls.examples() if o.resumable)
    msg = f"order: expected one of {resumable}, got {order!r}"
    raise InvalidArgument(msg)


def _round_up_2ulps(x: float) -> float:
    return math.nextafter(math.nextafter(x, math.inf), math.inf)


def tensor_core_factor(model: TensorCoreModel | str, n: int, *, order: str = "sequential") -> float:
    r"""The factor :math:`(1+\delta)^h - 1` of the dot-product bound (Theorem T.2).

    For ``n`` products with no nonzero input subnormal in the input format and no overflow,

    .. math::
        |\hat d - (c + \textstyle\sum_i a_i b_i)| \le ((1+\delta)^h - 1)
        (|c| + \textstyle\sum_i |a_i b_i|) + \eta_h,

    with :math:`\delta` = ``model.node_delta``, :math:`\eta_h` = :func:`tensor_core_eta`, and ``h``
    the height: ``ceil(n / group)`` for ``"sequential"`` (``model.dot`` and :func:`matmul`), and
    ``n`` for ``"native"``: any tree whose nodes are fused steps of this model or float32
    additions, grouped as a library chooses (split-K included), in which a node that rounds has
    at least two nonzero operands.

    Returns:
        The factor, rounded upward.

    Raises:
        InvalidArgument: for an unknown model or order, or a negative ``n``.

    Examples:
        >>> from mhanum.units.tensorcore import MODELS
        >>> tensor_core_factor("v100-fp16", 4) >= MODELS["v100-fp16"].node_delta  # one step
        True
    """
    m = get_model(model)
    h = _tensor_core_height(m, n, order)
    return _round_up_2ulps(math.expm1(h * math.log1p(m.node_delta))) if h else 0.0


def tensor_core_eta(model: TensorCoreModel | str, n: int, *, order: str = "sequential") -> float:
    r"""The underflow term :math:`\eta_h` of Theorem T.2: :math:`\eta \cdot N (1+\delta)^{h-1}`.

    ``N`` is the number of steps: ``h`` (sequential) or at most ``n`` (native).
    """
    m = get_model(model)
    h = _tensor_core_height(m, n, order)
    if h == 0:
        return 0.0
    return _round_up_2ulps(m.node_eta * h * math.exp((h - 1) * math.log1p(m.node_delta)))


# --------------------------------------------------------------------------------------------
# JAX emulation: integer arithmetic on the bits of float32 carriers.


def rounding_error(x: np.ndarray, fmt: Format) -> np.ndarray:
    """A componentwise bound on ``|fl(x) - x|`` for the rounding of ``x`` into ``fmt`` (step 1).

    ``0`` for a normal value of ``fmt`` or zero; ``u|x|`` for a value that rounds to a normal
    number; ``2^emin`` more for a value below ``2^emin``, even one ``fmt`` represents, since a
    subnormal may be read as zero (XLA's CPU backend treats float32 denormals as zero). Entry by
    entry: one subnormal input charges its own entry, not every entry.
    """
    x = np.asarray(x, np.float64)
    exact = representable(x, fmt)
    tiny = (x != 0) & (np.abs(x) < fmt.smallest_normal)
    return np.where(exact, 0.0, fmt.u * np.abs(x)) + np.where(tiny, fmt.smallest_normal, 0.0)
