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
import mhanum.bounds.attention as attention_module
from mhanum import reference
from mhanum.bounds import attention_bound

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
        bound = attention_bound(q, k, v, numerics=num, lam=6.0)
        out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
        err = np.abs(out - np.asarray(reference.attention(q, k, v), np.float64))
        assert np.all(err <= bound.total)
        with monkeypatch.context() as mp:  # step 4's logits term alone
            mp.setattr(attention_module, "_logits_across_keys", lambda *a: np.inf)
            step4 = attention_bound(q, k, v, numerics=num, lam=6.0)
        assert np.all(bound.terms["logits"] <= step4.terms["logits"])
        gains.append(float(np.median(step4.terms["logits"] / bound.terms["logits"])))
    assert min(gains) > 1
    if preset == "fp32" and order != "pairwise":  # where the long dots dominate the logits
        assert min(gains) > 3


def test_the_probability_counts_one_event_per_output_entry():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((5, 8)) for _ in range(3))
    lam, u = 6.0, 2.0**-24
    bound = attention_bound(q, k, v, numerics="fp32", lam=lam)
    chains = 5 * (5 * (8 + 1 + 8) + 8)
    fail = chains * 2 * math.exp(-((lam * (1 - u)) ** 2) / 2)
    assert bound.probability == pytest.approx(1 - fail, rel=1e-12)
