"""The forward bounds' result (papers/attention.md, A.1 and A.2): their assumptions and scope,
the per-head terms stacked into a :class:`~mhanum.bounds.Bound`, NaN made infinite with its
reason, and the probability of the union of the chains' events."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.union import union_failure
from mhanum.numerics import Numerics
from mhanum.units import Online

__all__ = [
    "ASSUMPTIONS",
    "PROBABILISTIC",
    "Events",
    "check_scope",
    "head_reasons",
    "result",
    "split_count",
    "stack",
]

ASSUMPTIONS = (
    "round-to-nearest; a rounding into F is x(1+δ)+η, |δ| <= u_F, |η| <= 2^emin_F (flush-to-zero)",
    "exp in the softmax format within exp_ulps ulps, division within div_ulps ulps",
    "sums and dots in numerics.summation: tree orders γ_h, Kahan as Theorem R.4 (Theorem S.0)",
    (
        "no overflow: proved on the given values stage by stage (papers/attention.md, R); where it "
        "cannot be, the entries it reaches are inf (terms overflow, vacuous) with Bound.reasons"
    ),
)


PROBABILISTIC = (
    "probabilistic (lam): the rounding errors of sums and dots are independent, mean-zero random "
    "variables (Higham & Mary 2019, Theorem 2.4; exact for stochastic rounding, a model for "
    "round to nearest); the bound holds with probability >= Bound.probability (union bound)"
)


def check_scope(num: Numerics) -> None:
    """Theorem A.1's scope: a score format no wider than the softmax format and, online, an
    accumulation format no wider than it either."""
    if isinstance(num.softmax_algorithm, Online) and (
        num.format_of("accum").precision > num.format_of("softmax").precision
    ):
        msg = (
            "numerics.softmax_format: Theorem A.1 needs, for the online softmax, a softmax "
            f"format at least as precise as accum, got {num.format_of('softmax').name} and "
            f"{num.format_of('accum').name}"
        )
        raise InvalidArgument(msg)
    if num.format_of("score").precision > num.format_of("softmax").precision:
        msg = (
            "numerics.score_format: Theorem A.1 needs a score format no wider than the softmax "
            f"format, got {num.format_of('score').name} and {num.format_of('softmax').name}"
        )
        raise InvalidArgument(msg)


def split_count(num: Numerics, keys: int) -> int:
    """The splits of split-KV over ``keys`` keys (1 unsplit): each repeats the chains' events."""
    return -(-keys // num.kv_split_size(keys))


_NAN = "the float64 evaluation of the bound overflowed (NaN): nothing is proved for these entries"


def head_reasons(per_head: Any) -> tuple[str, ...]:
    """The heads' reasons for infinite entries, each once, in order of appearance."""
    return tuple(dict.fromkeys(r for ranges in per_head for r in ranges.reasons))


def stack(per_head: list[dict[str, np.ndarray]], shape: tuple[int, ...]) -> dict[str, Any]:
    """Per-head dicts of ``(rows, d)`` arrays to one dict of ``shape`` arrays (0 where absent)."""
    names = sorted({name for head in per_head for name in head})
    zeros = np.zeros(shape[-2:])
    return {n: np.stack([h.get(n, zeros) for h in per_head]).reshape(shape) for n in names}


class Events(NamedTuple):
    """The events a probabilistic bound's statement counts: ``lam`` (``None``: a certain
    bound) over ``chains`` events, or ``1 - failure`` where classes of them take ``λ``s of their
    own (``lam`` then the chains')."""

    lam: float | None
    chains: int
    failure: float | None = None


def result(
    total: Any,
    terms: dict[str, Any],
    theorem: str,
    num: Numerics,
    events: Events,
    parts: dict[str, dict[str, Any]] | None = None,
    reasons: tuple[str, ...] = (),
) -> Bound:
    """The :class:`Bound`; with ``events.lam``, the probability of the union of the events.

    A NaN that the float64 evaluation produced (inf - inf, 0·inf where a range check already
    made an entry infinite, or an overflow no check caught) is an infinite bound: nothing is
    proved there, and an entry no other reason covers gets its own.
    """
    lam, chains, failure = events
    parts = parts or {}
    total = np.asarray(total, np.float64)
    nan = np.isnan(total)
    if nan.any():
        covered = np.zeros_like(nan)
        for t in terms.values():
            covered |= np.broadcast_to(np.isinf(t), nan.shape)
        terms = {n: np.where(np.isnan(t), np.inf, t) for n, t in terms.items()}
        if (nan & ~covered).any():
            terms["vacuous"] = np.where(nan & ~covered, np.inf, terms.get("vacuous", 0.0))
            reasons = (*reasons, _NAN)
        total = np.where(nan, np.inf, total)
    if lam is None:
        return Bound(
            total, terms, theorem, ASSUMPTIONS, "blanchard2021", parts=parts, reasons=reasons
        )
    assumptions = (*ASSUMPTIONS, PROBABILISTIC)
    if failure is None:
        failure = union_failure(lam, chains, num)
    probability = max(0.0, 1.0 - failure)
    return Bound(total, terms, theorem, assumptions, "higham2019", probability, parts, reasons, lam)
