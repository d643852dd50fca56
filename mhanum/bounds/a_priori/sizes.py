"""What Theorem A.4 (papers/attention.md) carries in place of values: bounds on the operands'
rows, the logits at their worst, and the stages that may overflow (section R), uniform over the
admissible inputs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum.formats import Format

__all__ = ["Logits", "Operand", "Range", "err_pair", "literal", "pair", "perturbed", "times"]


class Range:
    """Stages that may overflow and softmax hypotheses that cannot be proved, from the norms.

    A.4 is uniform over the admissible inputs, so a stage that may overflow makes every output
    entry infinite (term ``overflow``; ``vacuous`` for the softmax), with one reason per cause:
    per stage and format, with the largest value over the heads.
    """

    def __init__(self) -> None:
        self.where: dict[str, bool] = {}
        self.worst: dict[str, float] = {}  # reason template -> the largest value it reports

    def check(self, upper: Any, fmt: Format, stage: str) -> None:
        """Flag ``stage`` unless ``upper`` (an enclosure of what it rounds) fits ``fmt``."""
        worst = float(np.max(upper))
        if not worst <= fmt.max_finite:  # NaN counts as an overflow
            reason = (
                f"{stage}: values up to {{:.4g}} may overflow {fmt.name} "
                f"(largest finite {fmt.max_finite:.6g})"
            )
            self.flag(reason, "overflow", worst)

    def flag(self, reason: str, term: str = "overflow", value: float = math.nan) -> None:
        """Mark every entry infinite in ``term`` for ``reason`` (``{:.4g}`` shows ``value``)."""
        self.where[term] = True
        seen = self.worst.get(reason, value)
        self.worst[reason] = value if math.isnan(seen) or value > seen else seen

    @property
    def vacuous(self) -> bool:
        return "vacuous" in self.where

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(reason.format(value) for reason, value in self.worst.items())

    def terms(self, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {name: np.full(shape, np.inf) for name in self.where}


def literal(reason: str) -> str:
    """A finished sentence as a :meth:`Range.flag` template."""
    return reason.replace("{", "{{").replace("}", "}}")


@dataclasses.dataclass(frozen=True)
class Operand:
    """Bounds on a dot operand's rows, for the float64 stand-in ``x`` A.1 is evaluated on.

    ``|x| <= B`` with ``B = size`` entrywise (a vector over the row) or, in the norm form,
    ``‖x‖ <= norm``; the operand the computation uses is within ``rel·B + err`` of ``x`` and
    the stand-in within ``grel·B + gerr`` of the exact operand (``given``: A.2's projections,
    the float64 scale of step 2'), entrywise.
    """

    size: np.ndarray | None
    norm: float
    rel: float
    err: np.ndarray
    grel: float = 0.0
    gerr: Any = 0.0

    def sums(self, d: int) -> float:
        """A bound on ``Σ_t |x_t|``."""
        return float(self.size.sum()) if self.size is not None else math.sqrt(d) * self.norm

    def entry(self) -> float:
        """A bound on ``max_t |x_t|``."""
        return float(self.size.max()) if self.size is not None else self.norm

    def stored(self) -> float:
        """A bound on ``max_t |x_used,t|``: the stored operand (R.1)."""
        return (1 + self.rel) * self.entry() + float(np.max(self.err))


def times(a: float, b: float) -> float:
    """``a·b`` for bounds ``a, b >= 0``, with ``0·inf = 0`` (a zero bound stays zero)."""
    return a * b if a and b else 0.0


def pair(a: Operand, b: Operand) -> float:
    """A bound on ``|a|·|b|`` (Cauchy–Schwarz in the norm form)."""
    if a.size is not None and b.size is not None:
        return float(a.size @ b.size)
    return times(a.norm, b.norm)


def err_pair(ea: Any, b: Operand, d: int) -> float:
    """A bound on ``e_a·|b|`` for an error vector ``ea`` (a scalar spread over ``d`` entries)."""
    if b.size is not None:
        return float(np.broadcast_to(ea, (d,)) @ b.size)
    return times(float(np.linalg.norm(np.broadcast_to(ea, (d,)))), b.norm)


def perturbed(a: Operand, ra: float, ea: Any, b: Operand, rb: float, eb: Any, d: int) -> float:
    """A bound on ``e_a·|b| + |a|·e_b + e_a·e_b`` for ``e_a <= ra·A + ea``, ``e_b <= rb·B + eb``
    (``A``, ``B`` the operands' bounds): ``(|a| + e_a)·(|b| + e_b) - |a|·|b|``."""
    bb = float(np.broadcast_to(ea, (d,)) @ np.broadcast_to(eb, (d,)))
    return (
        times(ra + rb + ra * rb, pair(a, b))
        + (1 + rb) * err_pair(ea, b, d)
        + (1 + ra) * err_pair(eb, a, d)
        + bb
    )


@dataclasses.dataclass(frozen=True)
class Logits:
    """A.1 steps 0-3 at their worst: every logit error (``delta``), every float64 logit's
    magnitude (``reach``), the float64 logits' own error (``eps64``, step 0) and the logit
    error of the stand-ins against the exact operands (``moved``, A.2 (b), step 2')."""

    delta: float
    reach: float
    eps64: float
    moved: float
