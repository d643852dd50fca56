"""Reading a decoder checkpoint (Llama, Qwen2, Mistral, Gemma-2 style: ``config.json`` and
safetensors) and its attention blocks in float64, exact but for the float64 roundings.

A decoder layer's attention block is: the RMS norm of its input, the projections ``q``, ``k``,
``v`` (with biases where the model has them: Qwen2), rotary position embeddings
(:mod:`mhanum.rope`, every scaling ``transformers`` reads from the configuration), grouped-query
attention (``num_key_value_heads``), a causal mask or a sliding window (Mistral, Gemma-2's
alternate layers), Gemma-2's logit soft-cap and query scale, and the output projection. The
formulas are ``transformers``' (``modeling_llama``, ``modeling_qwen2``, ``modeling_mistral``,
``modeling_gemma2``, ``masking_utils``); the tests compare :func:`attention_block` with their
eager attention, layer by layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.masks import Band, causal, sliding_window
from mhanum.models._checkpoint import read_config, read_tensors
from mhanum.rope import Rope, apply_rope, reference_rope

__all__ = [
    "DECODERS",
    "DecoderCheckpoint",
    "DecoderConfig",
    "attention_block",
    "attention_of_normed",
    "load_decoder",
    "rms_norm",
]

DECODERS = ("llama", "qwen2", "mistral", "gemma2")
_ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn",
               "llama3": "llama3"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The fields of a decoder's ``config.json`` that its attention uses.

    Attributes:
        model_type: one of :data:`DECODERS`.
        hidden_size: the model width.
        num_attention_heads: the query heads.
        num_key_value_heads: the key and value heads (a divisor of the query heads: GQA).
        head_dim: the width of one head.
        num_hidden_layers: the layers.
        rms_norm_eps: the ``ε`` of the RMS norm.
        rope_parameters: ``rope_theta``, ``rope_type`` and the scaling's parameters.
        partial_rotary_factor: the share of each head that rotates.
        max_position_embeddings: the longest context (``dynamic`` scaling's ``M``).
        layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer.
        sliding_window: the window of the sliding layers, in keys (the query's own included).
        softcap: Gemma-2's ``attn_logit_softcapping``, or ``None``.
        scale: the logits' scale (``head_dim^-1/2``; Gemma-2: ``query_pre_attn_scalar^-1/2``).
        qkv_bias: whether the q, k and v projections have biases (Qwen2; ``attention_bias``).
        o_bias: whether the output projection has one (``attention_bias`` of Llama).
    """

    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    rms_norm_eps: float
    rope_parameters: Mapping[str, Any]
    partial_rotary_factor: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    softcap: float | None
    scale: float
    qkv_bias: bool
    o_bias: bool

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config") -> DecoderConfig:
        """Parse a ``config.json`` mapping.

        Raises:
            InvalidArgument: for a model type not in :data:`DECODERS`, a missing or ill-typed
                field, heads that do not divide, or a RoPE scaling mhanum does not model.
        """
        model_type = raw.get("model_type")
        if model_type is None:  # an old config.json names only its architectures
            causal_lm = {f"{n}ForCausalLM": m for n, m in
                         (("Llama", "llama"), ("Qwen2", "qwen2"), ("Mistral", "mistral"),
                          ("Gemma2", "gemma2"))}  # fmt: skip
            named = [causal_lm[a] for a in raw.get("architectures") or () if a in causal_lm]
            model_type = named[0] if named else None
        if model_type not in DECODERS:
            msg = f"{source}: expected model_type one of {', '.join(DECODERS)}, got {model_type!r}"
            raise InvalidArgument(msg)
        ints = {}
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
            ints[name] = _positive_int(raw.get(name), f"{source}: {name}")
        heads = ints["num_attention_heads"]
        kv_heads = _positive_int(
            raw.get("num_key_value_heads") or heads, f"{source}: num_key_value_heads"
        )
        if heads % kv_heads:
            msg = f"{source}: num_key_value_heads: expected a divisor of {heads}, got {kv_heads}"
            raise InvalidArgument(msg)
        head_dim = _positive_int(
            raw.get("head_dim") or ints["hidden_size"] // heads, f"{source}: head_dim"
        )
        n = ints["num_hidden_layers"]
        window = raw.get("sliding_window")
        types = _layer_types(raw, model_type, n, window, source)
        if any(t == "sliding_attention" for t in types):
            window = _positive_int(window, f"{source}: sliding_window")
        softcap = raw.get("attn_logit_softcapping") if model_type == "gemma2" else None
        scalar = raw.get("query_pre_attn_scalar") if model_type == "gemma2" else None
        scale = float(scalar) ** -0.5 if scalar else head_dim**-0.5
        bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=ints["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_hidden_layers=n,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_parameters=_rope_parameters(raw, source),
            partial_rotary_factor=float(raw.get("partial_rotary_factor", 1.0)),
            max_position_embeddings=_positive_int(
                raw.get("max_position_embeddings", 2048), f"{source}: max_position_embeddings"
            ),
            layer_types=types,
            sliding_window=window if any(t == "sliding_attention" for t in types) else None,
            softcap=None if softcap is None else float(softcap),
            scale=scale,
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=bias and model_type != "qwen2",
        )

    def rope(self, **formats: Any) -> Rope:
        """The :class:`~mhanum.rope.Rope` of the configuration (``formats``: its format fields)."""
        p = self.rope_parameters
        kind = _ROPE_TYPES[p.get("rope_type", "default")]
        extra: dict[str, Any] = {}
        if kind != "none":
            extra["factor"] = float(p["factor"])
        if kind == "dynamic":
            extra["original_max_position"] = self.max_position_embeddings
        if kind in ("yarn", "llama3"):
            extra["original_max_position"] = int(p["original_max_position_embeddings"])
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            if p.get(name) is not None:
                extra[name] = float(p[name])
        if kind == "yarn" and p.get("attention_factor") is not None:
            extra["attention_factor"] = float(p["attention_factor"])
        dim = int(self.head_dim * self.partial_rotary_factor)
        return Rope(dim=dim, base=float(p.get("rope_theta", 10000.0)), scaling=kind,
                    **extra, **formats)  # fmt: skip

    def mask(self, layer: int) -> Band:
        """The layer's mask: causal, or the sliding window of :attr:`sliding_window` keys."""
        if self.layer_types[layer] == "sliding_attention":
            assert self.sliding_window is not None
            return sliding_window(self.sliding_window)
        return causal()


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name}: expected a positive integer, got {value!r}"
        raise InvalidArgument(msg)
    return value


def _layer_types(
    raw: Mapping[str, Any], model_type: str, n: int, window: Any, source: str
) -> tuple[str, ...]:
    """Each layer's attention: the configuration's ``layer_types``, else the model's rule
    (Gemma-2: sliding on even layers; Mistral: sliding everywhere when a window is set; Qwen2:
    sliding from ``max_window_layers`` on when ``use_sliding_window``)."""
    given = raw.get("layer_types")
    if given is not None:
        types = tuple(given)
        if len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
            msg = (
                f"{source}: layer_types: expected {n} of 'full_attention' or "
                f"'sliding_attention', got {given!r}"
            )
            raise InvalidArgument(msg)
        return types
    if model_type == "gemma2":
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))
    if model_type == "mistral" and window:
        return ("sliding_attention",) * n
    if model_type == "qwen2" and raw.get("use_sliding_window") and window:
        first = int(raw.get("max_window_layers", n))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    return ("full_attention",) * n


def _rope_parameters(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5), else ``rope_theta`` and ``rope_scaling``."""
    given = raw.get("rope_parameters")
    if given is None:
        given = {"rope_theta": raw.get("rope_theta", 10000.0), **(raw.get("rope_scaling") or {})}
        if "type" in given and "rope_type" not in given:
            given["rope_type"] = given.pop("type")
    params = dict(given)
    kind = params.setdefault("rope_type", "default")
    if kind not in _ROPE_TYPES:
        msg = (
            f"{source}: rope_type: expected one of {', '.join(_ROPE_TYPES)} (the scalings "
            f"mhanum models), got {kind!r}"
        )
        raise InvalidArgument(msg)
    return params


@dataclasses.dataclass(frozen=True)
class DecoderCheckpoint:
    """A decoder's configuration and its attention weights, in float64 (exactly)."""

    path: Path
    config: DecoderConfig
    tensors: Mapping[str, np.ndarray] = dataclasses.field(repr=False)

    def weight(self, layer: int, name: str) -> np.ndarray | None:
        """``model.layers.<layer>.<name>``, or ``None`` where the model has no such tensor."""
        return self.tensors.get(f"model.layers.{layer}.{name}")


def load_decoder(model: str | Path) -> DecoderCheckpoint:
    """Read a decoder checkpoint: ``config.json`` and ``model.safetensors`` (or shards listed in
    ``model.safetensors.index.json``); only the attention blocks' tensors are kept.

    Raises:
        InvalidArgument: for a missing directory or file, an unsupported configuration, or a
            tensor of the wrong shape.
    """
    path = Path(model)
    if not path.is_dir():
        msg = f"model: expected a directory, got {str(path)!r}, which is not one"
        raise InvalidArgument(msg)
    if not (path / "config.json").is_file():
        msg = f"model: expected config.json in {str(path)!r}, found none"
        raise InvalidArgument(msg)
    config = DecoderConfig.from_dict(read_config(path / "config.json"), str(path / "config.json"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        msg = f"model: expected model.safetensors (or its index) in {str(path)!r}, found none"
        raise InvalidArgument(msg)
    wanted = ("self_attn.", "input_layernorm.")
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        for name, value in read_tensors(path / shard).items():
            if name.startswith("model.layers.") and any(w in name for w in wanted):
                tensors[name] = np.asarray(value, np.float64)
    checkpoint = DecoderCheckpoint(path, config, tensors)
    _check_shapes(checkpoint)
    return checkpoint


def _check_shapes(ck: DecoderCheckpoint) -> None:
    c = ck.config
    d, h, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    for i in range(c.num_hidden_layers):
        expected = {
            "self_attn.q_proj.weight": (h * hd, d),
            "self_attn.k_proj.weight": (kv * hd, d),
            "self_attn.v_proj.weight": (kv * hd, d),
            "self_attn.o_proj.weight": (d, h * hd),
            "input_layernorm.weight": (d,),
        }
        if c.qkv_bias:
            expected |= {
                "self_attn.q_proj.bias": (h * hd,),
                "self_attn.k_proj.bias": (kv * hd,),
                "self_attn.v_proj.bias": (kv * hd,),
            }
        for name, shape in expected.items():
            got = ck.weight(i, name)
            if got is None or got.shape != shape:
                found = "none" if got is None else str(got.shape)
                msg = (
                    f"checkpoint {str(ck.path)!r}: expected model.layers.{i}.{name} of shape "
                    f"{shape}, got {found}"
                )
                raise InvalidArgument(msg)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, gemma: bool = False) -> np.ndarray:
    """``x / sqrt(mean(x²) + ε)`` times ``weight`` (Gemma: times ``1 + weight``)."""
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed * ((1.0 + weight) if gemma else weight)


def attention_block(
    ck: DecoderCheckpoint, layer: int, x: np.ndarray, rope: Rope | None = None
) -> np.ndarray:
    """The attention block of ``layer`` on the hidden states ``x`` (``(L, d)``, positions
    ``0..L-1``): the RMS norm, then :func:`attention_of_normed`; in float64."""
    c = ck.config
    weight = ck.tensors[f"model.layers.{layer}.input_layernorm.weight"]
    h = rms_norm(x, weight, c.rms_norm_eps, gemma=c.model_type == "gemma2")
    return attention_of_normed(ck, layer, h, rope)


def attention_of_normed(
    ck: DecoderCheckpoint, layer: int, h: np.ndarray, rope: Rope | None = None
) -> np.ndarray:
    """The attention of ``layer`` on its normed input ``h``: projections, RoPE, GQA, the
    layer's mask and soft-cap, softmax, and the output projection, in float64. The rotation is
    exact (:func:`mhanum.rope.reference_rope`) unless ``rope`` states a kernel's
    (:func:`mhanum.rope.apply_rope`; ``transformers`` computes its tables in float32 whatever
    the model's dtype)."""
    c = ck.config
    q, k, v = (_project(ck, layer, name, h) for name in ("q", "k", "v"))
    positions = np.arange(h.shape[0])
    if rope is None:
        q, k = (reference_rope(t, positions, c.rope())[0] for t in (q, k))
    else:
        q, k = (apply_rope(t, positions, rope) for t in (q, k))
    group = c.num_attention_heads // c.num_key_value_heads
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = (q @ np.swapaxes(k, -1, -2)) * c.scale
    if c.softcap is not None:
        s = c.softcap * np.tanh(s / c.softcap)
    keep = c.mask(layer).array(h.shape[0], h.shape[0])
    s = np.where(keep, s, -math.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.swapaxes(p @ v, 0, 1).reshape(h.shape[0], -1)
    out = o @ ck.tensors[f"model.layers.{layer}.self_attn.o_proj.weight"].T
    bias = ck.weight(layer, "self_attn.o_proj.bias")
    return out if bias is None else out + bias


def _project(ck: DecoderCheckpoint, layer: int, name: str, h: np.ndarray) -> np.ndarray:
    """``h W^T (+ b)`` split into heads: ``(heads, L, head_dim)``."""
    w = ck.tensors[f"model.layers.{layer}.self_attn.{name}_proj.weight"]
    b = ck.weight(layer, f"self_attn.{name}_proj.bias")
    y = h @ w.T + (0.0 if b is None else b)
    return np.swapaxes(y.reshape(h.shape[0], -1, ck.config.head_dim), 0, 1)
