"""Rigorous error bounds for sums and inner products in every summation order of mhanum.

The orders are those of :mod:`mhanum.emulate.summation` (``native``, ``sequential``, ``pairwise``,
``blocked(b)``, ``kahan``); the theorems and their proofs are in ``papers/summation.md``
(R.1-R.6). The bounds are rigorous (no ``O(u^2)`` dropped) and include underflow; the a posteriori
ones (:func:`sum_bound`, :func:`dot_bound`, :func:`matmul_bound`) take the data the computation
ran on and bound its error componentwise.

Model of the arithmetic in the accumulation format ``F`` (unit roundoff ``u``, smallest normal
``2^emin``), shared by every theorem here:

* ``+ -`` and ``*`` round to nearest: ``fl(a op b) = (a op b)(1 + δ) + η``, ``|δ| <= u``; narrow
  formats are carried in float32 and rounded once more, which gives the correctly rounded result
  (double rounding is innocuous, see :mod:`mhanum.emulate._arith`);
* underflow: XLA's CPU backend flushes float32, bfloat16 (carried in float32) and float64
  subnormal results to zero and reads subnormal operands as zero, so a rounding carries
  ``|η| < 2^emin`` and a subnormal term or operand may be lost entirely (that loss is counted
  exactly, a posteriori); float16 is carried in float32, where its subnormals are normal numbers:
  underflow is gradual, ``|η| <= u 2^emin``;
* ``native`` is XLA's own reduction or dot: its order is unknown, so the bound holds for every
  summation tree (height at most ``n - 1``); for bfloat16 and float16 it may keep partial sums in
  float32 and round them to ``F`` anywhere, which costs a unit roundoff
  ``u' = u + 2^-24 + 2^-24 u`` per addition instead of ``u`` (Theorem R.3);
* no overflow: a bound that cannot exclude it is ``inf``.

Examples:
    >>> tree_height(1000, "pairwise"), tree_height(1000, "blocked(32)")
    (10, 62)
    >>> float(sum_bound([1.0, 2.0**-24, 2.0**-24], "sequential").total) > 2 * 2.0**-24
    True
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.factors import (
    check_count,
    check_lam,
    compound,
    gamma,
    kahan_constants,
    kahan_factor,
    native_unit,
    order_of,
    probabilistic_gamma,
    split_constants,
    sum_factor,
    tensor_core_factor,
    tree_height,
)
from mhanum.formats import Format, get_format, round_to
from mhanum.units import ACCUM_FORMATS, dot_unit

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = [
    "dot_bound",
    "dot_factor",
    "gamma",
    "kahan_factor",
    "matmul_bound",
    "probabilistic_gamma",
    "split_constants",
    "sum_bound",
    "sum_factor",
    "tree_height",
]

_PAPER = "papers/summation.md Theorem"
_FLUSHING = ("float64", "float32", "bfloat16")
_U64 = 2.0**-53
_SLACK = 1.0 + 2.0**-40  # evaluating a bound in float64 (each total is multiplied by it)
_MODEL = (
    "round to nearest in the accumulation format (narrow formats via float32, innocuously)",
    (
        "underflow: |η| < 2^emin per rounding and subnormal operands read as zero (flush to "
        "zero), or |η| <= u·2^emin (float16, gradual)"
    ),
    "native: any summation tree; bfloat16/float16 partial sums possibly carried in float32",
    "no overflow (the bound is inf where overflow is not excluded)",
    "x (or a, b) rounded once into the operand/accumulation format (as with jax_enable_x64)",
)


# Arguments -------------------------------------------------------------------------------------


def _accum(accum: Format | str) -> Format:
    fmt = get_format(accum, argname="accum")
    if fmt.name not in ACCUM_FORMATS:
        msg = f"accum: expected one of {', '.join(ACCUM_FORMATS)}, got {fmt.name}"
        raise InvalidArgument(msg)
    return fmt


def _array(x: ArrayLike, name: str, min_ndim: int) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as err:
        msg = f"{name}: expected a real array, got {type(x).__name__}"
        raise InvalidArgument(msg) from err
    if arr.dtype.kind not in "fiu" and not str(arr.dtype).startswith(("bfloat", "float")):
        msg = f"{name}: expected a real array, got dtype {arr.dtype}"
        raise InvalidArgument(msg)
    arr = arr.astype(np.float64)
    if arr.ndim < min_ndim or 0 in arr.shape[-min_ndim:]:
        shape = "(..., n)" if min_ndim == 1 else "(..., m, k) or (..., k, n)"
        msg = f"{name}: expected shape {shape} with nonzero sizes, got {arr.shape}"
        raise InvalidArgument(msg)
    if not np.isfinite(arr).all():
        msg = f"{name}: expected finite values, got NaN or inf"
        raise InvalidArgument(msg)
    return arr


# Constants -------------------------------------------------------------------------------------


def _subset(inner: Format, outer: Format) -> bool:
    """Whether every value of ``inner`` is a value of ``outer``."""
    return (
        inner.precision <= outer.precision
        and inner.emin >= outer.emin
        and inner.max_finite <= outer.max_finite
    )


def dot_factor(
    n: int,
    order: str,
    accum: Format | str,
    *,
    input: Format | str | None = None,
    operand: Format | str | None = None,
    dot: str = "ieee",
) -> float:
    """A priori relative constant of an inner product of length ``n`` (Theorems R.5, R.7, T.2).

    ``|fl(xᵀy) - xᵀy| <= dot_factor(...) · |x|ᵀ|y|`` without underflow, for ``x, y`` values of
    ``input`` (default: ``accum``), rounded to ``operand`` first if given (``"tf32"``), each
    product rounded to ``accum`` and the products summed in ``order``:

    .. math::

        (1 + \\phi)(1 + u_{op})^2 - 1, \\qquad
        \\phi = \\gamma_{h+1} \\text{ (or } \\gamma_h \\text{ if products are exact)},\\quad
        \\phi_{\\rm kahan} = u_\\times + K_n (1 + u_\\times),

    with ``h`` the tree height, ``u_op`` the operand format's unit roundoff (0 when ``input``'s
    values are values of it), and products exact (``u_× = 0``) when the multiplied values have
    at most ``p_acc/2`` significant bits (bfloat16 or float16 values in float32, float32 values in
    float64, tf32 operands in float32). ``native`` uses ``u'`` as :func:`sum_factor`.

    Other inner-product units (``dot``, as :attr:`mhanum.Numerics.dot`; ``accum`` float32):
    ``"bf16x1"`` is the above with ``operand="bfloat16"``; ``"bf16x3"``/``"bf16x6"`` (Theorem
    R.7) give ``((1 + φ_h)(1 + u)^{P-1} - 1)·c_P + τ_P`` with ``P`` passes of exact products
    (:func:`split_constants`); ``"tensor-core(<model>)"`` gives
    :func:`mhanum.bounds.factors.tensor_core_factor` (Theorem T.2, normal inputs), with the rounding of
    ``input`` values to the model's input format as for ``operand``. Underflow terms
    are not included.

    Raises:
        InvalidArgument: for ``n < 1``, an unknown order, format or unit, or an accumulation
            format that is not one of float64, float32, bfloat16, float16.

    Examples:
        >>> dot_factor(64, "sequential", "float32", input="bf16") == gamma(63, 2.0**-24)
        True
        >>> dot_factor(64, "sequential", "float32") == gamma(64, 2.0**-24)
        True
    """
    n = check_count(n)
    unit = order_of(order)
    acc = _accum(accum)
    dunit = dot_unit(dot)
    if dunit.kind in ("split", "tensor-core") and acc.name != "float32":
        msg = f"accum: expected 'float32' with dot={str(dunit)!r}, got {acc.name!r}"
        raise InvalidArgument(msg)
    if dunit.kind == "tensor-core" and not unit.resumable:
        msg = f"order: expected an order a tensor core runs with dot={str(dunit)!r}, got {order!r}"
        raise InvalidArgument(msg)
    if dunit != "ieee":
        if dunit.kind == "tensor-core":
            f = tensor_core_factor(dunit.model or "", n, order=order)
            unit_in = get_format(dunit.operand_format or "")
            given = acc if input is None else get_format(input, argname="input")
            return f if _subset(given, unit_in) else compound(f, unit_in.u, unit_in.u)
        if dunit.kind == "ieee":  # bf16x1
            return dot_factor(n, order, acc, input=input, operand="bfloat16")
        passes = dunit.passes
        u_add = native_unit(acc.u) if unit.carried else acc.u
        base = kahan_constants(n, acc.u)[0] if unit.compensated else gamma(unit.height(n), u_add)
        c, tau = split_constants(passes)
        return compound(base, powers=((acc.u, passes - 1),)) * c + tau
    fin = None if input is None else get_format(input, argname="input")
    fop = None if operand is None else get_format(operand, argname="operand")
    bits = [acc.precision] + [f.precision for f in (fin, fop) if f is not None]
    exact = 2 * min(bits) <= acc.precision
    u_op = 0.0
    if fop is not None and not (fin is not None and _subset(fin, fop)):
        u_op = fop.u
    if unit.compensated:
        u_mul = 0.0 if exact else acc.u
        k_x = kahan_constants(n, acc.u)[0]
        phi = u_mul + k_x * (1 + u_mul)
    else:
        u_add = native_unit(acc.u) if unit.carried else acc.u
        phi = gamma(unit.height(n) + (0 if exact else 1), u_add)
    return phi if u_op == 0 else compound(phi, u_op, u_op)


# Evaluation helpers ----------------------------------------------------------------------------


def _up(value: ArrayLike, k: int) -> np.ndarray:
    """An upper bound on the exact value of a float64 sum or dot of ``k`` nonnegative terms.

    Any evaluation order in float64 (pairwise, BLAS, fused or not) has relative error at most
    ``γ_k(2^-53)``; ``1/(1 - γ) <= 1 + 2γ``, and the multiplication by the factor rounds down by
    at most ``2^-53``. The absolute ``k·2^-1021`` covers float64 underflow.
    """
    g = gamma(max(k, 1), _U64)
    return np.asarray(value) * (1 + 2 * g + 2.0**-50) + k * 2.0**-1021


def _sig_bits(v: np.ndarray) -> int:
    """The largest number of significant bits of the nonzero entries of ``v`` (0 if none)."""
    a = np.abs(v[v != 0])
    if a.size == 0:
        return 0
    mant, _ = np.frexp(a)
    ints = (mant * 2.0**53).astype(np.int64)
    low = ints & -ints
    return int(53 - np.log2(low.astype(np.float64)).min())


def _eta(fmt: Format) -> float:
    """Absolute error of one rounding below the normal range."""
    return fmt.smallest_normal if fmt.name in _FLUSHING else fmt.u * fmt.smallest_normal


def _subnormal(v: np.ndarray, fmt: Format) -> np.ndarray:
    """Entries an operation may read as zero (denormals-are-zero in a flushing format)."""
    if fmt.name not in _FLUSHING:
        return np.zeros(v.shape, bool)
    return (v != 0) & (np.abs(v) < fmt.smallest_normal)


class _Model:
    """The constants of one summation over ``n`` terms in ``order`` and ``fmt``."""

    def __init__(self, n: int, order: str, fmt: Format, lam: float | None) -> None:
        self.n = n
        self.order = order_of(order)
        self.fmt = fmt
        self.eta = _eta(fmt)
        self.lam = lam
        self.unit = native_unit(fmt.u) if self.order.carried else fmt.u
        self.kahan = kahan_constants(n, fmt.u) if self.order.compensated else None
        self.height: int | None = self.order.height(n) if self.order.tree else None

    def relative(self, extra: int) -> tuple[float, float, float]:
        """``(φ, φ_det, Q)`` for terms rounded ``extra`` (0 or 1) times before the sum.

        ``φ`` is the relative factor, ``φ_det`` its deterministic value (used to propagate
        absolute errors) and ``Q`` the probability with which ``φ`` holds (1 if deterministic).
        """
        if self.kahan is not None:
            u_mul = self.fmt.u * extra
            phi = u_mul + self.kahan[0] * (1 + u_mul)
            return phi, phi, 1.0
        assert self.height is not None
        k = self.height + extra
        det = gamma(k, self.unit)
        if self.lam is None or k == 0:
            return det, det, 1.0
        g, p = probabilistic_gamma(k, self.unit, self.lam)
        return min(g, det), det, max(1 - self.n * (1 - p), 0.0)

    def propagation(self) -> float:
        """A bound on the factor an absolute error at a term picks up on its way to the result:
        ``(1 + u)^h <= 1 + γ_h`` (finite even where ``γ_h`` is not), Kahan ``1 + K_n``."""
        if self.kahan is not None:
            return 1 + self.kahan[0]
        assert self.height is not None
        return math.exp(self.height * math.log1p(self.unit)) * (1 + 2.0**-50)

    def additions_underflow(self) -> float:
        """The underflows of the additions (for Kahan: of all four operations per term),
        propagated to the result."""
        if self.kahan is not None:
            return self.kahan[1] * self.eta
        return self.order.roundings(self.n) * self.eta * self.propagation()

    def magnitude(self, x_abs: np.ndarray) -> np.ndarray:
        """A bound on every intermediate (exact or rounded), for terms of absolute sum ``x_abs``."""
        if self.kahan is not None:
            return 5 * (self.kahan[2] * x_abs + self.kahan[3] * self.eta)
        return self.propagation() * (x_abs + self.n * self.eta)


def _assumptions(model: _Model, q: float) -> tuple[str, ...]:
    if model.lam is None or model.kahan is not None:
        extra = () if model.lam is None else ("kahan: deterministic (no probabilistic form)",)
        return (*_MODEL, *extra)
    text = (
        f"probabilistic model (Higham & Mary 2019): the relative rounding errors are independent "
        f"and of mean zero (true for stochastic rounding, a model for round to nearest); each "
        f"entry holds with probability >= {q:.6g} (λ = {model.lam:g})"
    )
    return (*_MODEL, text)


def _theorem(model: _Model, base: str) -> str:
    if model.kahan is not None:
        return f"{_PAPER} R.4" if base == "R.3" else f"{_PAPER} {base} (with R.4)"
    if model.lam is not None:
        return f"{_PAPER} {base} (with R.6)"
    return f"{_PAPER} {base}"


# A posteriori bounds ---------------------------------------------------------------------------


def sum_bound(
    x: ArrayLike,
    order: str = "sequential",
    accum: Format | str = "float32",
    *,
    axis: int = -1,
    probabilistic: float | None = None,
) -> Bound:
    """The error bound of :func:`mhanum.emulate.summation.sum` on the terms ``x`` (R.3, R.4, R.6).

    **Theorem R.3 (tree orders), R.4 (Kahan).** Let ``x̂_i = fl_F(x_i)`` be the terms rounded
    into the accumulation format ``F`` and ``ŝ`` the result of ``mhanum.emulate.summation.sum(x,
    order=order, accum=F)``. Under the model of this module,

    .. math::

        |\\hat s - \\textstyle\\sum_i x_i| \\le \\underbrace{\\sum_i |\\hat x_i - x_i|}_{\\rm input}
            + \\underbrace{\\phi \\sum_i |\\hat x_i|}_{\\rm additions}
            + \\underbrace{\\sum_{\\hat x_i \\text{ subnormal}} |\\hat x_i|
            + (n-1)\\,\\eta\\,(1+u)^h}_{\\rm underflow}

    with ``φ = γ_h`` (``h`` :func:`tree_height`; ``native``: ``γ_{n-1}(u')``) and ``η`` the
    underflow error of one rounding (``2^emin`` flushing, ``u 2^emin`` float16). For Kahan
    ``φ = K_n`` (:func:`kahan_factor`) and the underflow term is ``K'_n η`` (the subnormal
    terms are inside it). With ``probabilistic=λ`` the tree factor ``γ_h`` becomes
    ``γ̃_h(λ)`` (Theorem R.6) and the bound holds, under that model, with probability at least
    ``1 - n(1 - P(λ))`` per entry (``Bound.probability``, also stated in ``assumptions``);
    Kahan stays deterministic.
    The total is the sum of the terms times ``1 + 2^-40`` (the float64 evaluation of the bound),
    and ``inf`` where an intermediate may overflow or ``hu' >= 1``.

    Args:
        x: the terms, a real array; summed along ``axis``.
        order: a summation order as in :attr:`mhanum.Numerics.summation`.
        accum: the accumulation format: float64, float32, bfloat16 or float16.
        axis: the axis summed over.
        probabilistic: ``λ > 0`` for the probabilistic bound, or ``None``.

    Returns:
        A :class:`Bound` shaped like ``x`` without ``axis``, with terms ``input``, ``additions``
        and ``underflow``.

    Raises:
        InvalidArgument: for non-finite or non-real ``x``, an empty or missing axis, an unknown
            order or format, or ``λ <= 0``.

    Examples:
        >>> b = sum_bound([1.0] + [2.0**-24] * 7, "pairwise")
        >>> round(float(b.terms["additions"]) / gamma(3, 2.0**-24), 6)  # γ_3 Σ|x_i|
        1.0

    References:
        Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002, Lemma 3.1,
        §4.2 (summation trees), §4.3 (compensated summation); papers/summation.md.
    """
    fmt = _accum(accum)
    lam = None if probabilistic is None else check_lam(probabilistic)
    arr = _array(x, "x", 1)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        msg = f"axis: expected an integer, got {axis!r}"
        raise InvalidArgument(msg)
    if not -arr.ndim <= axis < arr.ndim:
        msg = f"axis: expected an axis of x (ndim {arr.ndim}), got {axis}"
        raise InvalidArgument(msg)
    arr = np.moveaxis(arr, axis, -1)
    n = arr.shape[-1]
    if n < 1:
        msg = f"x: expected at least one term along axis {axis}, got shape {arr.shape}"
        raise InvalidArgument(msg)
    model = _Model(n, order, fmt, lam)
    hat = round_to(arr, fmt)
    overflow = ~np.isfinite(hat).all(axis=-1)  # a term beyond the format's range
    hat = np.where(np.isfinite(hat), hat, 0.0)
    phi, _, q = model.relative(0)
    with np.errstate(over="ignore", invalid="ignore"):  # a sum beyond float64: the bound is inf
        inputs = _up(np.sum(np.abs(hat - arr), axis=-1), n)
        absum = _up(np.sum(np.abs(hat), axis=-1), n)
        additions = phi * absum
        underflow = np.full(absum.shape, model.additions_underflow())
        if model.kahan is None:
            lost = np.where(_subnormal(hat, fmt), np.abs(hat), 0.0)
            underflow = underflow + _up(np.sum(lost, axis=-1), n)
        total = _finish(inputs + additions + underflow, model.magnitude(absum), fmt, overflow)
    return Bound(
        total=total,
        terms={"input": inputs, "additions": additions, "underflow": underflow},
        theorem=_theorem(model, "R.3"),
        assumptions=_assumptions(model, q),
        source="higham2002",
        probability=q,
    )


def _finish(
    total: np.ndarray, magnitude: np.ndarray, fmt: Format, overflow: np.ndarray
) -> np.ndarray:
    """``total·(1 + 2^-40)``; ``inf`` where an operand overflowed or an intermediate may."""
    with np.errstate(invalid="ignore", over="ignore"):
        ok = ~overflow & np.isfinite(total) & (magnitude * (1 + fmt.u) < fmt.max_finite)
        return np.where(ok, total * _SLACK, math.inf)


def matmul_bound(
    a: ArrayLike,
    b: ArrayLike,
    order: str = "native",
    accum: Format | str = "float32",
    *,
    operand: Format | str | None = None,
    probabilistic: float | None = None,
) -> Bound:
    """Componentwise bound on the error of :func:`mhanum.emulate.summation.matmul` (Theorem R.5).

    **Theorem R.5.** Let ``â = fl_F(fl_op(a))`` and ``b̂`` likewise be the operands the
    products are formed from (``op`` the operand format if given, e.g. ``"tf32"``; ``F`` the
    accumulation format), each product ``â_ik b̂_kj`` rounded to ``F`` and the ``K`` products
    summed in ``order``. Under the model of this module, for every entry,

    .. math::

        |\\widehat{ab} - ab| \\le \\underbrace{|\\hat a - a|\\,|\\hat b| + |a|\\,|\\hat b - b|}
            _{\\rm operands}
            + \\underbrace{\\phi\\,|\\hat a|\\,|\\hat b|}_{\\rm accumulation}
            + \\underbrace{|\\hat a_{\\rm sub}|\\,|\\hat b| + |\\hat a|\\,|\\hat b_{\\rm sub}|
            + \\xi}_{\\rm underflow}

    (matrix products of absolute values). ``φ = γ_{h+1}`` for a tree of height ``h``
    (Higham 2002, eq. (3.4)-(3.5)), ``γ_h`` when every product is exact: when the multiplied
    values have at most ``p_F`` significant bits between them (bfloat16/float16 values in
    float32, float32 values in float64, tf32 operands in float32), found from the data.
    ``native`` uses ``u'``; Kahan ``φ = u_× + K_K(1 + u_×)``. ``â_sub`` are the subnormal
    entries (read as zero in a flushing format: the product is lost) and
    ``ξ = (2K - 1)η(1 + u)^h`` (tree) or ``Kη(1 + K_K) + K'_K η`` (Kahan).
    With ``probabilistic=λ`` the tree factor is ``γ̃_{h(+1)}(λ)`` (Theorem R.6, probability
    ``>= 1 - K(1 - P(λ))`` per entry under that model). Total times ``1 + 2^-40``; ``inf``
    where overflow is not excluded.

    Args:
        a: ``(..., M, K)`` real array.
        b: ``(..., K, N)`` real array (batch dimensions broadcast).
        order: summation order over ``K``.
        accum: float64, float32, bfloat16 or float16.
        operand: format both operands are rounded to first (``"tf32"``), or ``None``.
        probabilistic: ``λ > 0`` for the probabilistic bound, or ``None``.

    Returns:
        A :class:`Bound` shaped ``(..., M, N)`` with terms ``operands``, ``accumulation`` and
        ``underflow``.

    Raises:
        InvalidArgument: for non-finite or non-real inputs, shapes that do not multiply, an
            unknown order or format, or ``λ <= 0``.

    Examples:
        >>> import numpy as np
        >>> q = np.array([[1.0, 2.0, 3.0], [0.1, 0.2, 0.3]])
        >>> b = matmul_bound(q, q.T, "sequential", "float32")
        >>> b.total.shape, b.dominant()
        ((2, 2), 'accumulation')

    References:
        Higham 2002, §3.1 (inner products), Lemma 3.1; papers/summation.md.
    """
    fmt = _accum(accum)
    op = None if operand is None else get_format(operand, argname="operand")
    lam = None if probabilistic is None else check_lam(probabilistic)
    av, bv = _array(a, "a", 2), _array(b, "b", 2)
    if av.shape[-1] != bv.shape[-2]:
        msg = f"b: expected shape (..., {av.shape[-1]}, N) to multiply a {av.shape}, got {bv.shape}"
        raise InvalidArgument(msg)
    try:
        shape = (*np.broadcast_shapes(av.shape[:-2], bv.shape[:-2]), av.shape[-2], bv.shape[-1])
    except ValueError as err:
        msg = f"b: expected batch dimensions broadcastable with a's {av.shape[:-2]}, got {bv.shape}"
        raise InvalidArgument(msg) from err
    k = av.shape[-1]
    model = _Model(k, order, fmt, lam)
    ah = round_to(av if op is None else round_to(av, op), fmt)
    bh = round_to(bv if op is None else round_to(bv, op), fmt)
    overflow = (~np.isfinite(ah).all(axis=-1))[..., :, None] | (~np.isfinite(bh).all(axis=-2))[
        ..., None, :
    ]
    ah, bh = np.where(np.isfinite(ah), ah, 0.0), np.where(np.isfinite(bh), bh, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float64: the bound is inf
        aa, ba = np.abs(ah), np.abs(bh)
        absum = _up(aa @ ba, k + (1 if fmt.name == "float64" else 0))
        operands = _operand_term(av, bv, ah, bh, shape)
        exact = _sig_bits(ah) + _sig_bits(bh) <= fmt.precision
        phi, _, q = model.relative(0 if exact else 1)
        accumulation = phi * absum
        lost = _up(np.where(_subnormal(ah, fmt), aa, 0.0) @ ba, k) + _up(
            aa @ np.where(_subnormal(bh, fmt), ba, 0.0), k
        )
        products = k * model.eta * model.propagation()
        underflow = lost + products + model.additions_underflow()
        x_abs = absum * (1 + (0.0 if exact else fmt.u)) + k * model.eta
        total = _finish(
            operands + accumulation + underflow,
            model.magnitude(x_abs),
            fmt,
            np.broadcast_to(overflow, shape),
        )
    return Bound(
        total=total,
        terms={"operands": operands, "accumulation": accumulation, "underflow": underflow},
        theorem=_theorem(model, "R.5"),
        assumptions=_assumptions(model, q),
        source="higham2002",
        probability=q,
    )


def _operand_term(
    a: np.ndarray, b: np.ndarray, ah: np.ndarray, bh: np.ndarray, shape: tuple[int, ...]
) -> np.ndarray:
    """``|â - a||b̂| + |a||b̂ - b|`` (upper), which bounds ``|âb̂ - ab|`` entrywise.

    ``â - a`` is exact in float64 (Sterbenz: ``â`` is within a factor 2 of ``a``, or 0).
    """
    k = a.shape[-1]
    da, db = np.abs(ah - a), np.abs(bh - b)
    out = np.zeros(shape)
    if da.any():
        out = out + _up(da @ np.abs(bh), k)
    if db.any():
        out = out + _up(np.abs(a) @ db, k)
    return out


def dot_bound(
    x: ArrayLike,
    y: ArrayLike,
    order: str = "native",
    accum: Format | str = "float32",
    *,
    operand: Format | str | None = None,
    probabilistic: float | None = None,
) -> Bound:
    """Bound on the error of the inner products ``Σ_k x[..., k] y[..., k]`` (Theorem R.5).

    The inner product as :func:`mhanum.emulate.summation.matmul` computes it for a ``(1, n)`` by
    ``(n, 1)`` product: see :func:`matmul_bound`, of which this is the batched vector form.
    ``x`` and ``y`` are ``(..., n)`` and broadcast in their leading dimensions.

    Returns:
        A :class:`Bound` shaped like the broadcast leading dimensions, with terms ``operands``,
        ``accumulation`` and ``underflow``.

    Raises:
        InvalidArgument: as :func:`matmul_bound`, and for last dimensions that differ.

    Examples:
        >>> b = dot_bound([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], "sequential", "bfloat16")
        >>> round(float(b.terms["accumulation"]) / (32 * gamma(2, 2.0**-8)), 6)  # exact products
        1.0
    """
    xv, yv = _array(x, "x", 1), _array(y, "y", 1)
    if xv.shape[-1] != yv.shape[-1]:
        msg = f"y: expected shape (..., {xv.shape[-1]}) like x {xv.shape}, got {yv.shape}"
        raise InvalidArgument(msg)
    try:
        lead = np.broadcast_shapes(xv.shape[:-1], yv.shape[:-1])
    except ValueError as err:
        msg = f"y: expected leading dimensions broadcastable with x's {xv.shape}, got {yv.shape}"
        raise InvalidArgument(msg) from err
    got = matmul_bound(
        xv[..., None, :],
        yv[..., :, None],
        order,
        accum,
        operand=operand,
        probabilistic=probabilistic,
    )

    def squeeze(v: ArrayLike) -> np.ndarray:
        return np.asarray(v).reshape(lead)

    return Bound(
        total=squeeze(got.total),
        terms={name: squeeze(v) for name, v in got.terms.items()},
        theorem=got.theorem,
        assumptions=got.assumptions,
        source=got.source,
        probability=got.probability,
    )
