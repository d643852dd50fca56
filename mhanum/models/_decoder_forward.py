"""A decoder checkpoint's forward pass in float64 up to a layer: each layer's input hidden state.

The layers are ``transformers``' (``modeling_llama``, ``modeling_qwen2``, ``modeling_mistral``,
``modeling_gemma2``): the token embeddings (Gemma-2: times ``sqrt(hidden_size)``), then per
layer ``x + attention(norm(x))`` and ``x + mlp(norm(x))`` with the MLP
``down(act(gate(x)) · up(x))``; Gemma-2 also norms the attention's and the MLP's outputs before
adding them (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``). Every step is in float64, the attention exact but for its
float64 roundings (:func:`~mhanum.models.attention_block`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.models._checkpoint import read_config, read_tensors
from mhanum.models._decoder import DecoderCheckpoint, attention_block, rms_norm

__all__ = ["activation", "hidden_states"]


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """The MLP's activation ``name`` (``hidden_act``) on ``x``, in float64: ``silu``,
    ``gelu_pytorch_tanh`` (and ``gelu_new``, the same tanh form) or ``gelu`` (erf).

    Raises:
        InvalidArgument: for another name.

    Examples:
        >>> float(activation("silu", np.array(0.0)))
        0.0
    """
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "gelu":
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
    msg = f"hidden_act: expected silu, gelu_pytorch_tanh, gelu_new or gelu, got {name!r}"
    raise InvalidArgument(msg)


def _shards(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _tensors(path: Path, layers: int) -> dict[str, np.ndarray]:
    """The embeddings and the tensors of layers ``0..layers-1``, in float64."""
    wanted = ("model.embed_tokens.weight", *(f"model.layers.{i}." for i in range(layers)))
    out: dict[str, np.ndarray] = {}
    for shard in _shards(path):
        for name, value in read_tensors(path / shard).items():
            if any(name == w or (w.endswith(".") and name.startswith(w)) for w in wanted):
                out[name] = np.asarray(value, np.float64)
    if "model.embed_tokens.weight" not in out:
        msg = f"checkpoint {str(path)!r}: expected model.embed_tokens.weight, found none"
        raise InvalidArgument(msg)
    return out


def _linear(t: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    if f"{name}.weight" not in t:
        msg = f"checkpoint: expected {name}.weight, found none"
        raise InvalidArgument(msg)
    y = x @ t[f"{name}.weight"].T
    bias = t.get(f"{name}.bias")
    return y if bias is None else y + bias


def hidden_states(
    ck: DecoderCheckpoint, ids: Sequence[Sequence[int]], layers: int
) -> list[np.ndarray]:
    """Each layer's input hidden state ``(B, L, hidden_size)`` for the token ids ``ids``
    ``(B, L)`` (positions ``0..L-1``, causal), for layers ``0..layers``, in float64.

    Rows past a sequence's end (right padding) never reach the earlier rows: every layer's mask
    is causal or a causal window.

    Raises:
        InvalidArgument: for a token id outside the vocabulary, a missing tensor, or an
            activation not modelled.
    """
    c = ck.config
    raw = read_config(ck.path / "config.json")
    t = _tensors(ck.path, layers)
    table = t["model.embed_tokens.weight"]
    tokens = np.asarray(ids, np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        msg = f"tokens: expected ids in [0, {table.shape[0]}), got {tokens.tolist()!r}"
        raise InvalidArgument(msg)
    gemma = c.model_type == "gemma2"
    act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu")
    x = table[tokens]
    if gemma:
        x = x * math.sqrt(c.hidden_size)
    out = [x]
    for i in range(layers):
        p = f"model.layers.{i}."

        def norm(y: np.ndarray, name: str, p: str = p) -> np.ndarray:
            key = f"{p}{name}.weight"
            if key not in t:
                msg = f"checkpoint {str(ck.path)!r}: expected {key}, found none"
                raise InvalidArgument(msg)
            return rms_norm(y, t[key], c.rms_norm_eps, gemma=gemma)

        attn = np.stack([attention_block(ck, i, row) for row in x])
        x = x + (norm(attn, "post_attention_layernorm") if gemma else attn)
        h = norm(x, "pre_feedforward_layernorm" if gemma else "post_attention_layernorm")
        mlp = _linear(
            t,
            f"{p}mlp.down_proj",
            activation(act, _linear(t, f"{p}mlp.gate_proj", h)) * _linear(t, f"{p}mlp.up_proj", h),
        )
        x = x + (norm(mlp, "post_feedforward_layernorm") if gemma else mlp)
        out.append(x)
    return out
