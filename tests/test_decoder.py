"""Decoder checkpoints (``mhanum.models._decoder``): Llama, Qwen2, Mistral and Gemma-2 style
configurations read as ``transformers`` reads them, and their attention blocks against
``transformers``' own eager attention on small random-initialised checkpoints built offline."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mhanum import InvalidArgument
from mhanum.models._decoder import (
    DecoderConfig,
    attention_of_normed,
    load_decoder,
    rms_norm,
)

# transformers computes the RMS norm, the RoPE tables and the softmax in float32 even in a
# float64 model (LlamaRMSNorm, LlamaRotaryEmbedding, eager_attention_forward's softmax), and the
# tables are emulated exactly here: what is left is the float32 softmax's relative error, a few
# 2^-24 carried through this small model's well-conditioned output; 2^-20 leaves 16 of them.
_TOLERANCE = 2.0**-20


def tiny_config(kind: str, **extra: object):
    """A small random-initialised configuration of ``kind`` (2 layers, width 64, 4 heads and 2
    key/value heads), with ``extra`` fields (``initializer_range``, ...)."""
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    common = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 64, **extra,
    }  # fmt: skip
    if kind == "llama":
        rope = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        }  # fmt: skip
        return transformers.LlamaConfig(**common, head_dim=16, rope_parameters=rope)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=5)
    return transformers.Gemma2Config(
        **common, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
    )  # fmt: skip


def _run(kind: str, tmp_path):
    """A random checkpoint saved by transformers, its layers' normed inputs and attention
    outputs on random tokens (float64 model, eager attention)."""
    torch = pytest.importorskip(
        "torch", reason="torch is not installed: pip install -e .[frameworks]"
    )
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(kind), attn_implementation="eager"
    )
    model = model.double().eval()
    model.save_pretrained(tmp_path)
    seen: dict = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(
                ("x", i), kw.get("hidden_states", a[0] if a else None)
            ),
            with_kwargs=True,
        )
        layer.input_layernorm.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(("h", i), out)
        )
        layer.self_attn.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(("o", i), out[0])
        )
    with torch.no_grad():
        model(torch.randint(0, 100, (1, 12)))
    return load_decoder(tmp_path), {key: value[0].numpy() for key, value in seen.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_the_attention_blocks_are_transformers_eager_attention(kind: str, tmp_path) -> None:
    """Per layer, on transformers' own normed input, with its float32 RoPE tables emulated:
    within 2^-20 (relative to the output's largest entry) of its eager attention; the layers'
    masks matter (a sliding layer read as causal is far off) and so does the norm."""
    ck, seen = _run(kind, tmp_path)
    rope = ck.config.rope(rotation_format="float64")
    for i in range(ck.config.num_hidden_layers):
        theirs = seen["o", i]
        ours = attention_of_normed(ck, i, seen["h", i], rope)
        assert np.max(np.abs(ours - theirs)) <= _TOLERANCE * np.max(np.abs(theirs))
        weight = ck.tensors[f"model.layers.{i}.input_layernorm.weight"]
        normed = rms_norm(seen["x", i], weight, ck.config.rms_norm_eps, gemma=kind == "gemma2")
        assert np.max(np.abs(normed - seen["h", i])) <= _TOLERANCE * np.max(np.abs(seen["h", i]))
    assert (
        ck.config.layer_types
        == {
            "llama": ("full_attention",) * 2,
            "qwen2": ("full_attention",) * 2,
            "mistral": ("sliding_attention",) * 2,
            "gemma2": ("sliding_attention", "full_attention"),
        }[kind]
    )
    if ck.config.layer_types[0] == "sliding_attention":
        import dataclasses

        full = dataclasses.replace(
            ck, config=dataclasses.replace(ck.config, layer_types=("full_attention",) * 2)
        )
        wrong = attention_of_normed(full, 0, seen["h", 0], rope)
        assert np.max(np.abs(wrong - seen["o", 0])) > 1e3 * _TOLERANCE * np.max(
            np.abs(seen["o", 0])
        )


def test_configurations_are_read_as_transformers_reads_them() -> None:
    gemma = DecoderConfig.from_dict(
        {"model_type": "gemma2", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 5,
         "query_pre_attn_scalar": 24, "attn_logit_softcapping": 50.0, "rope_theta": 10000.0}
    )  # fmt: skip
    assert gemma.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma.scale == 24**-0.5
    assert gemma.softcap == 50.0
    assert str(gemma.mask(0)) == "window(left=4, right=0)"
    assert str(gemma.mask(1)) == "causal()"
    qwen = DecoderConfig.from_dict(
        {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 1, "rope_scaling": {"type": "yarn", "factor": 4.0,
         "original_max_position_embeddings": 32}}
    )  # fmt: skip
    assert qwen.qkv_bias
    assert not qwen.o_bias
    assert qwen.num_key_value_heads == 4
    rope = qwen.rope()
    assert (rope.scaling, rope.factor, rope.original_max_position, rope.dim) == (
        "yarn",
        4.0,
        32,
        16,
    )


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"model_type": "bert"}, "model_type one of llama, qwen2, mistral, gemma2"),
        (
            {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 3, "num_hidden_layers": 1},
            "num_key_value_heads: expected a divisor of 4, got 3",
        ),
        (
            {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 1, "rope_scaling": {"rope_type": "longrope"}},
            "rope_type: expected one of",
        ),
        (
            {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 2, "layer_types": ["full_attention"]},
            "layer_types: expected 2 of",
        ),
        ({"model_type": "llama", "hidden_size": "64"}, "hidden_size: expected a positive integer"),
    ],
)  # fmt: skip
def test_bad_configurations_are_refused_by_name(raw: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        DecoderConfig.from_dict(raw)


def test_a_directory_without_weights_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8,
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
            }
        )
    )
    with pytest.raises(InvalidArgument, match=r"expected model\.safetensors"):
        load_decoder(tmp_path)
    with pytest.raises(InvalidArgument, match="model: expected a directory"):
        load_decoder(tmp_path / "missing")
