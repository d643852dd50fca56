"""Theorem A.4: a priori bounds from sizes and norms, against A.1/A.2 and the reference."""

from __future__ import annotations

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
from mhanum.numerics import PRESETS
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
