"""The attended keys of the forward bounds (papers/attention.md, A.1 steps 3 and 3'): the mask
and the bias as the theorem reads them, and the rows that attend no key."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.formats import Format, round_to
from mhanum.numerics import Numerics
from mhanum.units import Fill

__all__ = ["DEAD", "BandRows", "dead_rows", "keep_and_bias", "with_dead_rows"]

DEAD = (
    "fully-masked rows: a row that attends no key under -inf masking has no exact attention "
    "(its output is the path's convention: NaN in mhanum.attention, 0 in some kernels)"
)


@dataclasses.dataclass(frozen=True, eq=False)
class BandRows:
    """The keys a structured mask (:class:`mhanum.masks.Band`) attends over ``shape`` (batch
    dimensions in front, the same band for each), formed a block of query rows at a time
    (:meth:`rows`): no ``(Lq × Lk)`` array for a whole head. ``negate``: the keys it excludes
    instead (the logits a ``fill`` mask replaces). Indexing by a batch index gives one head's."""

    band: masks.Band
    shape: tuple[int, ...]
    negate: bool = False

    def __getitem__(self, index: tuple[int, ...]) -> BandRows:
        return BandRows(self.band, self.shape[len(index) :], self.negate)

    def rows(self, cut: slice) -> np.ndarray:
        """The query rows ``cut``, a read-only boolean array."""
        start, stop, _ = cut.indices(self.shape[-2])
        block = self.band.rows(start, stop, self.shape[-1])
        block = ~block if self.negate else block
        return np.broadcast_to(block, (*self.shape[:-2], stop - start, self.shape[-1]))

    def dense(self) -> np.ndarray:
        """Every row."""
        return self.rows(slice(None))


def keep_and_bias(
    mask: Any, bias: Any, target: tuple[int, ...], num: Numerics
) -> tuple[np.ndarray | BandRows, np.ndarray | None, np.ndarray | None, Any]:
    """The attended keys (mask True, bias not ``-inf``), the masked keys when the masking
    constant is finite (else ``None``), the bias (``-inf`` entries kept), and the logits the
    mask replaces by a constant (``fill`` mode; else ``None``), whose scores are never used.
    A band alone under ``-inf`` masking gives its keys and replaced logits as
    :class:`BandRows`, formed a block of rows at a time.

    The mask and the bias are those of a checked problem (:mod:`mhanum.problem`).

    Raises:
        InvalidArgument: for a bias that overflows the score format, or a row that attends no
            key while the masking constant is finite and the bias excludes every key.
    """
    if isinstance(mask, masks.Band) and bias is None and num.mask_constant() == -math.inf:
        # a band alone: its rows are formed where a block of rows is evaluated
        fill = isinstance(num.mask_mode, Fill)
        return BandRows(mask, target), None, None, BandRows(mask, target, True) if fill else None
    # a read-only view while nothing excludes a key: no (Lq × Lk) array is formed
    keep: np.ndarray = np.broadcast_to(np.True_, target)
    masked = replaced = None
    if mask is not None:
        m = masks.dense(mask, target)
        keep = keep & m
        if isinstance(num.mask_mode, Fill):
            replaced = ~np.broadcast_to(m, target)
        if num.mask_constant() != -math.inf:
            masked = ~np.broadcast_to(m, target)
    b = None
    if bias is not None:
        b = np.broadcast_to(np.asarray(bias, np.float64), target)
        keep = keep & ~np.isneginf(b)
        _check_bias_fits(b, ~np.isneginf(b), num.format_of("score"))
    if masked is not None:
        live = (
            keep | masked
            if isinstance(num.mask_mode, Fill)
            else keep | (masked & ~np.isneginf(b if b is not None else 0.0))
        )
        if not live.any(axis=-1).all():
            msg = (
                "bias: expected at least one key per row whose logit is finite, got a row with none"
            )
            raise InvalidArgument(msg)
    return keep, masked, b, replaced


def dead_rows(keep: np.ndarray | BandRows, masked: np.ndarray | None) -> np.ndarray:
    """Rows that attend no key while masked logits are ``-inf`` (keepdims): their output is the
    path's fully-masked convention (NaN in ``mhanum.attention``), not a rounding of the exact
    attention, which is undefined there."""
    if masked is not None:
        return np.zeros((*keep.shape[:-1], 1), bool)
    if isinstance(keep, BandRows):
        empty = keep.band.empty_rows(*keep.shape[-2:])[:, None]
        return np.broadcast_to(empty, (*keep.shape[:-1], 1))
    return np.asarray(~keep.any(axis=-1, keepdims=True))


def with_dead_rows(keep: np.ndarray | BandRows, dead: np.ndarray) -> np.ndarray | BandRows:
    """``keep`` with the dead rows attending every key (evaluated as unmasked, then infinite
    with the reason); ``keep`` itself where there are none."""
    if not dead.any():
        return keep
    return (keep.dense() if isinstance(keep, BandRows) else keep) | dead


def _check_bias_fits(b: np.ndarray, keep: np.ndarray, fmt: Format) -> None:
    """A finite bias that overflows the score format is a masking constant: outside A.1."""
    overflow = keep & ~np.isfinite(round_to(np.where(keep, b, 0.0), fmt))
    if overflow.any():
        index = tuple(int(i) for i in np.argwhere(overflow)[0])
        msg = (
            f"bias: expected values finite in the score format {fmt.name}, got {b[index]} at "
            f"index {index}, which overflows to inf or NaN (see mhanum.bounds.analyze_mask)"
        )
        raise InvalidArgument(msg)
