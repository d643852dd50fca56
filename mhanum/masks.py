"""Structured masks and biases: causal and sliding-window attention given as structure, and ALiBi.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum._errors import InvalidArgument

if TYPE_CHECKING:
    from types import ModuleType
    from typing import TypeGuard

    import jax

    from mhanum._types import Array, ArrayLike, FloatArray

__all__ = [
    "Band",
    "alibi",
    "alibi_slopes",
    "bottom_right",
    "causal",
    "check_sink",
    "dense",
    "head_sinks",
    "normalise",
    "sink_column",
    "sliding_window",
    "window",
    "with_sink",
    "zero_key",
]


def _int_or_none(value: object, name: str, *, minimum: int | None) -> int | None:
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

    def array(self, q_len: int, k_len: int, *, xp: ModuleType = np) -> Any:
        """The boolean ``(q_len, k_len)`` mask, True = attend (``xp``: numpy or ``jax.numpy``)."""
        return self.rows(0, q_len, k_len, xp=xp)

    def rows(self, start: int, stop: int, k_len: int, *, xp: ModuleType = np) -> Any:
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


def normalise(mask: Band | ArrayLike | None, target: tuple[int, ...]) -> Band | Array | None:
    """``mask`` read once, at the boundary, for scores shaped ``target = (..., Lq, Lk)``:
    ``None``, a :class:`Band` (kept as structure), or a boolean array broadcastable to
    ``target`` (numpy, or JAX's, kept as given). Every public function that takes ``mask=``
    calls this and nothing downstream reads the argument again; :func:`dense` gives the array.

    Examples:
        >>> normalise(causal(), (2, 3)) == causal()
        True
        >>> normalise(np.ones((1, 3), bool), (2, 3)).shape
        (1, 3)
        >>> normalise(np.ones((2, 3)), (2, 3))
        Traceback (most recent call last):
        ...
        mhanum._errors.InvalidArgument: mask: expected a boolean array (True = attend), got dtype float64; pass an additive float mask as bias=

    Raises:
        InvalidArgument: for anything else: a non-boolean array (an additive mask belongs in
            ``bias=``), a shape that does not broadcast to ``target``, or another type.
    """
    if mask is None or isinstance(mask, Band):
        return mask
    if isinstance(mask, (str, bytes, dict, set)) or not (
        hasattr(mask, "__array__") or isinstance(mask, (list, tuple))
    ):
        msg = (
            "mask: expected None, a boolean array or a mhanum.masks.Band, got "
            f"{type(mask).__name__} {mask!r:.60}"
        )
        raise InvalidArgument(msg)
    arr = mask if _is_jax_array(mask) else np.asarray(mask)
    if arr.dtype != np.bool_:
        msg = (
            f"mask: expected a boolean array (True = attend), got dtype {arr.dtype}; "
            "pass an additive float mask as bias="
        )
        raise InvalidArgument(msg)
    if not _fits(tuple(arr.shape), tuple(target)):
        msg = f"mask: expected a shape broadcastable to {tuple(target)}, got {tuple(arr.shape)}"
        raise InvalidArgument(msg)
    return arr


def dense(mask: Band | Array | None, target: tuple[int, ...], *, xp: ModuleType = np) -> Any:
    """A :func:`normalise`-d mask as the boolean array ``target``-shaped (True = attend; all
    True for ``None``): a band formed for ``target``'s last two lengths, an array broadcast.

    Examples:
        >>> dense(causal(offset=1), (2, 2, 3)).astype(int)[1]
        array([[1, 1, 0],
               [1, 1, 1]])
    """
    if mask is None:
        return xp.ones(target, bool)
    return xp.broadcast_to(resolve(mask, target[-2], target[-1], xp=xp), target)


def resolve(
    mask: Band | ArrayLike | None, q_len: int, k_len: int, *, xp: ModuleType = np
) -> ArrayLike | None:
    """``mask`` as a boolean array: a :class:`Band` formed for these lengths, anything else (a
    :func:`normalise`-d array or ``None``) as given."""
    return mask.array(q_len, k_len, xp=xp) if isinstance(mask, Band) else mask


def _fits(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without enlarging it."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _is_jax_array(x: object) -> TypeGuard[jax.Array]:
    import sys

    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array | jax.core.Tracer)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's slopes (Press, Smith & Lewis 2022), float64: ``2^(-8h/n)`` for ``h = 1..n`` when
    ``n`` is a power of two; otherwise those of the largest power of two ``n' < num_heads``
    followed by every other slope of ``2n'``, as the authors' code orders them; each is the
    power ``2^(-8h/n)`` rounded once (the authors' code forms it as a product, a few float64
    roundings away).

    Examples:
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        msg = f"num_heads: expected a positive integer, got {num_heads!r}"
        raise InvalidArgument(msg)

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    n = 1 << (int(num_heads).bit_length() - 1)
    slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: num_heads - n]
    return np.asarray(slopes, np.float64)


def alibi(
    num_heads: int, q_len: int, k_len: int, *, offset: int = 0, symmetric: bool = False
) -> np.ndarray:
    """The ALiBi bias ``(num_heads, q_len, k_len)``: ``m_h·(j - (i + offset))`` (causal models:
    ``<= 0`` on the attended keys; ``symmetric=True``: ``-m_h·|j - (i + offset)|``), float64, to
    pass as ``bias=`` (rounded into the score format like any bias, and charged by the bounds).

    A kernel that forms ``m_h·(j - i)`` itself in float32 rounds the slope and the product: a
    bias given here is one float64 value rounded once, which is the kernel's only where the
    slopes are powers of two (up to 8 heads).

    Raises:
        InvalidArgument: for a head count or length that is not a positive integer.
    """
    for name, value in (("q_len", q_len), ("k_len", k_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            msg = f"{name}: expected a positive integer, got {value!r}"
            raise InvalidArgument(msg)
    offset = _int_or_none(offset, "offset", minimum=None) or 0
    distance = np.arange(k_len)[None, :] - (np.arange(q_len)[:, None] + offset)
    if symmetric:
        distance = -np.abs(distance)
    return alibi_slopes(num_heads)[:, None, None] * distance.astype(np.float64)[None]


def with_sink(
    q: Array,
    k: Array,
    v: Array,
    mask: Band | ArrayLike | None,
    bias: ArrayLike | None,
    sink: ArrayLike,
    *,
    xp: ModuleType = np,
) -> tuple[Any, Any, Any, Any]:
    """Attention sinks as one more key: ``(k', v', mask', bias')`` for ``softmax`` over the keys
    and a per-head sink logit ``σ`` in the normaliser, ``p_j = e^{s_j}/(e^σ + Σ_l e^{s_l})``.

    The sink is a key ``k = 0`` (its score ``scale·(q·0) = 0`` exactly, in every dot unit and
    scale placement) with value ``v = 0`` and bias ``σ``, never masked, the last of its row: the
    row's output is ``Σ_j p_j v_j + p_σ·0``. The real keys get bias ``0`` where none is given
    (``s + 0`` is exact). A row whose keys are all masked attends the sink alone: its output is
    ``0``, not undefined. ``sink`` broadcasts against the batch dimensions (``(H,)`` for
    ``(B, H, L, d)`` inputs). ``mask`` is a boolean array or a :class:`Band`.

    Raises:
        InvalidArgument: for a sink that is not finite or does not broadcast.
    """
    lq, lk = q.shape[-2], k.shape[-2]
    batch: tuple[int, ...] = _sink_batch(
        sink, [q.shape[:-2], k.shape[:-2], v.shape[:-2]], mask, bias, lq, lk, xp
    )
    k2, v2 = (zero_key(xp.broadcast_to(x, (*batch, lk, x.shape[-1])), xp=xp) for x in (k, v))
    mask2, bias2 = sink_column(mask, bias, sink, (*batch, lq, lk), xp=xp)
    return k2, v2, mask2, bias2


def zero_key(x: Array, *, xp: ModuleType = np) -> Any:
    """``x`` ``(..., L, d)`` with one more row of zeros: the sink's key or value."""
    return xp.concatenate([x, xp.zeros((*x.shape[:-2], 1, x.shape[-1]), x.dtype)], axis=-2)


def sink_column(
    mask: Band | ArrayLike | None,
    bias: ArrayLike | None,
    sink: ArrayLike,
    scores: tuple[int, ...],
    *,
    xp: ModuleType = np,
) -> tuple[Array | None, Array]:
    """The mask and bias of :func:`with_sink` for scores shaped ``scores = (..., Lq, Lk)``: one
    more column, attended, with bias ``σ`` (the real keys' bias ``0`` where none is given)."""
    *batch, lq, lk = scores
    sig = _finite_sink(sink, xp)
    column = xp.broadcast_to(sig[..., None, None], (*batch, lq, 1))
    real = xp.zeros(scores) if bias is None else xp.broadcast_to(bias, scores)
    bias2 = xp.concatenate([real, column], axis=-1)
    mask = resolve(mask, lq, lk)
    if mask is None:
        return None, bias2
    keep = xp.broadcast_to(xp.asarray(mask), scores)
    return xp.concatenate([keep, xp.ones((*batch, lq, 1), bool)], axis=-1), bias2


def head_sinks(
    mask: Band | ArrayLike | None, bias: ArrayLike | None, sink: ArrayLike, scores: tuple[int, ...]
) -> tuple[Array | None, Array, tuple[int, ...]]:
    """:func:`sink_column` for multi-head scores ``(..., H, Lq, Lk)`` with one sink per head
    (``sink`` ``(H,)`` or broadcast against ``(..., H)``): the mask, the bias and the scores'
    new shape ``(..., H, Lq, Lk + 1)``.

    Raises:
        InvalidArgument: for a sink that is not finite or not one per head.
    """
    sig = _finite_sink(sink, np)
    heads = scores[-3]
    if np.shape(sig)[-1:] not in ((), (1,), (heads,)):
        msg = f"sink: expected one logit per head ({heads},), got shape {np.shape(sig)}"
        raise InvalidArgument(msg)
    batch = tuple(scores[:-2])
    if not _fits(np.shape(sig), batch):
        msg = (
            f"sink: expected a shape broadcastable to the heads' batch {batch}, got {np.shape(sig)}"
        )
        raise InvalidArgument(msg)
    full = (*batch, *scores[-2:])
    mask2, bias2 = sink_column(mask, bias, sig, full)
    return mask2, bias2, (*full[:-1], full[-1] + 1)


def _finite_sink(sink: ArrayLike, xp: ModuleType) -> Array:
    sig = np.asarray(sink, np.float64) if xp is np else xp.asarray(sink)
    concrete = sig if xp is np else _concrete(sig)
    if concrete is not None and not np.all(np.isfinite(concrete)):
        msg = "sink: expected finite logits (one per head), got NaN or Inf"
        raise InvalidArgument(msg)
    return sig


def _concrete(x: Array) -> FloatArray | None:
    """The values of the array ``x`` as numpy, or ``None`` under a jax trace (inside ``jit``)."""
    import jax

    return None if isinstance(x, jax.core.Tracer) else np.asarray(x, np.float64)


def _sink_batch(
    sink: ArrayLike,
    shapes: list[tuple[int, ...]],
    mask: Band | ArrayLike | None,
    bias: ArrayLike | None,
    lq: int,
    lk: int,
    xp: ModuleType,
) -> tuple[int, ...]:
    """The batch dimensions of the inputs, the mask and the bias, which the sink must fit: a
    sink never adds batch dimensions of its own (a ``(3,)`` sink with 2-D ``q`` would broadcast
    the output to ``(3, Lq, dv)``)."""
    mask = resolve(mask, lq, lk)
    extra = [np.shape(x)[:-2] for x in (mask, bias) if x is not None]
    batch = tuple(np.broadcast_shapes(*shapes, *extra))
    check_sink(sink, batch, xp=xp)
    return batch


def check_sink(sink: ArrayLike, batch: tuple[int, ...], *, xp: ModuleType = np) -> Array:
    """Sink logits checked against the inputs' ``batch`` dimensions: finite (where concrete)
    and broadcastable to ``batch`` without enlarging it; float64 numpy, or ``xp``'s array.

    Raises:
        InvalidArgument: for a NaN or infinite logit, or a shape that does not fit ``batch``.
    """
    sig = _finite_sink(sink, xp)
    if not _fits(tuple(np.shape(sig)), tuple(batch)):
        msg = (
            f"sink: expected one logit per batch element or head, a shape broadcastable to the "
            f"inputs' batch dimensions {tuple(batch)}, got {np.shape(sig)}"
        )
        raise InvalidArgument(msg)
    return sig
