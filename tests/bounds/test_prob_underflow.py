"""``Numerics.prob_underflow="gradual"`` (papers/attention.md, step 6): a weight rounded below
the probability format's smallest normal number ``η_p`` errs by at most ``u_p·η_p``, half the
subnormal spacing, where a flush would err by up to ``η_p``. The emulation rounds with gradual
underflow, so it is a kernel the gradual bound must hold for, on rows whose weights fall deep
into the subnormal range and below it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import Numerics, reference
from mhanum.bounds import attention_bound
from mhanum.formats import get_format, round_to


def _numerics(prob: str, softmax: str) -> Numerics:
    return Numerics(
        input="float16", accum="float32", score_format="float32", softmax_format="float32",
        prob_format=prob, output_format="float16", softmax=softmax, prob_underflow="gradual",
    )  # fmt: skip


def _error(q, k, v, num, mask=None):
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    return np.abs(out - np.asarray(reference.attention(q, k, v, mask=mask), np.float64))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    prob=st.sampled_from(["float16", "float8_e4m3fn", "float8_e5m2"]),
    softmax=st.sampled_from(["safe", "online(16)", "online(256)"]),
    n=st.sampled_from([5, 97, 300]),
    spread=st.sampled_from([0.0, 2.0, 3.0, 4.5]),
    causal=st.booleans(),
    known=st.booleans(),
    probability=st.sampled_from([None, 0.99]),
)
def test_the_gradual_bound_holds_where_weights_are_subnormal(
    seed, prob, softmax, n, spread, causal, known, probability
):
    """Logits spread by queries scaled up to ``2^4.5``: weights from normal through the
    subnormal range of the probability format to below its least subnormal (rounded to 0),
    with the known roundings of step 6k or the classic step 6, deterministic and with
    ``probability``: the emulation within the bound."""
    rng = np.random.default_rng(seed)
    q = round_to(rng.standard_normal((n, 16)) * 2.0**spread, "float16")
    k, v = (round_to(rng.standard_normal((n, 16)), "float16") for _ in range(2))
    mask = np.tril(np.ones((n, n), bool)) if causal else None
    num = _numerics(prob, softmax)
    bound = attention_bound(
        q, k, v, mask, numerics=num, known_rounding=known, probability=probability
    )
    assert np.all(_error(q, k, v, num, mask) <= bound.total)


def test_the_gradual_charge_is_half_the_subnormal_spacing():
    """A row whose only other key weighs ``e^-14`` (float16 subnormal, ``8.3e-7``): the classic
    probability term charges it ``min(p, η_p)`` when the rounding may flush, ``u_p·η_p`` when it
    underflows gradually, beside the same ``u_p·p̂`` of the normal key: the two terms differ by
    ``(p - u_p·η_p)·|v|``, to the evaluation's rounding."""
    q = np.array([[1.0, 0.0]])
    k = np.array([[0.0, 0.0], [-14.0, 0.0]])
    v = np.array([[0.0], [1.0]])
    flush = _numerics("float16", "safe").replace(prob_underflow="flush")
    terms = {
        num.prob_underflow: attention_bound(
            q, k, v, numerics=num, scale=1.0, known_rounding=False
        ).terms["probability_rounding"][0, 0]
        for num in (flush, flush.replace(prob_underflow="gradual"))
    }
    f16 = get_format("float16")
    p = np.exp(-14.0) / (1 + np.exp(-14.0))
    charge = terms["flush"] - terms["gradual"]
    assert abs(charge - (p - f16.u * f16.smallest_normal)) <= 1e-3 * p
