"""What the three searches share: sizes, the case type and its one record format, the
worst-entry measurement, the budget tracker and the Hypothesis stage runner.

A case (:class:`Case`) is a frozen dataclass whose fields are of three sorts: *arrays* (the
inputs, the mask, what was computed), *groups* of arrays held in one field (an MHA case's
weights, a gradient case's four gradients) and *scalars*. :meth:`Case.fields` and
:meth:`Case.arrays` split a case into JSON-ready scalars and flat float64 (or boolean) arrays;
:meth:`Case.from_parts` builds it back. Both the campaign journal (:meth:`Case.record`, arrays as
nested lists) and the saved ``.npz``/``.json`` pairs of :mod:`mhanum.cases` are this one split;
numerics become a dict only through :meth:`~mhanum.Numerics.to_dict`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeVar

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, settings, target
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from mhanum import strategies
from mhanum._digest import digest_problem, inputs_digest
from mhanum._errors import InvalidArgument
from mhanum.bounds import Bound
from mhanum.numerics import PRESETS, Backward, Numerics
from mhanum.rope import Rope

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

BoundFunction = Callable[..., Bound]
Progress = Callable[[int, int, float], None]


class Sizes:
    """Positive integer sizes, checked once (the fields of a frozen dataclass subclass); a
    mapping of sizes must name those in ``REQUIRED``; a size left ``None`` takes the size that
    ``SAME_AS`` names."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()
    SAME_AS: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        for name, other in self.SAME_AS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, other))
        for name, value in self.as_dict().items():
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                msg = f"shape.{name}: expected a positive integer, got {value!r}"
                raise InvalidArgument(msg)
            object.__setattr__(self, name, int(value))

    def as_dict(self) -> dict[str, int]:
        """The sizes by name (JSON-ready)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def masks(self, kind: str | None) -> st.SearchStrategy[np.ndarray | None]:
        """Masks of ``kind`` (:func:`mhanum.strategies.masks`) for these sizes (one for every
        head where the sizes have no ``heads``), or always ``None`` without a kind."""
        if kind is None:
            return st.none()
        sizes = self.as_dict()
        return strategies.masks(
            q_len=sizes["q_len"], kv_len=sizes["kv_len"], batch=sizes["batch"],
            heads=sizes.get("heads", 1), kind=kind,
        )  # fmt: skip

    @classmethod
    def of(cls, shape: Self | Mapping[str, int]) -> Self:
        """``shape`` as sizes of this class (a mapping of the field names is accepted).

        Raises:
            InvalidArgument: for an unknown key, a required size missing or a non-positive
                size.
        """
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


# the case type and its record ---------------------------------------------------------------


def preset_name(num: Numerics) -> str | None:
    """The preset whose numerics ``num`` are, if any."""
    return next((name for name, preset in PRESETS.items() if preset == num), None)


def int_pair(pair: Sequence[ArrayLike]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two arrays (or lists) of integers as a pair of int tuples (the queries' and keys'
    positions)."""
    first, second = (tuple(int(x) for x in np.asarray(a).ravel()) for a in pair)
    return first, second


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "Numerics": Numerics.from_dict,
    "Backward": Backward.from_dict,
    "Rope": Rope.from_dict,
    "float": float,
    "int": int,
    "tuple[int, ...]": tuple,
    "tuple[str, ...]": tuple,
    "tuple[tuple[int, ...], tuple[int, ...]]": int_pair,
}
"""How a scalar field of each annotated type is read back from JSON (``"inf"`` and ``"nan"``
strings included: :mod:`mhanum.cases` writes non-finite numbers so)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One worst case of any kind: what the three case dataclasses share.

    Attributes:
        numerics: the configuration searched.
        shape: the sizes searched.
        mask: the boolean mask (True = attend), or ``None``.
        error, bound: the measured error and the bound at ``index``; ratio: their quotient,
            the largest over the output (above 1 a violation).
        dominant_term: the bound's largest term at ``index``.
        index: the entry attaining ``ratio``.
        seed, budget, evaluations, seconds: the search's accounting.

    A subclass is a frozen dataclass naming its sizes class (``SHAPE``), the input arrays that
    the digest ``inputs_sha256`` covers (``INPUTS``, flat names), its array fields
    (``ARRAY_FIELDS``; ``OPTIONAL``: the flat names of those a case may lack), and the fields
    that hold several arrays (``GROUPS``: field name to flat names and to the function that
    builds the field from them). ``LEGACY`` holds the value of a field that records of earlier
    versions may lack; ``SPARSE`` the optional fields written only when set (added after records
    were first written, so that an earlier record writes back as it was read); ``SUMMARY`` the
    fields :meth:`summary` shows, in order.
    """

    KIND: ClassVar[str | None] = None
    SHAPE: ClassVar[type[Sizes]]
    INPUTS: ClassVar[tuple[str, ...]]
    OPTIONAL: ClassVar[tuple[str, ...]] = ("mask",)
    ARRAY_FIELDS: ClassVar[tuple[str, ...]]
    GROUPS: ClassVar[dict[str, tuple[tuple[str, ...], Callable[..., Any]]]] = {}
    LEGACY: ClassVar[dict[str, Any]] = {}
    SPARSE: ClassVar[tuple[str, ...]] = ()
    SUMMARY: ClassVar[tuple[str, ...]] = ()

    numerics: Numerics
    shape: Sizes
    mask: np.ndarray | None = dataclasses.field(repr=False)
    error: float
    bound: float
    ratio: float
    dominant_term: str
    index: tuple[int, ...]
    seed: int
    budget: int
    evaluations: int
    seconds: float = 0.0

    @property
    def violation(self) -> bool:
        """Whether the measured error exceeds the bound somewhere."""
        return self.ratio > 1

    @property
    def preset(self) -> str | None:
        """The preset name whose numerics these are, if any."""
        return preset_name(self.numerics)

    def summary(self) -> dict[str, Any]:
        """The scalars named in ``SUMMARY``, JSON-ready (numerics described in words; a name
        ending in ``?`` is left out when ``None``)."""
        out: dict[str, Any] = {}
        for entry in self.SUMMARY:
            name = entry.removesuffix("?")
            value = getattr(self, name)
            if value is None and entry.endswith("?"):
                continue
            if isinstance(value, Numerics):
                value = value.describe()
            elif isinstance(value, Backward):
                value = value.algorithm
            elif isinstance(value, Sizes):
                value = value.as_dict()
            elif isinstance(value, Rope):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = as_lists(value)
            out[name] = value
        return out

    def arrays(self) -> dict[str, np.ndarray | None]:
        """Every array of the case by flat name: float64 copies, a boolean mask, ``None`` for an
        absent one (no mask, a bias the weights lack)."""
        flat: dict[str, np.ndarray | None] = {}
        for name in self.ARRAY_FIELDS:
            value = getattr(self, name)
            if name in self.GROUPS:
                names = self.GROUPS[name][0]
                parts = value if isinstance(value, tuple) else [getattr(value, n) for n in names]
                flat |= {n: None if a is None else np.asarray(a, np.float64)
                         for n, a in zip(names, parts, strict=False)}  # fmt: skip
            elif value is None:
                flat[name] = None
            else:
                flat[name] = np.asarray(value, bool if name == "mask" else np.float64)
        return flat

    @classmethod
    def array_names(cls) -> tuple[str, ...]:
        """The flat names of the case's arrays (a group's arrays in its place)."""
        return tuple(
            n for name in cls.ARRAY_FIELDS for n in cls.GROUPS.get(name, ((name,), tuple_of))[0]
        )

    def input_arrays(self) -> dict[str, np.ndarray | None]:
        """The input arrays that ``inputs_sha256`` covers."""
        flat = self.arrays()
        return {name: flat.get(name) for name in self.INPUTS}

    def fields(self) -> dict[str, Any]:
        """The scalars, JSON-ready: numerics and a rope as their ``to_dict`` writes them, the
        shape as its sizes, tuples (nested ones too) as lists; a field of ``SPARSE`` only when
        set."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in self.ARRAY_FIELDS:
                continue
            value = getattr(self, f.name)
            if value is None and f.name in self.SPARSE:
                continue
            if isinstance(value, (Numerics, Backward, Rope)):
                value = value.to_dict()
            elif isinstance(value, Sizes):
                value = value.as_dict()
            elif isinstance(value, tuple):
                value = as_lists(value)
            out[f.name] = value
        return out

    def record(self) -> dict[str, Any]:
        """The case as one JSON object (a campaign journal's result): the scalars without
        ``seconds``, the arrays as nested lists (float64 values read back exactly; a group as an
        object of them), and the digest of the inputs (``inputs_sha256``)."""
        flat = self.arrays()
        lists = {n: None if a is None else a.tolist() for n, a in flat.items()}
        arrays: dict[str, Any] = {}
        for name in self.ARRAY_FIELDS:
            if name in self.GROUPS:
                arrays[name] = {n: lists[n] for n in self.GROUPS[name][0] if n in lists}
            else:
                arrays[name] = lists[name]
        scalars = self.fields()
        del scalars["seconds"]
        return scalars | arrays | {"inputs_sha256": inputs_digest(self.input_arrays())}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Self:
        """The case a :meth:`record` holds (``seconds`` 0).

        Raises:
            KeyError, TypeError, ValueError: for a record without a field, with a field of the
                wrong type, or whose inputs do not match its digest.
        """
        flat: dict[str, Any] = {}
        for name in cls.ARRAY_FIELDS:
            value = record[name]
            if name in cls.GROUPS and isinstance(value, Mapping):
                flat |= {n: value.get(n) for n in cls.GROUPS[name][0]}
            elif name in cls.GROUPS:
                flat |= dict(zip(cls.GROUPS[name][0], value, strict=True))
            else:
                flat[name] = value
        arrays = {
            n: None if a is None else np.asarray(a, bool if n == "mask" else np.float64)
            for n, a in flat.items()
        }
        digest = record.get("inputs_sha256")
        problem = None if digest is None else digest_problem(
            {n: arrays.get(n) for n in cls.INPUTS}, digest
        )  # fmt: skip
        if problem is not None:
            raise ValueError(problem)
        return cls.from_parts(record, arrays)

    @classmethod
    def from_parts(cls, fields: Mapping[str, Any], arrays: Mapping[str, np.ndarray | None]) -> Self:
        """The case of scalars as :meth:`fields` writes them and flat arrays as :meth:`arrays`
        gives them (an absent optional array missing or ``None``).

        Raises:
            KeyError: naming a scalar field or an array the case needs and lacks.
            TypeError, ValueError: for a field of the wrong type.
        """
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in cls.GROUPS:
                names, build = cls.GROUPS[f.name]
                values[f.name] = build(**{n: arrays[n] for n in names if arrays.get(n) is not None})
            elif f.name in cls.ARRAY_FIELDS:
                values[f.name] = arrays.get(f.name) if f.name == "mask" else arrays[f.name]
            elif f.name in fields:
                values[f.name] = _decode(cls, f, fields[f.name])
            elif f.name in cls.LEGACY:
                values[f.name] = cls.LEGACY[f.name]
            elif f.default is dataclasses.MISSING:
                raise KeyError(f.name)
        return cls(**values)


def _decode(cls: type[Case], f: dataclasses.Field[Any], value: Any) -> Any:
    """A scalar field from JSON, by the field's annotation."""
    if f.name == "shape":
        return cls.SHAPE.of(value)
    kind = str(f.type)
    optional = kind.endswith(" | None")
    if value is None and optional:
        return None
    decode = _DECODERS.get(kind.removesuffix(" | None"))
    return value if decode is None else decode(value)


def as_lists(value: tuple[object, ...]) -> list[object]:
    """A tuple as a list, the tuples it holds as lists too (JSON writes them so)."""
    return [as_lists(x) if isinstance(x, tuple) else x for x in value]


def tuple_of(**arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays, in order, as a tuple (a group field such as a gradient case's gradients)."""
    return tuple(arrays.values())


# arguments ------------------------------------------------------------------------------------


def check_x64() -> None:
    """Refuse to search outside JAX's 64-bit mode (the measurements are float64)."""
    import jax

    if not jax.config.read("jax_enable_x64"):
        msg = (
            "numerics: the search measures against float64 attention (Lemma W.1), which needs "
            "JAX's 64-bit mode; call jax.config.update('jax_enable_x64', True) at start-up"
        )
        raise InvalidArgument(msg)


def _positive(name: str, value: object, *, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        what = "a positive" if least == 1 else "a non-negative"
        msg = f"{name}: expected {what} integer, got {value!r}"
        raise InvalidArgument(msg)
    return int(value)


def check_budget(budget: object) -> int:
    """``budget`` as a positive int."""
    return _positive("budget", budget)


def check_seed(seed: object) -> int:
    """``seed`` as a non-negative int."""
    return _positive("seed", seed, least=0)


def check_runs(runs: object) -> int:
    """``runs`` as a positive int."""
    return _positive("runs", runs)


def check_heads(num_heads: Any, d_model: int) -> int:
    """``num_heads`` as a positive int dividing ``d_model``."""
    ok = isinstance(num_heads, (int, np.integer)) and not isinstance(num_heads, bool)
    if not ok or num_heads < 1 or d_model % num_heads:
        shown = num_heads if ok else repr(num_heads)
        msg = f"num_heads: expected a positive integer dividing d_model={d_model}, got {shown}"
        raise InvalidArgument(msg)
    return int(num_heads)


def check_search(budget: object, seed: object, mask: str | None) -> tuple[int, int, str | None]:
    """A search's budget, seed and mask kind checked (:func:`check_budget`,
    :func:`check_seed`, :func:`check_mask`), in JAX's 64-bit mode (:func:`check_x64`)."""
    budget, seed = check_budget(budget), check_seed(seed)
    check_x64()
    return budget, seed, check_mask(mask)


def check_mask(mask: str | None) -> str | None:
    """A mask kind of :func:`mhanum.strategies.masks`; ``None`` for none."""
    kinds = strategies.MASK_KINDS
    if mask is not None and mask not in kinds:
        msg = f"mask: expected None or one of {kinds}, got {mask!r}"
        raise InvalidArgument(msg)
    return None if mask == "none" else mask


# measurement ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """The worst entry of ``|got - want|`` over a bound: the ratio there and what it is made of.

    Attributes:
        ratio: ``max_i |got_i - want_i| / B_i`` over the entries with a finite bound.
        error, bound: ``|got_i - want_i|`` and ``B_i`` at ``index``.
        index: the entry attaining ``ratio``.
        dominant_term: the bound's largest term there.
        normwise: ``max |got - want| / max |scale|`` over the entries with a finite bound.
    """

    ratio: float
    error: float
    bound: float
    index: tuple[int, ...]
    dominant_term: str
    normwise: float


def worst_entry(
    got: ArrayLike, want: np.ndarray, b: Bound, scale: ArrayLike | None = None
) -> Entry | None:
    """The :class:`Entry` of ``got`` against ``want`` under the bound ``b`` (a ``total`` and
    ``terms``), or ``None`` where the bound is infinite everywhere. A NaN or infinite error at
    an entry with a finite bound counts as an infinite ratio; ``scale`` (default ``want``) is
    the normwise denominator."""
    total = np.asarray(b.total, np.float64)
    finite = np.isfinite(total)
    if not finite.any():
        return None
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        err = np.where(finite, np.abs(np.asarray(got, np.float64) - want), 0.0)
        err = np.where(finite & ~np.isfinite(err), np.inf, err)
        ratios = np.where(err > 0, err / np.where(finite, total, 1.0), 0.0)
    flat = int(np.argmax(np.where(finite, ratios, -1.0)))
    index = tuple(int(i) for i in np.unravel_index(flat, ratios.shape))
    by = want if scale is None else scale
    top = float(np.max(np.abs(np.where(finite, by, 0.0)), initial=0.0))
    terms = {name: float(np.broadcast_to(t, total.shape)[index]) for name, t in b.terms.items()}
    return Entry(
        ratio=float(ratios.flat[flat]),
        error=float(err[index]),
        bound=float(total[index]),
        index=index,
        dominant_term=max(terms, key=lambda name: terms[name]),
        normwise=float(err.max(initial=0.0)) / top if top > 0 else 0.0,
    )


# the budget -----------------------------------------------------------------------------------

E = TypeVar("E")


@dataclasses.dataclass
class Candidate(Generic[E]):
    """An input the tracker keeps: its objective value, arrays, structures and evaluation."""

    value: float
    inputs: dict[str, Any]
    structure: tuple[str, ...]
    evaluation: E


class Tracker(Generic[E]):
    """Counts evaluations against the budget, keeps the best few inputs, reports progress.

    Args:
        measure: evaluates the inputs (keyword arguments): an evaluation, or ``None`` outside
            the bound's scope.
        score: the objective value of an evaluation.
        budget: the number of evaluations allowed.
        progress: called as ``progress(done, budget, best_value)`` after each evaluation.
        skip: exceptions of ``measure`` that skip an input (counted in ``uncertified``).
    """

    def __init__(
        self,
        measure: Callable[..., E | None],
        score: Callable[[E], float],
        budget: int,
        progress: Progress | None = None,
        skip: tuple[type[Exception], ...] = (),
    ) -> None:
        self.measure = measure
        self.score = score
        self.budget = budget
        self.progress = progress
        self.skip = skip
        self.done = self.uncertified = self.out_of_scope = 0
        self.best: list[Candidate[E]] = []

    @property
    def exhausted(self) -> bool:
        return self.done >= self.budget

    @property
    def best_value(self) -> float:
        return self.best[0].value if self.best else 0.0

    def evaluate(self, structure: tuple[str, ...] = (), **inputs: Any) -> E | None:
        """Measure ``inputs``, keep them if among the best, report progress."""
        self.done += 1
        try:
            ev = self.measure(**inputs)
        except self.skip:  # the reference cannot certify it: no measurement, skip it
            self.uncertified += 1
            ev = None
        else:
            self.out_of_scope += ev is None
        if ev is not None and not math.isnan(value := self.score(ev)):  # inf: kept
            self._keep(Candidate(value, inputs, structure, ev))
        if self.progress is not None:
            self.progress(min(self.done, self.budget), self.budget, self.best_value)
        return ev

    def finish(self) -> Candidate[E]:
        """The best input, closing the progress bar of a search that finished early.

        Raises:
            InvalidArgument: when no input in the budget was within the bound's scope.
        """
        if not self.best:
            certified = f"{self.uncertified} not certified by the reference, " if self.skip else ""
            msg = (
                f"numerics: expected some input within the bound's scope, got none in "
                f"{self.done} evaluations ({certified}{self.out_of_scope} out of scope)"
            )
            raise InvalidArgument(msg)
        if self.progress is not None and not self.exhausted:
            self.progress(self.budget, self.budget, self.best_value)
        return self.best[0]

    def _keep(self, cand: Candidate[E], size: int = 4) -> None:
        if any(c.value == cand.value for c in self.best):
            return
        self.best = sorted([*self.best, cand], key=lambda c: -c.value)[:size]


# Hypothesis -----------------------------------------------------------------------------------


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal shares, the larger ones last."""
    return [(total * (i + 1)) // parts - (total * i) // parts for i in range(parts)]


def steer(value: float, label: str, dominant_term: str | None = None) -> None:
    """``target()`` a finite ``value`` under ``label`` (and under one label per dominant term,
    so that inputs where different terms dominate are climbed separately)."""
    if math.isfinite(value):
        target(value, label=label)
        if dominant_term is not None:
            target(value, label=f"{label} | {dominant_term}")


def run_stage(
    step: Callable[..., None],
    draws: Sequence[st.SearchStrategy[Any]],
    examples: int,
    seed: int,
) -> None:
    """Run ``step(*drawn)`` on ``examples`` draws of ``draws`` steered by its ``target()``
    calls: generation and targeting only, no database, no deadline, quiet, and without the
    local constants (:func:`without_local_constants`)."""

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        phases=[Phase.generate, Phase.target],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
    )
    @hypothesis_seed(seed)
    @given(st.tuples(*draws))
    def run(drawn: tuple[Any, ...]) -> None:
        step(*drawn)

    with without_local_constants():
        run()


@contextlib.contextmanager
def without_local_constants() -> Iterator[None]:
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
