"""Theorem A.5 (bounds.schedule_difference) and the search for two schedules' largest difference.

The bound is the sum of both schedules' A.1 bounds; the measured difference of real emulated
outputs lies within it for pairs that differ in block size, summation order, softmax algorithm
and accumulation format; the difference search finds a larger difference than random inputs
and never exceeds the bound; a difference case saves and replays bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, search
from mhanum import strategies as mst
from mhanum.bounds import attention_bound, schedule_difference, shares_logits
from mhanum.cases import replay, save

PAIRS = [
    ("fp32", mn.Numerics(softmax="online(16)")),
    (mn.Numerics(summation="sequential"), mn.Numerics(summation="pairwise", softmax="online(8)")),
    ("bf16-fp32acc", mn.Numerics.preset("bf16-fp32acc").replace(softmax="online(32)")),
    ("tf32", "fp32"),
]


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_the_difference_of_two_schedules_is_within_a5(a, b):
    rng = np.random.default_rng(0)
    fmt = mn.Numerics.preset("bf16-fp32acc").format_of("input")  # values every schedule holds
    q, k, v = (
        np.asarray(mn.round_to(rng.standard_normal((3, 64, 32)), fmt), np.float64) for _ in range(3)
    )
    bound = schedule_difference(q, k, v, mn.masks.causal(), numerics_a=a, numerics_b=b)
    out_a = np.asarray(mn.attention(q, k, v, mn.masks.causal(), numerics=a), np.float64)
    out_b = np.asarray(mn.attention(q, k, v, mn.masks.causal(), numerics=b), np.float64)
    assert np.all(np.abs(out_a - out_b) <= bound.total)
    parts = [attention_bound(q, k, v, mn.masks.causal(), numerics=n).total for n in (a, b)]
    np.testing.assert_array_equal(bound.total, parts[0] + parts[1])
    assert bound.theorem == "A.5"
    assert {t.split(".")[0] for t in bound.terms} == {"a", "b"}


def test_a_stated_probability_covers_both_sides():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((32, 16)) for _ in range(3))
    bound = schedule_difference(q, k, v, numerics_a="fp32", numerics_b="tf32", probability=0.99)
    assert bound.probability >= 0.99
    det = schedule_difference(q, k, v, numerics_a="fp32", numerics_b="tf32")
    assert np.all(bound.total <= det.total)


def test_the_difference_search_beats_random_inputs_and_respects_a5(tmp_path):
    import jax

    jax.config.update("jax_enable_x64", True)
    shape = search.Shape(q_len=2, kv_len=16, d_k=4, d_v=2)
    a, b = mn.Numerics(summation="sequential"), mn.Numerics(summation="pairwise")
    case = search.worst_case(a, shape, objective="difference", against=b, budget=40, seed=2)
    base = search.random_search(a, shape, objective="difference", against=b, budget=40, seed=2)
    assert case.normwise >= base.normwise
    assert case.ratio <= 1
    assert case.against == b
    path = save(case, tmp_path / "diff")
    again = replay(path)
    assert again.bit_for_bit
    assert again.error == case.error


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [({"objective": "difference"}, "against:"), ({"against": "fp32"}, "against:")],
)
def test_a_difference_objective_needs_its_second_schedule(kwargs, names):
    with pytest.raises(InvalidArgument, match=names):
        search.Objective(mn.Numerics(), **kwargs)


SHARED = [
    (
        mn.Numerics(summation="sequential", softmax="online(16)"),
        mn.Numerics(summation="sequential", softmax="online(64)"),
    ),
    (
        mn.Numerics.preset("bf16-fp32acc").replace(summation="pairwise", softmax="safe"),
        mn.Numerics.preset("bf16-fp32acc").replace(summation="pairwise", softmax="online(8)"),
    ),
    (
        mn.Numerics(input="float16", accum="float32", summation="blocked(8)", softmax="naive"),
        mn.Numerics(input="float16", accum="float32", summation="blocked(8)", prob_format="bf16"),
    ),
]


@pytest.mark.parametrize(("a", "b"), SHARED)
def test_schedules_that_share_their_logits_differ_within_a5_prime(a, b):
    rng = np.random.default_rng(1)
    fmt = a.format_of("input")
    q, k, v = (
        np.asarray(mn.round_to(rng.standard_normal((2, 64, 32)) * 2, fmt), np.float64)
        for _ in range(3)
    )
    mask = mn.masks.causal()
    sharp = schedule_difference(q, k, v, mask, numerics_a=a, numerics_b=b)
    out_a = np.asarray(mn.attention(q, k, v, mask, numerics=a), np.float64)
    out_b = np.asarray(mn.attention(q, k, v, mask, numerics=b), np.float64)
    assert sharp.theorem == "A.5'"
    assert np.all(np.abs(out_a - out_b) <= sharp.total)
    # the logits' error cancels: at least a third of A.5 on the classic steps goes in float32
    # accumulation; and A.5 on the known roundings (steps 3k, 6k, 6r) is taken where smaller
    plain = [attention_bound(q, k, v, mask, numerics=n, known_rounding=False).total for n in (a, b)]
    assert np.median(sharp.total / (plain[0] + plain[1])) < 2 / 3
    known = [attention_bound(q, k, v, mask, numerics=n).total for n in (a, b)]
    assert np.all(sharp.total <= known[0] + known[1])


def test_schedules_that_do_not_share_their_logits_keep_a5():
    pairs = [
        (mn.Numerics(softmax="online(16)"), mn.Numerics(softmax="online(64)")),  # native order
        (mn.Numerics(summation="sequential"), mn.Numerics(summation="pairwise")),
        (
            mn.Numerics(summation="sequential"),
            mn.Numerics(summation="sequential", kv_splits=2),
        ),
        (mn.Numerics(summation="sequential"), mn.Numerics(summation="sequential", scale="q")),
    ]
    for a, b in pairs:
        assert not shares_logits(a, b), (a, b)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_a5_prime_holds_at_the_range_edges(data):
    a = data.draw(mst.numerics(presets=False, free=False, custom=True, bounded=True))
    assume(a.exp_form == "exp" and a.summation_kind != "native")
    change = {
        "softmax": data.draw(st.sampled_from(["naive", "safe", "online(1)", "online(3)"])),
        "prob_format": data.draw(st.sampled_from([None, "float32", "bfloat16", "float16"])),
        "output_format": data.draw(st.sampled_from([None, "float32", "bfloat16"])),
        "online_sums": "block",
    }
    try:
        b = a.replace(**change)
    except InvalidArgument:
        assume(False)
    assert shares_logits(a, b)
    q_len, kv_len, d_k, d_v = data.draw(st.sampled_from([(2, 4, 4, 2), (3, 16, 8, 3)]))
    x = data.draw(
        mst.attention_inputs(
            q_len=q_len, kv_len=kv_len, d_k=d_k, d_v=d_v, structure="range", numerics=a
        )
    )
    try:
        with np.errstate(all="ignore"):
            bound = schedule_difference(
                x.q, x.k, x.v, bias=x.bias, scale=x.scale, numerics_a=a, numerics_b=b
            )
    except InvalidArgument:
        assume(False)
        raise
    assert bound.theorem == "A.5'"
    outs = [
        np.asarray(mn.attention(x.q, x.k, x.v, bias=x.bias, scale=x.scale, numerics=n), np.float64)
        for n in (a, b)
    ]
    total = np.asarray(bound.total, np.float64)
    finite = np.isfinite(total)
    for out in outs:
        assert np.isfinite(out[finite]).all()
    with np.errstate(invalid="ignore"):
        diff = np.abs(outs[0] - outs[1])  # inf - inf where the bound is infinite too
    over = finite & (diff > total)
    assert not over.any(), (a.describe(), b.describe(), diff[over], total[over])
