"""Auditing the attention layers of a decoder checkpoint (Llama, Qwen2, Mistral, Gemma-2).

Each layer's input is the hidden state the checkpoint's own layers produce in float64
(:func:`hidden_states`); the audited computation is the layer's attention after its RMS norm
and projections, through ``o_proj``, as a BERT layer is audited: the projections, RoPE,
grouped-query attention, the layer's causal or sliding-window mask, Gemma-2's soft-cap and
query scale, and the output projection. Under a preset the whole layer runs in the preset's
numerics (:func:`mhanum.multi_head_attention` with ``rope=``, the projections stored and rotated
in the preset's storage format with float32 tables stored in it, as ``transformers`` does); the
certified reference is the exact layer, its projections exactly rotated
(:func:`mhanum.reference.multi_head_attention` with ``rope=``), and the bound is Theorem A.2
with the rotated projections' errors (Corollary P.6; :func:`mhanum.bounds.mha_bound` with
``rope=``). Per head, the heads' attention is audited too: the float64 projections held in the
preset's input format, rotated as the kernel does, attended in its numerics, against the exact
attention of the exactly rotated inputs and Theorem A.1 with Theorem P.1 (Corollary P.4).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mhanum import bounds, metrics, reference
from mhanum._errors import InvalidArgument
from mhanum.emulate.attention import attention, multi_head_attention
from mhanum.formats import round_to
from mhanum.models._checkpoint import read_config
from mhanum.models._decoder import DECODERS, DecoderCheckpoint, load_decoder, rms_norm
from mhanum.models._decoder_forward import hidden_states
from mhanum.models._records import FrameworkAudit, HeadError, HeadStats, LayerAudit, PresetAudit
from mhanum.models._verdicts import DEFAULT_SENTENCES, mask_verdicts
from mhanum.numerics import Numerics
from mhanum.params import MHAParams
from mhanum.rope import Rope, reference_rope

__all__ = [
    "ARCHITECTURES",
    "FIXED_TOKENS",
    "DecoderInput",
    "DecoderLayer",
    "architecture",
    "check_frameworks",
    "decoder_framework",
    "decoder_hidden_states",
    "decoder_input",
    "decoder_layer_task",
    "decoder_preset",
    "describe_layer",
    "slice_layer",
]

ARCHITECTURES = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
}
"""The ``architectures`` of ``config.json`` read when it names no ``model_type``."""

FIXED_TOKENS = 16
"""The length of the fixed token sequence a decoder is audited on without a tokenizer: the ids
``(1 + 7 i) mod vocab_size`` for ``i = 0, 1, ...``."""

SINK_THRESHOLD = 0.5


def architecture(model: str | Path, argument: str = "model") -> str:
    """The architecture of the checkpoint directory ``model``: ``"bert"`` or one of
    :data:`~mhanum.models.DECODERS`, from ``config.json``'s ``model_type``, else its
    ``architectures``; ``"bert"`` when the directory has no ``config.json`` (the BERT reader
    then says what is missing) or it names neither.

    Raises:
        InvalidArgument: for another ``model_type`` (the message names ``argument`` and the
            supported types).
    """
    config = Path(model) / "config.json"
    if not config.is_file():
        return "bert"
    raw = read_config(config)
    kind = raw.get("model_type")
    if kind is None:
        names = raw.get("architectures") or []
        kinds = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
        if names and not kinds:
            kind = f"None (architectures {names!r})"
        else:
            return kinds[0] if kinds else "bert"
    if kind == "bert" or kind in DECODERS:
        return str(kind)
    supported = ", ".join(("bert", *DECODERS))
    msg = (
        f"{argument}: expected a checkpoint of model_type {supported}, got model_type {kind} "
        f"in {str(config)!r}"
        if str(kind).startswith("None")
        else f"{argument}: expected a checkpoint of model_type {supported}, got {kind!r} in "
        f"{str(config)!r}"
    )
    raise InvalidArgument(msg)


@dataclasses.dataclass(frozen=True)
class DecoderInput:
    """The token ids a decoder is audited on.

    Attributes:
        ids: each sequence's token ids.
        tokens: each sequence's tokens as text (the ids, without a tokenizer).
        sentences: the sentences tokenised (empty for the fixed sequence).
        note: what the input is, when it is not the sentences (the fixed sequence).
    """

    ids: tuple[tuple[int, ...], ...]
    tokens: tuple[tuple[str, ...], ...]
    sentences: tuple[str, ...]
    note: str = ""


def decoder_input(
    model: str | Path, vocab_size: int, sentences: Sequence[str] | None
) -> DecoderInput:
    """The input of a decoder's audit: ``sentences`` tokenised by the checkpoint's
    ``tokenizer.json`` (with the ``tokenizers`` package), else, when no sentences are given,
    :data:`FIXED_TOKENS` fixed token ids.

    Raises:
        InvalidArgument: for sentences given to a checkpoint without a tokenizer, or an empty
            sentence.
    """
    path = Path(model) / "tokenizer.json"
    usable = path.is_file() and importlib.util.find_spec("tokenizers") is not None
    if not usable:
        if sentences is not None:
            msg = (
                f"sentences: expected a checkpoint with tokenizer.json (read with the tokenizers "
                f"package) to tokenise them, got none usable in {str(Path(model))!r}"
            )
            raise InvalidArgument(msg)
        ids = tuple((1 + 7 * i) % vocab_size for i in range(FIXED_TOKENS))
        why = "no tokenizer.json" if not path.is_file() else "the tokenizers package is missing"
        note = f"{FIXED_TOKENS} fixed token ids ({why}): {' '.join(map(str, ids))}"
        return DecoderInput((ids,), (tuple(map(str, ids)),), (), note)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    texts = tuple(DEFAULT_SENTENCES if sentences is None else sentences)
    encoded = [tokenizer.encode(s) for s in texts]
    for s, e in zip(texts, encoded, strict=True):
        if not e.ids:
            msg = f"sentences: expected text with at least one token, got {s!r}"
            raise InvalidArgument(msg)
    return DecoderInput(
        tuple(tuple(e.ids) for e in encoded), tuple(tuple(e.tokens) for e in encoded), texts
    )


def describe_layer(ck: DecoderCheckpoint, layer: int) -> str:
    """One line: the configuration of ``layer``'s attention as audited (heads, key/value heads,
    head width, RoPE base and scaling, mask, soft-cap, logit scale)."""
    c = ck.config
    rope = c.rope()
    scaling = "" if rope.scaling == "none" else f" {rope.scaling} x{rope.factor:g}"
    partial = "" if rope.dim == c.head_dim else f" on {rope.dim} of {c.head_dim}"
    window = (
        f"sliding window {c.sliding_window}"
        if c.layer_types[layer] == "sliding_attention"
        else "causal"
    )
    cap = "none" if c.softcap is None else f"{c.softcap:g}"
    return (
        f"{c.model_type}, {c.num_attention_heads} heads, {c.num_key_value_heads} kv heads, "
        f"head dim {c.head_dim}, rope base {rope.base:g}{scaling}{partial}, {window}, "
        f"soft-cap {cap}, scale {c.scale:.4g}"
    )


def slice_layer(ck: DecoderCheckpoint, layer: int) -> DecoderCheckpoint:
    """``ck`` with only ``layer``'s tensors (what a layer's task needs, picklable and small)."""
    prefix = f"model.layers.{layer}."
    return dataclasses.replace(
        ck, tensors={k: v for k, v in ck.tensors.items() if k.startswith(prefix)}
    )


@dataclasses.dataclass(frozen=True)
class DecoderLayer:
    """One layer's attention inputs in float64: the normed hidden state ``h`` ``(B, L, d)`` and
    the layer's weights ``params`` (``num_kv_heads`` key/value heads); each head's projections
    ``q`` ``(B, H, L, d)``, ``k`` and ``v`` with the key/value heads repeated to ``H`` (GQA); the
    mask ``(L, L)``, the audited rows ``valid`` ``(B, L)`` (each sequence's tokens; right
    padding is never seen by them)."""

    ck: DecoderCheckpoint
    layer: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    keep: np.ndarray
    valid: np.ndarray
    h: np.ndarray
    params: MHAParams

    @property
    def layer_options(self) -> dict[str, Any]:
        """The keywords of the whole layer's emulation, reference and bound."""
        c = self.ck.config
        return {
            "num_kv_heads": c.num_key_value_heads, "mask": self.keep, "scale": c.scale,
            "softcap": c.softcap, "positions": self.positions,
        }  # fmt: skip

    @functools.cached_property
    def exact_layer(self) -> np.ndarray:
        """The certified output of the whole layer, its projections exactly rotated."""
        c = self.ck.config
        return np.asarray(
            reference.multi_head_attention(
                self.h,
                self.h,
                self.params,
                c.num_attention_heads,
                rope=c.rope(),
                **self.layer_options,
            )
        )

    @property
    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """The queries' and keys' positions, ``0..L-1``."""
        n = np.arange(self.q.shape[-2])
        return n, n

    def inputs(self, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``q``, ``k``, ``v`` rounded to ``fmt``, as a kernel in that format holds them."""
        return round_to(self.q, fmt), round_to(self.k, fmt), round_to(self.v, fmt)

    def exact(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The certified attention of the exactly rotated ``q``, ``k`` and ``v``."""
        c, (pos, _) = self.ck.config, self.positions
        qr, kr = (reference_rope(t, pos, c.rope())[0] for t in (q, k))
        mask = np.broadcast_to(self.keep, (*q.shape[:-1], k.shape[-2]))
        return np.asarray(
            reference.attention(qr, kr, v, mask=mask, scale=c.scale, softcap=c.softcap)
        )

    def bound(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, rope: Rope, num: Any, **kw: Any
    ) -> bounds.Bound:
        """Theorem A.1 with RoPE for these inputs (``kw``: ``probability``)."""
        c = self.ck.config
        mask = np.broadcast_to(self.keep, (*q.shape[:-1], k.shape[-2]))
        return bounds.attention_bound(
            q, k, v, mask, numerics=num, scale=c.scale, softcap=c.softcap, rope=rope,
            positions=self.positions, **kw,
        )  # fmt: skip


def _layer(
    ck: DecoderCheckpoint, layer: int, x: np.ndarray, lengths: Sequence[int]
) -> DecoderLayer:
    c = ck.config
    weight = ck.tensors[f"model.layers.{layer}.input_layernorm.weight"]
    h = rms_norm(x, weight, c.rms_norm_eps, gemma=c.model_type == "gemma2")

    def heads(name: str) -> np.ndarray:
        w = ck.tensors[f"model.layers.{layer}.self_attn.{name}_proj.weight"]
        b = ck.weight(layer, f"self_attn.{name}_proj.bias")
        y = h @ w.T + (0.0 if b is None else b)
        return np.swapaxes(y.reshape(*h.shape[:2], -1, c.head_dim), 1, 2)

    group = c.num_attention_heads // c.num_key_value_heads
    q, k, v = heads("q"), np.repeat(heads("k"), group, 1), np.repeat(heads("v"), group, 1)
    n = x.shape[1]
    keep = np.asarray(c.mask(layer).array(n, n), bool)
    valid = np.arange(n)[None, :] < np.asarray(lengths)[:, None]
    return DecoderLayer(ck, layer, q, k, v, keep, valid, h, layer_params(ck, layer))


def layer_params(ck: DecoderCheckpoint, layer: int) -> MHAParams:
    """The layer's attention weights in the ``y = x·w + b`` convention (``transformers``'
    ``nn.Linear`` weights transposed), its key/value heads as stored (``num_kv_heads``)."""
    prefix = f"model.layers.{layer}.self_attn"
    w = {n: np.asarray(ck.tensors[f"{prefix}.{n}_proj.weight"], np.float64).T for n in "qkvo"}
    b = {n: ck.weight(layer, f"self_attn.{n}_proj.bias") for n in "qkvo"}
    return MHAParams(
        wq=w["q"], wk=w["k"], wv=w["v"], wo=w["o"],
        **{f"b{n}": None if b[n] is None else np.asarray(b[n], np.float64) for n in "qkvo"},
    )  # fmt: skip


def _check(error: np.ndarray, bound: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(error == 0, 0.0, error / bound)
    return float(np.max(r, initial=0.0))


def _bound_total(b: bounds.Bound, exact: np.ndarray) -> np.ndarray:
    """The bound on the distance to the float64 reference: the theorem's total, plus the
    reference's own distance to the exact values (Lemma P.3's evaluation term, and the final
    rounding to float64, ``2^-52 |exact|``)."""
    total = np.broadcast_to(np.asarray(b.total, np.float64), exact.shape)
    evaluation = np.broadcast_to(np.asarray(b.terms.get("evaluation", 0.0)), exact.shape)
    return total + evaluation + 2.0**-52 * np.abs(exact)


def _head_errors(
    d: DecoderLayer, error: np.ndarray, total: np.ndarray, b: bounds.Bound
) -> tuple[HeadError, ...]:
    rows = d.valid
    out = []
    for h in range(error.shape[1]):
        err_h, bound_h = error[:, h][rows], total[:, h][rows]
        terms = {
            name: np.broadcast_to(np.asarray(t, np.float64), error.shape)[:, h][rows]
            for name, t in b.terms.items()
        }
        dominant = max(terms, key=lambda name: float(np.max(terms[name], initial=0.0)))
        out.append(
            HeadError(h, float(err_h.max()), float(bound_h.max()), _check(err_h, bound_h), dominant)
        )
    return tuple(out)


def decoder_preset(d: DecoderLayer, preset: str, probability: float | None = None) -> PresetAudit:
    """One decoder layer under one preset (see the module docstring): the whole layer's
    measured error against its certified reference and Theorem A.2 with RoPE (Corollary P.6)
    and, with ``probability``, its probabilistic form (Theorem A.3); per head, the heads'
    attention against Theorem A.1 with RoPE. A bound the theorems refuse for this combination
    is reported as not available, with the reason, in :attr:`PresetAudit.note`. The a priori
    bound of the layer (Theorem A.4 with Corollary P.7, from ``max |h|`` and the weights) is
    not stated with a soft-cap (Gemma-2)."""
    num = Numerics.preset(preset)
    c = d.ck.config
    heads_count, store = c.num_attention_heads, num.storage_format.name
    rope = c.rope(table_format=store, rotation_format=store)
    exact = d.exact_layer
    computed = np.asarray(
        multi_head_attention(d.h, d.h, d.params, heads_count, numerics=num, rope=rope,
                             **d.layer_options),
        np.float64,
    )  # fmt: skip
    errors = metrics.errors(computed[d.valid], exact[d.valid])
    notes: list[str] = []
    bound_max = ratio = probable_max = stated = None
    dominant, heads, model = "", tuple[HeadError, ...](), tuple[str, ...]()
    try:
        b = bounds.mha_bound(
            d.h, d.h, d.params, heads_count, numerics=num, rope=rope, **d.layer_options
        )
        total = np.broadcast_to(np.asarray(b.total, np.float64), exact.shape)
        bound_max = float(total[d.valid].max())
        ratio = _check(np.abs(computed - exact)[d.valid], total[d.valid])
        dominant = max(
            b.terms,
            key=lambda n: float(
                np.max(np.broadcast_to(np.asarray(b.terms[n], np.float64), exact.shape)[d.valid])
            ),
        )
        heads = _heads_audit(d, num)
    except InvalidArgument as exc:  # a stage or format outside the theorem's scope
        notes.insert(0, f"A.2: not available: {exc}")
    if probability is not None and bound_max is not None:
        try:
            p = bounds.mha_bound(
                d.h, d.h, d.params, heads_count, numerics=num, rope=rope,
                probability=probability, **d.layer_options,
            )  # fmt: skip
            probable_max = float(np.broadcast_to(p.total, exact.shape)[d.valid].max())
            stated = p.probability
            model = tuple(a for a in p.assumptions if a not in b.assumptions)
        except InvalidArgument as exc:
            notes.insert(0, f"A.3: not available: {exc}")
    prior, prior_reasons = _a_priori(d, num, rope, notes)
    return PresetAudit(
        preset=preset,
        error=errors.max_abs,
        normwise=errors.normwise_max,
        bound=bound_max,
        ratio=ratio,
        dominant_term=dominant,
        a_priori=prior,
        heads=heads,
        a_priori_reasons=prior_reasons,
        note="; ".join(notes),
        probable_bound=probable_max,
        probability=stated,
        probable_assumptions=model,
    )


def _a_priori(
    d: DecoderLayer, num: Numerics, rope: Rope, notes: list[str]
) -> tuple[float | None, tuple[str, ...]]:
    """The layer's a priori bound (Theorem A.4 with Corollary P.7) for every input with
    ``|h| <= max |h|``, and its reasons; ``None`` with a note where it is not stated."""
    c = d.ck.config
    if c.softcap is not None:
        notes.append("A.4: not stated for a layer with a soft-cap")
        return None, ()
    length = d.h.shape[-2]
    try:
        prior = bounds.mha_bound_a_priori(
            d.params, c.num_attention_heads, length, length, x_max=float(np.max(np.abs(d.h))),
            numerics=num, scale=c.scale, num_kv_heads=c.num_key_value_heads, rope=rope,
            positions=d.positions,
        )  # fmt: skip
    except InvalidArgument as exc:
        notes.append(f"A.4: {exc}")
        return None, ()
    return float(np.max(prior.total)), tuple(prior.reasons)


def _heads_audit(d: DecoderLayer, num: Numerics) -> tuple[HeadError, ...]:
    """Per head: the heads' attention of the float64 projections held in the input format,
    rotated as the kernel does, against the exact attention of the exactly rotated inputs and
    Theorem A.1 with RoPE (the bound is that of the float64 reference, with Lemma P.3's
    evaluation term)."""
    fmt = num.format_of("input").name
    c = d.ck.config
    rope = c.rope(table_format=fmt, rotation_format=fmt)
    q, k, v = d.inputs(fmt)
    exact = d.exact(q, k, v)
    computed = np.asarray(
        attention(q, k, v, d.keep, scale=c.scale, softcap=c.softcap, numerics=num, rope=rope,
                  positions=d.positions),
        np.float64,
    )  # fmt: skip
    b = d.bound(q, k, v, rope, num)
    return _head_errors(d, np.abs(computed - exact), _bound_total(b, exact), b)


def _head_stats(d: DecoderLayer) -> tuple[tuple[HeadStats, ...], float]:
    """Per head: the logit spread, the mean probability on the first token (``cls_mass``) and
    on the query's own token (``sep_mass``), sink heads (first token ``>= 0.5``); and the
    largest ``|logit|`` after the soft-cap, in float64 with the exact rotation."""
    c, (pos, _) = d.ck.config, d.positions
    qr, kr = (reference_rope(t, pos, c.rope())[0] for t in (d.q, d.k))
    s = qr @ np.swapaxes(kr, -1, -2) * c.scale
    if c.softcap is not None:
        s = c.softcap * np.tanh(s / c.softcap)
    keys = np.broadcast_to(d.keep, s.shape)
    top = np.where(keys, s, -np.inf).max(-1, keepdims=True)
    spread = top[..., 0] - np.where(keys, s, np.inf).min(-1)
    p = np.where(keys, np.exp(s - top), 0.0)
    p /= p.sum(-1, keepdims=True)
    first = p[..., 0]
    own = np.diagonal(p, axis1=-2, axis2=-1)
    n_rows = d.valid.sum()
    stats = []
    for h in range(s.shape[1]):
        mass = float(first[:, h][d.valid].sum() / n_rows)
        stats.append(
            HeadStats(h, float(spread[:, h][d.valid].max()), mass,
                      float(own[:, h][d.valid].sum() / n_rows), mass >= SINK_THRESHOLD)
        )  # fmt: skip
    score_bound = float(np.max(np.where(keys, np.abs(s), 0.0) * d.valid[:, None, :, None]))
    return tuple(stats), score_bound


def decoder_layer_task(spec: tuple[Any, ...], seed: Any = None) -> dict[str, Any]:
    """One decoder layer's audit as JSON (:class:`~mhanum.models.LayerAudit`): the task the
    audit maps over the layers. ``spec`` is ``(layer, checkpoint, x, lengths, presets, mask
    constants, frameworks, probability)``: the checkpoint with that layer's tensors
    (:func:`slice_layer`), its input hidden state ``x`` ``(B, L, d)`` and each sequence's
    length; ``seed`` is unused."""

    layer, ck, x, lengths, names, constants, frameworks, probability = spec
    d = _layer(ck, layer, x, lengths)
    stats, score_bound = _head_stats(d)
    per_preset = tuple(decoder_preset(d, name, probability) for name in names)
    masks = mask_verdicts(score_bound, x.shape[1], names, constants)
    runs = tuple(decoder_framework(d, name) for name in frameworks)
    scale = float(np.max(np.abs(d.exact_layer[d.valid]), initial=0.0))
    audit = LayerAudit(layer, score_bound, stats, per_preset, masks, runs, scale)
    return dataclasses.asdict(audit)


@functools.lru_cache(maxsize=4)
def _framework_model(directory: str, path: str) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation=path
    ).eval()


def check_frameworks(ck: DecoderCheckpoint, frameworks: Sequence[str]) -> None:
    """Read the checkpoint with each framework path once (the layers' tasks reuse it in this
    process).

    Raises:
        InvalidArgument: for a path ``transformers`` refuses for this architecture (Gemma-2
            has no sdpa path), with ``transformers``' reason.
    """
    for name in frameworks:
        try:
            _framework_model(str(ck.path), name.removeprefix("transformers-"))
        except ValueError as exc:
            reason = str(exc).split(". ")[0]
            msg = (
                f"frameworks: expected a path transformers runs for {ck.config.model_type}, got "
                f"{name!r} ({reason})"
            )
            raise InvalidArgument(msg) from None


def decoder_framework(d: DecoderLayer, framework: str) -> FrameworkAudit:
    """``transformers``' own attention module of the layer (``framework``:
    ``transformers-eager`` or ``transformers-sdpa``; the model read in float32 from the
    checkpoint) on the layer's normed hidden state rounded to float32: its projections, rotary
    tables, ``apply_rotary_pos_emb``, attention function (with the layer's mask, scale, window
    and soft-cap) and ``o_proj``, measured against the certified reference of the whole layer
    and judged by Theorem A.2 with RoPE in the path's numerics
    (:func:`mhanum.adapters.transformers.numerics`; the input's and weights' rounding into
    float32 included)."""
    import torch

    from mhanum.adapters import transformers as hf

    path = framework.removeprefix("transformers-")
    model = _framework_model(str(d.ck.path), path)
    module = model.model.layers[d.layer].self_attn
    c = d.ck.config
    h = torch.from_numpy(np.ascontiguousarray(d.h, np.float32))
    ids = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
    keep = torch.from_numpy(np.broadcast_to(d.keep, (h.shape[0], 1, *d.keep.shape)).copy())
    if path == "eager":
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    else:
        mask = keep
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(h, ids)
        out = module(h, position_embeddings=cos_sin, attention_mask=mask)[0]
    got = out.double().numpy()
    exact = d.exact_layer
    num = hf.numerics(path)
    # (a framework follows its model only to within step 6's charge: Kernel.known_rounding)
    b = bounds.mha_bound(
        d.h, d.h, d.params, c.num_attention_heads, numerics=num, rope=c.rope(),
        known_rounding=False, **d.layer_options,
    )  # fmt: skip
    total = np.broadcast_to(np.asarray(b.total, np.float64), exact.shape)
    errors = metrics.errors(got[d.valid], exact[d.valid])
    return FrameworkAudit(
        framework=framework,
        version=hf.version(),
        error=errors.max_abs,
        normwise=errors.normwise_max,
        bound=float(total[d.valid].max()),
        ratio=_check(np.abs(got - exact)[d.valid], total[d.valid]),
        numerics=num.describe(),
    )


def decoder_hidden_states(
    model: str | Path, ids: Sequence[Sequence[int]], last: int
) -> tuple[DecoderCheckpoint, np.ndarray, list[np.ndarray]]:
    """The checkpoint, the padded ids' lengths and each layer's input up to layer ``last``."""
    ck = load_decoder(model)
    lengths = np.array([len(s) for s in ids])
    width = int(lengths.max())
    padded = [list(s) + [0] * (width - len(s)) for s in ids]
    return ck, lengths, hidden_states(ck, padded, last)
