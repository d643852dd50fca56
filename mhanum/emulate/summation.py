"""Summation orders in JAX: every order really runs, in the accumulation format.

Each function takes the order as a string, as in :attr:`mhanum.Numerics.summation`: one of the
orders registered in :mod:`mhanum.units` (:func:`mhanum.units.summation_orders`), whose
:meth:`~mhanum.units.SummationOrder.emulate` sums the :class:`Terms` of the sum. The built-in
orders run the kernels of :class:`Terms`:

* ``"sequential"``: ``s = ((t0 + t1) + t2) + ...``, a loop over the terms;
* ``"pairwise"``: the complete binary tree over the terms in order, ``((t0 + t1) + (t2 + t3)) +
  ...``; with ``n`` not a power of two it equals the tree over the terms padded with zeros (the
  streaming form used here keeps ``log2 n`` partial sums, not all ``n`` terms);
* ``"blocked(b)"``: sequential within consecutive blocks of ``b`` terms, then sequential over the
  block sums (the last block may be shorter);
* ``"kahan"``: compensated summation, ``y = t - c; u = s + y; c = (u - s) - y; s = u``;
* ``"native"``: XLA's own ``dot``/``reduce`` in the accumulation dtype, order unknown.

A dot may run on another inner-product unit (:attr:`mhanum.Numerics.dot`): ``"bf16x3"`` and
``"bf16x6"`` split each float32 operand into bfloat16 pieces as XLA's dot-algorithm rewriter does
(``hi`` = the float32 truncated to 8 significant bits, then the remainder likewise, the last piece
rounded), form one dot per pass in ``order`` and add the passes in XLA's order, smallest first;
``"tensor-core(<model>)"`` runs :func:`mhanum.emulate.tensorcore.matmul`.

In a dot product the terms are the products ``a_k * b_k``, each rounded to the accumulation format
before it is added (no fused multiply-add; see :mod:`mhanum.emulate._arith`). ``"native"`` dots
run at ``lax.Precision.HIGHEST`` so that float32 means float32 on every backend.

On XLA's CPU backend float32 arithmetic flushes subnormal results to zero (``--xla_cpu_ftz``), and
so does bfloat16 arithmetic carried in float32: a sum whose exact value is below ``2**-126`` in
magnitude may come out as zero. float16 subnormals are normal float32 numbers and are exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mhanum._errors import InvalidArgument
from mhanum.emulate._arith import Arith, runtime_zero, to_format
from mhanum.formats import Format, get_format
from mhanum.numerics import Numerics
from mhanum.units import ACCUM_FORMATS, SummationOrder, summation_order, summation_orders

__all__ = ["Terms", "matmul", "sum"]

Stack: TypeAlias = "jax.Array | tuple[jax.Array, ...]"
"""The data of the terms: an array, or a tuple of arrays (a dot's operands), axis 0 the terms."""
Term = Callable[[Any], jax.Array]  # of one slice of a Stack, as lax.scan hands it
_Carry = TypeVar("_Carry")


def _order(order: str) -> SummationOrder:
    return summation_order(order, "order")


def _accum_format(accum: Format | str) -> Format:
    fmt = get_format(accum, argname="accum")
    if fmt.name not in ACCUM_FORMATS:
        msg = f"accum: expected float64, float32, bfloat16 or float16, got {fmt.name}"
        raise InvalidArgument(msg)
    return fmt


@dataclasses.dataclass(frozen=True)
class Terms:
    """The ``n`` terms of a sum (or the products of a dot), as an order's emulation takes them.

    :meth:`mhanum.units.SummationOrder.emulate` receives them and returns their sum in its order:
    a fold of the terms (:meth:`fold`) or one of the kernels below, every operation rounded by
    ``ar``.

    Attributes:
        xs: the terms' data, a pytree of arrays whose axis 0 runs over the ``n`` terms.
        term: the term of one slice of ``xs`` (the slice itself, or the rounded product of two).
        n: the number of terms.
        shape: the shape of the sum.
        ar: the arithmetic of the accumulation format.
        init: a value the sum starts from (a tensor core's C, a running sum's carried term), or
            ``None``; only an order that can resume a sum takes one.
        dense: the backend's own reduction of the terms (XLA's ``reduce`` or ``dot``), or
            ``None`` where there is none.
    """

    xs: Stack
    term: Term
    n: int
    shape: tuple[int, ...]
    ar: Arith
    init: jax.Array | None = None
    dense: Callable[[], jax.Array] | None = None

    def start(self) -> jax.Array:
        """The initial value of a running sum: ``init``, or zeros."""
        if self.init is None:
            return jnp.zeros(self.shape, self.ar.dtype)
        return jnp.broadcast_to(self.init, self.shape).astype(self.ar.dtype)

    def fold(
        self, step: Callable[[_Carry, jax.Array], _Carry], carry: _Carry, *, reverse: bool = False
    ) -> _Carry:
        """``carry = step(carry, t)`` for the terms ``t`` in order (last to first if
        ``reverse``), one ``lax.scan``; the final ``carry``."""

        def body(c: _Carry, x: Any) -> tuple[_Carry, None]:
            return step(c, self.term(x)), None

        return lax.scan(body, carry, self.xs, reverse=reverse)[0]

    def sequential(self) -> jax.Array:
        """``((init + t0) + t1) + ...``: one running sum."""
        return self.fold(self.ar.add, self.start())

    def kahan(self) -> jax.Array:
        """Kahan's ``y = t - c; u = s + y; c = (u - s) - y; s = u`` from ``s = c = 0``."""
        ar = self.ar

        def step(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[jax.Array, jax.Array]:
            s, c = carry
            y = ar.sub(t, c)
            u = ar.add(s, y)
            return u, ar.sub(ar.sub(u, s), y)

        zero = jnp.zeros(self.shape, ar.dtype)
        return self.fold(step, (zero, zero))[0]

    def blocked(self, b: int) -> jax.Array:
        """Sequential sums of consecutive blocks of ``b`` terms (the last padded with zeros),
        added sequentially."""
        ar, n = self.ar, self.n
        blocks = -(-n // b)
        pad = blocks * b - n

        def padded(x: jax.Array) -> jax.Array:
            widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
            return jnp.pad(x, widths).reshape(blocks, b, *x.shape[1:])

        def block(total: jax.Array, bx: Stack) -> tuple[jax.Array, None]:
            inner = Terms(bx, self.term, b, self.shape, ar)
            return ar.add(total, inner.sequential()), None

        xs = jax.tree_util.tree_map(padded, self.xs)
        return lax.scan(block, jnp.zeros(self.shape, ar.dtype), xs)[0]

    def pairwise(self) -> jax.Array:
        """The complete binary tree over the terms in order, padded with zeros to a power of
        two."""
        # Streaming pairwise summation: after the i-th term (0-based), merge as many times as
        # i+1 has trailing zero bits, each merge adding the newer partial sum to the one below
        # it. At the end the stack holds the sums of the blocks named by the binary digits of n,
        # largest first; they are folded from the top, as the zero-padded tree would add them.
        ar, shape = self.ar, self.shape
        depth = max(1, math.ceil(math.log2(self.n))) + 1
        zero = jnp.zeros(shape, ar.dtype)

        def step(
            carry: tuple[jax.Array, jax.Array, jax.Array], x: Any
        ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
            stack, sp, i = carry
            i1 = i + 1
            merges = lax.population_count((i1 & -i1) - 1)

            def merge(
                _: jax.Array, state: tuple[jax.Array, jax.Array]
            ) -> tuple[jax.Array, jax.Array]:
                val, top = state
                return ar.add(stack[top - 1], val), top - 1

            val, sp = lax.fori_loop(0, merges, merge, (self.term(x), sp))
            return (stack.at[sp].set(val), sp + 1, i1), None

        init = (jnp.zeros((depth, *shape), ar.dtype), jnp.int32(0), jnp.int32(0))
        stack, sp, _ = lax.scan(step, init, self.xs)[0]

        def fold(j: jax.Array, total: jax.Array) -> jax.Array:
            return ar.add(stack[sp - 2 - j], total)

        return lax.fori_loop(0, sp - 1, fold, stack[sp - 1] + zero)

    def native(self) -> jax.Array:
        """The backend's own reduction (``init`` added to it, one of the orders it stands for).

        Raises:
            InvalidArgument: where there is none (``dense`` is ``None``).
        """
        if self.dense is None:
            msg = "order: expected an emulated order, got 'native'"
            raise InvalidArgument(msg)
        total = self.dense()
        return total if self.init is None else self.ar.add(self.init, total)


def _emulate(order: SummationOrder, terms: Terms) -> jax.Array:
    if terms.init is not None and not order.resumable:
        resumable = [str(o) for cls in summation_orders() for o in cls.examples() if o.resumable]
        msg = (
            f"init: expected an order that resumes a sum ({' or '.join(resumable)}), got {order!r}"
        )
        raise InvalidArgument(msg)
    if terms.n == 0:
        return terms.start()
    return order.emulate(terms)


def _reduce(
    xs: Stack, term: Term, n: int, shape: tuple[int, ...], ar: Arith, order: str
) -> jax.Array:
    return _emulate(_order(order), Terms(xs, term, n, shape, ar))


def sum(
    x: jax.Array, *, order: str = "sequential", accum: Format | str = "float32", axis: int = -1
) -> jax.Array:
    """Sum ``x`` along ``axis`` in ``accum`` in the given order.

    The terms are first rounded into ``accum`` (exactly, if they are already values of it). The
    result is returned in ``accum``'s carrier dtype (float32, or float64 for float64). The sum
    runs as one compiled program (``jax.jit``) per shape, order, format and axis.

    Args:
        x: a JAX or numpy float array.
        order: ``"native"``, ``"sequential"``, ``"pairwise"``, ``"blocked(b)"`` or ``"kahan"``.
        accum: the accumulation format.
        axis: the axis to sum over.

    Examples:
        >>> import numpy as np
        >>> x = np.array([1.0] + [2.0**-24] * 4, np.float32)
        >>> float(sum(x, order="sequential"))  # each 2**-24 is absorbed by 1
        1.0
        >>> float(sum(x, order="pairwise")) == 1 + 2.0**-22
        True
    """
    fmt = _accum_format(accum)
    _order(order)
    x = jnp.asarray(x)
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        msg = f"axis: expected an integer, got {axis!r}"
        raise InvalidArgument(msg)
    if not -x.ndim <= axis < x.ndim:
        msg = f"axis: expected an axis of an array of {x.ndim} dimensions, got {axis}"
        raise InvalidArgument(msg)
    return _sum_jit(x, order, fmt, int(axis))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sum_jit(x: jax.Array, order: str, fmt: Format, axis: int) -> jax.Array:
    """:func:`sum` as one compiled program per shape, order, format and axis."""
    return sum_with(Arith(fmt, runtime_zero(x)), jnp.moveaxis(x, axis, -1), order)


def sum_with(ar: Arith, x: jax.Array, order: str, *, keepdims: bool = False) -> jax.Array:
    """Sum the last axis of ``x`` in ``ar``'s format (the terms rounded into it first)."""
    x = ar.take(x)
    fmt = ar.fmt

    def dense() -> jax.Array:
        return jnp.sum(x.astype(fmt.jax_dtype), axis=-1, dtype=fmt.jax_dtype).astype(ar.dtype)

    xs = jnp.moveaxis(x, -1, 0)
    terms = Terms(xs, _itself, x.shape[-1], x.shape[:-1], ar, dense=dense)
    total = _emulate(_order(order), terms)
    return total[..., None] if keepdims else total


def _itself(t: jax.Array) -> jax.Array:
    return t


def matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    order: str = "native",
    accum: Format | str = "float32",
    operand_format: Format | str | None = None,
    dot: str = "ieee",
) -> jax.Array:
    """``a @ b`` with products rounded to ``accum`` and summed in ``order``.

    Args:
        a: ``(..., M, K)`` float array.
        b: ``(..., K, N)`` float array (batch dimensions broadcast with ``a``'s).
        order: the summation order over ``K``.
        accum: the accumulation format (products are rounded to it, then summed in it).
        operand_format: if given, ``a`` and ``b`` are first rounded to this format (``"tf32"``).
        dot: the inner-product unit, as :attr:`mhanum.Numerics.dot` (``"ieee"``, ``"bf16x1"``,
            ``"bf16x3"``, ``"bf16x6"``, ``"tensor-core(<model>)"``).

    Returns:
        ``(..., M, N)`` in ``accum``'s carrier dtype, each entry a value of ``accum``, from one
        compiled program (``jax.jit``) per shapes and numerics.
    """
    fmt = _accum_format(accum)
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        msg = f"b: expected shape (..., {a.shape[-1] if a.ndim else '?'}, N), got {b.shape}"
        raise InvalidArgument(msg)
    num = Numerics(
        input=fmt.name,
        accum=fmt.name,
        summation=order,
        operand_format=None if operand_format is None else get_format(operand_format).name,
        dot=dot,
    )
    return _matmul_jit(a, b, order, fmt, num.operand_rounding, num.dot)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _matmul_jit(
    a: jax.Array, b: jax.Array, order: str, fmt: Format, operand: Format | None, dot: str
) -> jax.Array:
    """:func:`matmul` as one compiled program per shapes and numerics."""
    return matmul_with(Arith(fmt, runtime_zero(a)), a, b, order, operand, dot)


_PASSES = {
    # (lhs piece, rhs piece) of each pass, in the order XLA adds them (papers/summation.md R.7)
    "bf16x3": ((1, 0), (0, 1), (0, 0)),
    "bf16x6": ((1, 1), (0, 2), (2, 0), (0, 1), (1, 0), (0, 0)),
}


def _truncate_bf16(x: jax.Array) -> jax.Array:
    """A float32 truncated to its leading 8 significant bits (a bfloat16 value, toward zero)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def split_bf16(x: jax.Array, pieces: int) -> list[jax.Array]:
    """Split float32 ``x`` into ``pieces`` bfloat16 values (in float32) as XLA's rewriter does.

    Every piece but the last is the remainder truncated to 8 bits; the last is the remainder
    rounded to bfloat16. With three pieces the split is exact for normal numbers.
    """
    from mhanum.formats import get_format

    bf16 = get_format("bfloat16")
    out, rest = [], jnp.asarray(x, jnp.float32)
    for i in range(pieces):
        if i == pieces - 1:
            out.append(to_format(rest, bf16))
        else:
            head = _truncate_bf16(rest)
            out.append(head)
            rest = rest - head
    return out


def _split_matmul(ar: Arith, a: jax.Array, b: jax.Array, order: str, dot: str) -> jax.Array:
    pieces = 2 if dot == "bf16x3" else 3
    a_parts, b_parts = split_bf16(a, pieces), split_bf16(b, pieces)
    total = None
    for i, j in _PASSES[dot]:
        part = matmul_with(ar, a_parts[i], b_parts[j], order)
        total = part if total is None else ar.add(total, part)
    assert total is not None
    return total


def matmul_with(
    ar: Arith,
    a: jax.Array,
    b: jax.Array,
    order: str,
    operand: Format | None = None,
    dot: str = "ieee",
    init: jax.Array | None = None,
) -> jax.Array:
    """``a @ b`` accumulated in ``ar``'s format; operands first rounded to ``operand`` if given.

    ``dot`` is the inner-product unit (:attr:`mhanum.Numerics.dot`); ``"bf16x1"`` is ``"ieee"``
    with ``operand`` bfloat16, and a tensor core rounds the operands to its input format.
    ``init`` (a value of ``ar``'s format) starts the accumulation: a tensor core's C operand, the
    first term of a sequential sum; in the native order it is added to the product (one of the
    orders "native" stands for). Split dots take none.
    """
    if operand is not None:
        a, b = to_format(a, operand), to_format(b, operand)
    if dot in _PASSES:
        if init is not None:
            msg = f"init: expected None with the split dot {dot!r}"
            raise InvalidArgument(msg)
        return _split_matmul(ar, ar.take(a), ar.take(b), order, dot)
    if dot.startswith("tensor-core"):
        from mhanum.emulate import tensorcore

        model = tensorcore.get_model(dot[len("tensor-core(") : -1])
        return tensorcore.matmul(ar.take(a), ar.take(b), model, c=init).astype(ar.dtype)
    a, b = ar.take(a), ar.take(b)
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = (*batch, a.shape[-2], b.shape[-1])
    xs = (jnp.moveaxis(a, -1, 0), jnp.moveaxis(b, -2, 0))

    def product(x: tuple[jax.Array, jax.Array]) -> jax.Array:
        return ar.mul(x[0][..., :, None], x[1][..., None, :])

    def dense() -> jax.Array:
        storage = jnp.promote_types(a.dtype, b.dtype)
        out = jnp.matmul(
            a.astype(storage),
            b.astype(storage),
            precision=lax.Precision.HIGHEST,
            preferred_element_type=ar.fmt.jax_dtype,
        )
        return out.astype(ar.dtype)

    terms = Terms(xs, product, a.shape[-1], shape, ar, init=init, dense=dense)
    return _emulate(_order(order), terms)
