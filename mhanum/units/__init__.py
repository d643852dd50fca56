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

Adding a summation order or a dot unit touches this module, its emulation
(:mod:`mhanum.emulate.summation`) and its factor (:mod:`mhanum.bounds.factors`).
"""

from __future__ import annotations

import re
from typing import Any, Self

from mhanum._errors import InvalidArgument

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
    "SummationOrder",
    "TensorCoreDot",
    "dot_unit",
    "mask_mode",
    "softmax_algorithm",
    "summation_order",
]

ACCUM_FORMATS = ("float64", "float32", "bfloat16", "float16")
"""The formats a dot or a sum may accumulate in (and the softmax may be computed in)."""

_BLOCKED = re.compile(r"^blocked\((\d+)\)$")
_ONLINE = re.compile(r"^online(?:\((\d+)\))?$")
_TENSOR_CORE = re.compile(r"^tensor-core\(([a-z0-9_-]+)\)$")
_SPLIT = re.compile(r"^bf16x([136])$")


def _text(value: Any) -> str | None:
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


class SummationOrder(_Unit):
    """The order in which a sum (or a dot's products) is added (:attr:`mhanum.Numerics.summation`)."""

    __slots__ = ()
    kind: str = ""

    @property
    def block(self) -> int | None:
        """The block size of :class:`Blocked`, else ``None``."""
        return None

    def height(self, n: int) -> int:
        """The largest number of additions on a term's path to the result (Theorem R.2).

        Raises:
            InvalidArgument: for :class:`Kahan` (compensated summation is no tree).
        """
        msg = f"order: expected a summation tree order (not {str(self)!r}), got {str(self)!r}"
        raise InvalidArgument(msg)


class Native(SummationOrder):
    """Whatever order the backend chooses (XLA's): any tree with ``n`` leaves, height ``n - 1``."""

    __slots__ = ()
    kind = "native"

    def __new__(cls) -> Self:
        return super().__new__(cls, "native")

    def height(self, n: int) -> int:
        return n - 1


class Sequential(SummationOrder):
    """Left to right: height ``n - 1``."""

    __slots__ = ()
    kind = "sequential"

    def __new__(cls) -> Self:
        return super().__new__(cls, "sequential")

    def height(self, n: int) -> int:
        return n - 1


class Pairwise(SummationOrder):
    """Recursive halving: height ``⌈log2 n⌉``."""

    __slots__ = ()
    kind = "pairwise"

    def __new__(cls) -> Self:
        return super().__new__(cls, "pairwise")

    def height(self, n: int) -> int:
        return (n - 1).bit_length()


class Kahan(SummationOrder):
    """Kahan's compensated summation, left to right (no tree: Theorem R.4)."""

    __slots__ = ()
    kind = "kahan"

    def __new__(cls) -> Self:
        return super().__new__(cls, "kahan")


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

    @property
    def block(self) -> int:
        return int(self[len("blocked(") : -1])

    def height(self, n: int) -> int:
        b = self.block
        return (min(b, n) - 1) + (-(-n // b) - 1)


_ORDERS = {"native": Native, "sequential": Sequential, "pairwise": Pairwise, "kahan": Kahan}


def summation_order(value: Any, argname: str = "summation") -> SummationOrder:
    """Parse a summation order: ``native``, ``sequential``, ``pairwise``, ``kahan``, ``blocked(b)``.

    Raises:
        InvalidArgument: naming ``argname``, for anything else.
    """
    if isinstance(value, SummationOrder):
        return value
    text = _text(value)
    if text in _ORDERS:
        return _ORDERS[text]()
    m = _BLOCKED.match(text or "")
    if m and (b := _positive(m.group(1))):
        return Blocked(b)
    msg = (
        f"{argname}: expected 'native', 'sequential', 'pairwise', 'kahan' or 'blocked(b)', "
        f"b >= 1, got {value!r}"
    )
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


def softmax_algorithm(value: Any, argname: str = "softmax") -> SoftmaxAlgorithm:
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


def dot_unit(value: Any, argname: str = "dot") -> DotUnit:
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


def mask_mode(value: Any, argname: str = "mask_mode") -> MaskMode:
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
