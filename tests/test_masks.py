"""Structured masks (mhanum.masks): causal and sliding-window bands.

The band's definition is checked against the frameworks' own formulas; every entry point that
takes ``mask=`` gives, for a band, exactly what it gives for the band's boolean array (the
emulation bit for bit, the certified reference and the bounds exactly); the adapters pass a
band as the framework's own structure (``is_causal``, ``local_window_size``) and the output is
bit-identical to the array's and within its certified tolerance; the bound holds on drawn bands.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, masks, reference
from mhanum import strategies as mst
from mhanum.bounds import attention_bound, mha_bound
from mhanum.testing import attention_tolerance

BANDS = [
    masks.causal(),
    masks.causal(offset=2),
    masks.causal(offset=-1),
    masks.sliding_window(3),
    masks.sliding_window(2, offset=2),
    masks.window(1, 1),
    masks.window(None, None, offset=5),
    masks.window(0, 2, offset=-2),
]


def _draw(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape)


@pytest.mark.parametrize(("lq", "lk"), [(5, 5), (3, 7), (7, 3)])
def test_the_band_is_the_frameworks_formula(lq, lk):
    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    # torch's and jax's is_causal: tril(ones(Lq, Lk))
    np.testing.assert_array_equal(masks.causal().array(lq, lk), np.tril(np.ones((lq, lk), bool)))
    # jax's _get_window_mask: i <= j + left and i >= j - right
    for left, right in [(0, 0), (2, 0), (1, 3)]:
        jax_window = (i <= j + left) & (i >= j - right)
        np.testing.assert_array_equal(masks.window(left, right).array(lq, lk), jax_window)
    # FlashAttention's causal with Lq != Lk: aligned to the bottom right, j <= i + Lk - Lq
    bottom = masks.bottom_right(masks.causal(), lq, lk)
    np.testing.assert_array_equal(bottom.array(lq, lk), j <= i + lk - lq)
    # the last `size` keys up to the diagonal
    np.testing.assert_array_equal(masks.sliding_window(2).array(lq, lk), (j <= i) & (j >= i - 1))


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_rows_and_empty_rows_agree_with_the_array(band):
    full = band.array(6, 9)
    np.testing.assert_array_equal(band.rows(2, 5, 9), full[2:5])
    np.testing.assert_array_equal(band.empty_rows(6, 9), ~full.any(axis=-1))


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: masks.Band(left=-1), "left:"),
        (lambda: masks.Band(right=-2), "right:"),
        (lambda: masks.Band(offset=None), "offset:"),
        (lambda: masks.Band(left=1.5), "left:"),
        (lambda: masks.sliding_window(0), "size:"),
        (lambda: masks.sliding_window(True), "size:"),
    ],
)
def test_bad_bands_are_refused_by_name(build, names):
    with pytest.raises(InvalidArgument, match=names):
        build()


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("numerics", ["fp32", "bf16-fp32acc", mn.Numerics(softmax="online(2)")])
def test_the_emulation_builds_the_band_bit_for_bit(band, numerics):
    q, k, v = _draw((2, 5, 8), 0), _draw((2, 7, 8), 1), _draw((2, 7, 4), 2)
    structured = np.asarray(mn.attention(q, k, v, band, numerics=numerics), np.float64)
    dense = np.asarray(mn.attention(q, k, v, band.array(5, 7), numerics=numerics), np.float64)
    np.testing.assert_array_equal(structured, dense)
    s = _draw((5, 7), 3)
    np.testing.assert_array_equal(
        np.asarray(mn.softmax(s, band, numerics=numerics), np.float64),
        np.asarray(mn.softmax(s, band.array(5, 7), numerics=numerics), np.float64),
    )


def test_mha_reference_and_bounds_take_a_band():
    params = mn.MHAParams.random(8, seed=4)
    x_q, x_kv = _draw((6, 8), 5), _draw((9, 8), 6)
    band, dense = masks.sliding_window(4, offset=3), masks.sliding_window(4, offset=3).array(6, 9)
    np.testing.assert_array_equal(
        np.asarray(mn.multi_head_attention(x_q, x_kv, params, 2, mask=band)),
        np.asarray(mn.multi_head_attention(x_q, x_kv, params, 2, mask=dense)),
    )
    np.testing.assert_array_equal(
        reference.multi_head_attention(x_q, x_kv, params, 2, mask=band),
        reference.multi_head_attention(x_q, x_kv, params, 2, mask=dense),
    )
    np.testing.assert_array_equal(
        mha_bound(x_q, x_kv, params, 2, mask=band).total,
        mha_bound(x_q, x_kv, params, 2, mask=dense).total,
    )
    q, k, v = _draw((6, 8), 7), _draw((9, 8), 8), _draw((9, 3), 9)
    np.testing.assert_array_equal(
        reference.attention(q, k, v, mask=band), reference.attention(q, k, v, mask=dense)
    )
    np.testing.assert_array_equal(
        attention_bound(q, k, v, band).total, attention_bound(q, k, v, dense).total
    )


@pytest.mark.parametrize(
    "band", [masks.causal(), masks.window(2, 1), masks.sliding_window(3)], ids=str
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_takes_the_band_as_its_own_structure(band, dtype):
    from mhanum.adapters import jax as jax_adapter

    fmt = mn.get_format(dtype)
    q, k, v = (np.asarray(mn.round_to(_draw((2, 6, 8), s), fmt), np.float64) for s in (10, 11, 12))
    structured = jax_adapter.sdpa(q, k, v, band, dtype=dtype)
    dense = jax_adapter.sdpa(q, k, v, band.array(6, 6), dtype=dtype)
    np.testing.assert_array_equal(structured, dense)
    exact = np.asarray(reference.attention(q, k, v, mask=band), np.float64)
    tol = attention_tolerance(q, k, v, mask=band, kernel="jax-xla", dtype=dtype)
    assert np.all(np.abs(structured - exact) <= tol)


def test_torch_takes_the_causal_band_as_is_causal():
    pytest.importorskip("torch")
    from mhanum.adapters import torch as torch_adapter

    q, k, v = (_draw((2, 6, 8), s) for s in (13, 14, 15))
    structured = torch_adapter.sdpa(q, k, v, masks.causal(), backend="math")
    flagged = torch_adapter.sdpa(q, k, v, backend="math", is_causal=True)
    np.testing.assert_array_equal(structured, flagged)
    window = torch_adapter.sdpa(q, k, v, masks.sliding_window(2), backend="math")
    dense = torch_adapter.sdpa(q, k, v, masks.sliding_window(2).array(6, 6), backend="math")
    np.testing.assert_array_equal(window, dense)


@settings(max_examples=20, deadline=None)
@given(
    data=st.data(),
    preset=st.sampled_from(["fp32", "bf16-fp32acc", "fp16-fp32acc", "tf32"]),
    softmax=st.sampled_from(["safe", "online(4)"]),
)
def test_the_bound_holds_on_drawn_bands(data, preset, softmax):
    lq, lk = data.draw(st.sampled_from([(4, 8), (8, 8), (8, 4)]))
    band = data.draw(mst.bands(q_len=lq, kv_len=lk))
    assert not band.empty_rows(lq, lk).any()
    num = mn.Numerics.preset(preset).replace(softmax=softmax)
    fmt = num.format_of("input")
    seed = data.draw(st.integers(0, 2**16))
    q, k, v = (
        np.asarray(mn.round_to(_draw(shape, seed + i), fmt), np.float64)
        for i, shape in enumerate([(lq, 16), (lk, 16), (lk, 16)])
    )
    out = np.asarray(mn.attention(q, k, v, band, numerics=num), np.float64)
    err = np.abs(out - np.asarray(reference.attention(q, k, v, mask=band), np.float64))
    assert np.all(err <= attention_bound(q, k, v, band, numerics=num).total)


def _authors_slopes(n):
    # the recursion of the ALiBi authors' fairseq code, written out
    def power_of_2(m):
        start = 2 ** (-(2 ** -(np.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if np.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** int(np.floor(np.log2(n)))
    return power_of_2(closest) + _authors_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 2, 5, 8, 12, 16])
def test_alibi_slopes_are_the_authors(heads):
    # the authors' products of up to `heads` float64 factors carry up to γ_{heads+1}(2^-53);
    # mhanum's are the powers 2^(-8h/n) rounded once
    rtol = (heads + 2) * 2.0**-52
    np.testing.assert_allclose(masks.alibi_slopes(heads), _authors_slopes(heads), rtol=rtol)


def test_alibi_bias_is_the_slope_times_the_distance():
    bias = masks.alibi(4, 3, 5, offset=2)
    slopes = masks.alibi_slopes(4)
    i, j = np.arange(3)[:, None], np.arange(5)[None, :]
    np.testing.assert_array_equal(bias, slopes[:, None, None] * (j - i - 2))
    np.testing.assert_array_equal(
        masks.alibi(4, 3, 5, symmetric=True), -np.abs(slopes[:, None, None] * (j - i))
    )
    with pytest.raises(InvalidArgument, match="num_heads:"):
        masks.alibi(0, 3, 5)


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
def test_the_bound_holds_with_alibi_and_a_causal_band(preset):
    num = mn.Numerics.preset(preset)
    fmt = num.format_of("input")
    q, k, v = (
        np.asarray(mn.round_to(_draw((4, 12, 16), s), fmt), np.float64) for s in (20, 21, 22)
    )
    bias, band = masks.alibi(4, 12, 12), masks.causal()
    out = np.asarray(mn.attention(q, k, v, band, bias=bias, numerics=num), np.float64)
    exact = np.asarray(reference.attention(q, k, v, mask=band, bias=bias), np.float64)
    assert np.all(
        np.abs(out - exact) <= attention_bound(q, k, v, band, bias=bias, numerics=num).total
    )
