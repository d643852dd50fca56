"""Attention sinks: a per-head logit σ in every row's normaliser.

The certified reference is checked against the closed form ``Σ_j e^{s_j} v_j / (e^σ + Σ_j
e^{s_j})`` evaluated in mpmath and rounded to nearest; the emulation lies within Theorem A.1's
bound for the sink's key (score exactly 0, bias σ, value 0) across presets and softmax
algorithms, fully-masked rows included (their output is 0, the sink's value); bad sinks are
refused by name.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, masks, reference
from mhanum.bounds import attention_bound


def _inputs(seed, fmt="float64"):
    rng = np.random.default_rng(seed)
    f = mn.get_format(fmt)
    q, k, v = (
        np.asarray(mn.round_to(rng.standard_normal(s), f), np.float64)
        for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3))
    )
    return q, k, v


def test_the_reference_is_the_closed_form_rounded_to_nearest():
    q, k, v = _inputs(0)
    sink = np.array([0.75, -2.5])
    got = reference.attention(q, k, v, sink=sink)
    ctx = mpmath.MPContext()
    ctx.prec = 300
    want = np.empty_like(got)
    for h in range(2):
        for i in range(3):
            s = [
                sum(ctx.mpf(a) * ctx.mpf(b) for a, b in zip(q[h, i], k[h, j], strict=True)) / 2
                for j in range(5)
            ]
            weights = [ctx.exp(x) for x in s]
            total = ctx.exp(ctx.mpf(sink[h])) + sum(weights)
            for c in range(3):
                want[h, i, c] = float(
                    sum(w * ctx.mpf(v[h, j, c]) for j, w in enumerate(weights)) / total
                )
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
@pytest.mark.parametrize("softmax", ["safe", "online(2)", "naive"])
def test_the_emulated_sink_is_within_its_bound(preset, softmax):
    num = mn.Numerics.preset(preset).replace(softmax=softmax)
    q, k, v = _inputs(1, num.input)
    sink = np.array([1.5, -0.5])
    mask = masks.causal(offset=-1)  # row 0 attends no real key: the sink alone
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num, sink=sink), np.float64)
    exact = np.asarray(reference.attention(q, k, v, mask=mask, sink=sink), np.float64)
    np.testing.assert_array_equal(exact[:, 0], 0.0)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    bound = attention_bound(q, k, v, mask, numerics=num, sink=sink)
    assert np.all(np.abs(out - exact) <= bound.total)


def test_a_sink_that_dominates_shrinks_the_output():
    # σ = 30 holds nearly all the weight: the output is ~e^-30 times the sinkless one
    q, k, v = _inputs(2)
    plain = reference.attention(q, k, v)
    sunk = reference.attention(q, k, v, sink=30.0)
    assert np.all(np.abs(sunk) < np.abs(plain) * 1e-11)


@pytest.mark.parametrize(
    ("sink", "numerics"),
    [(np.nan, "fp32"), (np.ones(3), "fp32"), (0.0, mn.Numerics(exp_form="exp2-folded"))],
)
def test_bad_sinks_are_refused_by_name(sink, numerics):
    q, k, v = _inputs(3)
    with pytest.raises(InvalidArgument, match="sink:"):
        mn.attention(q, k, v, numerics=numerics, sink=sink)
    with pytest.raises(InvalidArgument, match="sink:"):
        attention_bound(q, k, v, numerics=numerics, sink=sink)
