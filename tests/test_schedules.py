"""Theorem A.5 (bounds.schedule_difference) and the search for two schedules' largest difference.

The bound is the sum of both schedules' A.1 bounds; the measured difference of real emulated
outputs lies within it for pairs that differ in block size, summation order, softmax algorithm
and accumulation format; the difference search finds a larger difference than random inputs
and never exceeds the bound; a difference case saves and replays bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, search
from mhanum.bounds import attention_bound, schedule_difference
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
