"""mhanum.bounds.heads: scale exactness by enumeration, dot and projection factors by measurement."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mhanum import InvalidArgument, MHAParams, round_to, summation
from mhanum.bounds import heads


@pytest.mark.parametrize("placement", ["scores", "q", "qk"])
def test_scale_is_exact_exactly_for_powers_of_4_or_16(placement):
    root = 4 if placement == "qk" else 2
    ctx = mpmath.MPContext()
    ctx.prec = 300
    for d in range(1, 1025):
        s = heads.scale_exactness(d, "float32", placement)
        c = ctx.power(d, ctx.mpf(-1) / root)
        dyadic = ctx.almosteq(
            c, ctx.ldexp(1, int(ctx.nint(ctx.log(c, 2)))), rel_eps=ctx.mpf(2) ** -250
        )
        assert s.exact == dyadic, d
        assert s.exact == (d in ({4**m for m in range(6)} if root == 2 else {1, 16, 256}))
        assert s.relative_error <= 2.0**-24  # rounding to nearest: at most u


@given(data=st.data())
def test_score_dot_factor_bounds_the_measured_error(data):
    fmt = data.draw(st.sampled_from(["bfloat16", "float16", "float32"]))
    order = data.draw(st.sampled_from(["sequential", "pairwise", "kahan", "blocked(4)", "native"]))
    d_model, num_heads = 64, data.draw(st.sampled_from([1, 2, 4, 8]))
    d_k = d_model // num_heads
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    q = round_to(rng.standard_normal((3, d_k)), fmt)
    k = round_to(rng.standard_normal((d_k, 5)), fmt)
    computed = np.asarray(summation.matmul(q, k, order=order, accum=fmt), np.float64)
    gamma = heads.score_dot_factor(d_model, num_heads, fmt).total
    for i in range(3):
        for j in range(5):
            exact = sum(
                Fraction(float(a)) * Fraction(float(b)) for a, b in zip(q[i], k[:, j], strict=True)
            )
            bound = gamma * float(np.abs(q[i]) @ np.abs(k[:, j]))
            assert abs(Fraction(float(computed[i, j])) - exact) <= Fraction(bound)


@given(
    seed=st.integers(0, 2**32 - 1),
    num_heads=st.sampled_from([2, 4, 8]),
    fmt=st.sampled_from(["bfloat16", "float16"]),
)
def test_output_projection_per_head_then_across_heads(fmt, seed, num_heads):
    d_v = 8
    rng = np.random.default_rng(seed)
    o = round_to(rng.standard_normal((2, num_heads * d_v)), fmt)
    w = round_to(rng.standard_normal((num_heads * d_v, 3)), fmt)
    partials = [
        np.asarray(
            summation.matmul(
                o[:, h * d_v : (h + 1) * d_v],
                w[h * d_v : (h + 1) * d_v],
                order="sequential",
                accum=fmt,
            ),
            np.float64,
        )
        for h in range(num_heads)
    ]
    across = np.asarray(
        summation.sum(np.stack(partials, -1), order="sequential", accum=fmt), np.float64
    )
    flat = np.asarray(summation.matmul(o, w, order="sequential", accum=fmt), np.float64)
    blocked_f = heads.output_projection_factor(num_heads, d_v, fmt)
    flat_f = heads.output_projection_factor(num_heads, d_v, fmt, per_head_partials=False)
    assert blocked_f.total < flat_f.total
    scale = np.abs(o) @ np.abs(w)
    for i in range(2):
        for j in range(3):
            exact = sum(
                Fraction(float(a)) * Fraction(float(b)) for a, b in zip(o[i], w[:, j], strict=True)
            )
            assert abs(Fraction(float(across[i, j])) - exact) <= Fraction(
                blocked_f.total * scale[i, j]
            )
            assert abs(Fraction(float(flat[i, j])) - exact) <= Fraction(flat_f.total * scale[i, j])


def test_head_partition_difference_is_zero_for_the_same_partition_and_order_one_otherwise():
    rng = np.random.default_rng(0)
    params = MHAParams.random(32, seed=0)
    x = rng.standard_normal((6, 32))
    same = heads.head_partition_difference(x, params, 4, 4)
    assert same.normwise_max == 0.0
    diff = heads.head_partition_difference(x, params, 8, 1)
    assert diff.normwise_max > 0.1
    assert len(diff.score_split["per_head_scores"]) == 1
    four = heads.head_partition_difference(x, params, 1, 4)
    assert len(four.score_split["per_head_scores"]) == 4
    assert "over 8 of the 32 components" in four.explanation


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: heads.scale_exactness(0, "float32"), "d_k: expected a positive integer"),
        (lambda: heads.scale_exactness(64, "float32", "k"), "placement: expected"),
        (lambda: heads.score_dot_factor(64, 3, "float32"), "num_heads: expected a divisor"),
        (lambda: heads.output_projection_factor(0, 8, "float32"), "num_heads: expected a positive"),
        (
            lambda: heads.head_partition_difference(
                np.zeros((2, 8)), MHAParams.random(8, seed=0), 3, 1
            ),
            "num_heads: expected a divisor",
        ),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()


def test_dot_factors_beyond_gamma_take_the_product_form():
    # 2^16 bfloat16 products: γ_n is infinite, (1 + u)^n - 1 is a (huge) finite factor
    u = 2.0**-8
    big = heads.score_dot_factor(2**16, 1, "bfloat16")
    assert float(big.total) == pytest.approx(math.expm1(2**16 * math.log1p(u)), rel=1e-12)
    assert "n·u < 1" not in big.assumptions
    # below γ_n < 1 the literature's γ_n stays
    small = heads.score_dot_factor(64, 1, "bfloat16")
    assert float(small.total) == pytest.approx(64 * u / (1 - 64 * u), rel=1e-15)
    # and the product form bounds a real product of 256 factors 1 + u (the worst case)
    assert (1 + u) ** 256 - 1 <= float(heads.output_projection_factor(1, 256, "bfloat16").total)
