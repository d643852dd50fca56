"""FlashAttention-3's ``Max_offset``: online exponentials lifted into ``[0, 2^k]`` (``prob_offset``).

With e4m3 probabilities the lift keeps small weights out of the format's subnormal range: the
bound's underflow charges shrink by ``2^-k`` and the bound tightens, while the emulation stays
within it; a lift past the format's largest value (``2^9 > 448``) overflows the kernel to NaN,
and the bound is infinite there with the reason; the offset is refused where it is not modelled.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, Numerics, reference
from mhanum.bounds import attention_bound
from mhanum.bounds.softmax import softmax_bound

FA3_FP8 = Numerics(
    input="float16",
    accum="float32",
    score_format="float32",
    softmax_format="float32",
    prob_format="float8_e4m3fn",
    output_format="float32",
    softmax="online(64)",
    exp_form="exp2-folded",
    online_sums="running",
)


def _inputs():
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((8, 64)),
        rng.standard_normal((300, 64)),
        rng.standard_normal((300, 64)),
    )


def test_the_lift_keeps_e4m3_weights_normal_and_tightens_the_bound():
    q, k, v = _inputs()
    exact = reference.attention(q, k, v)
    plain = attention_bound(q, k, v, numerics=FA3_FP8)
    lifted_num = FA3_FP8.replace(prob_offset=8)
    lifted = attention_bound(q, k, v, numerics=lifted_num)
    out = np.asarray(mn.attention(q, k, v, numerics=lifted_num), np.float64)
    assert (np.abs(out - exact) <= lifted.total).all()
    # the subnormal weights' charge (η_p = 2^-6 against the row sum, on each key that may lie
    # below e4m3's normal range; the lifted keys keep it on every key) falls by 2^8: the largest
    # probability term by 1.89 and the largest bound by 1.78 (measured; 1.5 asserted)
    term = "probability_rounding"
    assert np.max(plain.terms[term]) > 1.5 * np.max(lifted.terms[term])
    assert np.max(plain.total) > 1.5 * np.max(lifted.total)


def test_a_lift_past_the_largest_e4m3_value_is_infinite_with_its_reason():
    q, k, v = _inputs()
    num = FA3_FP8.replace(prob_offset=9)  # 2^9 = 512 > 448
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    bound = attention_bound(q, k, v, numerics=num)
    assert np.isnan(out).any()
    assert np.isinf(bound.total).all()
    assert any("prob_offset" in reason for reason in bound.reasons)


@pytest.mark.parametrize(
    "change",
    [
        {"prob_offset": -1},
        {"prob_offset": 2.0},
        {"prob_offset": 8, "exp_form": "exp"},
        {"prob_offset": 8, "softmax": "safe", "online_sums": "block"},
    ],
)
def test_the_offset_is_refused_where_it_is_not_modelled(change):
    with pytest.raises(InvalidArgument, match=r"numerics\.prob_offset"):
        FA3_FP8.replace(**change)


@pytest.mark.parametrize("centre", [3e4, 1e6])
@pytest.mark.parametrize("offset", [1, 8, 20])
def test_the_softmax_alone_charges_the_lift(centre, offset):
    # the shift fl(fl(m·c2) - k) is one more rounding, of up to half an ulp of m·c2 (0.06 near
    # 1e6 in float32): every exponent may be off by that much more
    rng = np.random.default_rng(7)
    x = np.asarray(mn.round_to(centre + rng.uniform(0, 4, (6, 16)), "float32"), np.float64)
    num = Numerics(softmax="online(4)", exp_form="exp2-folded", prob_offset=offset)
    got = np.asarray(mn.softmax(x, numerics=num), np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    bound = softmax_bound(x, num)
    err = np.abs(got - e / e.sum(axis=-1, keepdims=True))
    assert np.all(err <= bound.total)
    assert np.max(err / bound.total) > 0.01  # and not vacuous


def test_a_lift_past_the_softmax_format_is_infinite_with_its_reason():
    # 2^20 overflows a float16 softmax format (largest finite 65504): the kernel's row is NaN
    x = np.array([[0.0, 1.0, 2.0, 3.0]])
    num = Numerics(input="float16", accum="float32", softmax="online(2)",
                   softmax_format="float16", exp_form="exp2-folded", prob_offset=20)  # fmt: skip
    assert np.isnan(np.asarray(mn.softmax(x, numerics=num))).any()
    bound = softmax_bound(x, num)
    assert np.isinf(bound.total).all()
    assert any("prob_offset" in reason for reason in bound.reasons)
    assert np.isfinite(softmax_bound(x, num.replace(prob_offset=8)).total).all()
