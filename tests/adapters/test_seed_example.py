"""The classic report, end to end: "PyTorch and TensorFlow MultiHeadAttention give different
results for the same input". Two separately initialised layers; PyTorch's gets the mask right
(all keys attended); the TensorFlow one follows the Transformer tutorial, whose mask convention
is 1 = masked out, and is given ``mask = ones``, so ``mask * -1e9`` is added to every logit."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'mhanum[torch]')")
pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install 'mhanum[tensorflow]')"
)
pytest.importorskip("keras", reason="keras is not installed (pip install 'mhanum[tensorflow]')")

import mhanum as mn
from mhanum.adapters import _common as C
from mhanum.adapters import keras as tf_adapter
from mhanum.adapters import torch as torch_adapter
from mhanum.adapters.compare import Side, attribute


def _seed_example(d_model: int, heads: int, length: int):
    x = np.random.default_rng(0).standard_normal((1, length, d_model)).astype(np.float32)
    torch_layer = torch_adapter.load(mn.MHAParams.random(d_model, seed=0), heads)
    tf_layer = tf_adapter.load(mn.MHAParams.random(d_model, seed=1), heads)
    ones = np.ones((length, length), np.float32)
    attend_all = np.ones((length, length), bool)
    result = attribute(
        Side("torch", torch_layer, "explicit"),
        Side("keras", tf_layer, "additive", raw_mask=ones),
        x,
        x,
        heads,
        mask=attend_all,
    )
    return x, torch_layer, result


def _check_report(result, constant_range):
    assert result.dominant().name == "weights"
    assert result["weights"].size > 1.0  # O(1): two unrelated layers
    lo, hi = constant_range
    assert lo < result["masking constant"].size < hi
    assert "multiple of 64" in result["masking constant"].detail
    assert result["mask polarity"].size == 0.0
    assert "without effect in exact arithmetic" in result["mask polarity"].detail
    for name in ("summation order", "rounding", "matmul precision", "fully-masked rows"):
        assert result[name].size < 1e-5
    assert result.errors_a < 1e-5


def test_seed_example_small():
    _, _, result = _seed_example(64, 4, 32)
    _check_report(result, (0.5, 1.0))


@pytest.mark.slow
def test_seed_example_at_the_demo_size():
    """d_model 512, 8 heads, L 64: the -1e9 leaves 75% max-norm relative error."""
    _, _, result = _seed_example(512, 8, 64)
    _check_report(result, (0.70, 0.80))


def test_with_the_constant_fixed_the_layers_agree_within_their_bounds():
    d_model, heads, length = 64, 4, 32
    x, torch_layer, _ = _seed_example(d_model, heads, length)
    params = torch_adapter.extract(torch_layer)
    tf_layer = tf_adapter.load(params, heads)
    mask = np.ones((length, length), bool)
    out_torch = torch_adapter.run(torch_layer, x, x, mask, path="explicit")
    out_tf = tf_adapter.run(tf_layer, x, x, mask, path="additive")  # translated: 1 - mask = 0
    x64 = x.astype(np.float64)
    p32 = C.float32_params(params, heads)
    bounds = [
        mn.bounds.mha_bound(x64, x64, p32, heads, numerics=adapter.numerics(path)).total
        for adapter, path in ((torch_adapter, "explicit"), (tf_adapter, "additive"))
    ]
    diff = np.abs(out_torch.astype(np.float64) - out_tf)
    assert np.all(diff <= bounds[0] + bounds[1])
    assert diff.max() < 1e-5


def test_cli_seed_example(capsys):
    import json

    from mhanum.cli import main

    argv = ["compare", "--seed-example", "--d-model", "16", "--heads", "4", "--length", "8",
            "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sides"] == ["torch/explicit", "keras/additive"]
    assert report["causes"][0]["name"] == "weights"
