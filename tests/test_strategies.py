"""mhanum.strategies: shapes, formats and structures as requested; bad arguments rejected."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from mhanum import PRESETS, MHAParams, Numerics
from mhanum import strategies as mst
from mhanum.bounds import attention_bound
from mhanum.formats import Format, get_format, representable


@given(mst.formats(min_precision=8, max_precision=24))
def test_formats_respect_the_precision_range(fmt):
    assert isinstance(fmt, Format)
    assert 8 <= fmt.precision <= 24


@given(mst.numerics())
def test_numerics_are_numerics(num):
    assert isinstance(num, Numerics)


@given(mst.numerics(presets=False, input="bfloat16", summation=st.just("sequential")))
def test_numerics_free_combinations_take_values_and_strategies(num):
    assert num.input == "bfloat16"
    assert num.summation == "sequential"
    assert get_format(num.accum).precision >= 8


@given(mst.numerics(presets=["fp32", "bf16"], free=False))
def test_numerics_presets_only(num):
    assert num in (PRESETS["fp32"], PRESETS["bf16"])


@given(mst.numerics(bounded=True), st.data())
def test_bounded_numerics_are_covered_by_the_bound(num, data):
    x = data.draw(mst.attention_inputs(q_len=2, kv_len=3, d_k=2, fmt=num.input, structure="plain"))
    bound = attention_bound(x.q, x.k, x.v, numerics=num)
    assert bound.total.shape == (*x.q.shape[:-1], x.v.shape[-1])


@given(
    mst.attention_inputs(
        batch=2,
        heads=st.integers(1, 2),
        q_len=3,
        kv_len=st.integers(1, 5),
        d_k=4,
        d_v=2,
        fmt=mst.formats(names=["bfloat16", "float16", "float32"]),
    )
)
def test_attention_inputs_respect_shapes_and_format(x):
    b, h = x.q.shape[:2]
    n = x.k.shape[2]
    assert (b, x.q.shape[2:]) == (2, (3, 4))
    assert x.k.shape == (b, h, n, 4)
    assert x.v.shape == (b, h, n, 2)
    for arr in x.arrays:
        assert arr.dtype == np.float64
        assert np.isfinite(arr).all()
        assert representable(arr, x.fmt).all()
    assert x.structure <= set(mst.STRUCTURES)


@pytest.mark.parametrize("name", mst.STRUCTURES)
@given(data=st.data())
def test_each_structure_is_applied_and_stays_in_format(name, data):
    x = data.draw(
        mst.attention_inputs(q_len=3, kv_len=8, d_k=4, d_v=3, fmt="float16", structure=name)
    )
    assert x.structure == {name}
    for arr in x.arrays:
        assert np.isfinite(arr).all()
        assert representable(arr, "float16").all()
    scale = 1 / math.sqrt(4)
    assert (scale * np.abs(x.q) @ np.swapaxes(np.abs(x.k), -1, -2)).max() <= 2.0**12


@given(mst.attention_inputs(q_len=2, kv_len=6, d_k=3, fmt="float32", structure="absorption",
                            accum="float32"))  # fmt: skip
def test_absorption_places_half_ulp_addends_beside_one_large_value(x):
    ones = x.v == 1.0
    col = next(c for c in range(x.v.shape[-1]) if ones[..., c].sum() == 1)
    small = x.v[0, 0, ~ones[0, 0, :, col], col]
    assert (small == small[0]).all()
    assert 2.0**-26 <= small[0] <= 2.0**-23


@given(mst.attention_inputs(q_len=3, kv_len=5, d_k=4, fmt="float32", structure="ties"))
def test_ties_make_equal_scores(x):
    s = x.q @ np.swapaxes(x.k, -1, -2)
    assert (s[..., 0:1] == s[..., 0:1]).all()
    # the first key is copied: its score ties with at least itself, and zero rows tie everywhere
    zero_rows = ~x.q.any(axis=-1)
    assert (s[zero_rows] == 0).all()


@given(mst.attention_inputs(q_len=2, kv_len=4, d_k=2, fmt="bfloat16", structure="overflow"))
def test_overflow_brings_v_near_the_largest_value(x):
    assert np.abs(x.v).max() >= get_format("bfloat16").max_finite * 2.0**-10


@given(mst.attention_inputs(q_len=2, kv_len=4, d_k=2, fmt="float16", structure="underflow"))
def test_underflow_brings_v_near_the_smallest_normal(x):
    top = np.abs(x.v).max()
    assert top <= get_format("float16").smallest_normal * 2.0**9


@given(
    mst.masks(batch=2, heads=1, q_len=4, kv_len=st.integers(1, 6)),
)
def test_masks_attend_somewhere_in_every_row_by_default(mask):
    assert mask.dtype == bool
    assert mask.shape[:3] == (2, 1, 4)
    assert mask.any(axis=-1).all()


@given(mst.masks(q_len=4, kv_len=4, kind="causal"))
def test_causal_masks_are_lower_triangular(mask):
    assert (mask[0, 0] == np.tril(np.ones((4, 4), bool))).all()


@given(mst.masks(q_len=3, kv_len=5, batch=2, kind="padding"))
def test_padding_masks_cut_a_suffix_of_keys(mask):
    for b in range(2):
        row = mask[b, 0, 0]
        assert (mask[b] == row).all()
        assert row[0]
        assert not (np.diff(row.astype(int)) > 0).any()


@given(mst.masks(q_len=3, kv_len=5, kind=st.sampled_from(("random", "causal")),
                 fully_masked_rows=True))  # fmt: skip
def test_fully_masked_rows_on_request(mask):
    assert (~mask.any(axis=-1)).any()


@given(mst.mha_params(d_model=8, d_kv=st.integers(2, 4), fmt="bfloat16", bias=False))
def test_mha_params_shapes_and_format(params):
    assert isinstance(params, MHAParams)
    assert params.wq.shape == (8, 8)
    assert params.wk.shape[1] == 8
    assert 2 <= params.d_kv <= 4
    assert params.bq is None
    for w in (params.wq, params.wk, params.wv, params.wo):
        assert representable(w, "bfloat16").all()


BAD_ARGUMENTS = [
    (mst.formats, {"names": ["float128"]}),
    (mst.formats, {"min_precision": 60}),
    (mst.formats, {"min_precision": 0}),
    (mst.numerics, {"presets": ["no-such-preset"]}),
    (mst.numerics, {"presets": "fp32"}),
    (mst.numerics, {"presets": False, "free": False}),
    (mst.numerics, {"input": "float7"}),
    (mst.numerics, {"summation": "backwards"}),
    (mst.numerics, {"softmax": "online(0)"}),
    (mst.attention_inputs, {"q_len": 0, "kv_len": 2, "d_k": 2}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2.5, "d_k": 2}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": True}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "fmt": "int8"}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "structure": "chaos"}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "structure": 3}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "scale": -1.0}),
    (mst.masks, {"q_len": 2, "kv_len": 0}),
    (mst.masks, {"q_len": 2, "kv_len": 2, "kind": "diagonal"}),
    (mst.masks, {"q_len": 2, "kv_len": 2, "fully_masked_rows": 1}),
    (mst.mha_params, {"d_model": -1}),
    (mst.mha_params, {"d_model": 4, "fmt": "float3"}),
    (mst.mha_params, {"d_model": 4, "bias": "yes"}),
    (mst.mha_params, {"d_model": 4, "weight_scale": 0}),
]


@pytest.mark.parametrize(("function", "kwargs"), BAD_ARGUMENTS)
def test_bad_arguments_raise_invalid_argument(function, kwargs):
    with pytest.raises(InvalidArgument):
        function(**kwargs)


@pytest.mark.parametrize(
    "strategy",
    [
        mst.attention_inputs(q_len=st.just(0), kv_len=2, d_k=2),
        mst.attention_inputs(q_len=2, kv_len=2, d_k=2, fmt=st.just("float7")),
        mst.masks(q_len=2, kv_len=2, kind=st.just("diagonal")),
    ],
)
def test_bad_values_drawn_from_strategies_raise_when_drawn(strategy):
    @given(strategy)
    def draw(_):
        pass

    with pytest.raises(InvalidArgument):
        draw()


@pytest.mark.parametrize(
    "function", [mst.formats, mst.numerics, mst.attention_inputs, mst.masks, mst.mha_params]
)
def test_strategies_are_keyword_only(function):
    with pytest.raises(TypeError):
        function(1)
