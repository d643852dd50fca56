"""fp8 descaling (``descale=(d_q, d_k, d_v)``) as FlashAttention-3 applies it.

The reference is the exact attention of the descaled inputs (their float64 products, checked
exact); the emulation, which folds ``d_q·d_k`` into the scale and multiplies the output by
``d_v``, lies within step 7'''s bound on per-tensor quantised inputs and across the exponent
range of the factors; bad factors and inexact products are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import CertificationError, InvalidArgument, Numerics, reference
from mhanum import strategies as mst
from mhanum.bounds import attention_bound

E4M3 = mn.get_format("float8_e4m3fn")
FA3_FP8 = Numerics(
    input="float8_e4m3fn",
    accum="float32",
    score_format="float32",
    softmax_format="float32",
    prob_format="float8_e4m3fn",
    output_format="bfloat16",
    softmax="online(64)",
    exp_form="exp2-folded",
    online_sums="running",
    prob_offset=8,
)


def _quantised(seed: int = 0):
    """Per-tensor fp8 quantisation: ``x/d`` rounded to e4m3 with ``d = amax/448`` in float32."""
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal(s) * 3 for s in ((8, 64), (300, 64), (300, 64))]
    d = tuple(float(np.float32(np.abs(a).max() / 448)) for a in x)
    fp8 = [np.asarray(mn.round_to(a / f, E4M3), np.float64) for a, f in zip(x, d, strict=True)]
    return fp8, d


@pytest.mark.parametrize("softmax", ["online(64)", "safe"])
def test_per_tensor_quantised_attention_is_within_its_bound(softmax):
    (q, k, v), d = _quantised()
    num = (
        FA3_FP8
        if softmax != "safe"
        else FA3_FP8.replace(softmax="safe", online_sums="block", prob_offset=0)
    )
    out = np.asarray(mn.attention(q, k, v, numerics=num, descale=d), np.float64)
    exact = reference.attention(q, k, v, descale=d)
    bound = attention_bound(q, k, v, numerics=num, descale=d)
    assert np.isfinite(bound.total).all()
    assert (np.abs(out - exact) <= bound.total).all()
    assert "descale" in bound.terms


def test_the_reference_is_that_of_the_descaled_inputs():
    (q, k, v), d = _quantised(1)
    np.testing.assert_array_equal(
        reference.attention(q, k, v, descale=d), reference.attention(q * d[0], k * d[1], v * d[2])
    )


def test_inexact_products_and_bad_factors_are_refused_by_name():
    (q, k, v), d = _quantised(2)
    wide = q + 1e-9  # 53 significant bits: q·d_q is not a float64
    with pytest.raises(InvalidArgument, match="descale:"):
        reference.attention(wide, k, v, descale=d)
    for bad in [(1.0, 2.0), (0.0, 1.0, 1.0), (1.0, float("nan"), 1.0), (0.1, 1.0, 1.0), "abc",
                (1e39, 1.0, 1.0)]:  # fmt: skip
        with pytest.raises(InvalidArgument, match="descale:"):
            mn.attention(q, k, v, descale=bad)
        with pytest.raises(InvalidArgument, match="descale:"):
            attention_bound(q, k, v, descale=bad)
    with pytest.raises(InvalidArgument, match="descale:"):
        mn.attention(q, k, v, numerics=Numerics(scale="q"), descale=d)


FACTORS = st.builds(
    lambda m, e: float(np.float32(m * 2.0**e)), st.floats(1.0, 2.0), st.integers(-40, 40)
)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_descaled_attention_at_the_range_edges(data):
    num = data.draw(
        st.sampled_from(
            [
                FA3_FP8,
                FA3_FP8.replace(dot="ieee", prob_format="float32", prob_offset=0),
                Numerics(input="float8_e5m2", accum="float32", output_format="float16"),
                Numerics(input="float8_e4m3fn", accum="float32", softmax="online(4)"),
            ]
        )
    )
    q_len, kv_len, d_k, d_v = data.draw(st.sampled_from([(2, 4, 4, 2), (3, 16, 8, 3)]))
    x = data.draw(
        mst.attention_inputs(
            q_len=q_len, kv_len=kv_len, d_k=d_k, d_v=d_v, structure="range", numerics=num
        )
    )
    assume(x.bias is None or num.exp_form == "exp")
    factors = (data.draw(FACTORS), data.draw(FACTORS), data.draw(FACTORS))
    kw = {"bias": x.bias, "scale": x.scale, "descale": factors}
    try:
        with np.errstate(all="ignore"):
            bound = attention_bound(x.q, x.k, x.v, numerics=num, **kw)
            exact = reference.attention(x.q, x.k, x.v, **kw)
    except (InvalidArgument, CertificationError):
        assume(False)
        raise
    out = np.asarray(mn.attention(x.q, x.k, x.v, numerics=num, **kw), np.float64)
    total = np.asarray(bound.total, np.float64)
    finite = np.isfinite(total)
    assert np.isfinite(out[finite]).all()
    with np.errstate(invalid="ignore"):
        over = finite & (np.abs(out - exact) > total)
    assert not over.any(), (num.describe(), factors, out[over], exact[over], total[over])
    if not finite.all():
        assert bound.reasons
