"""mhanum.adapters.flax against flax.nnx.MultiHeadAttention (skipped without flax)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="flax is not installed (pip install 'mhanum[flax]')")

import mhanum as mn
from mhanum.adapters import flax as adapter
from mhanum.adapters import jax as jax_adapter
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


def test_fused_path_is_jax_nn(layer):
    """Pinned: with dropout 0 and no sown weights, nnx runs jax.nn.dot_product_attention."""
    x, params = _check.inputs()
    mask = _check.mask_of("causal")
    via_jax = jax_adapter.run(jax_adapter.load(params, _check.HEADS), x, x, mask)
    np.testing.assert_allclose(adapter.run(layer, x, x, mask), via_jax, rtol=0, atol=1e-6)


def test_installed_masking_constants():
    import inspect

    from flax.nnx.nn import attention

    src = inspect.getsource(attention.dot_product_attention_weights)
    assert "big_neg = jnp.finfo(dtype).min" in src
    assert "query = query / jnp.sqrt(depth).astype(dtype)" in src
    assert "jax.nn.dot_product_attention(" in inspect.getsource(attention.dot_product_attention)
    assert adapter.numerics("explicit").mask_constant() == float(np.finfo(np.float32).min)


def test_fully_masked_row_is_uniform(layer):
    x, params = _check.inputs()
    mask = _check.mask_of("empty-row")
    uniform = _check.C.reference(params, x, x, _check.HEADS, mask, "uniform")
    for path in adapter.PATHS:
        out = adapter.run(layer, x, x, mask, path=path)
        assert mn.metrics.errors(out[0, 2], uniform[0, 2]).max_abs < 1e-5
