"""Arithmetic in a named format, with every result rounded once and no operation fused.

Values of a format are carried in float32 (formats with ``p <= 24``) or float64. An operation runs
in the carrier and is then rounded into the format with :func:`mhanum.formats.round_jax`, which is
integer arithmetic on the bits and so cannot be elided by the compiler. The result is the correctly
rounded result of the operation in the format:

* products of two values of a format with ``p <= 12`` are exact in float32 (``2p <= 24``), and
  products of float32 values are exact in float64;
* a correctly rounded float32 sum, quotient or square root rounded again to a format with
  ``p <= 11`` is the correctly rounded result (double rounding is innocuous when the carrier has
  ``>= 2p + 2`` bits: Figueroa, "When is double rounding innocuous?", SIGNUM Newsl. 30(3), 1995).

When the format *is* the carrier (float32 or float64), XLA's CPU backend would contract
``a*b + c`` into a fused multiply-add, so a product would never be rounded. :meth:`Arith.mul`
therefore passes the bits of such a product through an OR with a zero that the compiler cannot
prove is zero (derived from input data by :func:`runtime_zero`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from mhanum.formats import Format, get_format, round_jax

if TYPE_CHECKING:
    from jax.typing import DTypeLike

# A NaN payload no finite input has: comparing input bits with it gives a zero XLA cannot fold.
_MAGIC32 = 0x7FC0DEAD


def runtime_zero(x: jax.Array) -> jax.Array:
    """A uint32 zero computed from the data in ``x`` (one if ``x``'s first bits are a special NaN);
    a constant zero for an empty ``x``, which holds no data to compute with (and no arithmetic
    to keep from being folded)."""
    if x.size == 0:
        return jnp.zeros((), jnp.uint32)
    first = jnp.ravel(x)[0].astype(jnp.float32)
    return (lax.bitcast_convert_type(first, jnp.uint32) == jnp.uint32(_MAGIC32)).astype(jnp.uint32)


def carrier_dtype(fmt: Format) -> DTypeLike:
    """float64 for float64, float32 for every other format."""
    return jnp.float64 if fmt.name == "float64" else jnp.float32


def to_format(x: jax.Array, fmt: Format) -> jax.Array:
    """Round ``x`` (in any float carrier) into ``fmt`` and return it in ``fmt``'s carrier."""
    carrier = jnp.dtype(carrier_dtype(fmt))
    x = jnp.asarray(x)
    if x.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        x = x.astype(jnp.float32)
    if x.dtype.itemsize > carrier.itemsize:
        x = round_jax(x, fmt)
        return x.astype(carrier)
    return round_jax(x.astype(carrier), fmt)


@dataclasses.dataclass(frozen=True)
class Arith:
    """Correctly rounded arithmetic in ``fmt``; ``guard`` is :func:`runtime_zero` of the inputs."""

    fmt: Format
    guard: jax.Array

    @classmethod
    def of(cls, fmt: Format | str, guard: jax.Array) -> Arith:
        return cls(get_format(fmt), guard)

    @property
    def dtype(self) -> DTypeLike:
        return carrier_dtype(self.fmt)

    @property
    def is_carrier(self) -> bool:
        """Whether the format is its own carrier, so that operations need no extra rounding."""
        return self.fmt.name in ("float32", "float64")

    def take(self, x: jax.Array) -> jax.Array:
        """Convert ``x`` into this format (rounding if it is more precise)."""
        return to_format(x, self.fmt)

    def round(self, x: jax.Array) -> jax.Array:
        return x if self.is_carrier else round_jax(x, self.fmt)

    def add(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return self.round(a + b)

    def sub(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return self.round(a - b)

    def div(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return self.round(a / b)

    def mul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        product = a * b
        if not self.is_carrier:
            return round_jax(product, self.fmt)
        uint = jnp.uint64 if self.dtype == jnp.float64 else jnp.uint32
        bits = lax.bitcast_convert_type(product, uint) | self.guard.astype(uint)
        return lax.bitcast_convert_type(bits, self.dtype)

    def exp(self, x: jax.Array) -> jax.Array:
        """XLA's ``exp`` in the format's carrier (float32 for narrow formats), then rounded."""
        return self.round(jnp.exp(x))

    def tanh(self, x: jax.Array) -> jax.Array:
        """XLA's ``tanh`` in the format's carrier, then rounded."""
        return self.round(jnp.tanh(x))

    def log(self, x: jax.Array) -> jax.Array:
        """XLA's ``log`` in the format's carrier, then rounded."""
        return self.round(jnp.log(x))

    def exp2(self, x: jax.Array) -> jax.Array:
        """XLA's ``exp2`` in the format's carrier, then rounded."""
        return self.round(jnp.exp2(x))
