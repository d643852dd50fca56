"""The range checks of papers/attention.md, section R: where one head's computation may leave a
format's range, and why."""

from __future__ import annotations

from typing import Any

import numpy as np

from mhanum.formats import Format

__all__ = ["Ranges"]


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
        upper = np.atleast_2d(np.asarray(upper, np.float64))
        bad = ~(upper <= fmt.max_finite)  # NaN counts as bad
        if not bad.any():
            return
        if rows == "q":
            hit = np.broadcast_to(bad.any(axis=-1)[:, None], self.shape)
        elif rows == "k":
            hit = np.ones(self.shape, bool)
        elif cols:
            hit = np.broadcast_to(bad.any(axis=0)[None, :], self.shape)
        elif entries:
            hit = np.broadcast_to(bad, self.shape)
        else:  # a per-logit flag (rows × keys): the row's outputs
            hit = np.broadcast_to(bad.any(axis=-1, keepdims=True), self.shape)
        worst = float(np.max(np.where(np.isnan(upper), np.inf, upper)[bad]))
        self.flag(
            hit,
            f"{stage}: values up to {worst:.4g} may overflow {fmt.name} "
            f"(largest finite {fmt.max_finite:.6g})",
        )

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
