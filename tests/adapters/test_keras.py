"""mhanum.adapters.keras against Keras 3 MultiHeadAttention on TensorFlow (skipped without them)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install 'mhanum[tensorflow]')"
)
keras = pytest.importorskip(
    "keras", reason="keras is not installed (pip install 'mhanum[tensorflow]')"
)

import mhanum as mn
from mhanum.adapters import keras as adapter
from tests.adapters import _check


@pytest.fixture(scope="module")
def layer():
    return _check.check_roundtrip(adapter)


@pytest.mark.parametrize("kind", _check.MASKS)
@pytest.mark.parametrize("path", adapter.PATHS)
def test_path_within_bound_of_reference_and_model(layer, path, kind):
    _check.check_path(adapter, layer, path, kind)


@pytest.mark.parametrize("path", adapter.PATHS)
def test_masked_key_gets_zero_weight(layer, path):
    _check.check_masked_key_ignored(adapter, layer, path)


def test_fully_masked_rows(layer):
    """Pinned: fused -> uniform over the keys; explicit -> 0 (the output bias)."""
    x, params = _check.inputs()
    mask = _check.mask_of("empty-row")
    uniform = _check.C.reference(params, x, x, _check.HEADS, mask, "uniform")
    fused = adapter.run(layer, x, x, mask, path="fused")
    assert np.max(np.abs(fused[0, 2] - uniform[0, 2])) < 1e-5
    np.testing.assert_array_equal(adapter.run(layer, x, x, mask, path="explicit")[0, 2], params.bo)


def test_installed_masking_constants():
    """The constants the model uses, read from the installed Keras."""
    from keras.src.backend.tensorflow.nn import _get_large_negative
    from keras.src.layers.activations import softmax

    assert softmax._large_negative_number("float32") == -1e9
    assert softmax._large_negative_number("float16") == -3e4
    got = float(_get_large_negative("float32").numpy())
    assert got == mn.Numerics(mask_value=adapter.FUSED_MASK_VALUE).mask_constant()
    assert got != mn.Numerics(mask_value="0.7*finfo.min").mask_constant()  # bf16's max, not f32's
    # the Softmax layer replaces masked logits (where), it does not add to them
    assert (
        "numpy.where(\n                mask, inputs, _large_negative_number"
        in inspect.getsource(softmax.Softmax.call)
    )


def test_tutorial_mask_of_ones_adds_minus_1e9_to_every_logit(layer):
    """``mask = ones`` in the tutorial's convention masks every key, additively: a uniform shift
    that only rounding makes visible."""
    x, params = _check.inputs()
    ones = np.ones((_check.LENGTH, _check.LENGTH), np.float32)
    out = adapter.run(layer, x, x, path="additive", raw_mask=ones)
    assert not adapter.effective_mask(ones, "additive").any()
    shifted = mn.multi_head_attention(
        x, x, params, _check.HEADS, bias=np.full((1, 1, 1, 1), -1e9), numerics="fp32"
    )
    np.testing.assert_allclose(out, np.asarray(shifted), atol=1e-5)
    ref = _check.C.reference(params, x, x, _check.HEADS, None)
    assert mn.metrics.errors(out, ref).normwise_max > 0.1


def test_tf32_model_rounds_operands():
    assert adapter.numerics("fused", tf32=True).operand_format == "tf32"


@pytest.mark.parametrize("kind", ["none", "causal", "padding"])
@pytest.mark.parametrize("path", ["fused", "explicit"])
def test_group_query_attention_is_within_a2(path, kind):
    # keras.layers.GroupQueryAttention: 4 query heads reading 2 key/value heads
    rng = np.random.default_rng(3)
    x = rng.standard_normal((_check.BATCH, _check.LENGTH, _check.D_MODEL)).astype(np.float32)
    grouped = mn.MHAParams.random(_check.D_MODEL, seed=3, kv_width=_check.D_MODEL // 2)
    layer = adapter.load(grouped, _check.HEADS, num_kv_heads=2)
    params = _check.C.float32_params(grouped, _check.HEADS, 2)  # what the layer holds
    np.testing.assert_array_equal(adapter.extract(layer).wk, params.wk)
    mask = _check.mask_of(kind)
    out = adapter.run(layer, x, x, mask, path=path).astype(np.float64)
    m4 = None if mask is None else mask[:, None]
    x64 = x.astype(np.float64)
    kw = {"mask": m4, "num_kv_heads": 2}
    exact = mn.reference.multi_head_attention(x64, x64, params, _check.HEADS, **kw)
    bound = mn.bounds.mha_bound(
        x64, x64, params, _check.HEADS, numerics=adapter.numerics(path), **kw
    )
    assert np.isfinite(bound.total).all()
    assert (np.abs(out - exact) <= bound.total).all()


def test_the_tutorial_path_is_refused_for_group_query_attention():
    x, _ = _check.inputs()
    grouped = mn.MHAParams.random(_check.D_MODEL, seed=3, kv_width=_check.D_MODEL // 2)
    layer = adapter.load(grouped, _check.HEADS, num_kv_heads=2)
    with pytest.raises(mn.InvalidArgument, match="path:"):
        adapter.run(layer, x, x, path="additive")
