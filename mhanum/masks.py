"""Structured masks: causal and sliding-window attention given as structure, not as an array.

A :class:`Band` says which keys each query attends by position alone: query ``i`` attends key
``j`` exactly when

.. math::

    i + \\mathrm{offset} - \\mathrm{left} \\le j \\le i + \\mathrm{offset} + \\mathrm{right}

(``left`` or ``right`` ``None``: unbounded on that side). Every function that takes ``mask=``
accepts one where it accepts a boolean array (True = attend), and the emulation builds it inside
the compiled computation, so a long causal row costs no ``Lq × Lk`` input array. The
conventions of the frameworks, checked against their sources:

- ``jax.nn.dot_product_attention(is_causal=True)`` and ``torch``'s SDPA ``is_causal=True``: the
  *top-left* causal mask, ``j <= i`` (``causal()``);
- ``jax.nn.dot_product_attention(local_window_size=(left, right))``: ``i - left <= j <= i + right``
  (``window(left, right)``), combined with ``is_causal`` as ``window(left, 0)``;
- FlashAttention's ``causal=True`` and ``window_size=(left, right)`` align the band to the
  *bottom-right* corner when ``Lq != Lk`` (a query block at the end of a KV cache):
  ``offset = Lk - Lq`` (``causal(offset=Lk - Lq)``, :func:`bottom_right`).

Examples:
    >>> from mhanum import masks
    >>> masks.causal().array(3, 4).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0]])
    >>> masks.sliding_window(2, offset=1).array(3, 4).astype(int)
    array([[1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument

__all__ = ["Band", "bottom_right", "causal", "sliding_window", "window"]


def _int_or_none(value: Any, name: str, *, minimum: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        msg = f"{name}: expected an integer or None, got {value!r}"
        raise InvalidArgument(msg)
    if minimum is not None and value < minimum:
        msg = f"{name}: expected an integer >= {minimum} (or None), got {value!r}"
        raise InvalidArgument(msg)
    return int(value)


@dataclasses.dataclass(frozen=True)
class Band:
    """Query ``i`` attends key ``j`` iff ``i + offset - left <= j <= i + offset + right``.

    Attributes:
        left: keys before the diagonal ``j = i + offset`` that a query attends (``None``: all).
        right: keys after it (``None``: all; ``0``: causal).
        offset: the diagonal's shift: ``Lk - Lq`` aligns it to the bottom-right corner.

    Raises:
        InvalidArgument: ``left`` or ``right`` negative or not integers, ``offset`` not an
            integer.
    """

    left: int | None = None
    right: int | None = 0
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "left", _int_or_none(self.left, "left", minimum=0))
        object.__setattr__(self, "right", _int_or_none(self.right, "right", minimum=0))
        offset = _int_or_none(self.offset, "offset", minimum=None)
        if offset is None:
            msg = "offset: expected an integer, got None"
            raise InvalidArgument(msg)
        object.__setattr__(self, "offset", offset)

    def __str__(self) -> str:
        parts = [] if self.offset == 0 else [f"offset={self.offset}"]
        if self.left is None and self.right == 0:
            return f"causal({', '.join(parts)})"
        return f"window(left={self.left}, right={self.right}{''.join(', ' + p for p in parts)})"

    def array(self, q_len: int, k_len: int, *, xp: Any = np) -> Any:
        """The boolean ``(q_len, k_len)`` mask, True = attend (``xp``: numpy or ``jax.numpy``)."""
        return self.rows(0, q_len, k_len, xp=xp)

    def rows(self, start: int, stop: int, k_len: int, *, xp: Any = np) -> Any:
        """Rows ``start:stop`` of :meth:`array`, without forming the others."""
        i = xp.arange(start, stop)[:, None] + self.offset
        j = xp.arange(k_len)[None, :]
        keep = xp.ones((stop - start, k_len), dtype=bool)
        if self.left is not None:
            keep = keep & (j >= i - self.left)
        if self.right is not None:
            keep = keep & (j <= i + self.right)
        return keep

    def empty_rows(self, q_len: int, k_len: int) -> np.ndarray:
        """The rows that attend no key (``(q_len,)``, True where empty), from the band alone."""
        i = np.arange(q_len) + self.offset
        lo = np.zeros_like(i) if self.left is None else np.maximum(i - self.left, 0)
        hi = (
            np.full_like(i, k_len - 1)
            if self.right is None
            else np.minimum(i + self.right, k_len - 1)
        )
        return lo > hi


def causal(offset: int = 0) -> Band:
    """The causal mask ``j <= i + offset`` (``offset = 0``: torch's and jax's ``is_causal``)."""
    return Band(left=None, right=0, offset=offset)


def window(left: int | None, right: int | None = 0, offset: int = 0) -> Band:
    """``jax.nn``'s ``local_window_size=(left, right)``: ``i - left <= j <= i + right``."""
    return Band(left=left, right=right, offset=offset)


def sliding_window(size: int, offset: int = 0) -> Band:
    """Causal attention to the last ``size`` keys, the query's own included (``size >= 1``)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        msg = f"size: expected a window of at least one key (an integer >= 1), got {size!r}"
        raise InvalidArgument(msg)
    return Band(left=int(size) - 1, right=0, offset=offset)


def bottom_right(band: Band, q_len: int, k_len: int) -> Band:
    """``band`` aligned to the bottom-right corner, as FlashAttention aligns its masks: the
    last query's diagonal falls on the last key (``offset`` increased by ``k_len - q_len``)."""
    return dataclasses.replace(band, offset=band.offset + k_len - q_len)


def resolve(mask: Any, q_len: int, k_len: int) -> Any:
    """``mask`` as a boolean array: a :class:`Band` formed for these lengths, anything else as
    given (checked where it is used)."""
    return mask.array(q_len, k_len) if isinstance(mask, Band) else mask
