"""``confidence=``: the oracle's probabilistic tolerance (Theorem A.3) beside the certified one.

Bad confidences are refused by name; the probabilistic tolerance is never above the certified
one; on inputs whose roundings all go one way a kernel that computes exactly as its descriptor
says exceeds it while staying within the certified one; and on random inputs torch's and JAX's
kernels stay within it.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mhanum import InvalidArgument, MHAParams, Numerics
from mhanum.testing import (
    PROBABILISTIC_MODEL,
    AttentionMismatch,
    Kernel,
    Oracle,
    ProbabilisticOracle,
    assert_attention_close,
    assert_mha_close,
    attention_oracle,
    attention_tolerance,
    mha_oracle,
    mha_tolerance,
)

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

DTYPES = {"float32": (np.float32, torch.float32), "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16),
          "float16": (np.float16, torch.float16)}  # fmt: skip

# Under Theorem A.3's model a call's output leaves its tolerance with probability at most
# 1 - CONFIDENCE. The soundness tests below make 2 kernels x 3 formats x DRAWS = 24 attention
# calls and one layer call, so a false alarm under the model has probability at most
# 25 * 1e-12 = 2.5e-11 (the union bound): a failure there is a finding (the kernel does not
# round as the model says on random data, or a bug), never bad luck.
CONFIDENCE = 1 - 1e-12
DRAWS = 4
SHAPE = (16, 24, 64)  # (Lq, Lk, d): one shape, so that JAX compiles once per format


def _inputs(seed, dtype, shape=SHAPE, spread=1.0):
    lq, lk, d = shape
    rng = np.random.default_rng(seed)
    return tuple(
        (spread * rng.standard_normal(s)).astype(np.float32).astype(DTYPES[dtype][0])
        for s in ((lq, d), (lk, d), (lk, d))
    )


def _torch_math(q, k, v, *, is_causal=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    td = DTYPES[str(q.dtype)][1]
    t = [torch.from_numpy(np.asarray(a, np.float32)).to(td)[None, None] for a in (q, k, v)]
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=is_causal)
    return out[0, 0]


def _jax(q, k, v, *, is_causal=False):
    out = jax.nn.dot_product_attention(
        *(jnp.asarray(a)[None, :, None] for a in (q, k, v)), is_causal=is_causal
    )
    return np.asarray(out)[0, :, 0]


RUNS = {"torch-sdpa-math": _torch_math, "jax-xla": _jax}


# -- validation ------------------------------------------------------------------------------

BAD = [0, 1, 0.0, 1.0, -0.5, 1.5, math.nan, math.inf, True, False, "0.99", np.array([0.99])]
Q, K, V = _inputs(0, "float32", (2, 3, 4))
X = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
PARAMS = MHAParams.random(8, seed=0)
CALLS = {
    "attention_oracle": lambda c: attention_oracle(Q, K, V, confidence=c),
    "attention_tolerance": lambda c: attention_tolerance(Q, K, V, confidence=c),
    "assert_attention_close": lambda c: assert_attention_close(Q[:, :4], Q, K, V, confidence=c),
    "mha_oracle": lambda c: mha_oracle(X, X, PARAMS, 2, confidence=c),
    "mha_tolerance": lambda c: mha_tolerance(X, X, PARAMS, 2, confidence=c),
    "assert_mha_close": lambda c: assert_mha_close(X, X, X, PARAMS, 2, confidence=c),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_confidence_outside_the_open_unit_interval_is_refused_by_name(call, bad):
    with pytest.raises(InvalidArgument, match=r"^confidence: expected None or a float strictly"):
        CALLS[call](bad)


def test_the_default_is_the_certified_tolerance_unchanged():
    default = attention_oracle(Q, K, V)
    explicit = attention_oracle(Q, K, V, confidence=None)
    assert type(default) is Oracle
    assert type(explicit) is Oracle
    np.testing.assert_array_equal(default.tolerance, explicit.tolerance)


@pytest.mark.parametrize("confidence", [0.5, 0.99, np.float64(0.999)])
def test_the_oracle_carries_the_probability_and_the_model(confidence):
    oracle = attention_oracle(Q, K, V, confidence=confidence)
    assert isinstance(oracle, ProbabilisticOracle)
    assert oracle.confidence == confidence
    assert confidence <= oracle.probability < 1
    assert oracle.model == PROBABILISTIC_MODEL
    layer = mha_oracle(X, X, PARAMS, 2, confidence=confidence)
    assert isinstance(layer, ProbabilisticOracle)
    assert confidence <= layer.probability < 1


# -- never above the certified tolerance ------------------------------------------------------


@pytest.mark.parametrize("kernel", ["torch-sdpa-math", "torch-sdpa-flash-cpu", "jax-xla"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_probabilistic_tolerance_is_never_above_the_certified_one(kernel, dtype):
    # Theorem A.3 keeps the deterministic factor wherever it is the smaller, so the bound is
    # elementwise at most A.1's; the oracle adds the same reference rounding to both.
    q, k, v = _inputs(3, dtype, spread=3.0)
    mask = np.random.default_rng(4).random((SHAPE[0], SHAPE[1])) < 0.7
    mask[:, 0] = True
    for kw in ({}, {"mask": mask}, {"is_causal": True}):
        certified = attention_tolerance(q, k, v, kernel=kernel, **kw)
        likely = {
            c: attention_tolerance(q, k, v, kernel=kernel, confidence=c, **kw)
            for c in (0.5, 0.99, CONFIDENCE)
        }
        for c, tolerance in likely.items():
            assert np.all(tolerance <= certified), (kw, c)
        if dtype == "float32":  # sums and dots set some of the tolerance: it is smaller there
            assert np.any(likely[0.99] < certified), kw


def test_the_layers_probabilistic_tolerance_is_never_above_the_certified_one():
    x = np.random.default_rng(5).standard_normal((2, 6, 16)).astype(np.float32)
    params = MHAParams.random(16, seed=2)
    certified = mha_tolerance(x, x, params, 4, kernel="torch-sdpa-math")
    likely = mha_tolerance(x, x, params, 4, kernel="torch-sdpa-math", confidence=0.99)
    assert np.all(likely <= certified)
    assert np.any(likely < certified)


# -- how it fails: roundings that all go one way ----------------------------------------------


def _sequential_attention(q, k, v):
    """Float32 attention whose dots add their products one at a time, in order."""
    s = np.zeros((q.shape[0], k.shape[0]), np.float32)
    for i, row in enumerate(q):
        for j, key in enumerate(k):
            for product in row * key:
                s[i, j] = s[i, j] + product
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


SEQUENTIAL = Kernel(
    "sequential-dots",
    {"float32": (Numerics(summation="sequential"),)},
    fully_masked="nan",
    evidence=("_sequential_attention: float32, dots summed in order",),
)


def test_a_kernel_whose_roundings_all_go_one_way_exceeds_the_probabilistic_tolerance():
    # Key 0's dot is 1 + 1023 products t = 2^-24 + 2^-34, each just over half an ulp of the
    # running sum in [1, 2): every addition rounds up to the next float, by 2^-24 - 2^-34, so
    # the logit is off by 1023·(2^-24 - 2^-34), all in one direction, where the model expects
    # about λ·sqrt(1023)·2^-24. Key 1's dot is exact. With values ±1 the output is
    # tanh((s0 - s1)/2), computed from the rounded logits: its error is the difference of the
    # two tanh's, up to the softmax's own roundings: exp(s1 - s0) near 1 within 2 ulps (2^-23,
    # moving the output by half that), the sum near 2 (a relative 2^-24 of an output near
    # 6e-5), p0 in [1/2, 1) and p1 in [1/4, 1/2) (half-ulps 2^-25 and 2^-26), and p0 - p1
    # exact (Sterbenz): less than 2·2^-24 in all.
    d = 1024
    q = np.full((1, d), 2.0**-24 + 2.0**-34, np.float32)
    q[0, 0] = 1.0
    k = np.zeros((2, d), np.float32)
    k[0] = 1.0
    k[1, 0] = 1.0
    v = np.array([[1.0], [-1.0]], np.float32)
    out = _sequential_attention(q, k, v)

    certified = attention_oracle(q, k, v, scale=1.0, kernel=SEQUENTIAL)
    likely = attention_oracle(q, k, v, scale=1.0, kernel=SEQUENTIAL, confidence=0.99)
    err = float(np.abs(out - certified.exact)[0, 0])
    t = 2.0**-24 + 2.0**-34
    ideal = math.tanh(1023 * 2.0**-23 / 2) - math.tanh(1023 * t / 2)
    assert abs(err - ideal) < 2 * 2.0**-24
    assert err > float(likely.tolerance[0, 0])
    assert err <= float(certified.tolerance[0, 0])
    assert_attention_close(out, q, k, v, scale=1.0, kernel=SEQUENTIAL)
    with pytest.raises(AttentionMismatch) as failure:
        assert_attention_close(out, q, k, v, scale=1.0, kernel=SEQUENTIAL, confidence=0.99)
    text = str(failure.value)
    assert text.startswith("1 of 1 elements outside the probabilistic tolerance")
    assert "probability >= 0.99 (confidence=0.99)" in text
    assert PROBABILISTIC_MODEL in text


def test_the_certified_failure_message_says_nothing_of_probability():
    wrong = _torch_math(Q, K, V) + 1e-3
    with pytest.raises(AttentionMismatch) as failure:
        assert_attention_close(wrong, Q, K, V, kernel="torch-sdpa-math")
    assert "certified tolerance" in str(failure.value)
    assert "probab" not in str(failure.value).replace("probability_rounding", "")


# -- soundness on random inputs (statistical: see CONFIDENCE) ---------------------------------


@pytest.mark.parametrize("kernel", list(RUNS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_correct_kernels_stay_within_the_probabilistic_tolerance_on_random_inputs(kernel, dtype):
    for seed in range(DRAWS):
        causal, spread = seed % 2 == 1, (1.0, 3.0)[seed // 2]
        q, k, v = _inputs(10 + seed, dtype, spread=spread)
        out = RUNS[kernel](q, k, v, is_causal=causal)
        assert_attention_close(out, q, k, v, kernel=kernel, is_causal=causal, confidence=CONFIDENCE)


def test_torchs_multihead_attention_stays_within_the_layers_probabilistic_tolerance():
    from mhanum.adapters import torch as adapter

    params = MHAParams.random(16, seed=2)
    layer = adapter.load(params, 4)
    x = np.random.default_rng(13).standard_normal((2, 6, 16)).astype(np.float32)
    out = adapter.run(layer, x, x, None, path="sdpa")
    p32 = adapter.extract(layer)
    assert_mha_close(out, x, x, p32, 4, kernel="torch-sdpa-flash-cpu", confidence=CONFIDENCE)


# -- the pytest plugin's fixture forwards it ------------------------------------------------


def test_the_fixtures_methods_take_a_confidence():
    from mhanum.pytest_plugin import KernelOracle

    fixture = KernelOracle("torch-sdpa-math")
    oracle = fixture.oracle(Q, K, V, confidence=0.99)
    assert isinstance(oracle, ProbabilisticOracle)
    np.testing.assert_array_equal(
        fixture.tolerance(Q, K, V, confidence=0.99),
        attention_tolerance(Q, K, V, kernel="torch-sdpa-math", confidence=0.99),
    )
    fixture.assert_close(_torch_math(Q, K, V), Q, K, V, confidence=0.99)
    with pytest.raises(AttentionMismatch, match="probabilistic tolerance"):
        fixture.assert_close(_torch_math(Q, K, V) + 1e-3, Q, K, V, confidence=0.99)
    with pytest.raises(InvalidArgument, match=r"^confidence: "):
        fixture.tolerance(Q, K, V, confidence=1.0)
