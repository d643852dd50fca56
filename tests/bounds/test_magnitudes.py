"""Step W: the safe softmax's output is bounded whatever the logit errors, ``|ô - o| <= |ô| + |o|``
with ``|ô|`` enclosed from the computed weights' sum alone (papers/attention.md, step W)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import mhanum as mn
from mhanum import CertificationError, MHAParams, reference
from mhanum.bounds import (
    attention_bound,
    attention_bound_a_priori,
    attention_grad_bound,
    mha_bound,
    mha_bound_a_priori,
    schedule_difference,
    shares_logits,
)
from tests._numerics import configured

# presets whose scores are float32 (logits up to 1e4 fit): the logit errors, not the range, limit
WIDE_SCORES = ["bf16", "bf16-fp32acc", "tf32", "fp8-e4m3-fp32acc", "tpu-bf16-1pass"]


def _certified(function, *args):
    """The certified reference, or the draw rejected where it cannot certify its digits (an
    output that cancels to near 0 against terms of e^(logit))."""
    try:
        return function(*args)
    except CertificationError:
        assume(False)
        raise  # unreachable: assume(False) raises


def _near_ties(rng: np.random.Generator, size: float, n: int, d: int) -> tuple[np.ndarray, ...]:
    """One query against ``n`` keys whose logits (about ``size²/√d``) differ by O(1): their
    rounding errors, about ``u·size²``, decide the softmax, and the values differ widely."""
    q = np.zeros((2, d))
    q[:, 0] = size
    k = np.zeros((n, d))
    k[:, 0] = size + rng.uniform(-1, 1, n) / size
    k[:, 1:] = rng.uniform(-1, 1, (n, d - 1))
    v = rng.uniform(-4, 4, (n, 3))
    return q, k, v


@given(
    seed=st.integers(0, 2**32 - 1),
    preset=st.sampled_from(WIDE_SCORES),
    size=st.sampled_from([30.0, 100.0, 300.0]),
)
def test_the_bound_holds_and_stays_finite_whatever_the_logit_errors(seed, preset, size):
    num = configured(preset, softmax="safe")
    q, k, v = (
        np.asarray(mn.round_to(x, num.input), np.float64)
        for x in _near_ties(np.random.default_rng(seed), size, 12, 8)
    )
    bound = attention_bound(q, k, v, numerics=num)
    # no refusal: the range fits every format, and step W bounds the rows step 5 cannot
    assert np.isfinite(bound.total).all(), bound.reasons
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    err = np.abs(out - _certified(reference.attention, q, k, v))
    assert np.all(err <= bound.total)
    # A.4 on the same norms is finite too, and at least A.1
    prior = attention_bound_a_priori(
        2,
        12,
        8,
        3,
        q_norm=float(np.linalg.norm(q, axis=-1).max()),
        k_norm=float(np.linalg.norm(k, axis=-1).max()),
        v_max=float(np.abs(v).max()),
        numerics=num,
    )
    assert np.isfinite(prior.total).all(), prior.reasons
    assert np.all(bound.total <= prior.total)


def test_rows_step_5_cannot_bound_are_bounded_by_the_magnitudes():
    # bfloat16 softmax: the exponent's argument |ŝ_j - m| up to 2·300² / √8 is rounded with
    # u = 2^-8, so the computed row sum's error factor T exceeds 1 (step 5 is vacuous); the
    # computed weights still sum to at most (1 + ε_÷)/(1 - T_0)
    num = configured("bf16", softmax="safe")
    q, k, v = (
        np.asarray(mn.round_to(x, num.input), np.float64)
        for x in _near_ties(np.random.default_rng(5), 300.0, 12, 8)
    )
    bound = attention_bound(q, k, v, numerics=num)
    assert not bound.reasons
    assert set(np.flatnonzero(bound.terms["magnitudes"])) == set(range(bound.total.size))
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    o = reference.attention(q, k, v)
    assert np.all(np.abs(out - o) <= bound.total)
    # the bound is |ô|'s enclosure plus |o|'s: at least the two magnitudes it stands for
    assert np.all(bound.total >= np.abs(out) + np.abs(o))


@pytest.mark.parametrize("preset", ["bf16-fp32acc", "tf32"])
def test_mha_a_priori_is_finite_where_the_logit_errors_swamp_the_softmax(preset):
    # x_max = 40 on a 16-wide layer: the logits may reach ~10^4, their errors e^(2Δ) overflow
    # float64; step W leaves every head's output within |ô| + |o|
    num = configured(preset, softmax="safe")
    params = MHAParams.random(16, seed=3)
    prior = mha_bound_a_priori(params, 2, 6, 9, x_max=40.0, numerics=num)
    assert np.isfinite(prior.total).all(), prior.reasons
    assert "attention.magnitudes" in prior.terms
    rng = np.random.default_rng(7)
    # admissible inputs: uniform, and every entry at ±x_max (the logits' largest reach)
    for x in (rng.uniform(-40, 40, (6, 16)), 40.0 * np.sign(rng.standard_normal((6, 16)))):
        x_kv = np.concatenate([x, x[:3]])
        post = mha_bound(x, x_kv, params, 2, numerics=num)
        assert np.all(post.total <= prior.total)
        out = np.asarray(mn.multi_head_attention(x, x_kv, params, 2, numerics=num), np.float64)
        err = np.abs(out - reference.multi_head_attention(x, x_kv, params, 2))
        assert np.all(err <= post.total)


@pytest.mark.parametrize("size", [30.0, 300.0])
def test_two_schedules_sharing_their_logits_differ_within_a5_prime(size):
    # A.5' takes each side around the exact attention of the computed logits: an entry that
    # takes step W pays the values' largest magnitude for that attention
    a = configured("bf16", summation="sequential", softmax="safe")
    b = a.replace(prob_format="float16", output_format="float32")
    assert shares_logits(a, b)
    q, k, v = (
        np.asarray(mn.round_to(x, a.input), np.float64)
        for x in _near_ties(np.random.default_rng(11), size, 12, 8)
    )
    diff = schedule_difference(q, k, v, numerics_a=a, numerics_b=b)
    assert diff.theorem == "A.5'"
    assert np.isfinite(diff.total).all(), diff.reasons
    out_a, out_b = (np.asarray(mn.attention(q, k, v, numerics=n), np.float64) for n in (a, b))
    assert np.all(np.abs(out_a - out_b) <= diff.total)


@given(
    seed=st.integers(0, 2**32 - 1),
    preset=st.sampled_from(["bf16", "bf16-fp32acc", "tf32"]),
    size=st.sampled_from([30.0, 300.0]),
)
def test_textbook_gradients_stay_finite_whatever_the_logit_errors(seed, preset, size):
    # B.1 step 3W: the stored P̂ of a safe softmax is at most P̂max per entry and W per row, so
    # the gradients' bounds stay finite (they overflowed float64, or D's range failed, before)
    num = configured(preset, softmax="safe")
    rng = np.random.default_rng(seed)
    q, k, v = (
        np.asarray(mn.round_to(x, num.input), np.float64) for x in _near_ties(rng, size, 12, 8)
    )
    d_out = np.asarray(mn.round_to(rng.standard_normal((2, 3)), num.input), np.float64)
    bounds = attention_grad_bound(q, k, v, d_out, numerics=num, backward="textbook")
    got = mn.attention_grad(q, k, v, d_out, numerics=num, backward="textbook")
    exact = _certified(reference.attention_grad, q, k, v, d_out)
    for name in ("dq", "dk", "dv"):
        b = getattr(bounds, name)
        assert np.isfinite(b.total).all(), (name, b.reasons)
        err = np.abs(np.asarray(getattr(got, name), np.float64) - np.asarray(getattr(exact, name)))
        assert np.all(err <= b.total), name
    # dV = Pᵀ d_out: |P̂ - P| <= max(P̂max, P̄) with P̂max = (1 + ε_÷)(1 + ε_e)/(1 - T_0)·(1 + u_p)
    # <= 1 + 21u for 12 keys in bfloat16 (ε_÷, ε_e <= 4u, T_0 <= 12u, u_p <= u), and the
    # 2-term accumulation adds 2u: the bound is below (1 + 32u) Σ_i |d_out_i|, u = 2^-8
    assert np.all(bounds.dv.total <= (1 + 32 * 2.0**-8) * np.abs(d_out).sum(axis=0))
