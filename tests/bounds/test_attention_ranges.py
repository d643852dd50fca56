"""Theorem A.1 at the edges of every format: range proved on the values, or inf with a reason.

Each case is one class of input that an earlier revision bounded with a finite number while the
emulated output overflowed or was off by more (papers/attention.md, R.1-R.7). The assertion is
the theorem itself: where the bound is finite the output is finite and within it of the
certified reference; where it is infinite, ``Bound.reasons`` says why.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, Numerics, reference
from mhanum.bounds import attention_bound, attention_bound_a_priori, mha_bound
from mhanum.bounds.softmax import division_error

RNG = np.random.default_rng(20261124)
Q, K, V = (RNG.standard_normal((6, 8)) for _ in range(3))
FP16 = Numerics.preset("fp16")


def _outlier(x: np.ndarray) -> np.ndarray:
    y = x.copy()
    y[:, 0] *= 1200.0  # one channel far above the others (real models' outlier channels)
    return y


CASES = {
    # name: (q, k, v, numerics, keyword arguments, reason expected where the bound is inf)
    "fp16 naive row sum overflows": (
        np.full((2, 1), 3.0),
        np.full((64, 1), 3.0),
        RNG.standard_normal((64, 2)),
        FP16.replace(softmax="naive"),
        {"scale": 1.0},
        "row sum may overflow float16",
    ),
    "fp16 logit plus bias overflows": (
        np.full((2, 1), 250.0),
        np.full((3, 1), 250.0),
        RNG.standard_normal((3, 2)),
        FP16,
        {"scale": 1.0, "bias": np.full((2, 3), 10000.0)},
        "plus the bias",
    ),
    "fp16 scores overflow before a small scale": (
        np.full((2, 4), 200.0),
        np.full((3, 4), 200.0),
        RNG.standard_normal((3, 2)),
        FP16,
        {"scale": 1e-3},
        "QKᵀ",
    ),
    "fp16 values near the limit in P·V": (
        np.zeros((2, 2)),
        np.zeros((40, 2)),
        np.full((40, 2), 65000.0),
        FP16,
        {},
        "P·V",
    ),
    "fp16 values near the limit, online": (
        np.zeros((2, 2)),
        np.zeros((40, 2)),
        np.full((40, 2), 30000.0),
        FP16.replace(softmax="online(8)"),
        {},
        "accumulator",
    ),
    "e4m3 inputs overflow": (
        Q * 500,
        K,
        V,
        "fp8-e4m3-fp32acc",
        {},
        "q in the input format",
    ),
    "float32 input overflows its TF32 conversion": (
        np.full((2, 2), np.float32(3.4028235e38) * (1 - 2**-24)),
        np.full((3, 2), 1e-38),
        RNG.standard_normal((3, 2)),
        "tf32",
        {},
        "tf32",
    ),
    "e4m3 score format": (
        Q * 30,
        K * 30,
        V,
        Numerics(score_format="float8_e4m3fn"),
        {},
        "float8_e4m3fn",
    ),
    "e4m3 output format": (
        Q,
        K,
        V * 1000,
        Numerics(output_format="float8_e4m3fn"),
        {},
        "the output",
    ),
    "bfloat16 inputs overflow a float16 accumulation": (
        Q * 1e5,
        K,
        V,
        Numerics(input="bfloat16", accum="float16"),
        {},
        "accumulation format",
    ),
    "bfloat16 inputs below float16's normal range": (
        Q * 1e-6,
        K * 1e-6,
        V * 1e-6,
        Numerics(input="bfloat16", accum="float16"),
        {},
        None,
    ),
    "scale 1e-40 is subnormal in float32": (
        Q * 1e19,
        K * 1e18,
        V,
        "fp32",
        {"scale": 1e-40},
        None,
    ),
    "scale 1.5e-7 is subnormal in float16": (
        Q * 10,
        K * 10,
        V,
        FP16,
        {"scale": 1.5e-7},
        None,
    ),
    "scale 1.5e-7 on q in float16": (
        Q * 10,
        K * 10,
        V,
        FP16.replace(scale="q"),
        {"scale": 1.5e-7},
        None,
    ),
    "outlier channel, float32": (_outlier(Q), _outlier(K), V, "fp32", {}, None),
    "outlier channel, bf16-fp32acc": (_outlier(Q), _outlier(K), V, "bf16-fp32acc", {}, None),
}
for fmt in ("bfloat16", "float16", "float8_e4m3fn"):
    for place in ("q", "qk"):
        for scale in (0.5, 0.3, None):
            CASES[f"scale on {place} in {fmt}, scale {scale}"] = (
                Q * 1.2345, K, V, Numerics(scale=place, scale_format=fmt),
                {} if scale is None else {"scale": scale}, None,
            )  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_finite_bounds_hold_and_infinite_ones_say_why(name):
    q, k, v, num, kw, reason = CASES[name]
    bound = attention_bound(q, k, v, numerics=num, **kw)
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.asarray(mn.attention(q, k, v, numerics=num, **kw), np.float64)
    ref = reference.attention(q, k, v, **kw)
    finite = np.isfinite(bound.total)
    assert np.isfinite(out[finite]).all(), "a non-finite output under a finite bound"
    assert np.all(np.abs(out - ref)[finite] <= bound.total[finite])
    if reason is None:
        assert finite.all(), bound.reasons
    else:
        assert not finite.all()
        assert any(reason in r for r in bound.reasons), bound.reasons
        assert reason in str(bound)
    if not finite.all():
        assert bound.reasons


def test_the_outlier_channel_is_not_refused_and_stays_informative():
    # scale·|q|·|k| reaches 2.6e5, far past the old 2^12 refusal; the bound is finite and
    # within 1e-3 of the output's size.
    q, k = _outlier(Q), _outlier(K)
    assert (abs(q) @ abs(k).T).max() / np.sqrt(8) > 2.0**12
    bound = attention_bound(q, k, V, numerics="fp32")
    assert np.isfinite(bound.total).all()
    assert bound.total.max() < 1e-3 * np.abs(V).max()


def test_a_subnormal_scale_charges_its_whole_value():
    # 2^-140 is subnormal in float32 and may be read as zero: the logits' error is c·|q·k|.
    q, k = Q * 2.0**70, K * 2.0**70
    bound = attention_bound(q, k, V, numerics="fp32", scale=2.0**-140)
    flushed = attention_bound(q, k, V, numerics="fp32", scale=2.0**-126)
    assert bound.parts["logits"]["scale"].max() > 100 * flushed.parts["logits"]["scale"].max()


def test_a_mask_constant_that_becomes_nan_in_the_score_format_is_refused():
    num = Numerics(score_format="float8_e4m3fn", mask_value=-1e9)
    mask = np.ones((6, 6), bool)
    mask[:, 3:] = False
    with pytest.raises(InvalidArgument, match=r"numerics.mask_value: .* becomes NaN"):
        attention_bound(Q[:, :6], K[:, :6], V[:, :6], mask, numerics=num)
    with pytest.raises(InvalidArgument, match=r"numerics\.mask_value"):
        mn.attention(Q[:, :6], K[:, :6], V[:, :6], mask, numerics=num)


def test_a_bias_that_becomes_nan_in_an_e4m3_score_format_is_refused():
    num = Numerics(score_format="float8_e4m3fn")
    with pytest.raises(InvalidArgument, match="bias: expected values finite"):
        attention_bound(Q, K, V, numerics=num, bias=np.full((6, 6), 1000.0))


def test_xla_division_is_within_the_default_model_and_beyond_a_correctly_rounded_one():
    # A division by a broadcast row sum is a product with the reciprocal: up to (1 + u)^2 - 1.
    import jax
    import jax.numpy as jnp

    e = RNG.uniform(0, 1, (4000, 64)).astype(np.float32)
    out = np.asarray(jax.jit(lambda x: x / jnp.sum(x, axis=-1, keepdims=True))(e), np.float64)
    total = np.asarray(jnp.sum(e, axis=-1, keepdims=True), np.float64)
    rel = np.abs(out - e / total) / (e / total)
    u = 2.0**-24
    assert rel.max() <= division_error(Numerics().div_ulps, u)
    assert rel.max() > division_error(0.5, u)  # a correctly rounded quotient would be wrong


def test_mha_projection_overflow_is_inf_with_a_reason():
    params = mn.MHAParams.random(8, seed=0)
    x = RNG.standard_normal((4, 8)) * 3e4
    bound = mha_bound(x, x, params, 2, numerics="fp16")
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.asarray(mn.multi_head_attention(x, x, params, 2, numerics="fp16"), np.float64)
    finite = np.isfinite(bound.total)
    assert not finite.all()
    assert np.isfinite(out[finite]).all()
    assert any("projection" in r for r in bound.reasons), bound.reasons


def test_softmax_bound_and_a1_agree_on_a_float16_naive_row_that_overflows():
    from mhanum.bounds.softmax import softmax_bound

    num = FP16.replace(softmax="naive")
    logits = np.full((1, 64), 9.0)  # 64·e^9 = 5.2e5 > 65504: the row sum overflows
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.asarray(mn.softmax(logits, numerics=num), np.float64)
    assert not np.allclose(out, 1 / 64)
    alone = softmax_bound(logits, num)
    composed = attention_bound(
        np.full((1, 1), 3.0),
        np.full((64, 1), 3.0),
        np.ones((64, 1)),
        numerics=num,
        scale=1.0,
    )
    assert np.isinf(alone.total).all()
    assert alone.reasons
    assert np.isinf(composed.total).all()
    assert composed.reasons


def test_one_subnormal_input_charges_only_the_entries_it_reaches():
    # v[2, 1] = 1e-6 is subnormal in float16: only output column 1 may change by its flush.
    rng = np.random.default_rng(7)
    q, k, v = (
        np.asarray(rng.standard_normal(s), np.float16).astype(float)
        for s in ((4, 8), (6, 8), (6, 3))
    )
    v[2, 1] = 0.0
    plain = attention_bound(q, k, v, numerics="fp16").total
    v_sub = v.copy()
    v_sub[2, 1] = 1e-6
    bound = attention_bound(q, k, v_sub, numerics="fp16").total
    out = np.asarray(mn.attention(q, k, v_sub, numerics="fp16"), np.float64)
    assert np.all(np.abs(out - reference.attention(q, k, v_sub)) <= bound)
    np.testing.assert_array_equal(bound[:, [0, 2]], plain[:, [0, 2]])
    assert np.all(bound[:, 1] > plain[:, 1])


def test_a_safe_row_sum_that_may_overflow_its_format_is_infinite_with_its_reason():
    # 2^16 equal logits, float16 softmax, pairwise sums: the row sum of the ones reaches inf,
    # 1/inf = 0 and the output is 0 where the exact one is 1 (every value is 1). Each computed
    # exponential is at most 1 + ε_e (Lemma W), so below 65504 keys the sum is proved finite.
    num = Numerics(softmax_format="float16", score_format="float16", summation="pairwise")
    for n, overflows in ((65536, True), (60000, False)):
        q, k, v = np.zeros((1, 2)), np.zeros((n, 2)), np.ones((n, 1))
        out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
        bound = attention_bound(q, k, v, numerics=num)
        prior = attention_bound_a_priori(
            1, n, 2, 1, q_norm=0.0, k_norm=0.0, v_max=1.0, numerics=num
        )
        if overflows:
            assert out.item() == 0.0
            for b in (bound, prior):
                assert np.isinf(b.total).all()
                assert any("the softmax's row sum" in r for r in b.reasons), b.reasons
        else:
            assert np.isfinite(bound.total).all(), bound.reasons
            assert abs(out.item() - 1.0) <= bound.total.item()
            assert not any("the softmax's row sum" in r for r in prior.reasons)
