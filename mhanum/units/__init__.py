"""The vocabulary of numerical choices, parsed once into typed values.

A choice is written as a string (``"blocked(8)"``, ``"online(64)"``, ``"tensor-core(h100-fp16)"``)
in :class:`mhanum.Numerics`, JSON records, case files and the command line. It is parsed here,
once, into a small frozen value: :class:`Blocked` ``(8)``, :class:`Online` ``(64)``,
:class:`TensorCoreDot` ``("h100-fp16")``. Every value *is* a ``str`` equal to its canonical
spelling (so records, reports and ``jax.jit`` static arguments keep working, and values hash by
their spelling), and carries typed fields that the code downstream reads instead of the text:

>>> order = summation_order("Blocked(8)")
>>> order, order.block, order.height(20), isinstance(order, Blocked)
('blocked(8)', 8, 9, True)
>>> dot_unit("bf16x3").passes, dot_unit("tensor-core(h100-fp16)").model
(3, 'h100-fp16')
>>> match softmax_algorithm("online(64)"):
...     case Online(block=b):
...         print(b)
64

Summation orders are a registry (:func:`summation_orders`): a subclass of
:class:`SummationOrder` carries everything the library reads of its order (its spelling, its
emulation, its tree height or compensated nature, the count of its roundings, whether a sum in it
can resume from a carried value), and :func:`register_summation_order` makes it one of the
library's orders; the parser, :class:`mhanum.Numerics`, the emulation, the bounds of sums, dots and
softmax factors and the strategies read the registry, not an order's name.

Adding an order therefore touches at most three files: this module (its class, registered),
:mod:`mhanum.emulate.summation` (a :class:`~mhanum.emulate.summation.Terms` method, where its
emulation is not a fold of the terms already there) and ``papers/summation.md`` (its theorem,
where its bound is not Theorem R.3's for its tree height or R.4's for a compensated sum).

Adding a dot unit touches this module, its emulation (:mod:`mhanum.emulate.summation`) and its
factor (:mod:`mhanum.bounds.factors`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar

from mhanum._errors import InvalidArgument

if TYPE_CHECKING:
    from collections.abc import Callable

    from mhanum._types import JaxArray

__all__ = [
    "ACCUM_FORMATS",
    "Add",
    "Blocked",
    "DotUnit",
    "Fill",
    "IEEEDot",
    "Kahan",
    "MaskMode",
    "Naive",
    "Native",
    "Online",
    "Pairwise",
    "Safe",
    "Sequential",
    "SoftmaxAlgorithm",
    "SplitBF16",
    "Summands",
    "SummationOrder",
    "TensorCoreDot",
    "dot_unit",
    "mask_mode",
    "register_summation_order",
    "softmax_algorithm",
    "summation_order",
    "summation_order_spellings",
    "summation_orders",
    "unregister_summation_order",
]

ACCUM_FORMATS = ("float64", "float32", "bfloat16", "float16")
"""The formats a dot or a sum may accumulate in (and the softmax may be computed in)."""

_BLOCKED = re.compile(r"^blocked\((\d+)\)$")
_ONLINE = re.compile(r"^online(?:\((\d+)\))?$")
_TENSOR_CORE = re.compile(r"^tensor-core\(([a-z0-9_-]+)\)$")
_SPLIT = re.compile(r"^bf16x([136])$")


def _text(value: object) -> str | None:
    return value.strip().lower().replace(" ", "") if isinstance(value, str) else None


def _positive(text: str) -> int | None:
    n = int(text)
    return n if n >= 1 else None


class _Unit(str):
    """A parsed choice: a ``str`` equal to its canonical spelling, immutable, with typed fields."""

    __slots__ = ()
    __match_args__: tuple[str, ...] = ()

    def __getnewargs__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__match_args__)


# Summation orders ---------------------------------------------------------------------------------

_C = TypeVar("_C")


class Rounding(Protocol):
    """The rounded arithmetic of one format (:class:`mhanum.emulate.summation.Terms`'s ``ar``):
    each operation on two arrays, rounded once."""

    def add(self, a: JaxArray, b: JaxArray) -> JaxArray: ...

    def sub(self, a: JaxArray, b: JaxArray) -> JaxArray: ...

    def mul(self, a: JaxArray, b: JaxArray) -> JaxArray: ...


class Summands(Protocol):
    """The terms of a sum as an order's :meth:`~SummationOrder.emulate` receives them: what
    :class:`mhanum.emulate.summation.Terms` provides (the arithmetic, a fold of the terms, and
    the kernels of the built-in orders)."""

    @property
    def ar(self) -> Rounding: ...

    def start(self) -> JaxArray: ...

    def fold(
        self, step: Callable[[_C, JaxArray], _C], carry: _C, *, reverse: bool = False
    ) -> _C: ...

    def native(self) -> JaxArray: ...

    def sequential(self) -> JaxArray: ...

    def pairwise(self) -> JaxArray: ...

    def kahan(self) -> JaxArray: ...

    def blocked(self, b: int) -> JaxArray: ...


class SummationOrder(_Unit):
    """The order in which a sum (or a dot's products) is added (:attr:`mhanum.Numerics.summation`).

    A subclass is one order, and everything the library needs to know of it: its spelling
    (:attr:`kind`, with one integer parameter ``kind(N)`` when :attr:`__match_args__` names it),
    its emulation (:meth:`emulate`) and what its bounds read (:meth:`height`,
    :attr:`compensated`, :meth:`roundings`, :attr:`carried`, :attr:`running`). It is an order
    of the library once :func:`register_summation_order` has registered it.
    """

    __slots__ = ()
    kind: ClassVar[str] = ""
    compensated: ClassVar[bool] = False
    """Kahan's compensated summation (Theorem R.4 bounds it), else a summation tree (R.2, R.3)."""
    carried: ClassVar[bool] = False
    """The backend chooses the tree, and may carry the partial sums of a format narrower than
    float32 in float32 (XLA's own reduction): any tree of height ``n - 1``, unit roundoff ``u'``,
    and not the same order in two programs."""
    running: ClassVar[bool] = False
    """Each term is added to the sum of the terms before it, in order: a sum can resume from a
    value carried in (matmul's ``init``, the online softmax's running sums, a tensor core's
    accumulator)."""

    @classmethod
    def examples(cls) -> tuple[SummationOrder, ...]:
        """The values of this order that :func:`mhanum.strategies.numerics` draws."""
        return () if cls.__match_args__ else (cls(),)

    @classmethod
    def spelling(cls) -> str:
        """How the order is written: ``kahan``, or ``blocked(b)`` for one with a parameter."""
        return f"{cls.kind}({cls.__match_args__[0][0]})" if cls.__match_args__ else cls.kind

    @classmethod
    def from_text(cls, text: str) -> SummationOrder | None:
        """The order written ``text`` (lower case, no spaces), or ``None`` if it is not one."""
        if not cls.__match_args__:
            return cls() if text == cls.kind else None
        m = re.fullmatch(rf"{re.escape(cls.kind)}\((\d+)\)", text)
        if not m or not (value := _positive(m.group(1))):
            return None
        try:
            return cls(value)
        except InvalidArgument:
            return None

    @property
    def block(self) -> int | None:
        """The block size of :class:`Blocked`, else ``None``."""
        return None

    @property
    def tree(self) -> bool:
        """Whether the sum is a summation tree (bounded by ``γ_h``, Theorem R.3)."""
        return not self.compensated

    @property
    def resumable(self) -> bool:
        """Whether a sum in this order can start from a carried value (:attr:`running`, or
        :attr:`carried`: the backend's tree may add it anywhere)."""
        return self.running or self.carried

    def height(self, n: int) -> int:
        """The largest number of additions on a term's path to the result (Theorem R.2).

        Raises:
            InvalidArgument: for a compensated order (no tree).
        """
        msg = f"order: expected a summation tree order (not {str(self)!r}), got {str(self)!r}"
        raise InvalidArgument(msg)

    def roundings(self, n: int) -> int:
        """The number of rounded operations of a sum of ``n`` terms (each may underflow): a tree's
        ``n - 1`` additions (of nonzero operands), Kahan's four operations per term."""
        return 4 * n if self.compensated else max(n - 1, 0)

    def emulate(self, terms: Summands) -> JaxArray:
        """The sum of ``terms`` in this order, each operation rounded by ``terms.ar``
        (:class:`Summands`: a fold of the terms, or the kernel of a built-in order)."""
        msg = f"order: expected an emulated order, got {str(self)!r}"
        raise InvalidArgument(msg)


_O = TypeVar("_O", bound=SummationOrder)
_SUMMATION_ORDERS: dict[str, type[SummationOrder]] = {}
_BUILT_IN_ORDERS = ("native", "sequential", "pairwise", "kahan", "blocked")
_SPELLING = re.compile(r"^[a-z][a-z0-9_-]*$")


def register_summation_order(order: type[_O]) -> type[_O]:
    """Make ``order`` (a subclass of :class:`SummationOrder`) an order of the library.

    From then on :func:`summation_order` (and so :class:`mhanum.Numerics`, the command line and
    the strategies) parses its spelling, :mod:`mhanum.emulate.summation` runs its
    :meth:`~SummationOrder.emulate` and :mod:`mhanum.bounds` bound it from its
    :meth:`~SummationOrder.height` (a tree order, Theorem R.3) or as Kahan's sum
    (:attr:`~SummationOrder.compensated`, Theorem R.4). Usable as a class decorator.

    Raises:
        InvalidArgument: for a class that is not a :class:`SummationOrder` with a new lower-case
            :attr:`~SummationOrder.kind`, an :meth:`~SummationOrder.emulate` of its own and, unless
            compensated, a :meth:`~SummationOrder.height` of its own.

    Examples:
        A right-to-left sum, a tree of height ``n - 1`` folded by its emulation::

            class Reverse(SummationOrder):
                kind = "reverse"

                def __new__(cls):
                    return super().__new__(cls, "reverse")

                def height(self, n):
                    return n - 1

                def emulate(self, terms):
                    return terms.fold(terms.ar.add, terms.start(), reverse=True)

            register_summation_order(Reverse)

        An order is registered once:

        >>> register_summation_order(Kahan)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        mhanum._errors.InvalidArgument: order.kind: expected a lower-case name not among (...), got 'kahan'
    """
    if not (isinstance(order, type) and issubclass(order, SummationOrder)):
        msg = f"order: expected a subclass of SummationOrder, got {order!r}"
        raise InvalidArgument(msg)
    kind = order.kind
    if not (isinstance(kind, str) and _SPELLING.match(kind)) or kind in _SUMMATION_ORDERS:
        taken = tuple(_SUMMATION_ORDERS)
        msg = f"order.kind: expected a lower-case name not among {taken}, got {kind!r}"
        raise InvalidArgument(msg)
    missing = [
        name
        for name in ("emulate", "height")
        if getattr(order, name) is getattr(SummationOrder, name)
        and not (name == "height" and order.compensated)
    ]
    if missing:
        msg = f"order: expected a class that defines {' and '.join(missing)}, got {order!r}"
        raise InvalidArgument(msg)
    _SUMMATION_ORDERS[kind] = order
    return order


def unregister_summation_order(kind: str) -> None:
    """Remove an order :func:`register_summation_order` added (not one of the built-in orders).

    Raises:
        InvalidArgument: for a built-in or unknown order.
    """
    added = tuple(k for k in _SUMMATION_ORDERS if k not in _BUILT_IN_ORDERS)
    if kind not in added:
        msg = (
            f"kind: expected a registered order other than the built-in ones {added}, got {kind!r}"
        )
        raise InvalidArgument(msg)
    del _SUMMATION_ORDERS[kind]


def summation_orders() -> tuple[type[SummationOrder], ...]:
    """The registered summation orders, built-in ones first (in the order they were registered).

    Examples:
        >>> [order.spelling() for order in summation_orders()]
        ['native', 'sequential', 'pairwise', 'kahan', 'blocked(b)']
    """
    return tuple(_SUMMATION_ORDERS.values())


def summation_order_spellings(condition: str = ", ") -> str:
    """The registered orders as an error message lists them, each family's condition after
    ``condition``.

    Examples:
        >>> summation_order_spellings(" with ")
        "'native', 'sequential', 'pairwise', 'kahan' or 'blocked(b)' with b >= 1"
    """
    orders = summation_orders()
    names = [f"{order.spelling()!r}" for order in orders]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    params = sorted({order.__match_args__[0][0] for order in orders if order.__match_args__})
    return listed + "".join(f"{condition}{p} >= 1" for p in params)


@register_summation_order
class Native(SummationOrder):
    """Whatever order the backend chooses (XLA's): any tree with ``n`` leaves, height ``n - 1``."""

    __slots__ = ()
    kind = "native"
    carried = True

    def __new__(cls) -> Self:
        return super().__new__(cls, "native")

    def height(self, n: int) -> int:
        return n - 1

    def emulate(self, terms: Summands) -> JaxArray:
        return terms.native()


@register_summation_order
class Sequential(SummationOrder):
    """Left to right: height ``n - 1``."""

    __slots__ = ()
    kind = "sequential"
    running = True

    def __new__(cls) -> Self:
        return super().__new__(cls, "sequential")

    def height(self, n: int) -> int:
        return n - 1

    def emulate(self, terms: Summands) -> JaxArray:
        return terms.sequential()


@register_summation_order
class Pairwise(SummationOrder):
    """Recursive halving: height ``⌈log2 n⌉``."""

    __slots__ = ()
    kind = "pairwise"

    def __new__(cls) -> Self:
        return super().__new__(cls, "pairwise")

    def height(self, n: int) -> int:
        return (n - 1).bit_length()

    def emulate(self, terms: Summands) -> JaxArray:
        return terms.pairwise()


@register_summation_order
class Kahan(SummationOrder):
    """Kahan's compensated summation, left to right (no tree: Theorem R.4)."""

    __slots__ = ()
    kind = "kahan"
    compensated = True

    def __new__(cls) -> Self:
        return super().__new__(cls, "kahan")

    def emulate(self, terms: Summands) -> JaxArray:
        return terms.kahan()


@register_summation_order
class Blocked(SummationOrder):
    """Sequential sums of blocks of ``block`` terms, then a sequential sum of the blocks."""

    __slots__ = ()
    __match_args__ = ("block",)
    kind = "blocked"

    def __new__(cls, block: int) -> Self:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            msg = f"block: expected an integer >= 1, got {block!r}"
            raise InvalidArgument(msg)
        return super().__new__(cls, f"blocked({block})")

    @classmethod
    def examples(cls) -> tuple[SummationOrder, ...]:
        return cls(8), cls(32), cls(3)

    @property
    def block(self) -> int:
        return int(self[len("blocked(") : -1])

    def height(self, n: int) -> int:
        b = self.block
        return (min(b, n) - 1) + (-(-n // b) - 1)

    def emulate(self, terms: Summands) -> JaxArray:
        return terms.blocked(self.block)


def summation_order(value: object, argname: str = "summation") -> SummationOrder:
    """Parse a summation order: a registered one (:func:`summation_orders`): ``native``,
    ``sequential``, ``pairwise``, ``kahan``, ``blocked(b)``.

    Raises:
        InvalidArgument: naming ``argname``, for anything else.
    """
    if isinstance(value, SummationOrder) and _SUMMATION_ORDERS.get(value.kind) is type(value):
        return value
    text = _text(value)
    for order in summation_orders():
        if text is not None and (unit := order.from_text(text)) is not None:
            return unit
    msg = f"{argname}: expected {summation_order_spellings()}, got {value!r}"
    raise InvalidArgument(msg)


# Softmax algorithms -------------------------------------------------------------------------------


class SoftmaxAlgorithm(_Unit):
    """How a row's softmax is computed (:attr:`mhanum.Numerics.softmax`)."""

    __slots__ = ()
    kind: str = ""

    @property
    def block(self) -> int | None:
        """The key-block size of :class:`Online`, else ``None``."""
        return None


class Naive(SoftmaxAlgorithm):
    """``exp(x) / Σ exp(x)``, no shift."""

    __slots__ = ()
    kind = "naive"

    def __new__(cls) -> Self:
        return super().__new__(cls, "naive")


class Safe(SoftmaxAlgorithm):
    """``exp(x - max) / Σ exp(x - max)``."""

    __slots__ = ()
    kind = "safe"

    def __new__(cls) -> Self:
        return super().__new__(cls, "safe")


class Online(SoftmaxAlgorithm):
    """The online softmax over key blocks of ``block`` keys (FlashAttention's running rescaling)."""

    __slots__ = ()
    __match_args__ = ("block",)
    kind = "online"

    def __new__(cls, block: int) -> Self:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            msg = f"block: expected an integer >= 1, got {block!r}"
            raise InvalidArgument(msg)
        return super().__new__(cls, f"online({block})")

    @property
    def block(self) -> int:
        return int(self[len("online(") : -1])


def softmax_algorithm(value: object, argname: str = "softmax") -> SoftmaxAlgorithm:
    """Parse a softmax algorithm: ``naive``, ``safe`` or ``online(B)``, ``B >= 1``.

    Raises:
        InvalidArgument: naming ``argname``, for anything else.
    """
    if isinstance(value, SoftmaxAlgorithm):
        return value
    text = _text(value)
    if text == "naive":
        return Naive()
    if text == "safe":
        return Safe()
    m = _ONLINE.match(text or "")
    if m and m.group(1) and (b := _positive(m.group(1))):
        return Online(b)
    msg = f"{argname}: expected 'naive', 'safe' or 'online(B)', B >= 1, got {value!r}"
    raise InvalidArgument(msg)


# Dot units ----------------------------------------------------------------------------------------


class DotUnit(_Unit):
    """The unit an inner product runs on (:attr:`mhanum.Numerics.dot`)."""

    __slots__ = ()
    kind: str = ""

    @property
    def passes(self) -> int:
        """Number of bfloat16 passes of a split dot (1 for every other unit)."""
        return 1

    @property
    def model(self) -> str | None:
        """The tensor-core model name, else ``None``."""
        return None

    @property
    def operand_format(self) -> str | None:
        """The format the unit rounds its operands to on entry, if any."""
        return None


class IEEEDot(DotUnit):
    """Products and sums rounded in the accumulation format (IEEE 754 arithmetic)."""

    __slots__ = ()
    kind = "ieee"

    def __new__(cls) -> Self:
        return super().__new__(cls, "ieee")


class SplitBF16(DotUnit):
    """A float32 dot as ``passes`` (1, 3 or 6) bfloat16 passes (XLA's ``BF16_BF16_F32[_X3|_X6]``).

    One pass is an IEEE dot of operands rounded to bfloat16 (``kind == "ieee"``).
    """

    __slots__ = ()
    __match_args__ = ("passes",)

    def __new__(cls, passes: int) -> Self:
        if passes not in (1, 3, 6) or isinstance(passes, bool):
            msg = f"passes: expected 1, 3 or 6, got {passes!r}"
            raise InvalidArgument(msg)
        return super().__new__(cls, f"bf16x{passes}")

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "ieee" if self.passes == 1 else "split"

    @property
    def passes(self) -> int:
        return int(self[len("bf16x") :])

    @property
    def operand_format(self) -> str | None:
        return "bfloat16" if self.passes == 1 else None


class TensorCoreDot(DotUnit):
    """An NVIDIA tensor core (:mod:`mhanum.units.tensorcore`): fused steps of exact products."""

    __slots__ = ()
    __match_args__ = ("model",)
    kind = "tensor-core"

    def __new__(cls, model: str) -> Self:
        from mhanum.units.tensorcore import get_model

        return super().__new__(cls, f"tensor-core({get_model(model).name})")

    @property
    def model(self) -> str:
        return self[len("tensor-core(") : -1]

    @property
    def operand_format(self) -> str:
        from mhanum.units.tensorcore import get_model

        return get_model(self.model).input_format


def dot_unit(value: object, argname: str = "dot") -> DotUnit:
    """Parse a dot unit: ``ieee``, ``bf16x1``, ``bf16x3``, ``bf16x6`` or ``tensor-core(<model>)``.

    Raises:
        InvalidArgument: naming ``argname``, for anything else (an unknown model included).
    """
    if isinstance(value, DotUnit):
        return value
    text = _text(value) or ""
    if text == "ieee":
        return IEEEDot()
    if m := _SPLIT.match(text):
        return SplitBF16(int(m.group(1)))
    if m := _TENSOR_CORE.match(text):
        return TensorCoreDot(m.group(1))
    msg = (
        f"{argname}: expected 'ieee', 'bf16x1', 'bf16x3', 'bf16x6' or 'tensor-core(<model>)', "
        f"got {value!r}"
    )
    raise InvalidArgument(msg)


# Mask modes ---------------------------------------------------------------------------------------


class MaskMode(_Unit):
    """How a finite masking constant enters the scores (:attr:`mhanum.Numerics.mask_mode`)."""

    __slots__ = ()
    kind: str = ""


class Fill(MaskMode):
    """Masked scores are replaced by the constant."""

    __slots__ = ()
    kind = "fill"

    def __new__(cls) -> Self:
        return super().__new__(cls, "fill")


class Add(MaskMode):
    """The constant is added to masked scores."""

    __slots__ = ()
    kind = "add"

    def __new__(cls) -> Self:
        return super().__new__(cls, "add")


def mask_mode(value: object, argname: str = "mask_mode") -> MaskMode:
    """Parse a mask mode: ``fill`` or ``add``.

    Raises:
        InvalidArgument: naming ``argname``, for anything else.
    """
    if isinstance(value, MaskMode):
        return value
    if value == "fill":
        return Fill()
    if value == "add":
        return Add()
    msg = f"{argname}: expected one of ('fill', 'add'), got {value!r}"
    raise InvalidArgument(msg)
