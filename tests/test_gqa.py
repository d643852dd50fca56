"""Grouped-query and multi-query attention (``num_kv_heads``).

The head mapping is checked against PyTorch's own grouped-query attention (SDPA's
``enable_gqa``) in float64, within Theorem A.2's float64 bound of the certified reference (a
wrong mapping moves the output by O(1)); the emulation is checked against the reference within
its bound for several presets; bad head counts and widths are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, reference
from mhanum import strategies as mst
from mhanum.bounds import mha_bound, mha_bound_a_priori
from mhanum.testing import mha_tolerance

D_MODEL, HEADS = 16, 4


def _layer(kv_heads, seed=0):
    params = mn.MHAParams.random(D_MODEL, seed=seed, kv_width=kv_heads * D_MODEL // HEADS)
    rng = np.random.default_rng(seed + 1)
    return params, rng.standard_normal((2, 5, D_MODEL)), rng.standard_normal((2, 7, D_MODEL))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_expanding_repeats_each_key_value_head_for_its_group(kv_heads):
    params, _, _ = _layer(kv_heads)
    full = params.expand_kv_heads(HEADS, kv_heads)
    d, group = D_MODEL // HEADS, HEADS // kv_heads
    for h in range(HEADS):
        src = slice((h // group) * d, (h // group + 1) * d)
        np.testing.assert_array_equal(full.wk[:, h * d : (h + 1) * d], params.wk[:, src])
        np.testing.assert_array_equal(full.bv[h * d : (h + 1) * d], params.bv[src])
    np.testing.assert_array_equal(full.wq, params.wq)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_head_mapping_is_torchs_enable_gqa(kv_heads):
    torch = pytest.importorskip("torch")
    params, x_q, x_kv = _layer(kv_heads, seed=3)
    t = {n: torch.from_numpy(np.asarray(getattr(params, n))) for n in ("wq", "wk", "wv", "wo")}
    b = {n: torch.from_numpy(np.asarray(getattr(params, n))) for n in ("bq", "bk", "bv", "bo")}
    d = D_MODEL // HEADS

    def heads(x, n):  # (B, L, n*d) -> (B, n, L, d)
        return x.reshape(*x.shape[:-1], n, d).transpose(-2, -3)

    tq, tkv = torch.from_numpy(x_q), torch.from_numpy(x_kv)
    q = heads(tq @ t["wq"] + b["bq"], HEADS)
    k = heads(tkv @ t["wk"] + b["bk"], kv_heads)
    v = heads(tkv @ t["wv"] + b["bv"], kv_heads)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out = (o.transpose(-2, -3).reshape(*o.shape[:-3], o.shape[-2], -1) @ t["wo"] + b["bo"]).numpy()
    exact = reference.multi_head_attention(x_q, x_kv, params, HEADS, num_kv_heads=kv_heads)
    bound = mha_bound(x_q, x_kv, params, HEADS, numerics="fp64", num_kv_heads=kv_heads)
    assert np.all(np.abs(out - np.asarray(exact, np.float64)) <= bound.total)


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16-fp32acc"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_emulated_grouped_layer_is_within_its_bound(preset, kv_heads):
    params, x_q, x_kv = _layer(kv_heads, seed=5)
    out = mn.multi_head_attention(
        x_q, x_kv, params, HEADS, num_kv_heads=kv_heads, numerics=preset, mask=mn.masks.causal(2)
    )
    exact = reference.multi_head_attention(
        x_q, x_kv, params, HEADS, num_kv_heads=kv_heads, mask=mn.masks.causal(2)
    )
    bound = mha_bound(
        x_q, x_kv, params, HEADS, numerics=preset, num_kv_heads=kv_heads, mask=mn.masks.causal(2)
    )
    err = np.abs(np.asarray(out, np.float64) - np.asarray(exact, np.float64))
    assert np.all(err <= bound.total)
    prior = mha_bound_a_priori(
        params, HEADS, 5, 7, x_max=float(np.abs(np.concatenate([x_q, x_kv], axis=-2)).max()),
        numerics=preset, num_kv_heads=kv_heads,
    )  # fmt: skip
    assert np.all(err <= prior.total)
    tol = mha_tolerance(x_q, x_kv, params, HEADS, num_kv_heads=kv_heads, kernel="jax-xla")
    assert tol.shape == out.shape


@pytest.mark.parametrize(
    ("kv_heads", "width", "names"),
    [(3, 12, "num_kv_heads:"), (0, 4, "num_kv_heads:"), (2, 12, "params.wk:")],
)
def test_bad_grouping_is_refused_by_name(kv_heads, width, names):
    params = mn.MHAParams.random(D_MODEL, seed=0, kv_width=width)
    x = np.ones((3, D_MODEL))
    with pytest.raises(InvalidArgument, match=names):
        mn.multi_head_attention(x, x, params, HEADS, num_kv_heads=kv_heads)
    with pytest.raises(InvalidArgument, match=names):
        mha_bound(x, x, params, HEADS, num_kv_heads=kv_heads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jaxs_own_grouped_attention_is_within_the_grouped_tolerance(dtype):
    from mhanum.adapters import jax as jax_adapter
    from mhanum.testing import attention_tolerance

    fmt = mn.get_format(dtype)
    rng = np.random.default_rng(8)
    q = np.asarray(mn.round_to(rng.standard_normal((2, 4, 6, 8)), fmt), np.float64)
    k, v = (
        np.asarray(mn.round_to(rng.standard_normal((2, 2, 6, 8)), fmt), np.float64) for _ in "kv"
    )
    out = jax_adapter.sdpa(q, k, v, mn.masks.causal(), dtype=dtype)
    assert out.shape == (2, 4, 6, 8)
    exact = np.asarray(
        reference.attention(
            q, np.repeat(k, 2, axis=-3), np.repeat(v, 2, axis=-3), mask=mn.masks.causal()
        ),
        np.float64,
    )
    tol = attention_tolerance(
        q, k, v, mask=mn.masks.causal(), kernel="jax-xla", dtype=dtype, enable_gqa=True
    )
    assert np.all(np.abs(out - exact) <= tol)
    # query head 1 reads key/value head 0, head 2 reads head 1: swapping the kv heads moves it
    swapped = jax_adapter.sdpa(q, k[:, ::-1], v[:, ::-1], mn.masks.causal(), dtype=dtype)
    assert np.any(np.abs(swapped - exact) > tol)


@settings(max_examples=15, deadline=None)
@given(
    data=st.data(),
    preset=st.sampled_from(["fp32", "bf16-fp32acc", "fp16-fp32acc", "fp16"]),
    kv_heads=st.sampled_from([1, 2, 4]),
)
def test_the_grouped_layer_is_within_a2_on_drawn_bands_and_sinks(data, preset, kv_heads):
    params, x_q, x_kv = _layer(kv_heads, seed=data.draw(st.integers(0, 2**16)))
    band = data.draw(mst.bands(q_len=5, kv_len=7, empty_rows=True))
    sink = data.draw(st.none() | st.just(np.array([0.5, -1.0, 2.0, 0.0])))
    kw = {"mask": band, "sink": sink, "num_kv_heads": kv_heads}
    if sink is None and band.empty_rows(5, 7).any():
        kw["mask"] = band.array(5, 7) | np.eye(5, 7, dtype=bool)  # every row attends a key
    out = mn.multi_head_attention(x_q, x_kv, params, HEADS, numerics=preset, **kw)
    exact = reference.multi_head_attention(x_q, x_kv, params, HEADS, **kw)
    bound = mha_bound(x_q, x_kv, params, HEADS, numerics=preset, **kw)
    err = np.abs(np.asarray(out, np.float64) - np.asarray(exact, np.float64))
    assert np.all(err <= bound.total)
