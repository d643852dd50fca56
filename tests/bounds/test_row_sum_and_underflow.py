"""Steps 5' and 6 of Theorem A.1 (papers/attention.md).

Step 5': the row sum's error is one number for the whole row, so it is charged against
``|Σ_j p̃_j v_j|`` and not against ``Σ_j p̃_j |v_j|``: where the values cancel, a long row's sum
error costs almost nothing. Step 6: a probability format's absolute underflow term is charged
only for keys whose probability may lie below its smallest normal number, and there it is at
most the probability itself. Each test would fail
under the charge it replaces, and each checks the bound against the measured error.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum import Numerics, reference
from mhanum.bounds import attention_bound
from mhanum.bounds.factors import gamma
from mhanum.formats import get_format


def _error(q, k, v, num):
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    return np.abs(out - np.asarray(reference.attention(q, k, v), np.float64))


@pytest.mark.parametrize("softmax", ["safe", "online(16)"])
def test_a_cancelling_row_is_not_charged_its_sum_error_against_p_abs_v(softmax):
    # float16 sums over 64 keys: the row sum's relative error may reach γ_63(2^-11) = 0.031.
    # Values ±1 alternate and the logits are small, so o is ~0 while Σ p|v| = 1: the old
    # charge T·Σ p̃|v| alone exceeds γ_63·(1 - 0.05); step 5' charges T·|õ| instead and keeps
    # only the keys' own exponential errors (online: K = 4 rescalings in float16, ~0.017).
    num = Numerics(input="float16", accum="float16", summation="sequential", softmax=softmax)
    rng = np.random.default_rng(5)
    n, d = 64, 8
    fmt = get_format("float16")
    q = np.asarray(mn.round_to(0.05 * rng.standard_normal((4, d)), fmt), np.float64)
    k = np.asarray(mn.round_to(rng.standard_normal((n, d)), fmt), np.float64)
    v = np.tile(np.array([[1.0], [-1.0]]), (n // 2, d))
    bound = attention_bound(q, k, v, numerics=num)
    t_floor = gamma(n - 1, fmt.u) * (1 - 0.05)
    assert np.max(bound.terms["softmax"]) < t_floor
    assert np.all(_error(q, k, v, num) <= bound.total)


def test_normal_probabilities_in_float16_carry_no_underflow_term():
    # Random normal rows of 64 keys: every probability is far above float16's smallest normal
    # 2^-14, so the term is u_p·Σ p̂|v| (about 2^-11·0.8), not n·2^-14·Σ|v|/n as before.
    num = Numerics.preset("fp16-fp32acc")
    rng = np.random.default_rng(6)
    fmt = get_format("float16")
    q, k, v = (
        np.asarray(mn.round_to(rng.standard_normal((64, 64)), fmt), np.float64) for _ in "qkv"
    )
    bound = attention_bound(q, k, v, numerics=num)
    eta = fmt.smallest_normal
    assert np.max(bound.terms["probability_rounding"]) < eta * np.abs(v).sum(axis=0).min()
    assert np.all(_error(q, k, v, num) <= bound.total)


def test_probabilities_below_the_smallest_normal_are_charged_what_flushing_moves():
    # One key holds the row; the others have probability e^-24 ~ 4e-11, far below float16's
    # 2^-14 (6.1e-5), and large values, so whether the format flushes or keeps subnormals
    # moves the output by up to 63·4e-11·6e4 ~ 1.5e-4. Below the normal range a rounding moves
    # a value by at most min(|x|, η_p) (0 is a candidate): the bound charges that, at least
    # the flush's own effect and at most it plus u_p on the key that holds the row (1% for the
    # float32 softmax's roundings); an absolute η_p per key (63·6.1e-5·6e4 = 230) was the old
    # charge.
    num = Numerics.preset("fp16-fp32acc")
    n, d = 64, 4
    q = np.full((1, d), 4.0)
    k = np.zeros((n, d))
    k[0] = 3.0  # logit 4·3·4/2 = 24 above the others
    v = np.full((n, d), 60000.0)
    v[0] = 1.0
    # (step 6k would take the four weights' terms at once: the classic terms are tested here)
    bound = attention_bound(q, k, v, numerics=num, known_rounding=False)
    p_small = np.exp(-24.0) / (1 + (n - 1) * np.exp(-24.0))
    flushed = (n - 1) * p_small * 60000.0
    term = bound.terms["probability_rounding"]
    assert np.min(term) >= flushed
    assert np.max(term) <= 1.01 * (flushed * (1 + 2.0**-11) + 2.0**-11)
    assert np.all(_error(q, k, v, num) <= bound.total)


@pytest.mark.parametrize("softmax", ["safe", "online(16)"])
def test_an_output_proven_normal_carries_no_underflow_term(softmax):
    # Step 7: the output's rounding into float16 moves a normal value by at most u_o|x|; η_o =
    # 2^-14 (6.1e-5, as large as u_o·0.125) only where the value may lie below the normal range.
    # Outputs about 1: the plain term is u_o|o| (online: and the division's), with no η_o.
    num = Numerics.preset("fp16-fp32acc").replace(softmax=softmax)
    fmt = get_format("float16")
    rng = np.random.default_rng(8)
    q, k = (np.asarray(mn.round_to(rng.standard_normal((8, 16)), fmt), np.float64) for _ in "qk")
    v = np.asarray(mn.round_to(1 + 0.1 * rng.standard_normal((32, 16)), fmt), np.float64)
    k = np.concatenate([k, k, k, k])[:32]
    bound = attention_bound(q, k, v, numerics=num, known_rounding=False)
    o = np.asarray(reference.attention(q, k, v), np.float64)
    plain = np.asarray(bound.parts["output"]["rounding"])
    assert np.all(plain >= fmt.u * np.abs(o))
    assert np.all(plain < fmt.u * np.abs(o) * 1.01 + (2.0**-22 if "online" in softmax else 0.0))
    assert np.all(_error(q, k, v, num) <= bound.total)


@pytest.mark.parametrize("softmax", ["safe", "online(16)"])
@pytest.mark.parametrize("exponent", [-13, -14, -15, -20, -25])
def test_outputs_at_the_edge_of_the_normal_range_are_within_the_bound(softmax, exponent):
    # Values of both signs about 2^e, e from -13 to -25: outputs on both sides of float16's
    # smallest normal 2^-14 and down among its subnormals. Where |o| - ε - E may be below 2^-14
    # the rounding's η_o is charged; everywhere the measured error is within the bound.
    num = Numerics.preset("fp16-fp32acc").replace(softmax=softmax)
    fmt = get_format("float16")
    rng = np.random.default_rng(9 - exponent)
    q = np.asarray(mn.round_to(rng.standard_normal((8, 16)), fmt), np.float64)
    k = np.asarray(mn.round_to(rng.standard_normal((16, 16)), fmt), np.float64)
    v = rng.choice([-1.0, 1.0], (16, 16)) * (1 + rng.random((16, 16))) * 2.0**exponent
    v = np.asarray(mn.round_to(v, fmt), np.float64)
    bound = attention_bound(q, k, v, numerics=num, known_rounding=False)
    o = np.asarray(reference.attention(q, k, v), np.float64)
    plain = np.asarray(bound.parts["output"]["rounding"])
    below = np.abs(o) < fmt.smallest_normal
    assert np.all(plain[below] >= fmt.smallest_normal)
    assert np.all(_error(q, k, v, num) <= bound.total)


@pytest.mark.parametrize("exponent", [0, -13, -20])
def test_split_kv_charges_the_output_underflow_where_it_may_occur(exponent):
    # A.6: the merged value rounded into float16 carries η_o = 2^-14 only where |o| - ε - E may
    # lie below 2^-14: not with outputs about 1, everywhere among the subnormals (2^-20), and
    # the measured error within the bound at each scale.
    num = Numerics.preset("fp16-fp32acc").replace(softmax="online(16)", kv_splits=4)
    fmt = get_format("float16")
    rng = np.random.default_rng(10 - exponent)
    q = np.asarray(mn.round_to(rng.standard_normal((8, 16)), fmt), np.float64)
    k = np.asarray(mn.round_to(rng.standard_normal((64, 16)), fmt), np.float64)
    sign = 1.0 if exponent == 0 else rng.choice([-1.0, 1.0], (64, 16))
    v = np.asarray(mn.round_to(sign * (1 + rng.random((64, 16))) * 2.0**exponent, fmt), np.float64)
    bound = attention_bound(q, k, v, numerics=num)
    o = np.asarray(reference.attention(q, k, v), np.float64)
    term = np.asarray(bound.terms["output"])
    if exponent == 0:  # u_o(|o| + E), and the splits' own float32 roundings (< 2^-20): no η_o
        total = np.asarray(bound.total)
        assert np.all(term <= fmt.u * (np.abs(o) + total) * (1 + 2.0**-20) + 2.0**-20)
    below = np.abs(o) < fmt.smallest_normal
    assert np.all(term[below] >= fmt.smallest_normal)
    assert np.all(_error(q, k, v, num) <= bound.total)
