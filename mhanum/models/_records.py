"""The records of an audit: what a head does, a preset's figures on a layer, a layer's, and a verdict."""

from __future__ import annotations

import dataclasses

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.params import MHAParams

VERDICTS = ("certified", "probable", "measured", "not within")
"""The verdicts of a preset against a tolerance, strongest first (see :class:`Verdict`)."""


@dataclasses.dataclass(frozen=True)
class HeadStats:
    """What a head does on the sentences (the same under every preset).

    Attributes:
        head: the head's index.
        logit_spread: the largest, over the sentences' query rows, of ``max − min`` of the row's
            scaled logits ``q·k/sqrt(d_k)`` over the keys it attends (its sentence's tokens).
        cls_mass: the probability the head puts on ``[CLS]`` (position 0), averaged over every
            query row of every sentence (padding rows excluded).
        sep_mass: likewise on each sentence's ``[SEP]`` (its last token).
        sink: ``cls_mass + sep_mass >= 0.5``: on average, at least half of the head's attention
            goes to the two special tokens (a "sink head", which attends to them as a no-op).
    """

    head: int
    logit_spread: float
    cls_mass: float
    sep_mass: float
    sink: bool


@dataclasses.dataclass(frozen=True)
class HeadError:
    """One head's attention error under one preset: the head's attention (softmax of the scaled
    logits times ``v``, before the output projection) run by :func:`mhanum.attention` on the
    head's float64 projections ``q, k, v``, against :func:`mhanum.reference.attention` of the same
    ``q, k, v``, with :func:`mhanum.bounds.attention_bound` (Theorem A.1), over the sentences'
    tokens (padding rows excluded).

    Attributes:
        head: the head's index.
        error: the largest absolute error of a component.
        bound: the largest bound of a component.
        ratio: the largest ``error / bound`` over the components.
        dominant_term: the largest term of the bound (by its maximum over those components).
    """

    head: int
    error: float
    bound: float
    ratio: float
    dominant_term: str


@dataclasses.dataclass(frozen=True)
class PresetAudit:
    """One layer under one preset: the whole multi-head attention and each head.

    The layer's figures are of :func:`mhanum.multi_head_attention` (projections, heads, output
    projection) on the layer's input, against :func:`mhanum.reference.multi_head_attention`
    (certified), with :func:`mhanum.bounds.mha_bound` (Theorem A.2), over the sentences' tokens.

    Attributes:
        preset: the preset's name.
        error: the largest absolute error of an output component.
        normwise: the normwise relative error (max-norm) over the sentences' tokens.
        bound: the largest A.2 bound of a component (``inf`` where the theorem cannot exclude
            an overflow or a vacuous softmax; ``None`` outside its scope, see ``note``).
        ratio: the largest ``error / bound`` (at most 1: the bound is a theorem); ``None``
            outside the scope.
        dominant_term: the largest term of the A.2 bound (``""`` outside the scope).
        a_priori: the largest component of the A.4 bound from the weights and ``max |x|``
            (:func:`mhanum.bounds.mha_bound_a_priori`), or ``None`` outside its scope.
        heads: each head's :class:`HeadError`.
        a_priori_reasons: why the A.4 bound is infinite (``Bound.reasons``), else empty.
        note: why a bound is missing (the preset is outside its theorem's scope), else ``""``.
        probable_bound: the largest component of the probabilistic A.2 bound (Theorem A.3:
            ``mha_bound(..., probability=)``), or ``None`` when not asked or outside the scope.
        probability: the probability that bound states (``Bound.probability``), or ``None``.
        probable_assumptions: the assumptions the probabilistic bound adds to the deterministic
            one (its model of the rounding errors), in words.
    """

    preset: str
    error: float
    normwise: float
    bound: float | None
    ratio: float | None
    dominant_term: str
    a_priori: float | None
    heads: tuple[HeadError, ...]
    a_priori_reasons: tuple[str, ...] = ()
    note: str = ""
    probable_bound: float | None = None
    probability: float | None = None
    probable_assumptions: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FrameworkAudit:
    """One layer run by a real framework code path in float32: ``transformers``' own
    ``BertAttention`` of the layer (self-attention and ``output.dense``, read from the same
    checkpoint) on the layer's input rounded to float32, against the certified reference of the
    float64 input, with Theorem A.2 for the path's numerics (which charges that rounding), over
    the sentences' tokens.

    Attributes:
        framework: the path's name (see :data:`FRAMEWORKS`).
        version: the framework's installed version.
        error: the largest absolute error of an output component.
        normwise: the normwise relative error (max-norm).
        bound: the largest A.2 bound of a component.
        ratio: the largest ``error / bound`` (at most 1).
        numerics: the path's :class:`~mhanum.Numerics`, as its one-line ``describe()``.
    """

    framework: str
    version: str
    error: float
    normwise: float
    bound: float
    ratio: float
    numerics: str


@dataclasses.dataclass(frozen=True)
class MaskVerdict:
    """A padding constant added to the masked keys' logits, in a preset's score format.

    Attributes:
        preset: the preset's name.
        constant: the constant, as given (``"finfo.min"`` is the score format's).
        stored_value: the constant as stored in the score format (``-inf`` if it overflows).
        leakage_bound: the bound on the total computed probability of the padding keys of a row
            (Theorem M.5, with the layer's score bound and its padded length).
        safe: the padding changes no probability by more than a unit roundoff ``u_s`` of the
            softmax format: the leakage bound is at most ``u_s`` (or exactly 0), and a finite
            constant stays finite when stored and added. ``-inf`` is safe for padding: every row
            attends ``[CLS]``, so no row is fully masked.
    """

    preset: str
    constant: float | str
    stored_value: float
    leakage_bound: float
    safe: bool


@dataclasses.dataclass(frozen=True)
class LayerReference:
    """What every preset of one layer is compared with: the layer's inputs, its certified outputs
    and the heads' statistics (computed once per layer)."""

    layer: int
    params: MHAParams = dataclasses.field(repr=False)
    num_heads: int
    x: np.ndarray = dataclasses.field(repr=False)
    mask: np.ndarray = dataclasses.field(repr=False)
    valid: np.ndarray = dataclasses.field(repr=False)
    lengths: tuple[int, ...]
    exact: np.ndarray = dataclasses.field(repr=False)
    exact_heads: np.ndarray = dataclasses.field(repr=False)
    heads: tuple[HeadStats, ...]
    score_bound: float


@dataclasses.dataclass(frozen=True)
class LayerAudit:
    """One attention layer: its heads, each preset, and the padding constants.

    Attributes:
        layer: the encoder layer's index.
        score_bound: the largest ``|scaled logit|`` over the sentences' rows and the padded keys.
        heads: each head's :class:`HeadStats`.
        presets: each preset's :class:`PresetAudit`, in the order asked.
        masks: each (preset, constant) :class:`MaskVerdict`.
        frameworks: each framework path's :class:`FrameworkAudit`, in the order asked (empty
            unless asked).
        output_scale: the layer's output scale, ``max |exact output|``: the largest magnitude
            of a component of the certified reference output over the sentences' tokens (what a
            relative tolerance ``rtol`` is taken of; ``None`` in audits written before it).
    """

    layer: int
    score_bound: float
    heads: tuple[HeadStats, ...]
    presets: tuple[PresetAudit, ...]
    masks: tuple[MaskVerdict, ...]
    frameworks: tuple[FrameworkAudit, ...] = ()
    output_scale: float | None = None

    def preset(self, name: str) -> PresetAudit:
        """The audit of preset ``name``.

        Raises:
            InvalidArgument: for a preset that was not audited.
        """
        for p in self.presets:
            if p.preset == name:
                return p
        msg = f"name: expected one of {', '.join(p.preset for p in self.presets)}, got {name!r}"
        raise InvalidArgument(msg)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a preset is within the tolerance on every audited layer, and how sure that is.

    A layer's tolerance is ``τ = min(tolerance, rtol·scale)`` of those given (both must hold),
    where ``scale`` is the layer's :attr:`LayerAudit.output_scale`, ``max |exact output|``. The
    verdict is the first that holds of:

    * ``"not within"``: a measured error exceeds ``τ`` on some layer;
    * ``"certified"``: the deterministic bound (Theorem A.2) is at most ``τ`` on every layer:
      every rounding of these computations is within the tolerance, a theorem;
    * ``"probable"``: the probabilistic bound (Theorem A.3) is at most ``τ`` on every layer:
      within the tolerance with probability at least ``probability`` (the union bound over the
      layers), under that theorem's model of the rounding errors (``assumptions``);
    * ``"measured"``: only the measured errors are within ``τ`` (on these sentences; no bound
      is).

    Attributes:
        preset: the preset's name.
        verdict: one of :data:`VERDICTS`.
        ratio: the figure the verdict rests on (``bound``, ``probable_bound``, or ``error`` for
            ``"measured"`` and ``"not within"``) over ``τ``, at its worst layer.
        layer: that worst layer's index.
        head: the worst head of that layer: the head whose attention (before the output
            projection) has the largest A.1 bound, or for the measured verdicts the largest
            measured error; ``None`` when the layer has no head figures.
        error_ratio: the largest ``error / τ`` over the layers.
        bound_ratio: the largest ``bound / τ`` (``None`` if a layer has no bound).
        probable_ratio: the largest ``probable_bound / τ`` (``None`` if a layer has none).
        probability: the probability of the probabilistic statement over every layer,
            ``1 - Σ (1 - P_layer)`` (``None`` without probabilistic bounds).
        assumptions: the model of the probabilistic bound, in words (empty without one).
    """

    preset: str
    verdict: str
    ratio: float
    layer: int
    head: int | None
    error_ratio: float
    bound_ratio: float | None
    probable_ratio: float | None
    probability: float | None
    assumptions: tuple[str, ...] = ()
