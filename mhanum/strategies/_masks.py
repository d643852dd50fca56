"""Strategies for boolean masks and :class:`~mhanum.masks.Band` values."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from mhanum.masks import Band
from mhanum.strategies._attention import resolve_int
from mhanum.strategies._common import MASK_KINDS, check_count, fail

# masks -------------------------------------------------------------------------------------------


def masks(
    *,
    q_len: int | st.SearchStrategy[int],
    kv_len: int | st.SearchStrategy[int],
    batch: int | st.SearchStrategy[int] = 1,
    heads: int | st.SearchStrategy[int] = 1,
    kind: str | st.SearchStrategy[str] | None = None,
    fully_masked_rows: bool = False,
) -> st.SearchStrategy[np.ndarray]:
    """Boolean masks ``(batch, heads, q_len, kv_len)``; **True means attend**.

    Args:
        q_len, kv_len, batch, heads: sizes (values or strategies).
        kind: ``"none"`` (attend everywhere), ``"padding"`` (per batch entry, keys past a drawn
            length are masked), ``"causal"`` (query ``i`` attends keys ``j <= i + kv_len - q_len``),
            ``"random"``, ``"band"`` (a :func:`bands` band's array), a strategy of these, or
            ``None`` for any of them.
        fully_masked_rows: if ``False`` every row attends at least one key (a row that would not
            attends its last allowed key, key 0); if ``True`` at least one row is fully masked.

    Raises:
        InvalidArgument: for a non-positive size or an unknown kind.
    """
    sizes = {"q_len": q_len, "kv_len": kv_len, "batch": batch, "heads": heads}
    for name, value in sizes.items():
        if not isinstance(value, st.SearchStrategy):
            check_count(value, name)
    if kind is None:
        kind = st.sampled_from(MASK_KINDS)
    elif not isinstance(kind, st.SearchStrategy) and kind not in MASK_KINDS:
        fail("kind", f"one of {MASK_KINDS}", kind)
    if not isinstance(fully_masked_rows, bool):
        fail("fully_masked_rows", "a bool", fully_masked_rows)
    return _masks(sizes, kind, fully_masked_rows)


@st.composite
def _masks(
    draw: st.DrawFn, sizes: dict[str, Any], kind: str | st.SearchStrategy[str], fully_masked: bool
) -> np.ndarray:
    n = {name: resolve_int(draw, value, name) for name, value in sizes.items()}
    k = draw(kind) if isinstance(kind, st.SearchStrategy) else kind
    if k not in MASK_KINDS:
        fail("kind", f"one of {MASK_KINDS}", k)
    shape = (n["batch"], n["heads"], n["q_len"], n["kv_len"])
    keys = np.arange(n["kv_len"])
    if k == "none":
        mask = np.ones(shape, bool)
    elif k == "padding":
        lengths = [draw(st.integers(1, n["kv_len"])) for _ in range(n["batch"])]
        mask = np.stack([np.broadcast_to(keys < m, shape[1:]) for m in lengths])
    elif k == "causal":
        rows = np.arange(n["q_len"])[:, None] + (n["kv_len"] - n["q_len"])
        mask = np.broadcast_to(keys[None, :] <= rows, shape).copy()
    elif k == "band":
        band = draw(_bands(n["q_len"], n["kv_len"], False))
        mask = np.broadcast_to(band.array(n["q_len"], n["kv_len"]), shape).copy()
    else:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        mask = rng.random(shape) < draw(st.sampled_from((0.25, 0.5, 0.9)))
    mask = np.array(mask, bool)
    if fully_masked:
        b, h, i = (draw(st.integers(0, m - 1)) for m in shape[:3])
        mask[b, h, i, :] = False
    else:
        empty = ~mask.any(axis=-1)
        mask[..., 0] |= empty
    return mask


def bands(
    *,
    q_len: int | st.SearchStrategy[int],
    kv_len: int | st.SearchStrategy[int],
    empty_rows: bool = False,
) -> st.SearchStrategy[Band]:
    """Structured masks (:class:`mhanum.masks.Band`): causal or windowed, on the main diagonal,
    aligned to the bottom-right corner (``offset = kv_len - q_len``) or shifted.

    Args:
        q_len, kv_len: sizes (values or strategies) the band is drawn for.
        empty_rows: if ``False`` every row attends at least one key; if ``True`` the offset may
            leave rows that attend none.

    Raises:
        InvalidArgument: for a non-positive size.
    """
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, st.SearchStrategy):
            check_count(value, name)
    if not isinstance(empty_rows, bool):
        fail("empty_rows", "a bool", empty_rows)
    return _bands(q_len, kv_len, empty_rows)


@st.composite
def _bands(
    draw: st.DrawFn,
    q_len: int | st.SearchStrategy[int],
    kv_len: int | st.SearchStrategy[int],
    empty_rows: bool,
) -> Band:
    lq, lk = resolve_int(draw, q_len, "q_len"), resolve_int(draw, kv_len, "kv_len")
    side = st.one_of(st.none(), st.integers(0, lk))
    left, right = draw(side), draw(st.one_of(st.just(0), side))
    offset = draw(st.sampled_from((0, lk - lq)) | st.integers(-lq, lk))
    band = Band(left, right, offset)
    if not empty_rows and band.empty_rows(lq, lk).any():
        # unbounded to the left, and reaching key 0 from row 0: every row attends a key
        band = Band(None, None if right is None else max(right, -offset), offset)
    return band
