"""Theorem A.4: a priori bounds from sizes and norms, against A.1/A.2 and the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, MHAParams, Numerics, reference
from mhanum.bounds import (
    attention_bound,
    attention_bound_a_priori,
    mha_bound,
    mha_bound_a_priori,
)
from mhanum.formats import get_format, round_to
from mhanum.numerics import PRESETS, resolve
from tests._numerics import configured


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1),
    d_k=st.sampled_from([4, 12, 16]),
    preset=st.sampled_from(list(PRESETS)),
    order=st.sampled_from(["native", "sequential", "pairwise", "kahan"]),
    softmax=st.sampled_from(["naive", "safe", "online(3)"]),
    placement=st.sampled_from(["scores", "q", "qk"]),
    size=st.sampled_from([0.5, 1.0, 3.0]),
    masked=st.booleans(),
)
def test_a_priori_covers_a_posteriori_covers_measured(
    seed, d_k, preset, order, softmax, placement, size, masked
):
    num = configured(preset, summation=order, softmax=softmax, scale=placement)
    rng = np.random.default_rng(seed)
    q, k = size * rng.standard_normal((5, d_k)), size * rng.standard_normal((7, d_k))
    v = rng.standard_normal((7, 3))
    mask = None
    if masked:
        mask = rng.random((5, 7)) < 0.6
        mask[:, 0] = True
    prior = attention_bound_a_priori(
        5,
        7,
        d_k,
        3,
        q_norm=float(np.linalg.norm(q, axis=-1).max()),
        k_norm=float(np.linalg.norm(k, axis=-1).max()),
        v_max=float(np.abs(v).max()),
        numerics=num,
        min_keys=int(mask.sum(axis=-1).min()) if masked else None,
    )
    assert bool(prior.reasons) == (not np.isfinite(prior.total).all())
    post = attention_bound(q, k, v, mask, numerics=num)
    assume(np.isfinite(post.total).all())
    assert np.all(post.total <= prior.total), f"{np.max(post.total / prior.total):.3g}"
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    err = np.abs(out - reference.attention(q, k, v, mask=mask))
    assert np.all(err <= post.total)


@settings(max_examples=10)
@given(
    seed=st.integers(0, 2**32 - 1),
    preset=st.sampled_from(["fp32", "bf16-fp32acc", "fp16", "tf32", "tpu-bf16-3pass"]),
    heads=st.sampled_from([1, 2, 4]),
    softmax=st.sampled_from(["safe", "online(4)"]),
)
def test_mha_a_priori_covers_a_posteriori_covers_measured(seed, preset, heads, softmax):
    num = configured(preset, softmax=softmax)
    params = MHAParams.random(16, seed=seed % 1000)
    rng = np.random.default_rng(seed)
    x_q, x_kv = rng.uniform(-2, 2, (6, 16)), rng.uniform(-2, 2, (9, 16))
    prior = mha_bound_a_priori(params, heads, 6, 9, x_max=2.0, numerics=num)
    post = mha_bound(x_q, x_kv, params, heads, numerics=num)
    assert prior.total.shape == (16,)
    assert np.all(post.total <= prior.total), f"{np.max(post.total / prior.total):.3g}"
    out = np.asarray(mn.multi_head_attention(x_q, x_kv, params, heads, numerics=num), np.float64)
    err = np.abs(out - reference.multi_head_attention(x_q, x_kv, params, heads))
    assert np.all(err <= post.total)


def test_a_priori_grows_with_the_norms_and_the_row_length():
    # The logit term grows like c·|q||k|·γ_{d_k}, the softmax term with the logit range
    # 2c|q||k| (first order: e^{2Δ} - 1 ≈ 2Δ); the pv term like γ_n with the row length.
    def total(q_norm, n):
        b = attention_bound_a_priori(
            8, n, 64, q_norm=q_norm, k_norm=8.0, v_max=1.0, numerics="fp32"
        )
        return float(b.total.max())

    assert total(16.0, 64) > 1.9 * total(8.0, 64) / 2
    assert total(8.0, 1024) > total(8.0, 64)
    b = attention_bound_a_priori(8, 64, 64, q_norm=8.0, k_norm=8.0, v_max=1.0, numerics="fp32")
    assert set(b.terms) >= {"logits", "softmax", "pv", "output"}
    assert b.theorem == "A.4"


def test_a_priori_is_vacuous_where_the_naive_softmax_may_overflow():
    # c|q||k| = 2500 > log(max float32): exp of an unshifted logit may overflow.
    num = Numerics(softmax="naive")
    b = attention_bound_a_priori(1, 8, 16, q_norm=100.0, k_norm=100.0, v_max=1.0, numerics=num)
    assert np.isinf(b.total).all()
    assert "vacuous" in b.terms


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"q_norm": -1.0}, "q_norm: expected a finite number >= 0"),
        ({"v_max": float("nan")}, "v_max: expected a finite number"),
        ({"numerics": Numerics(mask_value=-1e9)}, "numerics.mask_value: the a priori"),
        ({"min_keys": 9}, "min_keys: expected at most kv_len"),
    ],
)
def test_a_priori_bad_arguments(kwargs, match):
    args = {"q_norm": 1.0, "k_norm": 1.0, "v_max": 1.0, **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        attention_bound_a_priori(2, 8, 4, **args)


# Float64 norms may fall a few ulps below the exact ones; A.4 needs upper bounds.
_UP = 1 + 2.0**-40


def _norms(q, k, v):
    return {
        "q_norm": float(np.linalg.norm(q, axis=-1).max()) * _UP,
        "k_norm": float(np.linalg.norm(k, axis=-1).max()) * _UP,
        "v_max": float(np.abs(v).max()),
    }


def _chain(q, k, v, num, scale=None):
    """A.4 from the inputs' norms, A.1 and the measured error against the certified reference."""
    prior = attention_bound_a_priori(
        q.shape[0], k.shape[0], q.shape[1], v.shape[1], numerics=num, scale=scale, **_norms(q, k, v)
    )
    post = attention_bound(q, k, v, numerics=num, scale=scale)
    out = np.asarray(mn.attention(q, k, v, numerics=num, scale=scale), np.float64)
    err = np.abs(out - reference.attention(q, k, v, scale=scale))
    return prior, post, err


def _bf16(x):
    return np.asarray(round_to(np.asarray(x, np.float64), get_format("bfloat16")), np.float64)


def test_a_priori_is_vacuous_where_the_naive_row_sum_may_overflow_float16():
    # Every logit is q·k = 6 < log(65504) - 1, so no exponential overflows, but 256 of them
    # sum to 256·e^6 ≈ 1.03e5 > 65504: the float16 row sum is inf and every probability 0.
    num = Numerics.preset("fp16").replace(softmax="naive", summation="pairwise")
    q, k, v = np.array([[2.0]]), np.full((256, 1), 3.0), np.ones((256, 1))
    rho = 6.0
    assert rho < math.log(65504) - 1
    assert math.log(256) + rho >= math.log(65504)
    out = np.asarray(mn.attention(q, k, v, numerics=num, scale=1.0), np.float64)
    err = np.abs(out - reference.attention(q, k, v, scale=1.0))
    assert err.max() >= 0.5  # the computation fails outright (reference 1)
    prior = attention_bound_a_priori(
        1, 256, 1, 1, q_norm=2.0, k_norm=3.0, v_max=1.0, numerics=num, scale=1.0
    )
    assert np.isinf(prior.total).all()
    assert "vacuous" in prior.terms
    assert any("row sum of n = 256" in r and "float16" in r for r in prior.reasons)
    assert not any("exp of an unshifted logit" in r for r in prior.reasons)
    # with 8 keys the row sum (8·e^6 ≈ 3.2e3) fits: a finite bound, which holds
    q8, k8, v8 = q, k[:8], v[:8]
    prior8, post8, err8 = _chain(q8, k8, v8, num, scale=1.0)
    assert np.isfinite(prior8.total).all()
    assert prior8.reasons == ()
    assert np.all(err8 <= post8.total)
    assert np.all(post8.total <= prior8.total)


@pytest.mark.parametrize(
    ("placement", "scale"), [("q", 0.25), ("q", 2.0), ("q", -0.25), ("qk", 0.25), ("qk", 2.0)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_priori_covers_a_scale_format_narrower_than_the_input(placement, scale, seed):
    # q (and k) are read into bfloat16 before the exact product by a power of two: a relative
    # rounding of 2^-9 that float32 inputs do not have.
    num = Numerics(input="float32", accum="float32", scale=placement, scale_format="bfloat16")
    rng = np.random.default_rng(seed)
    q, k, v = (
        3 * rng.standard_normal((4, 16)),
        3 * rng.standard_normal((8, 16)),
        rng.standard_normal((8, 3)),
    )
    prior, post, err = _chain(q, k, v, num, scale=scale)
    assert np.isfinite(prior.total).all()
    assert prior.reasons == ()
    assert np.all(err <= post.total)
    assert np.all(post.total <= prior.total), f"{np.max(post.total / prior.total):.3g}"


@pytest.mark.parametrize("placement", ["scores", "q"])
def test_a_priori_covers_a_subnormal_scale(placement):
    # 2^-130 is subnormal in float32, where XLA reads it as zero: the logits become 0 (a
    # uniform softmax) while the exact ones are ±1/8.
    num = Numerics.preset("fp32").replace(scale=placement, scale_format="float32")
    big = 2.0**63
    q = np.array([[big, big]])
    k = np.array([[big, big], [-big, -big], [big, -big]])
    v = np.array([[1.0], [0.0], [0.0]])
    prior, post, err = _chain(q, k, v, num, scale=2.0**-130)
    assert err.max() > 1e-2  # the constant was read as zero
    assert np.all(err <= post.total)
    assert np.all(post.total <= prior.total), f"{np.max(post.total / prior.total):.3g}"


@pytest.mark.parametrize("softmax", ["safe", "online(4)"])
@pytest.mark.parametrize(("q_size", "k_size"), [(2e-5, 3e3), (1e-6, 1e3), (1.0, 1.0)])
def test_a_priori_covers_bfloat16_inputs_accumulated_in_float16(softmax, q_size, k_size):
    # bfloat16 values below 2^-14 are subnormal (or flushed) when read into float16: an
    # absolute error below 2^-14 per operand (A.1 step 1), which |k| multiplies in the logits.
    num = Numerics(input="bfloat16", accum="float16", softmax=softmax)
    rng = np.random.default_rng(7)
    q = _bf16(q_size * rng.uniform(0.5, 1, (4, 4)))
    k = _bf16(k_size * rng.choice([-1, 1], (8, 4)) * rng.uniform(0.5, 1, (8, 4)))
    v = _bf16(rng.standard_normal((8, 2)))
    prior, post, err = _chain(q, k, v, num, scale=1.0)
    assert np.isfinite(prior.total).all()
    assert prior.reasons == ()
    assert np.all(err <= post.total)
    assert np.all(post.total <= prior.total), f"{np.max(post.total / prior.total):.3g}"


@pytest.mark.parametrize(
    ("numerics", "norms", "stage"),
    [
        ("fp16", {"q_norm": 1e5}, "q in the input format"),
        (
            Numerics(input="bfloat16", accum="float16"),
            {"q_norm": 1e5},
            "q read into the accumulation format",
        ),
        (
            Numerics(input="bfloat16", accum="float16"),
            {"v_max": 1e5},
            "v read into the accumulation format",
        ),
        ("fp16", {"q_norm": 300.0, "k_norm": 300.0}, "QKᵀ accumulated"),
    ],
)
def test_a_priori_is_infinite_where_a_norm_overflows_a_format(numerics, norms, stage):
    # An admissible input that attains the norm (one large entry) overflows the stage: the
    # computed output is NaN, and A.4 must be infinite with the stage as its reason.
    num = resolve(numerics)
    bounds = {"q_norm": 1.0, "k_norm": 1.0, "v_max": 1.0, **norms}
    prior = attention_bound_a_priori(2, 4, 4, 2, numerics=num, **bounds)
    assert np.isinf(prior.total).all()
    assert "overflow" in prior.terms
    assert any(r.startswith(stage) for r in prior.reasons), prior.reasons
    q, k = np.zeros((2, 4)), np.zeros((4, 4))
    q[:, 0], k[:, 0] = bounds["q_norm"], bounds["k_norm"]
    v = np.full((4, 2), bounds["v_max"])
    v[1] = -bounds["v_max"]
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    assert not np.isfinite(out).all()
    # with norms of 200 (200² < 65504) the stage is proved finite
    fine = {name: min(value, 200.0) for name, value in bounds.items()}
    ok = attention_bound_a_priori(2, 4, 4, 2, numerics=num, **fine)
    assert not any(r.startswith(stage) for r in ok.reasons)


def test_a_priori_reasons_exactly_where_infinite():
    for num in ("fp16", "bf16", "fp32"):
        for q_norm in (1.0, 30.0, 1e3, 1e5, 1e40):
            b = attention_bound_a_priori(
                4, 16, 8, q_norm=q_norm, k_norm=q_norm, v_max=1.0, numerics=num
            )
            assert bool(b.reasons) == bool(np.isinf(b.total).any())
            assert np.isinf(b.total).all() or np.isfinite(b.total).all()


def test_mha_a_priori_is_infinite_where_a_projection_may_overflow():
    # x_max·max_l Σ_t |wq_tl| > 65504: x = x_max·sign(wq[:, l]) makes the q projection inf.
    num = Numerics.preset("fp16")
    params = MHAParams.random(16, seed=0)
    wq = np.asarray(params.wq, np.float64)
    col = int(np.abs(wq).sum(axis=0).argmax())
    x_max = float(round_to(1.05 * 65504 / np.abs(wq).sum(axis=0).max(), get_format("float16")))
    assert x_max < 65504
    prior = mha_bound_a_priori(params, 2, 3, 3, x_max=x_max, numerics=num)
    assert np.isinf(prior.total).all()
    assert "overflow" in prior.terms
    assert any(r.startswith("q projection") for r in prior.reasons), prior.reasons
    x_q = np.tile(x_max * np.sign(wq[:, col]), (3, 1))
    x_kv = np.ones((3, 16))
    out = np.asarray(mn.multi_head_attention(x_q, x_kv, params, 2, numerics=num), np.float64)
    assert not np.isfinite(out).all()
    over = mha_bound_a_priori(params, 2, 3, 3, x_max=7e4, numerics=num)
    assert any(r.startswith("x_q in the input format") for r in over.reasons)
    fine = mha_bound_a_priori(params, 2, 3, 3, x_max=0.5, numerics=num)
    assert np.isfinite(fine.total).all()
    assert fine.reasons == ()


@pytest.mark.parametrize("softmax", ["naive", "safe", "online(3)"])
@pytest.mark.parametrize("placement", ["scores", "q", "qk"])
def test_a_priori_covers_a_posteriori_in_float64(softmax, placement):
    # In float64 the logits' evaluation error (step 0, ε64 = 2^-52 (d_k + 2) c|q||k|) is as large
    # as their rounding error; A.1 counts it, so A.4 must too.
    num = Numerics.preset("fp64").replace(softmax=softmax, scale=placement)
    rng = np.random.default_rng(1)
    q, k, v = (
        3 * rng.standard_normal((5, 16)),
        3 * rng.standard_normal((7, 16)),
        rng.standard_normal((7, 3)),
    )
    prior, post, err = _chain(q, k, v, num)
    assert "evaluation" in prior.terms
    assert np.all(err <= post.total)
    assert np.all(post.total <= prior.total), f"{np.max(post.total / prior.total):.3g}"


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16-fp32acc"])
@pytest.mark.parametrize(("size", "cap"), [(1.0, 30.0), (4.0, 2.0), (12.0, 0.5)])
def test_a_priori_with_a_cap_covers_the_measured_error(preset, size, cap):
    """A.4 on the capped logits (papers/backward.md B.9 (c)): rows of q and k of one norm,
    logits from inside the cap to 36 times past it."""
    rng = np.random.default_rng(5)
    fmt = PRESETS[preset].input
    q, k = (rng.standard_normal((8, 4)) for _ in range(2))
    q, k = (round_to(size * x / np.linalg.norm(x, axis=-1, keepdims=True), fmt) for x in (q, k))
    v = round_to(rng.uniform(-1, 1, (8, 4)), fmt)
    prior = attention_bound_a_priori(8, 8, 4, numerics=preset, softcap=cap, **_norms(q, k, v))
    out = np.asarray(mn.attention(q, k, v, numerics=preset, softcap=cap), np.float64)
    err = np.abs(out - reference.attention(q, k, v, softcap=cap))
    assert np.isfinite(prior.total).all(), prior.reasons
    assert (err <= prior.total).all()
