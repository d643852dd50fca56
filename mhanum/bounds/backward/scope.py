"""What every backward theorem states (papers/backward.md): its assumptions, its scope
(the numerics it covers), the results it returns, and how a gradient's terms become a
:class:`~mhanum.bounds.Bound`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.enclosure import Ranges
from mhanum.bounds.forward import PROBABILISTIC
from mhanum.bounds.union import union_failure
from mhanum.numerics import Backward, Numerics

__all__ = [
    "ASSUMPTIONS",
    "GradientBounds",
    "Statement",
    "check_scope",
    "check_scores_placement",
]

ASSUMPTIONS = (
    "round-to-nearest; a rounding into F is x(1+δ)+η, |δ| <= u_F, |η| <= 2^emin_F (flush-to-zero)",
    "exp and log in the softmax format within exp_ulps ulps, division within div_ulps ulps",
    "every dot on the numerics' dot unit in its summation order (Theorem S.0 / R.5 / T.2)",
    (
        "masked keys excluded exactly (-inf masking); the scale on the scores, or on q (its "
        "square root on q and k) with dq (and dk) multiplied by it again"
    ),
    "float64 evaluation of the bound: numpy's exp and log within 1 ulp, sums within γ_n",
    (
        "no overflow: proved on the given values stage by stage; where it cannot be, the "
        "gradient is inf with Bound.reasons"
    ),
)


class GradientBounds(NamedTuple):
    """The bounds of one backward pass, one :class:`Bound` per gradient (each shaped like it),
    and ``stages``: componentwise bounds on the error of the intermediates every gradient reads
    (``P``, the probabilities each gradient's stage uses; ``dP``, ``D`` and ``dS``), so that a
    user sees where the error enters; with a sink, ``dsink``."""

    dq: Bound
    dk: Bound
    dv: Bound
    dbias: Bound
    stages: dict[str, np.ndarray]
    dsink: Bound | None = None


def check_scope(num: Numerics, bw: Backward, theorem: str = "B.2") -> None:
    """Refuses, by name, numerics the backward theorems do not cover (``theorem``: the one
    asked for; FlashAttention-2's exp2, ``exp_form="exp2-folded"``, is Theorem B.2's and,
    through its enclosures of ``dS``, B.3's)."""
    bw.check_forward(num)
    if num.folds_scale and theorem not in ("B.2", "B.3"):
        msg = (
            f"numerics.exp_form: expected 'exp' for Theorem {theorem} (the folded exp2 is "
            f"covered by Theorems B.2 and B.3), got {num.exp_form!r}"
        )
        raise InvalidArgument(msg)
    if bw.scale_at != "output" and num.dot_kind == "tensor-core":
        msg = (
            "backward.scale_at: expected 'output' with a tensor-core dot unit (steps 8s and 8p "
            f"do not carry its alignment anchor), got {bw.scale_at!r}"
        )
        raise InvalidArgument(msg)
    if num.softmax_kind == "naive":
        msg = (
            "numerics.softmax: the backward bound covers the 'safe' and 'online(B)' softmax, "
            f"got {num.softmax!r}"
        )
        raise InvalidArgument(msg)
    if num.format_of("score").precision > num.format_of("softmax").precision:
        msg = (
            "numerics.score_format: the backward bound needs a score format no wider than the "
            f"softmax format, got {num.score_format} and {num.format_of('softmax').name}"
        )
        raise InvalidArgument(msg)


def check_scores_placement(num: Numerics, bw: Backward, theorem: str) -> None:
    """Refuses, by name, a scale on ``q`` or on ``q`` and ``k``, or one that multiplies ``dS``
    (``Backward.scale_at="ds"``), where ``theorem`` models the scale on the scores, multiplying
    ``dQ`` and ``dK`` (B.1 and B.2 take every placement: steps 2' and 6s)."""
    if bw.scale_at != "output":
        msg = f"backward.scale_at: expected 'output' for Theorem {theorem}, got {bw.scale_at!r}"
        raise InvalidArgument(msg)
    if num.scale != "scores":
        msg = (
            f"numerics.scale: expected 'scores' for Theorem {theorem} (the scale on q, or on q "
            f"and k, is modelled by Theorems B.1 and B.2 only), got {num.scale!r}"
        )
        raise InvalidArgument(msg)


@dataclasses.dataclass(frozen=True)
class Statement:
    """A theorem's statement as each of its bounds carries it: the theorem, its assumptions,
    the probability with which every bound holds (1, or B.5/B.8's union bound over ``chains``
    with ``λ = lam``) and the float64 evaluation's widening ``ev``."""

    theorem: str
    assumptions: tuple[str, ...]
    probability: float = 1.0
    lam: float | None = None
    ev: float = 1.0

    @classmethod
    def of(
        cls, theorem: str, lam: float | None, chains: int, num: Numerics, ev: float = 1.0
    ) -> Statement:
        """The deterministic ``theorem``, or its probabilistic variant with ``λ = lam``
        (``theorem`` is then the probabilistic one's number)."""
        if lam is None:
            return cls(theorem, ASSUMPTIONS, 1.0, None, ev)
        stated = max(0.0, 1.0 - union_failure(lam, chains, num))
        return cls(theorem, (*ASSUMPTIONS, PROBABILISTIC), stated, lam, ev)

    def bound(self, name: str, terms: dict[str, np.ndarray], rng: Ranges) -> Bound:
        """The bound of the gradient ``name`` from its terms (broadcast together and widened
        by ``ev``): ``inf`` wherever a term is NaN, everywhere where a stage that reaches it
        may overflow (``rng``), with the reasons where it is not finite."""
        shape = np.broadcast_shapes(*(np.shape(t) for t in terms.values()))
        terms = {key: np.broadcast_to(val, shape) * self.ev for key, val in terms.items()}
        total = sum(terms.values())
        total = np.where(np.isnan(total), np.inf, total)
        if rng.hit[name]:
            total = np.full(shape, np.inf)
        return Bound(
            total=total,
            terms=terms,
            theorem=self.theorem,
            assumptions=self.assumptions,
            source="dao2023",
            probability=self.probability,
            reasons=tuple(rng.reasons) if rng.hit[name] or not np.isfinite(total).all() else (),
            lam=self.lam,
        )
