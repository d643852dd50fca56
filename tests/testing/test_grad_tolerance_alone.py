"""``attention_grad_tolerance`` without the certified gradients (Lemma O.2, papers/backward.md):
the bounds of the exact gradients' magnitudes hold against the reference from the smallest
subnormal to the edge of overflow, and the tolerance they give is at least the oracle's and at
most ``2^-52`` of those bounds above it, in every stage the gradient oracle has."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhanum import masks, reference
from mhanum.testing import attention_grad_oracle, attention_grad_tolerance
from mhanum.testing.grad_magnitudes import gradient_magnitudes, probabilities_upper

RNG = np.random.default_rng(39)
Q, K, V, G = (RNG.standard_normal((2, 4, 7, 8)).astype(np.float32) for _ in range(4))
MASK = RNG.random((2, 1, 7, 7)) < 0.6
MASK[..., 0] = True  # every row attends some key
BIAS = (RNG.standard_normal((2, 4, 7, 7)) / 2).astype(np.float32)
BIAS[0, 0, 1, 2] = -np.inf
F64 = 2.0**-52


def _exact(q, k, v, g, **keywords):
    out = reference.attention_grad(q, k, v, g, digits=17, **keywords)
    return {"dq": out.dq, "dk": out.dk, "dv": out.dv, "dbias": out.dbias, "dsink": out.dsink}


def _scale_of(d, scale):
    return 1 / np.sqrt(d) if scale is None else scale


@pytest.mark.parametrize(
    "keywords",
    [
        {"kernel": "torch-sdpa-math"},
        {"kernel": "torch-sdpa-math", "mask": MASK, "bias": BIAS, "softcap": 2.5, "scale": 0.7},
        {"kernel": "jax-xla", "is_causal": True, "layout": "blhd", "dtype": "bfloat16"},
        {"kernel": "torch-sdpa-flash-cpu", "mask": masks.sliding_window(3)},
        {"kernel": "jax-xla", "enable_gqa": True},  # one dot per group: a sum of magnitudes
    ],
    ids=["plain", "mask-bias-softcap", "causal-blhd-bf16", "window", "gqa-one-dot"],
)
def test_the_grad_tolerance_alone_is_the_oracles_with_bounded_magnitudes(keywords):
    k, v = (K[:, :2], V[:, :2]) if keywords.get("enable_gqa") else (K, V)
    oracle = attention_grad_oracle(Q, k, v, G, **keywords)
    alone = attention_grad_tolerance(Q, k, v, G, **keywords)
    assert set(alone) == set(oracle)
    bounds = None
    if set(keywords) <= {"kernel", "mask", "bias", "softcap", "scale"}:  # the bounds' own shapes
        q64, k64, v64, g64 = (np.asarray(a, np.float64) for a in (Q, k, v, G))
        mask = keywords.get("mask")
        bias = keywords.get("bias")
        bias = None if bias is None else bias.astype(np.float64)
        c = _scale_of(8, keywords.get("scale"))
        bounds = gradient_magnitudes(q64, k64, v64, g64, mask, bias, (c, keywords.get("softcap")))
    looser = False
    for name, tol in alone.items():
        ref = oracle[name].tolerance
        np.testing.assert_array_equal(np.isfinite(tol), np.isfinite(ref))
        assert (tol >= ref).all(), name
        if bounds is not None:  # 2^-52 of the bound's excess over |exact| (at most of the
            # bound), and each tolerance's two additions rounded (2^-53 of it, twice)
            assert (tol - ref <= F64 * (bounds[name] + tol + ref)).all(), name
        looser = looser or (tol > ref).any()
    assert looser  # the magnitudes, not the exact values


@pytest.mark.parametrize(
    "keywords",
    [
        {"kernel": "torch-sdpa-math", "sink": np.array([0.5, -1.0, 0.0, 2.0], np.float32)},
        {"kernel": "torch-sdpa-math", "bias": BIAS[:1, :, :1]},  # broadcast over rows and batch
        {"kernel": "torch-sdpa-math", "enable_gqa": True},  # per-head gradients, then their sum
    ],
    ids=["sink", "broadcast-bias", "gqa-summed"],
)
def test_a_summed_gradient_takes_the_oracles_exact_values(keywords):
    k, v = (K[:, :2], V[:, :2]) if keywords.get("enable_gqa") else (K, V)
    oracle = attention_grad_oracle(Q, k, v, G, **keywords)
    alone = attention_grad_tolerance(Q, k, v, G, **keywords)
    for name, tol in alone.items():
        np.testing.assert_array_equal(tol, oracle[name].tolerance)


def _mp_probabilities(q, k, mask, bias, c, cap, sink=None):
    """The exact softmax probabilities in 60 digits (a sink as one more logit, dropped)."""
    with mpmath.workdps(60):
        out = np.zeros((q.shape[0], k.shape[0]))
        for i in range(q.shape[0]):
            logits = []
            for j in range(k.shape[0]):
                raw = mpmath.mpf(c) * mpmath.fsum(
                    mpmath.mpf(a) * mpmath.mpf(b) for a, b in zip(q[i], k[j], strict=True)
                )
                s = raw if cap is None else mpmath.mpf(cap) * mpmath.tanh(raw / cap)
                keep = (mask is None or mask[i, j]) and (bias is None or bias[i, j] > -np.inf)
                logits.append(s + (0 if bias is None else mpmath.mpf(bias[i, j])) if keep else None)
            extra = [] if sink is None else [mpmath.mpf(sink)]
            top = max([s for s in logits if s is not None] + extra)
            total = mpmath.fsum(
                [mpmath.exp(s - top) for s in logits if s is not None]
                + [mpmath.exp(s - top) for s in extra]
            )
            for j, s in enumerate(logits):
                out[i, j] = 0.0 if s is None else float(mpmath.exp(s - top) / total)
    return out


@st.composite
def _edge_problems(draw):
    """A small head whose logits, values and upstream gradient sit anywhere in float64's
    range: scales from the smallest subnormal's neighbourhood to near overflow."""
    n, d = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    qk_exp = draw(st.sampled_from([-540, -20, 0, 3, 6, 9]))  # logits ~ 2^(2·qk_exp)
    vg_exp = draw(st.sampled_from([-1074, -1030, -600, 0, 500, 1000]))  # |g||v| up to 2^1000
    q, k = (rng.standard_normal((n, d)) * 2.0**qk_exp for _ in range(2))
    v = rng.standard_normal((n, d)) * 2.0 ** (vg_exp // 2)
    g = rng.standard_normal((n, d)) * 2.0 ** (vg_exp - vg_exp // 2)
    mask = rng.random((n, n)) < 0.7
    mask[:, 0] = True
    bias = None
    if draw(st.booleans()):
        bias = rng.standard_normal((n, n)) * 2.0 ** draw(st.sampled_from([-1060, 0, 8]))
    cap = draw(st.sampled_from([None, 0.5, 30.0]))
    scale = draw(st.sampled_from([None, 3.0, -0.25]))
    sink = draw(st.sampled_from([None, -3.0, 4.0]))
    return q, k, v, g, mask, bias, cap, scale, sink


@settings(deadline=None)
@given(_edge_problems())
def test_the_magnitude_bounds_hold_across_the_range(problem):
    q, k, v, g, mask, bias, cap, scale, sink = problem
    c = _scale_of(q.shape[-1], scale)
    up = probabilities_upper(q, k, mask, bias, c, cap)
    if sink is None:
        exact_p = _mp_probabilities(q, k, mask, bias, c, cap)
        assert (up >= exact_p).all()
        assert (up <= 1).all()
    bounds = gradient_magnitudes(q, k, v, g, mask, bias, (c, cap), sink)
    exact = _exact(q, k, v, g, mask=mask, bias=bias, scale=scale, softcap=cap, sink=sink)
    for name, bound in bounds.items():
        magnitude = np.abs(exact[name]) if name != "dsink" else np.abs(exact[name]).sum()
        assert (bound >= magnitude).all(), name


def test_the_bounds_are_tight_where_the_inequalities_are_equalities():
    """One key: ``P = 1`` and ``dv = Σ_i d_out_i`` with one sign; so the bound of ``dv`` is
    ``|dv|`` within a few ulps, and the test above could fail by as little as that."""
    q, k = np.ones((3, 2)), np.ones((1, 2))
    v, g = np.ones((1, 2)), np.full((3, 2), 0.75)
    bound = gradient_magnitudes(q, k, v, g, None, None, (0.5, None))
    exact = _exact(q, k, v, g, scale=0.5)
    np.testing.assert_array_equal(exact["dv"], 2.25)
    assert (bound["dv"] >= 2.25).all()
    assert (bound["dv"] <= 2.25 * (1 + 8 * 2.0**-52)).all()  # _up's (1 + 7·2^-52), rounded
    assert (probabilities_upper(q, k, None, None, 0.5, None) <= 1).all()
    # a float64 sum that rounds down: 1 + 2^-53 + 2^-53 is 1 in float64, 1 + 2^-52 exactly
    g = np.array([[1.0], [2.0**-53], [2.0**-53]])
    bound = gradient_magnitudes(q[:, :1], k[:, :1], v[:, :1], g, None, None, (0.5, None))
    assert bound["dv"][0, 0] >= 1 + 2.0**-52 > float(g.sum())


def test_the_grad_tolerance_alone_refuses_an_unknown_keyword():
    with pytest.raises(TypeError, match="unexpected keyword argument 'causal'"):
        attention_grad_tolerance(Q, K, V, G, causal=True)
