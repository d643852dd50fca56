"""Logit soft-capping: the scaled scores become ``c·tanh(s/c)`` before the bias and the mask.

Every reference backend is checked against the closed form evaluated in mpmath and rounded to
nearest; multi-head attention against its heads; the emulation lies within step 3c's bound
across presets, caps, biases, masks and sinks; far beyond the cap, the incoming logit errors
are squashed by ``tanh``'s slope; bad caps are refused by name.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

import mhanum as mn
from mhanum import CertificationError, InvalidArgument, Numerics, reference
from mhanum.bounds import attention_bound, mha_bound, schedule_difference


def _inputs(seed: int, q_len: int = 3, kv_len: int = 7, d: int = 4, spread: float = 3.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((q_len, d)) * spread
    k = rng.standard_normal((kv_len, d)) * spread
    v = rng.standard_normal((kv_len, 3))
    bias = rng.standard_normal((q_len, kv_len))
    return q, k, v, bias


def _closed_form(q, k, v, bias, cap):
    """``softmax(c·tanh(q·k/(c·sqrt(d))) + b) v`` at 60 digits, rounded to nearest."""
    out = np.empty((q.shape[0], v.shape[1]))
    with mpmath.workdps(60):
        scale = 1 / mpmath.sqrt(q.shape[1])
        c = mpmath.mpf(cap)
        for i in range(q.shape[0]):
            dots = [
                mpmath.fsum(mpmath.mpf(a) * b for a, b in zip(q[i], kj, strict=True)) for kj in k
            ]
            logits = [
                c * mpmath.tanh(scale * t / c) + mpmath.mpf(bias[i, j]) for j, t in enumerate(dots)
            ]
            top = max(logits)
            weights = [mpmath.exp(x - top) for x in logits]
            total = mpmath.fsum(weights)
            for col in range(v.shape[1]):
                value = mpmath.fsum(w * v[j, col] for j, w in enumerate(weights)) / total
                out[i, col] = float(value)
    return out


@pytest.mark.parametrize("backend", ["auto", "exact", "mpmath", "arb"])
@pytest.mark.parametrize("cap", [50.0, 2.0, 0.125])
def test_the_reference_is_the_closed_form_rounded_to_nearest(cap, backend):
    q, k, v, bias = _inputs(0)
    got = reference.attention(q, k, v, bias=bias, softcap=cap, backend=backend)
    np.testing.assert_array_equal(got, _closed_form(q, k, v, bias, cap))


def test_the_multi_head_reference_is_its_heads_soft_capped():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 8)) * 2
    params = mn.MHAParams.random(8, seed=1)
    got = reference.multi_head_attention(x, x, params, 2, softcap=1.5)
    q, k, v = (x @ w + b for w, b in ((params.wq, params.bq), (params.wk, params.bk),
                                       (params.wv, params.bv)))  # fmt: skip
    cols = [slice(h * 4, (h + 1) * 4) for h in range(2)]
    heads = [reference.attention(q[:, c], k[:, c], v[:, c], softcap=1.5) for c in cols]
    # the per-head outputs went through float64 projections, so compare to a few ulps
    np.testing.assert_allclose(got, np.concatenate(heads, axis=-1) @ params.wo + params.bo,
                               rtol=1e-12, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("cap", [50.0, 5.0, 1.0, 0.25])
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16", "bf16", "tf32"])
def test_the_emulation_is_within_step_3c(preset, cap):
    q, k, v, bias = _inputs(2, q_len=4, kv_len=24, d=16)
    mask = np.tril(np.ones((4, 24), bool), k=20)
    num = Numerics.preset(preset)
    out = np.asarray(mn.attention(q, k, v, mask, bias=bias, numerics=num, softcap=cap))
    bound = attention_bound(q, k, v, mask, bias=bias, numerics=num, softcap=cap)
    exact = reference.attention(q, k, v, mask=mask, bias=bias, softcap=cap)
    assert np.isfinite(bound.total).all()
    assert (np.abs(out.astype(np.float64) - exact) <= bound.total).all()
    assert "softcap" in bound.parts["logits"]


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc"])
def test_the_layer_is_within_a2_with_caps_and_sinks(preset):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 16)) * 4
    params = mn.MHAParams.random(16, seed=3)
    sink = np.array([0.5, -1.0, 2.0, 0.0])
    kw = {"softcap": 2.0, "sink": sink}
    out = mn.multi_head_attention(x, x, params, 4, numerics=preset, **kw)
    bound = mha_bound(x, x, params, 4, numerics=preset, **kw)
    exact = reference.multi_head_attention(x, x, params, 4, **kw)
    assert (np.abs(np.asarray(out, np.float64) - exact) <= bound.total).all()


def test_far_beyond_the_cap_the_logit_errors_are_squashed():
    # scores of several hundred against a cap of 1: tanh's slope there is below e^-400, so
    # the QKᵀ and scale roundings no longer reach the probabilities; what is left is the
    # rounding of tanh and of the product by the cap
    rng = np.random.default_rng(4)
    q = 8.0 * np.outer([1.0, -1.0, 0.5], np.ones(16))
    k = 8.0 * np.outer(rng.choice([-1.0, 1.0], 16) * (1 + rng.uniform(0, 1, 16)), np.ones(16))
    v = rng.standard_normal((16, 3))  # every |score| >= 64·16·0.5/4 = 128
    num = Numerics.preset("bf16-fp32acc")
    capped = attention_bound(q, k, v, numerics=num, softcap=1.0, known_rounding=False)
    parts = capped.parts["logits"]
    carried = sum(x for name, x in parts.items() if name != "softcap")
    assert np.max(carried) < 1e-30 * np.max(parts["softcap"])
    exact = reference.attention(q, k, v, softcap=1.0)
    out = np.asarray(mn.attention(q, k, v, numerics=num, softcap=1.0), np.float64)
    assert (np.abs(out - exact) <= capped.total).all()


def test_two_schedules_of_a_capped_attention_differ_within_a5():
    q, k, v, bias = _inputs(5, q_len=4, kv_len=64, d=16)
    a, b = Numerics(softmax="online(8)"), Numerics(softmax="safe", summation="pairwise")
    diff = np.abs(
        np.asarray(mn.attention(q, k, v, bias=bias, numerics=a, softcap=5.0), np.float64)
        - np.asarray(mn.attention(q, k, v, bias=bias, numerics=b, softcap=5.0), np.float64)
    )
    bound = schedule_difference(q, k, v, bias=bias, numerics_a=a, numerics_b=b, softcap=5.0)
    assert (diff <= bound.total).all()


def test_a_cap_the_score_format_cannot_hold_gives_an_infinite_bound_with_its_reason():
    q, k, v, _ = _inputs(6)
    num = Numerics(input="float16", accum="float32", score_format="float16")
    bound = attention_bound(q, k, v, numerics=num, softcap=1e-6)  # 1/c overflows float16
    assert np.isinf(bound.total).all()
    assert any("softcap" in reason for reason in bound.reasons)


# reciprocals past float64's range (below 2^-1024) and subnormal in it (above 2^1022)
@pytest.mark.parametrize("cap", [1e-320, 2.0**-1030, 1e308])
def test_a_cap_whose_reciprocal_leaves_float64_gives_infinite_bounds_with_the_reason(cap):
    q, k, v, _ = _inputs(6)
    q[0] = 0.0  # a zero score times the reciprocal's stand-in: no NaN either
    g = np.ones((3, 3))
    params = mn.MHAParams.random(4, seed=0)
    bounds = {
        "attention_bound": attention_bound(q, k, v, softcap=cap),
        "mha_bound": mha_bound(q, q, params, 2, softcap=cap),
        "attention_grad_bound": mn.bounds.attention_grad_bound(q, k, v, g, softcap=cap).dq,
    }
    for name, bound in bounds.items():
        assert np.isposinf(bound.total).all(), name
        assert any(reason.startswith("softcap: the cap") for reason in bound.reasons), name


@pytest.mark.parametrize("cap", [0.0, -1.0, np.inf, np.nan, True, "50"])
def test_bad_caps_are_refused_by_name(cap):
    q, k, v, _ = _inputs(7)
    for call in (mn.attention, attention_bound):
        with pytest.raises(InvalidArgument, match="softcap:"):
            call(q, k, v, softcap=cap)
    with pytest.raises(InvalidArgument, match="softcap:"):
        reference.attention(q, k, v, softcap=cap)


def test_soft_capping_is_refused_where_it_is_not_modelled():
    q, k, v, _ = _inputs(8)
    folded = Numerics(softmax="online(4)", exp_form="exp2-folded")
    with pytest.raises(InvalidArgument, match="softcap:"):
        mn.attention(q, k, v, numerics=folded, softcap=5.0)
    with pytest.raises(CertificationError, match="softcap"):
        reference.attention(q, k, v, softcap=5.0, backend="dd")
