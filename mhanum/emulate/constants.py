"""The kernels' real constants, rounded on the host and handed to the jitted emulation as data.

An attention kernel multiplies by constants derived from the problem: the scale ``c`` (or
``sqrt(c)`` on ``q`` and ``k``), ``c·log2(e)`` folded into ``exp2``, the soft-cap's ``ĉ = fl(c)``
and ``r̂ = fl(1/c)``. Each is a float64 value computed on the host and rounded once, by
:func:`mhanum.formats.round_to`, into the format that multiplies by it.

The rounded values are operands of the compiled program, not literals in it: a new scale (a
drawn one, another head size, another soft-cap) is new data for the same program instead of a
new compilation. The values are the same bits either way, and the operations that read them are
the same operations (:class:`mhanum.emulate._arith.Arith` rounds every product, and keeps XLA from
fusing one; a product by a literal is not simplified either, since it is integer arithmetic on
the bits or an OR with a runtime zero).

Examples:
    >>> from mhanum.numerics import resolve
    >>> consts = Constants.of(resolve("bf16"), 0.3)
    >>> float(consts.value(Const.SCALE, resolve("bf16").format_of("score")))
    0.30078125
    >>> float(consts.value(Const.SQRT_SCALE, resolve("bf16").format_of("scale")))
    0.546875
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

import jax
import numpy as np

from mhanum.emulate._arith import carrier_dtype
from mhanum.formats import Format, round_to
from mhanum.numerics import Numerics

if TYPE_CHECKING:
    from mhanum._types import Array

__all__ = ["LOG2E", "Const", "Constants"]

LOG2E = math.log2(math.e)
"""``log2(e)`` as the float64 constant ``M_LOG2E`` the kernels multiply by."""


class Const(enum.Enum):
    """The constants a kernel derives from the scale ``c`` and the soft-cap ``cap``."""

    SCALE = "c"
    SQRT_SCALE = "sqrt(c)"
    SCALE_LOG2E = "c·log2(e)"  # the float64 product, then rounded (exp2-folded)
    SCALE_LOG2E_FACTORS = "fl(c)·fl(log2(e))"  # the product of the rounded factors (exp2-scaled)
    CAP = "cap"
    INV_CAP = "1/cap"


_SCALED = (Const.SCALE, Const.SQRT_SCALE, Const.SCALE_LOG2E, Const.SCALE_LOG2E_FACTORS)
_CAPPED = (Const.CAP, Const.INV_CAP)


def _values(scale: float, cap: float | None, fmt: Format) -> list[float]:
    """The constants' float64 values (those of ``_SCALED``, then of ``_CAPPED`` with a cap)
    before their one rounding into ``fmt``."""
    values = [
        scale,
        math.sqrt(scale) if scale >= 0 else math.nan,  # "qk" takes c >= 0
        scale * LOG2E,
        float(round_to(scale, fmt)) * float(round_to(LOG2E, fmt)),
    ]
    return values if cap is None else [*values, cap, 1.0 / cap]


@jax.tree_util.register_pytree_node_class
class Constants:
    """The constants of one run, each rounded into each format that may multiply by it.

    A pytree: the rounded values (one array per format, in its carrier: float64 for float64,
    float32 otherwise) are its leaves; the formats and the constants' names are its structure,
    so a jitted function that takes it compiles once per structure, whatever the values.
    """

    def __init__(
        self, formats: tuple[Format, ...], names: tuple[Const, ...], tables: tuple[Array, ...]
    ) -> None:
        self.formats = formats
        self.names = names
        self.tables = tables

    @classmethod
    def of(cls, num: Numerics, scale: float, cap: float | None = None, *extra: Format) -> Constants:
        """The constants of ``scale`` (and ``cap``) in the formats of ``num``'s accumulation,
        scores, softmax and scale stages, and in ``extra`` (a gradient's format)."""
        stages = (num.format_of(role) for role in ("accum", "score", "softmax", "scale"))
        formats = tuple(dict.fromkeys((*stages, *extra)))
        names = _SCALED if cap is None else (*_SCALED, *_CAPPED)
        tables = tuple(
            round_to(np.array(_values(scale, cap, fmt)), fmt).astype(carrier_dtype(fmt))
            for fmt in formats
        )
        return cls(formats, names, tables)

    @property
    def capped(self) -> bool:
        """Whether the run has a soft-cap (whose constants these hold)."""
        return Const.CAP in self.names

    def value(self, name: Const, fmt: Format) -> Array:
        """The constant ``name`` rounded into ``fmt``, in ``fmt``'s carrier."""
        return self.tables[self.formats.index(fmt)][self.names.index(name)]

    def tree_flatten(
        self,
    ) -> tuple[tuple[Array, ...], tuple[tuple[Format, ...], tuple[Const, ...]]]:
        return self.tables, (self.formats, self.names)

    @classmethod
    def tree_unflatten(
        cls, aux: tuple[tuple[Format, ...], tuple[Const, ...]], tables: tuple[Array, ...]
    ) -> Constants:
        return cls(aux[0], aux[1], tuple(tables))
