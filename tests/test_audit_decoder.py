"""``mhanum audit`` of decoder checkpoints (Llama, Qwen2, Mistral, Gemma-2): small random
checkpoints built offline with ``transformers`` itself, audited through the command and through
:func:`mhanum.models.audit`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e .[frameworks]")
pytest.importorskip("safetensors", reason="reading checkpoints needs safetensors")

from mhanum import InvalidArgument, models
from mhanum.cli import main
from mhanum.models._decoder_forward import hidden_states
from tests.test_decoder import tiny_config

KINDS = ("llama", "qwen2", "mistral", "gemma2")

# The configuration each tiny checkpoint's layers must be audited with (describe_layer's lines).
_HEADS = "4 heads, 2 kv heads, head dim 16"
CONFIGURATIONS = {
    "llama": (f"llama, {_HEADS}, rope base 500000 llama3 x8, causal, soft-cap none, scale 0.25",)
    * 2,
    "qwen2": (f"qwen2, {_HEADS}, rope base 10000, causal, soft-cap none, scale 0.25",) * 2,
    "mistral": (f"mistral, {_HEADS}, rope base 10000, sliding window 5, soft-cap none, scale 0.25",)
    * 2,
    "gemma2": (
        f"gemma2, {_HEADS}, rope base 10000, sliding window 5, soft-cap 2, scale 0.2041",
        f"gemma2, {_HEADS}, rope base 10000, causal, soft-cap 2, scale 0.2041",
    ),
}


def _config(kind: str):
    # initializer_range 0.2: logits of a few units (the default 0.02 leaves them near 0, where
    # neither the soft-cap nor the softmax's rounding is exercised)
    return tiny_config(kind, initializer_range=0.2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The four tiny random checkpoints, saved by transformers (no tokenizer)."""
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            _config(kind), attn_implementation="eager"
        )
        path = tmp_path_factory.mktemp(kind)
        model.eval().save_pretrained(path)
        out[kind] = str(path)
    return out


@pytest.fixture(scope="module")
def audits(checkpoints) -> dict[str, models.Audit]:
    return {
        kind: models.audit(path, presets=("fp32", "bf16-fp32acc"))
        for kind, path in checkpoints.items()
    }


@pytest.mark.parametrize("kind", KINDS)
def test_every_layer_is_audited_with_its_configuration_within_the_bound(kind, audits):
    """Two layers, each with its configuration; fp32's measured error is within Theorem A.1 with
    RoPE on every layer and head (a theorem: it must hold), and so are bf16's."""
    result = audits[kind]
    assert result.architecture == kind
    assert [layer.layer for layer in result.layers] == [0, 1]
    assert result.configurations == tuple(
        f"layer {i}: {line}" for i, line in enumerate(CONFIGURATIONS[kind])
    )
    assert result.input_note.startswith("16 fixed token ids (no tokenizer.json): 1 8 15 22")
    assert result.tokens[0][:3] == ("1", "8", "15")
    for layer in result.layers:
        for p in layer.presets:
            assert p.bound is not None
            assert 0 < p.error <= p.bound
            assert p.ratio is not None
            assert p.ratio <= 1
            assert len(p.heads) == 4
            assert all(h.error <= h.bound for h in p.heads)
            assert p.probable_bound is not None
            assert p.error <= p.probable_bound <= p.bound
        fp32, bf16 = layer.presets
        assert fp32.bound < bf16.bound  # 2^-24 against 2^-8: the formats' unit roundoffs
        assert layer.output_scale is not None
        assert layer.output_scale > 0
    assert result.within_bounds


def test_the_layers_inputs_are_the_checkpoints_own_hidden_states(checkpoints):
    """The float64 forward against transformers' float64 model: transformers computes its RMS
    norms, RoPE tables and softmax in float32, each a few 2^-24 relative; through two norms, an
    attention and an MLP of this small model 2^-16 (relative to the largest entry) leaves 2^8 of
    them. A step left out (Gemma-2's embedding scale, its post-norms) is off by O(1)."""
    ids = [[1, 8, 15, 22, 29, 36, 43, 50], [5, 6, 7, 8, 9, 10, 11, 12]]
    for path in checkpoints.values():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            theirs = model(torch.tensor(ids), output_hidden_states=True).hidden_states
        ours = hidden_states(models.load_decoder(path), ids, 1)
        for i in range(2):  # transformers' last hidden state is after the final norm
            expected = theirs[i].numpy()
            assert np.max(np.abs(ours[i] - expected)) <= 2.0**-16 * np.max(np.abs(expected))


def test_verdicts_follow_from_the_measured_figures(checkpoints, audits, capsys):
    """A tolerance 1000 times fp32's largest bound certifies fp32; one half its largest measured
    error is not met (the worst layer's error is twice it); through the command."""
    result = audits["gemma2"]
    bound = max(layer.preset("fp32").bound for layer in result.layers)
    error = max(layer.preset("fp32").error for layer in result.layers)
    path = checkpoints["gemma2"]
    args = ["audit", "--model", path, "--preset", "fp32", "--layers", "0", "1"]
    assert main([*args, "--tolerance", repr(1000 * bound)]) == 0
    text = capsys.readouterr().out
    assert "  fp32  certified within: bound 0.001 tol at worst" in text
    assert "input: 16 fixed token ids (no tokenizer.json): 1 8 15" in text
    for i, line in enumerate(CONFIGURATIONS["gemma2"]):
        assert f"  layer {i}: {line}\n" in text
    assert "cheapest preset within it: measured fp32; probably fp32; certified fp32" in text
    assert main([*args, "--tolerance", repr(error / 2)]) == 0  # every error is within its bound
    text = capsys.readouterr().out
    assert "  fp32  not within: error 2 tol at worst" in text
    v = models.verdict("fp32", result.layers, tolerance=1000 * bound)
    assert (v.verdict, v.bound_ratio) == ("certified", pytest.approx(1e-3))


def test_the_command_writes_json_and_html(checkpoints, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, html = tmp_path / "audit.json", tmp_path / "html"
    path = checkpoints["mistral"]
    args = ["audit", path, "--preset", "fp32", "--layers", "1", "-o", str(out), "--html", str(html)]
    assert main([*args, "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "head    spread  first   self  sink" in text
    data = json.loads(out.read_text())
    assert data["architecture"] == "mistral"
    assert [layer["layer"] for layer in data["layers"]] == [1]
    assert data["configurations"] == [f"layer 1: {CONFIGURATIONS['mistral'][1]}"]
    assert (html / "index.html").is_file()


def test_a_bound_a_preset_is_outside_of_is_reported_not_available(checkpoints):
    """Theorem A.3 does not cover tensor-core dot units: the layer's probabilistic bound is not
    available, with the reason, and the deterministic one still holds."""
    result = models.audit(checkpoints["qwen2"], presets=("tensor-core-bf16",), layers=[0])
    (layer,) = result.layers
    p = layer.preset("tensor-core-bf16")
    assert p.probable_bound is None
    assert "A.3: not available: lam: the probabilistic bound (Theorem A.3) does not cover" in p.note
    assert p.bound is not None
    assert p.error <= p.bound
    assert "A.3: not available" in result.render()


def test_transformers_eager_and_sdpa_are_within_the_bound(checkpoints):
    """transformers' own attention functions on the layer's float32 inputs, judged like the
    presets; Gemma-2 has no sdpa path in transformers, and says so by name."""
    paths = ("transformers-eager", "transformers-sdpa")
    result = models.audit(checkpoints["llama"], presets=("fp32",), frameworks=paths)
    for layer in result.layers:
        assert [f.framework for f in layer.frameworks] == list(paths)
        for f in layer.frameworks:
            assert 0 < f.error <= f.bound
            assert f.ratio <= 1
    assert "transformers-sdpa" in result.render()
    eager = models.audit(checkpoints["gemma2"], presets=("fp32",), frameworks=paths[:1])
    assert all(layer.frameworks[0].ratio <= 1 for layer in eager.layers)
    with pytest.raises(InvalidArgument, match="frameworks: expected a path transformers runs for "
                       "gemma2, got 'transformers-sdpa'"):  # fmt: skip
        models.audit(checkpoints["gemma2"], presets=("fp32",), frameworks=paths)


def test_an_unknown_model_type_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["audit", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "mhanum audit: --model: expected a checkpoint of model_type bert, llama, qwen2, mistral, "
        f"gemma2, got 'gpt2' in {str(tmp_path / 'config.json')!r}\n"
    )
    with pytest.raises(InvalidArgument, match=r"^model: expected a checkpoint of model_type bert"):
        models.audit(tmp_path)


def test_sentences_need_a_tokenizer_and_are_tokenised_with_it(checkpoints, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path = checkpoints["qwen2"]
    with pytest.raises(InvalidArgument, match=r"^sentences: expected a checkpoint with tokenizer"):
        models.audit(path, ["a b"], presets=("fp32",))
    copy = tmp_path / "qwen2"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((Path(path) / name).read_bytes())
    vocab = {w: i for i, w in enumerate(["<unk>", "the", "cat", "sat", "on", "mat", "."])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(copy / "tokenizer.json"))
    result = models.audit(copy, ["the cat sat on the mat .", "the cat"], presets=("fp32",))
    assert result.tokens == (("the", "cat", "sat", "on", "the", "mat", "."), ("the", "cat"))
    assert result.input_note == ""
    assert "sentence (2 tokens): the cat" in result.render()
    assert all(layer.preset("fp32").ratio <= 1 for layer in result.layers)


def test_the_architecture_is_read_from_architectures_without_a_model_type(tmp_path):
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert models.architecture(tmp_path) == "llama"
    assert models.DecoderConfig.from_dict(raw).model_type == "llama"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(InvalidArgument, match=r"got model_type None \(architectures \['GPT2"):
        models.architecture(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert models.architecture(tmp_path) == "bert"


def test_the_heatmap_names_the_decoder_layers_theorem(audits):
    """A decoder's layer column is the whole layer's A.2 with RoPE (Corollary P.6), as a BERT
    layer's; each figure is at least the error it bounds."""
    data = models.heatmap_data(audits["llama"], "fp32")
    assert data.bound_columns[-2:] == ("layer A.2", "layer A.3")
    assert (data.bound[:, :-1] >= data.error).all()


def test_the_layer_is_audited_through_o_proj_against_the_certified_layer(checkpoints):
    """The layer's figure is the whole attention block, o_proj included: its measured error is
    that of ``multi_head_attention(rope=)`` against ``reference.multi_head_attention(rope=)`` on
    the normed hidden state, recomputed here from the checkpoint's weights, and differs from
    every head's."""
    import mhanum
    from mhanum import reference
    from mhanum.models._decoder_audit import _layer, decoder_hidden_states

    result = models.audit(checkpoints["qwen2"], presets=("bf16-fp32acc",), layers=[1])
    p = result.layers[0].preset("bf16-fp32acc")
    ids = [[int(t) for t in result.tokens[0]]]  # the fixed token ids (no tokenizer)
    ck, lengths, inputs = decoder_hidden_states(checkpoints["qwen2"], ids, 1)
    d = _layer(ck, 1, inputs[1], lengths)
    c = ck.config
    rope = c.rope(table_format="bfloat16", rotation_format="bfloat16")
    kw = d.layer_options
    got = mhanum.multi_head_attention(
        d.h, d.h, d.params, 4, numerics="bf16-fp32acc", rope=rope, **kw
    )
    exact = reference.multi_head_attention(d.h, d.h, d.params, 4, rope=c.rope(), **kw)
    assert d.params.bq is not None  # qwen2's projections carry biases
    assert p.error == float(np.max(np.abs(np.asarray(got, np.float64) - exact)))
    assert all(h.error != p.error for h in p.heads)


def test_the_a_priori_bound_of_a_decoder_layer(audits):
    """Theorem A.4 with RoPE (Corollary P.7) from ``max |h|`` and the weights: stated for the
    layers without a soft-cap, where it bounds the measured error (a theorem over every input
    of that size); refused by name for Gemma-2's soft-capped layers."""
    for kind in ("llama", "qwen2", "mistral"):
        for layer in audits[kind].layers:
            for p in layer.presets:
                assert p.a_priori is not None
                assert p.error <= p.a_priori
    for layer in audits["gemma2"].layers:
        for p in layer.presets:
            assert p.a_priori is None
            assert "A.4: not stated for a layer with a soft-cap" in p.note
