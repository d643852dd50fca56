"""mhanum.adapters.jax: jax.nn.dot_product_attention in a multi-head layer (jax is always there)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument
from mhanum.adapters import jax as adapter
from tests.adapters import _check


@pytest.fixture(scope="module")
def layer():
    return _check.check_roundtrip(adapter)


@pytest.mark.parametrize("kind", _check.MASKS)
def test_xla_within_bound_of_reference_and_model(layer, kind):
    _check.check_path(adapter, layer, "xla", kind)


def test_masked_key_gets_zero_weight(layer):
    _check.check_masked_key_ignored(adapter, layer, "xla")


def test_installed_constant_and_softmax_format():
    from jax._src.nn import functions

    got = float(functions._get_large_negative(np.float32))
    assert got == adapter.numerics().mask_constant()
    src = inspect.getsource(functions._dot_product_attention_core)
    assert "padded_logits.astype(np.float32)" in src  # softmax in float32, always
    assert "logits *= jnp.array(scale" in src  # scale on the logits


@pytest.mark.parametrize(
    ("precision", "field", "value"),
    [("tf32", "operand_format", "tf32"), ("bf16", "dot", "bf16x1"), ("default", "dot", "ieee")],
)
def test_device_precision_models(precision, field, value):
    assert getattr(adapter.numerics(precision=precision), field) == value


def test_raw_mask_must_be_boolean():
    with pytest.raises(InvalidArgument, match="raw_mask: expected a boolean"):
        adapter.effective_mask(np.ones((6, 6), np.float32))
    with pytest.raises(InvalidArgument, match="precision"):
        adapter.numerics(precision="fp8")


def test_two_dimensional_inputs_stay_two_dimensional(layer):
    x, _ = _check.inputs()
    assert adapter.run(layer, x[0], x[0]).shape == x[0].shape
    assert mn.InvalidArgument is InvalidArgument
