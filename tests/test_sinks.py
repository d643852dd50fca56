"""Attention sinks: a per-head logit σ in every row's normaliser.

The certified reference is checked against the closed form ``Σ_j e^{s_j} v_j / (e^σ + Σ_j
e^{s_j})`` evaluated in mpmath and rounded to nearest; the emulation lies within Theorem A.1's
bound for the sink's key (score exactly 0, bias σ, value 0) across presets and softmax
algorithms, fully-masked rows included (their output is 0, the sink's value); bad sinks are
refused by name.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, masks, reference
from mhanum import strategies as mst
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


def test_a_sink_given_as_a_jax_array_is_checked_like_a_numpy_one():
    q, k, v = _inputs(3)
    with pytest.raises(InvalidArgument, match="sink:"):
        mn.attention(q, k, v, sink=jnp.asarray(np.nan, jnp.float32))


def _identity_layer(width):
    eye = np.eye(width)
    return mn.MHAParams(eye, eye, eye, eye)


def test_multi_head_sinks_are_the_heads_attention_with_sinks():
    # identity projections are exact: head h of the layer is attention on columns of block h
    rng = np.random.default_rng(4)
    x_q, x_kv = rng.standard_normal((3, 8)), rng.standard_normal((5, 8))
    sink = np.array([0.5, -1.0])
    got = reference.multi_head_attention(x_q, x_kv, _identity_layer(8), 2, sink=sink)
    heads = [
        reference.attention(x_q[:, 4 * h : 4 * h + 4], x_kv[:, 4 * h : 4 * h + 4],
                            x_kv[:, 4 * h : 4 * h + 4], sink=sink[h])
        for h in range(2)
    ]  # fmt: skip
    np.testing.assert_array_equal(got, np.concatenate(heads, axis=-1))


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
def test_the_emulated_layer_with_sinks_is_within_a2(preset):
    params = mn.MHAParams.random(16, seed=5, kv_width=8)  # 4 query heads, 2 key/value heads
    rng = np.random.default_rng(6)
    x_q, x_kv = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 16))
    sink, band = np.array([0.0, 1.0, -1.0, 2.0]), masks.causal(offset=-1)
    kw = {"mask": band, "sink": sink, "num_kv_heads": 2}
    out = np.asarray(
        mn.multi_head_attention(x_q, x_kv, params, 4, numerics=preset, **kw), np.float64
    )
    exact = np.asarray(reference.multi_head_attention(x_q, x_kv, params, 4, **kw), np.float64)
    # row 0 attends the sinks alone: every head returns 0, the layer its output bias
    np.testing.assert_array_equal(exact[:, 0], np.broadcast_to(params.bo, exact[:, 0].shape))
    bound = mn.bounds.mha_bound(x_q, x_kv, params, 4, numerics=preset, **kw)
    assert np.all(np.abs(out - exact) <= bound.total)


def test_a_multi_head_sink_must_be_one_per_head():
    params = mn.MHAParams.random(8, seed=0)
    x = np.ones((3, 8))
    with pytest.raises(InvalidArgument, match="sink:"):
        mn.multi_head_attention(x, x, params, 2, sink=np.zeros(3))
    with pytest.raises(InvalidArgument, match="sink:"):
        mn.bounds.mha_bound(x, x, params, 2, sink=np.zeros(3))


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    preset=st.sampled_from(["fp32", "bf16-fp32acc", "fp16-fp32acc", "fp16", "tf32"]),
    softmax=st.sampled_from(["safe", "online(4)", "naive"]),
)
def test_the_bound_holds_with_sinks_across_the_exponent_range(data, preset, softmax):
    # sinks from far below to far above the logits (their exponentials underflow or hold the
    # whole row), up to the score format's largest power of two; rows that attend the sink
    # alone included
    num = mn.Numerics.preset(preset).replace(softmax=softmax)
    fmt = num.format_of("score")
    exponent = data.draw(st.integers(-30, int(np.log2(fmt.max_finite))))
    sign = data.draw(st.sampled_from([-1.0, 1.0]))
    sink = np.array([sign * 2.0**exponent, data.draw(st.floats(-8, 8))])
    q, k, v = _inputs(data.draw(st.integers(0, 2**16)), num.input)
    band = data.draw(mst.bands(q_len=3, kv_len=5, empty_rows=True))
    bound = attention_bound(q, k, v, band, numerics=num, sink=sink)
    out = np.asarray(mn.attention(q, k, v, band, numerics=num, sink=sink), np.float64)
    exact = np.asarray(reference.attention(q, k, v, mask=band, sink=sink), np.float64)
    finite = np.isfinite(bound.total)
    assert np.all(np.abs(out - exact)[finite] <= bound.total[finite])


@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v, s: mn.attention(q, k, v, sink=s),
        lambda q, k, v, s: mn.reference.attention(q, k, v, sink=s),
        lambda q, k, v, s: mn.bounds.attention_bound(q, k, v, sink=s),
        lambda q, k, v, s: mn.attention_grad(q, k, v, np.ones((4, 8)), sink=s),
        lambda q, k, v, s: mn.bounds.attention_grad_bound(q, k, v, np.ones((4, 8)), sink=s),
    ],
)
def test_a_sink_never_adds_batch_dimensions(call: Any) -> None:
    """A ``(3,)`` sink with 2-D inputs would broadcast the output to ``(3, Lq, dv)``: refused."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    with pytest.raises(mn.InvalidArgument, match=r"^sink: expected one logit per batch element"):
        call(q, k, v, np.zeros(3))


def test_a_head_sink_never_adds_batch_dimensions() -> None:
    x = np.random.default_rng(0).standard_normal((3, 8))
    params = mn.MHAParams.random(8, seed=0)
    with pytest.raises(
        mn.InvalidArgument, match=r"^sink: expected one logit per batch element or head"
    ):
        mn.multi_head_attention(x, x, params, 2, sink=np.zeros((5, 2)))
