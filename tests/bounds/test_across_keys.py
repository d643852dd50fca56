"""Theorem A.3': the QKᵀ dots' roundings summed across keys as one martingale.

The logits term of the probabilistic bound is the smaller of step 4's (a sum of absolute values
over the keys) and A.3''s (a root-sum-square over the keys, by Azuma-Hoeffding). On random
inputs it is several times smaller, and every measured error still lies within the bound, whose
stated probability counts the new events.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mhanum as mn
import mhanum.bounds.forward.across_keys as across_keys_module
import mhanum.bounds.forward.softmax_pv as softmax_pv_module
from mhanum import reference
from mhanum.bounds import attention_bound
from mhanum.bounds.factors import gamma
from mhanum.bounds.forward.one_martingale import Increments
from mhanum.bounds.union import ENTRIES_SHARE, lam_or_probability, lam_split, split_failure

INF = np.array(np.inf)

CASES = [
    ("fp32", "native"),
    ("fp32", "sequential"),
    ("bf16-fp32acc", "native"),
    ("fp16-fp32acc", "pairwise"),
    ("tf32", "native"),
    ("fp16", "native"),
]


@pytest.mark.parametrize(("preset", "order"), CASES)
def test_across_keys_is_tighter_and_holds_on_random_inputs(preset, order, monkeypatch):
    num = mn.Numerics.preset(preset).replace(summation=order)
    rng = np.random.default_rng(len(preset) + len(order))
    gains = []
    for _ in range(4):
        q, k, v = (
            np.asarray(mn.round_to(rng.standard_normal((64, 64)), num.input), np.float64)
            for _ in range(3)
        )
        # (the classic steps 4-6: step 6k would take the logits term into another)
        bound = attention_bound(q, k, v, numerics=num, lam=6.0, known_rounding=False)
        out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
        err = np.abs(out - np.asarray(reference.attention(q, k, v), np.float64))
        assert np.all(err <= bound.total)
        with monkeypatch.context() as mp:  # A.3' without A.3e, then step 4's logits term alone
            mp.setattr(softmax_pv_module, "one_martingale_step", lambda *a: None)
            bound = attention_bound(q, k, v, numerics=num, lam=6.0, known_rounding=False)
            mp.setattr(softmax_pv_module, "logits_increments", lambda *a: Increments(INF, INF))
            step4 = attention_bound(q, k, v, numerics=num, lam=6.0, known_rounding=False)
        assert np.all(bound.terms["logits"] <= step4.terms["logits"])
        gains.append(float(np.median(step4.terms["logits"] / bound.terms["logits"])))
    assert min(gains) > 1
    if preset == "fp32" and order != "pairwise":  # where the long dots dominate the logits
        assert min(gains) > 3


def test_the_probability_counts_three_events_per_output_entry():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((5, 8)) for _ in range(3))
    lam, u = 6.0, 2.0**-24
    bound = attention_bound(q, k, v, numerics="fp32", lam=lam)
    chains = 5 * (5 * (8 + 1 + 8) + 3 * 8)  # A.3', A.3'' and A.3e: three per output entry
    fail = chains * 2 * math.exp(-((lam * (1 - u)) ** 2) / 2)
    assert bound.probability == pytest.approx(1 - fail, rel=1e-12)


@pytest.mark.parametrize("probability", [0.5, 0.9, 0.99, 0.999, 1 - 1e-9])
def test_a_requested_probability_is_stated_and_its_lams_are_the_union_bounds(probability):
    # probability= solves the union bound over two classes: the chains on 0.9 of the failure
    # probability (a λ smaller by 1e-9, relative, would not reach it) and the three
    # martingale events per output entry on the rest, each with its own λ; the stated
    # probability reaches the request, and the chains' λ for every event (the entries' is
    # below it) gives a bound never below it, stating more.
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 32, 8)) for _ in range(3))
    num = mn.Numerics.preset("bf16-fp32acc")
    bound = attention_bound(q, k, v, numerics=num, probability=probability)
    assert bound.probability >= probability
    assert bound.lam is not None
    chains, entries = 2 * 32 * 32 * (8 + 1 + 8), 2 * 32 * 3 * 8
    lam_c, lam_e = lam_split(probability, chains, entries, num)
    assert bound.lam == lam_c
    assert lam_e < lam_c
    assert bound.probability == 1 - split_failure((lam_c, lam_e), (chains, entries), num)
    u = 2.0**-24
    below = lam_c * (1 - 1e-9)
    chains_share = 1 - (1 - probability) * (1 - ENTRIES_SHARE)
    assert 1 - chains * 2 * math.exp(-((below * (1 - u)) ** 2) / 2) < chains_share
    one = attention_bound(q, k, v, numerics=num, lam=lam_c)
    assert one.probability > bound.probability
    assert np.all(one.total >= bound.total)


def test_a_small_problem_keeps_one_lam_for_every_event():
    # 5 keys of width 8: the entries' 3·8 events per row against 5·17 chains, so a tenth of
    # the failure probability would give the entries a λ above the common one; the union
    # bound then takes one λ over all 5(5·17 + 3·8) events per batch element.
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 5, 8)) for _ in range(3))
    num = mn.Numerics.preset("bf16-fp32acc")
    bound = attention_bound(q, k, v, numerics=num, probability=0.99)
    events = 2 * 5 * (5 * (8 + 1 + 8) + 3 * 8)
    assert bound.lam == lam_or_probability(None, 0.99, events, num)
    assert lam_split(0.99, 2 * 5 * 5 * 17, 2 * 5 * 24, num)[1] > bound.lam
    same = attention_bound(q, k, v, numerics=num, lam=bound.lam)
    assert same.probability == bound.probability
    np.testing.assert_array_equal(same.total, bound.total)


def test_mha_states_a_requested_probability():
    rng = np.random.default_rng(3)
    params = mn.MHAParams.random(16, seed=3)
    x = rng.standard_normal((6, 16))
    bound = mn.bounds.mha_bound(x, x, params, 2, numerics="fp32", probability=0.99)
    assert bound.probability >= 0.99
    assert bound.lam is not None
    assert f"λ = {bound.lam:.4g}" in str(bound)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"probability": 1.0}, "probability:"),
        ({"probability": 0.0}, "probability:"),
        ({"probability": True}, "probability:"),
        ({"probability": 0.9, "lam": 6.0}, "lam, probability:"),
        ({"lam": -1.0}, "lam:"),
    ],
)
def test_bad_probability_or_lam_is_refused_by_name(kwargs, names):
    z = np.ones((3, 4))
    with pytest.raises(mn.InvalidArgument, match=names):
        attention_bound(z, z, z, **kwargs)


def test_the_probabilities_roundings_as_a_martingale_on_long_rows():
    # Theorem A.3'': at L = 512 in bfloat16 the roundings of the ~190 effective keys' p̂_j
    # average out: the probability rounding term falls below u_p·Σ_j p_j|v_j| (the
    # deterministic charge is at least that), and the measured error stays within the bound.
    num = mn.Numerics.preset("bf16-fp32acc")
    fmt = mn.formats.get_format("bfloat16")
    rng = np.random.default_rng(7)
    n, d = 512, 16
    for _ in range(3):
        q, k, v = (
            np.asarray(mn.round_to(rng.standard_normal((n, d)), fmt), np.float64) for _ in "qkv"
        )
        bound = attention_bound(q, k, v, numerics=num, probability=0.99)
        s = q @ k.T / 4.0
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        deterministic = fmt.u * (p @ np.abs(v))
        assert np.median(bound.terms["probability_rounding"] / deterministic) < 0.75
        out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
        err = np.abs(out - np.asarray(reference.attention(q, k, v), np.float64))
        assert np.all(err <= bound.total)


def _roundings(products: np.ndarray, order: str) -> list[float]:
    """The value ``T`` before each rounding ``fl(T)`` of a float32 dot of these products, summed
    in ``order`` (float64 holds every product and sum of two float32 numbers exactly)."""
    values = [float(np.float32(x)) for x in products]
    seen = [float(x) for x in products]  # each product rounded once
    while len(values) > 1:
        if order == "sequential":
            exact = values[0] + values[1]
            seen.append(exact)
            values = [float(np.float32(exact)), *values[2:]]
        else:  # pairwise
            pairs = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
            seen += pairs
            rest = values[-1:] if len(values) % 2 else []
            values = [float(np.float32(x)) for x in pairs] + rest
    return seen


@pytest.mark.parametrize("arrangement", ["random", "positives first", "all positive"])
@pytest.mark.parametrize("order", ["sequential", "pairwise"])
def test_a_dots_roundings_lie_within_the_increments_in_any_order(arrangement, order):
    # A.3''s increments: Σ_k T_k² over a dot's roundings is at most (Σ|q_t k_t|² + (d - 1)·
    # ((1 + g)·min(A, (A + |q·k|)/2 + g·A))²)^½ squared, whatever the order of the sums; the
    # arrangement that puts every positive product first makes the partial sums largest
    d = 64
    rng = np.random.default_rng(sorted(["random", "positives first", "all positive"]).index(
        arrangement) + 10 * len(order))  # fmt: skip
    q = rng.standard_normal((3, d)).astype(np.float32).astype(np.float64)
    k = rng.standard_normal((5, d)).astype(np.float32).astype(np.float64)
    if arrangement == "all positive":
        q, k = np.abs(q), np.abs(k)
    g = gamma(d, 2.0**-24)
    t, qk = q @ k.T, np.abs(q) @ np.abs(k).T
    b = across_keys_module.dot_increments(np.abs(q), np.abs(k), t, np.zeros_like(t), qk, g, 1)
    crude = (1 + g) * math.sqrt(2 * d - 1) * qk
    assert np.all(b <= crude)
    for i in range(3):
        for j in range(5):
            products = q[i] * k[j]
            if arrangement == "positives first":
                products = np.concatenate([products[products > 0], products[products <= 0]])
            seen = np.asarray(_roundings(products, order))
            assert math.sqrt(float(np.sum(seen**2))) <= b[i, j]
    if arrangement == "random":  # the products' signs cancel: about half the crude increments
        assert np.median(b / crude) < 0.6
