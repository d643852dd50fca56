"""The range checks of papers/attention.md, section R: where one head's computation may leave a
format's range, and why."""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum.formats import Format

__all__ = ["Found", "Ranges", "finding"]

# what a range check found: the output entries it hits (broadcast to the head's) and the reason;
# None where the enclosure lies within the format's range
Found = tuple[np.ndarray, str] | None


def finding(
    upper: np.ndarray | float,
    fmt: Format,
    stage: str,
    *,
    rows: str | None = None,
    cols: bool = False,
    entries: bool = False,
) -> Found:
    """What :meth:`Ranges.check` flags, without flagging it. A check of the keys' side
    (``rows="k"``, or ``cols``) finds the same for every chunk of a head's query rows: it is
    made once for the head, and each chunk's record takes it (:meth:`Ranges.take`)."""
    up: np.ndarray = np.atleast_2d(np.asarray(upper, np.float64))
    bad: np.ndarray = ~(up <= fmt.max_finite)  # NaN counts as bad
    if not bad.any():
        return None
    if rows == "q":
        hit = np.asarray(bad.any(axis=-1))[:, None]
    elif rows == "k":
        hit = np.ones((1, 1), bool)
    elif cols:
        hit = np.asarray(bad.any(axis=0))[None, :]
    elif entries:
        hit = bad
    else:  # a per-logit flag (rows × keys): the row's outputs
        hit = np.asarray(bad.any(axis=-1, keepdims=True))
    worst = float(np.max(np.where(np.isnan(up), np.inf, up)[bad]))
    reason = (
        f"{stage}: values up to {worst:.4g} may overflow {fmt.name} "
        f"(largest finite {fmt.max_finite:.6g})"
    )
    return hit, reason


class Ranges:
    """Where one head's computation may leave a format's range, and why (papers/attention.md, R).

    Every check takes an enclosure ``upper >= |value|`` of the exact value a stage rounds (so
    that ``upper <= max_finite`` proves the rounding to nearest stays finite) and marks the
    output entries the stage feeds: a query row's outputs (``rows="q"``, or a boolean per row),
    every output of the head (``rows="k"``), a value column (``cols``), or single entries.
    """

    def __init__(self, rows: int, cols: int) -> None:
        self.shape = (rows, cols)
        self.where: dict[str, np.ndarray] = {}
        self.reasons: list[str] = []
        self.hits: dict[str, tuple[str, np.ndarray]] = {}  # reason -> (term, entries)

    def check(
        self,
        upper: Any,
        fmt: Format,
        stage: str,
        *,
        rows: str | None = None,
        cols: bool = False,
        entries: bool = False,
    ) -> None:
        """Flag the output entries that ``upper >= |value|``, the enclosure of the exact value
        a stage rounds into ``fmt``, does not prove finite (:func:`finding`)."""
        self.take(finding(upper, fmt, stage, rows=rows, cols=cols, entries=entries))

    def take(self, found: Found) -> None:
        """Flag what a check found (:func:`finding`; ``None``: nothing)."""
        if found is not None:
            self.flag(*found)

    def flag(self, hit: Any, reason: str, term: str = "overflow") -> None:
        """Mark the output entries ``hit`` infinite in ``term``, for ``reason``."""
        hit = np.broadcast_to(np.asarray(hit, bool), self.shape)
        if hit.any():
            self.where[term] = self.where.get(term, np.zeros(self.shape, bool)) | hit
            if reason not in self.reasons:
                self.reasons.append(reason)
            seen = self.hits.get(reason, (term, np.zeros(self.shape, bool)))[1]
            self.hits[reason] = (term, seen | hit)

    def merge(self, other: Ranges, keep: Any) -> None:
        """Take ``other``'s flags on the entries ``keep`` (with their reasons)."""
        for reason, (term, hit) in other.hits.items():
            self.flag(hit & np.asarray(keep, bool), reason, term)

    def terms(self) -> dict[str, np.ndarray]:
        """``inf`` where flagged, per term (``overflow``, ``vacuous``)."""
        return {name: np.where(hit, np.inf, 0.0) for name, hit in self.where.items()}
