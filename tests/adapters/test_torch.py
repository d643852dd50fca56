"""mhanum.adapters.torch against torch.nn.MultiheadAttention (skipped without torch)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'mhanum[torch]')")

import mhanum as mn
from mhanum import InvalidArgument
from mhanum.adapters import torch as adapter
from tests.adapters import _check


@pytest.fixture(scope="module")
def layer():
    return _check.check_roundtrip(adapter)


@pytest.mark.parametrize("kind", _check.MASKS)
@pytest.mark.parametrize("path", adapter.PATHS)
def test_path_within_bound_of_reference_and_model(layer, path, kind):
    _check.check_path(adapter, layer, path, kind)


@pytest.mark.parametrize("form", adapter.MASK_FORMS)
@pytest.mark.parametrize("path", ["explicit", "sdpa"])
def test_every_mask_form_gives_a_masked_key_zero_weight(layer, path, form):
    _check.check_masked_key_ignored(adapter, layer, path, mask_form=form)


@pytest.mark.parametrize("form", ["float", "key_padding"])
def test_mask_forms_agree_with_bool(layer, form):
    x, _ = _check.inputs()
    mask = _check.mask_of("padding")
    want = adapter.run(layer, x, x, mask, path="explicit")
    got = adapter.run(layer, x, x, mask, path="explicit", mask_form=form)
    np.testing.assert_array_equal(got, want)


def test_batch_first_false_gives_the_same_output():
    x, params = _check.inputs()
    mask = _check.mask_of("causal")
    seq_first = adapter.load(params, _check.HEADS, batch_first=False)
    batch_first = adapter.load(params, _check.HEADS)
    np.testing.assert_array_equal(
        adapter.run(seq_first, x, x, mask), adapter.run(batch_first, x, x, mask)
    )


def test_fully_masked_row_nan_explicit_and_fast_output_bias_sdpa(layer):
    """Pinned: need_weights=True and the fast path give NaN, SDPA gives 0 (then the bias)."""
    x, params = _check.inputs()
    mask = _check.mask_of("empty-row")
    assert np.isnan(adapter.run(layer, x, x, mask, path="explicit")[0, 2]).all()
    assert np.isnan(adapter.run(layer, x, x, mask, path="fast")[0, 2]).all()
    np.testing.assert_array_equal(adapter.run(layer, x, x, mask, path="sdpa")[0, 2], params.bo)


def test_bool_attn_mask_true_means_masked_out(layer):
    """Pinned polarity: passing mhanum's all-True mask untranslated masks every key (NaN)."""
    x, _ = _check.inputs()
    every = np.ones((_check.LENGTH, _check.LENGTH), bool)
    assert np.isnan(adapter.run(layer, x, x, raw_mask=every)).all()
    np.testing.assert_array_equal(adapter.effective_mask(every), ~every)


def test_installed_sources_match_the_model():
    """The facts the numerics model rests on, read from the installed torch."""
    import torch.nn.functional as F

    src = inspect.getsource(F.multi_head_attention_forward)
    assert "q_scaled = q * math.sqrt(1.0 / float(E))" in src  # scale on q, before the dot
    assert "torch.baddbmm(" in src  # the float mask is added to the scores
    mask = F._canonical_mask(
        torch.tensor([True, False]), "m", None, "", torch.float32, check_other=False
    )
    assert mask.tolist() == [-math.inf, 0.0]  # bool True -> -inf, added
    assert adapter.model("explicit").numerics.scale == "q"
    assert adapter.model("sdpa").numerics.scale == "scores"


def test_fast_path_conditions_are_checked(layer):
    x, _ = _check.inputs()
    with pytest.raises(InvalidArgument, match="x_kv is not x_q"):
        adapter.run(layer, x, x.copy(), path="fast")
    with pytest.raises(InvalidArgument, match="float mask"):
        adapter.run(layer, x, x, _check.mask_of("causal"), path="fast", mask_form="float")


def test_tf32_model_rounds_operands():
    assert adapter.numerics("explicit", tf32=True).operand_format == "tf32"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"path": "flash"}, "path: expected one of"),
        ({"mask_form": "int"}, "mask_form: expected one of"),
        ({"mask": np.ones((6, 6), np.int8)}, "mask: expected a boolean"),
        ({"mask": np.ones((6, 6), bool), "raw_mask": np.ones((6, 6), bool)}, "raw_mask"),
    ],
)
def test_bad_arguments(layer, kwargs, match):
    x, _ = _check.inputs()
    with pytest.raises(InvalidArgument, match=match):
        adapter.run(layer, x, x, **kwargs)


@pytest.mark.parametrize("backend", adapter.SDPA_BACKENDS)
@pytest.mark.parametrize("kind", ["none", "causal", "empty-row"])
def test_scaled_dot_product_attention_within_bound(backend, kind):
    """SDPA's bool mask True = attend; fully-masked rows are 0 on both CPU backends."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 6, 4)).astype(np.float32) for _ in range(3))
    mask = _check.mask_of(kind)
    model = adapter.sdpa_model(backend)
    out = adapter.sdpa(q, k, v, mask, backend=backend)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref = mn.reference.attention(q64, k64, v64, mask=mask, fully_masked="zero")
    rows = np.zeros((2, 6), bool) if mask is None else ~mask.any(axis=-1)
    np.testing.assert_array_equal(out[rows], 0.0)
    live = None if mask is None else np.where(rows[..., None], True, mask)
    bound = mn.bounds.attention_bound(q64, k64, v64, live, numerics=model.numerics).total
    err = np.abs(out - ref)[~rows]
    assert np.all(err <= np.asarray(bound)[~rows])


@given(
    seed=st.integers(0, 2**32 - 1),
    mask=hnp.arrays(np.bool_, (_check.BATCH, _check.LENGTH, _check.LENGTH)),
    path=st.sampled_from(adapter.PATHS),
)
def test_generated_inputs_and_masks_stay_within_the_bound(layer, seed, mask, path):
    """Soundness on generated inputs and masks (fully-masked rows included)."""
    _, params = _check.inputs()
    x = np.random.default_rng(seed).standard_normal((_check.BATCH, _check.LENGTH, _check.D_MODEL))
    _check.check_output(adapter, layer, params, path, x.astype(np.float32), mask)


@pytest.mark.parametrize("backend", ["math", "flash"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sdpa_in_half_precision_causal_and_grouped_lies_within_its_certified_tolerance(
    backend, dtype
):
    from mhanum.testing import assert_attention_close

    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 4, 9, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 9, 16)).astype(np.float32) for _ in range(2))
    out = adapter.sdpa(q, k, v, backend=backend, dtype=dtype, is_causal=True, enable_gqa=True)
    # the kernel read the inputs rounded to dtype: the oracle is given exactly those values
    rounded = [torch.from_numpy(a).to(getattr(torch, dtype)) for a in (q, k, v)]
    kernel = {"math": "torch-sdpa-math", "flash": "torch-sdpa-flash-cpu"}[backend]
    assert_attention_close(out, *rounded, is_causal=True, enable_gqa=True, kernel=kernel)


def test_the_sdpa_kernel_descriptors_agree_with_the_adapter_models_in_float32():
    from mhanum.testing import KERNELS

    assert KERNELS["torch-sdpa-math"].models["float32"] == (adapter.sdpa_model("math").numerics,)
    assert KERNELS["torch-sdpa-flash-cpu"].models["float32"] == (
        adapter.sdpa_model("flash").numerics,
    )
    assert KERNELS["torch-sdpa-math"].fully_masked == adapter.sdpa_model("math").fully_masked
