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

With a rotary embedding (``rope=``, a :class:`mhanum.rope.Rope`, and ``positions=``) the exact
output ``o`` is the exact attention of the exactly rotated q and k, and the bound ``B`` is
:func:`mhanum.bounds.attention_bound` with the rope (Theorem P.1 carried into the logits). The
float64 stand-in ``õ`` rotates with the rope's float64 copy (every ``*_format`` field
``float64``: ``pow``, ``cos`` and ``sin`` within the rope's ulps of float64) and attends with
``fp64``; its own bound ``B64`` is ``attention_bound(..., numerics=fp64, rope=<the float64
copy>)``, which bounds ``|õ_i - o_i|`` against the same exact output (Theorem P.1 in float64 for
the rotation, Theorem A.1 for the attention): Lemma W.1 holds as stated, with the same slack.

:func:`random_search` spends the same budget on independent random inputs with the same objective,
for an honest comparison.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import hypothesis.errors
import numpy as np
from hypothesis import strategies as st

from mhanum import _validate as V
from mhanum import masks, reference, strategies
from mhanum._errors import InvalidArgument
from mhanum.bounds import Bound, attention_bound, schedule_difference
from mhanum.emulate.attention import attention
from mhanum.formats import get_format, round_to
from mhanum.numerics import PRESETS, Numerics, resolve
from mhanum.rope import Rope, check_holds
from mhanum.search._core import (
    BoundFunction,
    Candidate,
    Case,
    Entry,
    Progress,
    Sizes,
    Tracker,
    check_search,
    int_pair,
    run_stage,
    shares,
    steer,
    worst_entry,
)

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = [
    "OBJECTIVES",
    "RANGE_FAMILIES",
    "SLACK_LIMIT",
    "Evaluation",
    "Objective",
    "Shape",
    "WorstCase",
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


@dataclasses.dataclass(frozen=True)
class Shape(Sizes):
    """Sizes of one attention call: q ``(batch, heads, q_len, d_k)``, k/v ``(…, kv_len, d_k/d_v)``.

    ``d_v`` defaults to ``d_k``, ``batch`` and ``heads`` to 1; a mapping must give ``q_len``,
    ``kv_len`` and ``d_k``.
    """

    REQUIRED: ClassVar[tuple[str, ...]] = ("q_len", "kv_len", "d_k")
    SAME_AS: ClassVar[dict[str, str]] = {"d_v": "d_k"}

    q_len: int = 8
    kv_len: int = 16
    d_k: int = 16
    d_v: int | None = None
    batch: int = 1
    heads: int = 1

    def draws(
        self, num: Numerics, structure: str | Iterable[str] | None = None
    ) -> st.SearchStrategy[strategies.AttentionInputs]:
        """q, k and v of these sizes (:func:`mhanum.strategies.attention_inputs`, for ``num``,
        with ``structure``), without a scale or a bias (a case holds neither).

        Raises:
            InvalidArgument: (mhanum's) for an unknown structure name, which the strategies
                refuse with Hypothesis's error of the same message.
        """
        try:
            drawn = strategies.attention_inputs(
                q_len=self.q_len, kv_len=self.kv_len, d_k=self.d_k, d_v=self.d_v,
                batch=self.batch, heads=self.heads, accum=num.accum, structure=structure,
                numerics=num,
            )  # fmt: skip
        except hypothesis.errors.InvalidArgument as exc:
            raise InvalidArgument(str(exc)) from None
        return drawn.filter(lambda x: x.bias is None and x.scale is None)

    def arrays(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The shapes of q, k and v."""
        lead = (self.batch, self.heads)
        d_v = int(self.d_v or self.d_k)
        return (
            (*lead, self.q_len, self.d_k),
            (*lead, self.kv_len, self.d_k),
            (*lead, self.kv_len, d_v),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation(Entry):
    """One evaluation of the objective: the worst entry (``ratio`` ``max_i |ô_i − o_i| / B_i``,
    and ``error``, ``bound``, ``index``, ``dominant_term`` there; ``normwise``
    ``max |ô − o| / max |o|``) and, besides:

    Attributes:
        value: the objective (``ratio`` or ``normwise``).
        slack: ``max_i B64_i / B_i``, how far the cheap ratio may be from the true one (0 when
            measured against the certified reference).
        output: the computed output ``ô`` as float64.
    """

    value: float
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
        rope: a :class:`mhanum.rope.Rope` that rotates q and k in every call (the exact output
            is the attention of the exactly rotated inputs), or ``None``; its
            ``rotation_format`` must hold ``numerics.input`` exactly. With ``against``, both
            schedules rotate, and the difference is bounded by ``schedule_difference(...,
            rope=)``.
        positions: with ``rope``, the queries' and keys' positions ``(queries', keys')``
            (default: as :meth:`mhanum.rope.Rope.positions_for` reads ``None``).

    Raises:
        InvalidArgument: for an unknown objective, ``against`` missing or out of place, a bad
            ``softcap`` or ``sink``, a ``rope`` that is not a :class:`mhanum.rope.Rope` or whose
            ``rotation_format`` does not hold ``numerics.input``, or positions without a rope.
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
        rope: Rope | None = None,
        positions: tuple[ArrayLike, ArrayLike] | None = None,
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
        self.rope = _check_rope(rope, positions, numerics)
        self.positions = positions
        # passed only when set, so that a bound function without the arguments still serves
        self.extra: dict[str, Any] = {
            name: value
            for name, value in (("softcap", self.softcap), ("sink", self.sink), ("rope", rope))
            if value is not None
        }
        if rope is not None and positions is not None:
            self.extra["positions"] = positions
        # the float64 stand-in rotates with the rope's float64 copy (Lemma W.1 with a rope)
        self.extra64 = self.extra if rope is None else self.extra | {"rope": _float64_rope(rope)}
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
            kw64 = self.extra64
            try:
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    b64 = attention_bound(q, k, v, mask, numerics=self.fp64, **kw64).total
            except InvalidArgument:  # outside Lemma W.1's hypotheses: measure exactly
                b64 = np.full_like(total, np.inf)
            slack = _max_ratio(np.where(finite, b64, 0.0), total)
            exact = not slack <= SLACK_LIMIT
            if not exact:
                ref = np.asarray(attention(q, k, v, mask, numerics=self.fp64, **kw64), np.float64)
                exact = not bool(np.all(np.isfinite(ref[finite])))
        if exact:
            ref = np.asarray(reference.attention(q, k, v, mask=mask, **kw), np.float64)
            slack = 0.0
        return self._evaluation(out, ref, ref, b, slack)

    def _evaluation(
        self, out: np.ndarray, other: np.ndarray, scale_by: np.ndarray, b: Bound, slack: float
    ) -> Evaluation:
        """``|out - other|`` against ``b`` where it is finite; normwise over ``max |scale_by|``."""
        entry = worst_entry(out, other, b, scale=scale_by)
        assert entry is not None  # the caller checked that the bound is finite somewhere
        value = entry.ratio if self.objective.endswith("/bound") else entry.normwise
        return Evaluation(value=value, slack=slack, output=out, **dataclasses.asdict(entry))


def _check_rope(rope: object, positions: object, numerics: Numerics) -> Rope | None:
    """A search's rope: ``None``, or a :class:`mhanum.rope.Rope` whose ``rotation_format`` holds
    ``numerics.input`` exactly (:func:`mhanum.rope.check_holds`: the kernel rotates its inputs as
    it holds them); positions only with a rope.

    Raises:
        InvalidArgument: naming ``rope``, ``rope.rotation_format`` or ``positions``.
    """
    if rope is None:
        if positions is not None:
            msg = "positions: expected only with rope= (the positions of a rotary embedding)"
            raise InvalidArgument(msg)
        return None
    if not isinstance(rope, Rope):
        msg = f"rope: expected a mhanum.rope.Rope or None, got {type(rope).__name__}"
        raise InvalidArgument(msg)
    check_holds(rope, get_format(numerics.input), "the search's input format")
    return rope


def _float64_rope(rope: Rope) -> Rope:
    """``rope`` with every ``*_format`` field float64: the rotation of the float64 stand-in
    (Lemma W.1 with a rope), bounded by Theorem P.1 in float64."""
    formats: dict[str, Any] = {
        f.name: "float64" for f in dataclasses.fields(rope) if f.name.endswith("_format")
    }
    return dataclasses.replace(rope, **formats)


def _search_rope(
    rope: object,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None,
    num: Numerics,
    sizes: Shape,
) -> tuple[Rope | None, tuple[np.ndarray, np.ndarray] | None]:
    """A search's rope checked (:func:`_check_rope`) and its positions as the pair
    ``(queries', keys')`` that :meth:`mhanum.rope.Rope.positions_for` reads for ``sizes``."""
    checked = _check_rope(rope, positions, num)
    if checked is None:
        return None, None
    pair = checked.positions_for(
        positions, d_k=sizes.d_k, q_len=sizes.q_len, k_len=sizes.kv_len
    )  # fmt: skip
    return checked, pair


def _sink_value(sink: float | None) -> float | None:
    """A search's sink logit: ``None`` or a finite number (one for every row and head)."""
    if sink is None:
        return None
    ok = isinstance(sink, (int, float, np.floating)) and not isinstance(sink, bool)
    if not ok or not math.isfinite(sink):
        msg = f"sink: expected a finite number (one logit for every head) or None, got {sink!r}"
        raise InvalidArgument(msg)
    return float(sink)


def _difference_bound(against: Numerics) -> BoundFunction:
    def bound(
        q: ArrayLike,
        k: ArrayLike,
        v: ArrayLike,
        mask: np.ndarray | None,
        *,
        numerics: Numerics,
        **kw: Any,
    ) -> Bound:
        return schedule_difference(q, k, v, mask, numerics_a=numerics, numerics_b=against, **kw)

    return bound


def _max_ratio(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(a > 0, a / b, 0.0)
    return float(np.max(r, initial=0.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorstCase(Case):
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
        rope: the :class:`mhanum.rope.Rope` that rotates q and k in every evaluation, or
            ``None``.
        positions: with ``rope``, the queries' and the keys' positions ``(queries', keys')``.
    """

    shape: Shape
    q: np.ndarray = dataclasses.field(repr=False)
    k: np.ndarray = dataclasses.field(repr=False)
    v: np.ndarray = dataclasses.field(repr=False)
    output: np.ndarray = dataclasses.field(repr=False)
    objective: str
    normwise: float
    method: str
    cheap_ratio: float
    slack: float
    structure: tuple[str, ...] = ()
    against: Numerics | None = None
    softcap: float | None = None
    sink: float | None = None
    rope: Rope | None = None
    positions: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    SHAPE: ClassVar[type[Sizes]] = Shape
    INPUTS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "mask")
    ARRAY_FIELDS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "output", "mask")
    LEGACY: ClassVar[dict[str, Any]] = {
        "normwise": math.nan, "index": (), "method": "targeted", "budget": 0, "evaluations": 0,
        "cheap_ratio": math.nan, "slack": math.nan,
    }  # fmt: skip
    SPARSE: ClassVar[tuple[str, ...]] = ("rope", "positions")
    SUMMARY: ClassVar[tuple[str, ...]] = (
        "preset", "numerics", "method", "objective", "error", "bound", "ratio", "normwise",
        "dominant_term", "violation", "evaluations", "seconds", "against?", "softcap?", "sink?",
        "rope?",
    )  # fmt: skip

    @property
    def value(self) -> float:
        """The objective's value (``ratio`` or ``normwise``)."""
        return self.ratio if self.objective.endswith("/bound") else self.normwise

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        """``{"q": q, "k": k, "v": v}``, and ``"mask"`` if there is one."""
        arrays = {"q": self.q, "k": self.k, "v": self.v}
        return arrays if self.mask is None else arrays | {"mask": self.mask}


def _tracker(goal: Objective, budget: int, progress: Progress | None) -> Tracker[Evaluation]:
    """The budget of a search for ``goal``: inputs ``q``, ``k``, ``v``, ``mask``."""

    def measure(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None
    ) -> Evaluation | None:
        return goal(q, k, v, mask)

    return Tracker(measure, lambda ev: ev.value, budget, progress)


def worst_case(
    numerics: Numerics | str,
    shape: Shape | Mapping[str, int],
    *,
    objective: str = "error/bound",
    budget: int = 200,
    seed: int = 0,
    refine: float = 0.25,
    structure: str | Iterable[str] | None = None,
    mask: str | None = None,
    bound: BoundFunction | None = None,
    progress: Progress | None = None,
    against: Numerics | str | None = None,
    softcap: float | None = None,
    sink: float | None = None,
    rope: Rope | None = None,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
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
        rope: a :class:`mhanum.rope.Rope` that rotates q and k in every evaluation: the error is
            measured against the exact attention of the exactly rotated inputs and bounded by
            ``attention_bound(..., rope=)`` (with ``against``: both schedules rotate, and
            ``schedule_difference(..., rope=)`` bounds their difference). Its
            ``rotation_format`` must hold ``numerics.input`` exactly.
        positions: with ``rope``, the queries' and keys' positions: a pair ``(queries',
            keys')``, one array for both when ``q_len == kv_len``, or by default the keys
            ``0..kv_len-1`` and the queries the last ``q_len`` of them
            (:meth:`mhanum.rope.Rope.positions_for`).

    Returns:
        A :class:`WorstCase` measured against the certified reference.

    Raises:
        InvalidArgument: for a bad argument (a ``rope`` that is not a
            :class:`mhanum.rope.Rope` or whose ``rotation_format`` does not hold
            ``numerics.input``; positions without a rope or that do not fit the shape), without JAX's 64-bit mode, or when no input in the budget was
            within the bound's scope.

    Examples:
        >>> import jax
        >>> jax.config.update("jax_enable_x64", True)
        >>> case = worst_case("fp16-fp32acc", {"q_len": 2, "kv_len": 4, "d_k": 4}, budget=8)
        >>> 0 <= case.ratio <= 1
        True
    """
    num = resolve(numerics)
    sizes = Shape.of(shape)
    budget, seed, kind = check_search(budget, seed, mask)
    if not isinstance(refine, (int, float)) or not 0 <= refine < 1:
        msg = f"refine: expected a fraction in [0, 1), got {refine!r}"
        raise InvalidArgument(msg)
    start = time.perf_counter()
    checked, pair = _search_rope(rope, positions, num, sizes)
    goal = Objective(
        num, objective, bound=bound, against=against, softcap=softcap, sink=sink, rope=checked,
        positions=pair,
    )  # fmt: skip
    tracker = _tracker(goal, budget, progress)
    search_budget = max(1, budget - int(refine * budget))
    _targeted(tracker, goal, sizes, search_budget, seed, structure, kind)
    _refine(tracker, num)
    return _confirm(tracker, goal, sizes, "targeted", seed, start)


def _families(structure: str | Iterable[str] | None) -> list[tuple[str, Any]]:
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


def _targeted(
    tracker: Tracker[Evaluation],
    goal: Objective,
    shape: Shape,
    examples: int,
    seed: int,
    structure: str | Iterable[str] | None,
    mask: str | None,
) -> None:
    """Hypothesis with ``target()``, one stage per structure family, the budget split evenly."""
    stages = _families(structure)
    for i, ((family, mix), share) in enumerate(
        zip(stages, shares(examples, len(stages)), strict=True)
    ):
        if share > 0:
            label = f"{goal.objective} | {family}"
            _stage(tracker, goal.numerics, shape, share, seed * 1000 + i, label, mix, mask)


def _stage(
    tracker: Tracker[Evaluation],
    num: Numerics,
    shape: Shape,
    examples: int,
    seed: int,
    label: str,
    structure: str | Iterable[str] | None,
    mask: str | None,
) -> None:
    """``examples`` draws of one family, steered by ``target()`` under ``label``."""
    inputs, masks_ = shape.draws(num, structure), shape.masks(mask)
    stop = tracker.done + examples

    def step(x: strategies.AttentionInputs, m: np.ndarray | None) -> None:
        if tracker.done >= stop:
            return
        ev = tracker.evaluate(tuple(sorted(x.structure)), q=x.q, k=x.k, v=x.v, mask=m)
        if ev is not None:
            steer(ev.value, label, ev.dominant_term)

    run_stage(step, [inputs, masks_], examples, seed)


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


def _refine(tracker: Tracker[Evaluation], num: Numerics) -> None:
    """Nelder–Mead over :func:`_transform` from each of the best inputs, within the budget."""
    from scipy.optimize import minimize

    starts = list(tracker.best[:2])
    # a second pass restarts from the same inputs with a wider simplex if budget remains
    for step, cand in [(0.5, c) for c in starts] + [(2.0, c) for c in starts]:
        if tracker.exhausted:
            return

        def loss(params: np.ndarray, cand: Candidate[Evaluation] = cand) -> float:
            if tracker.exhausted:
                return 0.0
            x = cand.inputs
            q, k, v = _transform(params, x["q"], x["k"], x["v"], num.input)
            ev = tracker.evaluate(cand.structure, q=q, k=k, v=v, mask=x["mask"])
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
    tracker: Tracker[Evaluation],
    goal: Objective,
    shape: Shape,
    method: str,
    seed: int,
    start: float,
) -> WorstCase:
    """The best input re-measured against the certified reference, as a :class:`WorstCase`."""
    best = tracker.finish()
    x = best.inputs
    ev = goal(x["q"], x["k"], x["v"], x["mask"], certified=True)
    if ev is None:  # the same input was in scope a moment ago
        msg = "numerics: the best input fell out of the bound's scope on confirmation"
        raise InvalidArgument(msg)
    return WorstCase(
        numerics=goal.numerics, shape=shape, q=x["q"], k=x["k"], v=x["v"], output=ev.output,
        mask=x["mask"], objective=goal.objective, error=ev.error, bound=ev.bound,
        ratio=ev.ratio, normwise=ev.normwise, dominant_term=ev.dominant_term, index=ev.index,
        method=method, seed=seed, budget=tracker.budget, evaluations=tracker.done,
        cheap_ratio=best.evaluation.ratio, slack=best.evaluation.slack,
        seconds=time.perf_counter() - start, structure=best.structure, against=goal.against,
        softcap=goal.softcap, sink=goal.sink, rope=goal.rope,
        positions=None if goal.positions is None else int_pair(goal.positions),
    )  # fmt: skip


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
    rope: Rope | None = None,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
) -> WorstCase:
    """The random baseline: ``budget`` independent inputs, the best one confirmed.

    Each input draws q, k and v independently from the standard normal distribution, multiplies
    each by ``2^j`` for ``j`` uniform in ``[-3, 3]``, and rounds into ``numerics.input``. The
    objective and its confirmation are those of :func:`worst_case`. A mask of the requested kind
    is drawn with each input (padding: a uniform valid length per batch entry; random: each key
    kept with probability 1/2, key 0 kept in a row that would be empty).

    Args:
        numerics, shape, objective, budget, seed, mask, bound, progress: as for
            :func:`worst_case` (``seed`` seeds a ``numpy.random.Generator``).
        against, softcap, sink, rope, positions: as for :func:`worst_case`.

    Returns:
        A :class:`WorstCase` with ``method="random"``.
    """
    num = resolve(numerics)
    sizes = Shape.of(shape)
    budget, seed, kind = check_search(budget, seed, mask)
    start = time.perf_counter()
    checked, pair = _search_rope(rope, positions, num, sizes)
    goal = Objective(
        num, objective, bound=bound, against=against, softcap=softcap, sink=sink, rope=checked,
        positions=pair,
    )  # fmt: skip
    tracker = _tracker(goal, budget, progress)
    rng = np.random.default_rng(seed)
    fmt = get_format(num.input)
    while not tracker.exhausted:
        q, k, v = (
            round_to(rng.standard_normal(s) * 2.0 ** rng.uniform(-3, 3), fmt)
            for s in sizes.arrays()
        )
        m = None if kind is None else _random_mask(kind, sizes, rng)
        tracker.evaluate(q=q, k=k, v=v, mask=m)
    return _confirm(tracker, goal, sizes, "random", seed, start)


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
