"""mhanum.strategies: shapes, formats and structures as requested; bad arguments rejected."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import find, given, settings
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
    assert x.scale is None
    assert x.bias is None
    for arr in x.arrays:
        assert np.isfinite(arr).all()
        assert representable(arr, "float16").all()


@given(mst.attention_inputs(q_len=3, kv_len=8, d_k=4, fmt="float32", structure="large_logits"))
def test_large_logits_reach_at_most_2_to_the_11(x):
    scale = 1 / math.sqrt(4)
    top = (scale * np.abs(x.q) @ np.swapaxes(np.abs(x.k), -1, -2)).max()
    assert top <= 2.0**11 * (1 + 2.0**-20)


def test_logits_are_not_capped():
    # Theorem A.1 no longer refuses large logits, so neither are they capped here: an outlier
    # channel of q and k scaled by up to 2^12 each is kept as drawn
    def logits(x):
        return (np.abs(x.q) @ np.swapaxes(np.abs(x.k), -1, -2)).max() / math.sqrt(2)

    x = find(
        mst.attention_inputs(q_len=2, kv_len=4, d_k=2, fmt="float32", structure="outliers"),
        lambda x: logits(x) > 2.0**14,
        settings=settings(database=None, max_examples=1000, derandomize=True),
    )
    assert np.isfinite(x.q).all()


NUMERICS_FOR_RANGES = [
    Numerics.preset("fp16"),
    Numerics.preset("fp8-e4m3-fp32acc"),
    Numerics(input="bfloat16", accum="float16"),
    Numerics(scale="qk", scale_format="bfloat16"),
    Numerics(input="float16", accum="float32", score_format="float8_e5m2", softmax="naive"),
]


@pytest.mark.parametrize("name", mst.RANGE_STRUCTURES)
@pytest.mark.parametrize("num", NUMERICS_FOR_RANGES, ids=lambda n: n.describe())
@given(data=st.data())
def test_each_range_structure_is_applied_and_stays_in_format(name, num, data):
    x = data.draw(
        mst.attention_inputs(q_len=3, kv_len=8, d_k=4, d_v=3, structure=name, numerics=num)
    )
    assert x.structure == {name}
    assert x.numerics == num
    assert x.fmt == num.input
    for arr in x.arrays:
        assert arr.dtype == np.float64
        assert np.isfinite(arr).all()
        assert representable(arr, num.input).all()
    if name == "scale_range":
        assert x.scale is not None
        assert math.isfinite(x.scale)
    else:
        assert x.scale is None
    if x.bias is not None:
        assert name in ("bias_range", "softmax_sum")
        assert x.bias.shape == (1, 1, 3, 8)
        assert np.isfinite(x.bias).all()
        assert np.abs(x.bias).max() <= num.format_of("score").max_finite


@given(mst.attention_inputs(q_len=2, kv_len=8, d_k=4, structure="range", numerics="fp16"))
def test_range_draws_one_or_two_range_structures(x):
    assert 1 <= len(x.structure) <= 2
    assert x.structure <= set(mst.RANGE_STRUCTURES)
    assert frozenset(x.structure) in mst.range_mixes()


@given(
    mst.attention_inputs(
        q_len=2, kv_len=4, d_k=2, structure=["range", "ties"], numerics=mst.numerics(custom=True)
    )
)
def test_range_among_names_adds_a_range_mix_and_reports_the_drawn_numerics(x):
    assert "ties" in x.structure
    assert x.structure - {"ties"} <= set(mst.RANGE_STRUCTURES)
    assert isinstance(x.numerics, Numerics)
    assert representable(x.q, x.fmt).all()


@given(
    mst.attention_inputs(
        q_len=2, kv_len=4, d_k=2, fmt="float16", structure="near_max", numerics="fp16"
    )
)
def test_near_max_reaches_within_three_binades_of_the_largest_value(x):
    top = max(np.abs(a).max() for a in x.arrays)
    assert 65504 * 2.0**-4 <= top <= 65504


@given(
    mst.attention_inputs(
        q_len=2, kv_len=4, d_k=2, structure="subnormal", numerics=Numerics(input="float16")
    )
)
def test_subnormal_places_subnormal_values(x):
    tiny = np.concatenate([np.abs(a).ravel() for a in x.arrays])
    assert ((tiny > 0) & (tiny < 2.0**-14)).any()


@given(
    mst.attention_inputs(
        q_len=2,
        kv_len=8,
        d_k=2,
        structure="softmax_sum",
        numerics=Numerics(input="float32", softmax="naive", softmax_format="float16"),
    )
)
def test_softmax_sum_brings_the_row_sum_near_the_threshold(x):
    scale = 1 / math.sqrt(2) if x.scale is None else x.scale
    s = scale * x.q @ np.swapaxes(x.k, -1, -2)
    if x.bias is not None:
        s = s + x.bias
    total = np.exp(s).sum(axis=-1)
    # m keys at log(L/m) + δ (|δ| <= 1) sum to L·e^δ; the other keys, lower, add at most 8x
    for limit in (65504, 2.0**126):
        near = (limit * np.exp(-1.01) <= total) & (total <= 8 * limit * np.exp(1.01))
        if near.all():
            return
    raise AssertionError(total)


@pytest.mark.parametrize("placement", ["scores", "q", "qk"])
@given(data=st.data())
def test_scale_range_covers_the_exponent_range_of_the_scale_format(placement, data):
    num = data.draw(mst.numerics(presets=False, free=False, custom=True, scale=placement))
    assert num.scale == placement
    x = data.draw(
        mst.attention_inputs(q_len=2, kv_len=4, d_k=2, structure="scale_range", numerics=num)
    )
    fmt = num.format_of("score" if placement == "scores" else "scale")
    if placement == "qk":
        assert x.scale >= 0  # sqrt(scale) goes on q and k
    factor = math.sqrt(x.scale) if placement == "qk" else abs(x.scale)
    # zero, or from below the smallest subnormal to above the largest finite value (float64's
    # own range)
    assert factor == 0 or fmt.smallest_subnormal / 2 <= factor * (1 + 2.0**-50)
    assert factor <= 4 * fmt.max_finite


@given(
    mst.attention_inputs(
        q_len=2,
        kv_len=4,
        d_k=2,
        structure="bias_range",
        numerics=Numerics(input="bfloat16", score_format="float16"),
    )
)
def test_bias_range_stays_within_the_score_format(x):
    assert x.bias is not None
    assert np.abs(x.bias).max() <= 65504


@given(mst.numerics(presets=False, free=False, custom=True))
def test_custom_numerics_are_valid_and_their_mask_constant_is_not_nan(num):
    assert isinstance(num, Numerics)
    assert not math.isnan(num.mask_constant())


@given(mst.numerics(presets=False, free=False, custom=True, bounded=True))
def test_bounded_custom_numerics_are_in_the_bounds_scope(num):
    score, soft, acc = (num.format_of(r).precision for r in ("score", "softmax", "accum"))
    assert score <= soft
    assert num.softmax_kind != "online" or acc <= soft


NARROW_AFTER_WIDE = {
    "float16 scores after float32 accumulation": lambda f, n: (
        f["accum"] == "float32" and f["score"] == "float16"
    ),
    "bfloat16 scale format with float32 inputs": lambda f, n: (
        f["input"] == "float32" and f["scale"] == "bfloat16" and n.scale != "scores"
    ),
    "bfloat16 inputs accumulated in float16": lambda f, n: (
        f["input"] == "bfloat16" and f["accum"] == "float16"
    ),
    "fp8 score format": lambda f, n: f["score"].startswith("float8"),
    "fp8 output format": lambda f, n: f["output"].startswith("float8"),
    "scale on q": lambda f, n: n.scale == "q",
    "scale on q and k": lambda f, n: n.scale == "qk",
    "tensor-core dot": lambda f, n: n.dot_kind == "tensor-core",
    "finite masking constant": lambda f, n: math.isfinite(n.mask_constant()),
}


@pytest.mark.parametrize("name", list(NARROW_AFTER_WIDE))
def test_custom_numerics_reach_narrow_formats_after_wide_ones(name):
    def formats_of(num):
        return {r: num.format_of(r).name for r in ("input", "accum", "score", "scale", "output")}

    found = find(
        mst.numerics(presets=False, free=False, custom=True, bounded=True),
        lambda num: NARROW_AFTER_WIDE[name](formats_of(num), num),
        settings=settings(database=None, max_examples=2000, derandomize=True),
    )
    assert isinstance(found, Numerics)


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
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "scale": math.inf}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "structure": "ranges"}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "numerics": "fp12"}),
    (mst.attention_inputs, {"q_len": 2, "kv_len": 2, "d_k": 2, "numerics": 3}),
    (mst.numerics, {"custom": 1}),
    (mst.numerics, {"bounded": "yes"}),
    (mst.numerics, {"scale": "k"}),
    (mst.numerics, {"presets": False, "free": False, "custom": False}),
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
        mst.attention_inputs(q_len=2, kv_len=2, d_k=2, numerics=st.just("fp12")),
        mst.numerics(presets=False, free=False, custom=True, scale=st.just("k")),
    ],
)
def test_bad_values_drawn_from_strategies_raise_when_drawn(strategy):
    @given(strategy)
    def draw(_):
        pass

    with pytest.raises(InvalidArgument):
        draw()


@pytest.mark.parametrize(
    "function",
    [
        mst.formats,
        mst.numerics,
        mst.attention_inputs,
        mst.masks,
        mst.mha_params,
        mst.mha_inputs,
        mst.perturbed_inputs,
    ],
)
def test_strategies_are_keyword_only(function):
    with pytest.raises(TypeError):
        function(1)
