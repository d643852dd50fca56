"""The value every bound function returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Bound:
    """An error bound: the total, its terms, and the theorem it instantiates.

    Attributes:
        total: the bound (a float, or an array shaped like the quantity bounded).
        terms: named contributions whose combination (as the theorem states) gives ``total``.
        theorem: the theorem's label in ``papers/`` (e.g. ``"S.2"``).
        assumptions: the assumptions under which the bound holds, in words.
        source: the literature the theorem follows (a key of ``docs/references.md``), if any.
        probability: the probability with which the bound holds under a probabilistic model of
            the rounding errors (stated in ``assumptions``); 1 for a deterministic bound.
        parts: finer breakdowns of some terms: ``parts[term][source]`` add up to ``terms[term]``
            (the attention bounds split ``logits`` into the sources of the logit errors:
            ``operands`` (input and operand rounding of q and k), ``qk_dot``, ``scale``,
            ``bias``, ``mask_absorption``, ``softcap``, ``exp_fold``, apportioned by their share of each row's errors).
        reasons: why the bound is infinite where it is, one sentence per cause (the stage, the
            format and the value that may overflow, or the hypothesis that cannot be proved on
            the given values); empty when the bound is finite everywhere. ``str(bound)`` shows
            them, and so do the reports.
        lam: the ``λ`` of a probabilistic bound (Theorem A.3: given, or the least one that
            states the requested ``probability``); ``None`` for a deterministic bound.
    """

    total: Any
    terms: Mapping[str, Any]
    theorem: str
    assumptions: tuple[str, ...] = ()
    source: str | None = None
    probability: float = 1.0
    parts: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    lam: float | None = None

    def __str__(self) -> str:
        total = np.asarray(self.total, np.float64)
        finite = total[np.isfinite(total)]
        lines = [
            f"Bound (Theorem {self.theorem}): max {float(np.max(total, initial=0.0)):.3g}"
            + (
                f", {total.size - finite.size} of {total.size} entries inf"
                if finite.size < total.size
                else ""
            )
            + (f", probability >= {self.probability:.6g}" if self.probability < 1 else "")
            + (f" (λ = {self.lam:.4g})" if self.lam is not None else ""),
            f"  dominant term: {self.dominant()}" if self.terms else "  no terms",
        ]
        lines += [f"  inf: {reason}" for reason in self.reasons]
        return "\n".join(lines)

    def dominant(self) -> str:
        """The name of the largest term (by its maximum over entries)."""
        return max(self.terms, key=lambda name: float(np.max(np.abs(self.terms[name]))))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: arrays become nested lists."""

        def plain(x: Any) -> Any:
            return np.asarray(x).tolist() if isinstance(x, np.ndarray) else x

        return {
            "total": plain(self.total),
            "terms": {k: plain(v) for k, v in self.terms.items()},
            "theorem": self.theorem,
            "assumptions": list(self.assumptions),
            "source": self.source,
            "probability": self.probability,
            "parts": {t: {k: plain(v) for k, v in p.items()} for t, p in self.parts.items()},
            "reasons": list(self.reasons),
            "lam": self.lam,
        }


def where_smaller(
    terms: Mapping[str, Any], alternative: Any, name: str
) -> tuple[dict[str, Any], Any]:
    """``terms``, with every entry where ``alternative`` (another bound on the same error) is
    smaller than their sum, or where that sum is NaN and ``alternative`` finite, replaced by
    one term ``name`` equal to ``alternative`` (the others 0 there); and the mask of those
    entries (``None`` where there is none)."""
    total = sum(terms.values())
    with np.errstate(invalid="ignore"):
        take = (alternative < total) | (np.isnan(total) & np.isfinite(alternative))
    if not np.any(take):
        return dict(terms), None
    kept = {key: np.where(take, 0.0, t) for key, t in terms.items()}
    kept[name] = np.where(take, alternative, 0.0)
    return kept, take
