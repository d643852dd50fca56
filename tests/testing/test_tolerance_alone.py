"""``attention_tolerance`` without the certified reference: at least the oracle's tolerance and
at most ``2^-51·max_j |v_j|`` above it, element by element, in every stage the oracle has."""

from __future__ import annotations

import numpy as np
import pytest

from mhanum import InvalidArgument, MHAParams
from mhanum.rope import Rope
from mhanum.testing import attention_oracle, attention_tolerance, mha_oracle, mha_tolerance

RNG = np.random.default_rng(38)
Q, K, V = (RNG.standard_normal((2, 2, 9, 16)).astype(np.float32) for _ in range(3))
MASK = RNG.random((2, 1, 9, 9)) < 0.6
MASK[0, 0, 3] = False  # a row that attends no key


@pytest.mark.parametrize(
    "keywords",
    [
        {"kernel": "jax-xla", "mask": MASK},  # its empty row: the mean of the values
        {"kernel": "torch-sdpa-math", "mask": MASK, "sink": np.float32(0.5)},
        {"kernel": "torch-sdpa-math", "mask": MASK, "softcap": 3.0, "bias": Q[..., :9] / 4},
        {"kernel": "triton-tutorial", "mask": MASK, "dtype": "float16"},  # adds -1e6, base 2
        {"kernel": "jax-xla", "is_causal": True, "layout": "blhd", "confidence": 0.99},
        {"kernel": "torch-sdpa-math", "rope": Rope(dim=16), "positions": np.arange(9)},
        {"kernel": "torch-sdpa-math", "kv_cache": "vllm-fp8-e4m3"},
    ],
    ids=["uniform-row", "sink", "softcap-bias", "mask-add", "causal-blhd", "rope", "kv-cache"],
)
def test_the_tolerance_alone_is_the_oracles_with_max_v_for_the_exact(keywords):
    oracle = attention_oracle(Q, K, V, **keywords)
    alone = attention_tolerance(Q, K, V, **keywords)
    keys = -3 if keywords.get("layout") == "blhd" else -2
    top = np.broadcast_to(np.abs(V.astype(np.float64)).max(axis=keys, keepdims=True), alone.shape)
    assert alone.shape == oracle.tolerance.shape
    np.testing.assert_array_equal(np.isfinite(alone), np.isfinite(oracle.tolerance))
    finite = np.isfinite(alone)
    assert finite.any()
    assert (alone[finite] >= oracle.tolerance[finite]).all()
    assert (alone[finite] <= oracle.tolerance[finite] + 2.0**-51 * top[finite]).all()
    exact = np.where(np.isfinite(oracle.exact), np.abs(oracle.exact), 0.0)
    somewhere = finite & (oracle.tolerance > 0) & (exact < top / 2)
    assert (alone[somewhere] > oracle.tolerance[somewhere]).any()  # not the oracle's own


def test_the_tolerance_alone_refuses_an_unknown_keyword():
    with pytest.raises(TypeError, match="unexpected keyword argument 'masks'"):
        attention_tolerance(Q, K, V, masks=MASK)


# -- mha_tolerance -------------------------------------------------------------------------------

PARAMS = MHAParams.random(16, seed=3)
X = RNG.standard_normal((2, 7, 16)).astype(np.float32)
HEAD_MASK = RNG.random((2, 4, 7, 7)) < 0.6
HEAD_MASK[0, 1, 2] = False  # one head of a row attends no key


@pytest.mark.parametrize(
    "keywords",
    [
        {"kernel": "jax-xla"},
        {"kernel": "torch-sdpa-math", "mask": HEAD_MASK, "softcap": 2.0},
        {"kernel": "jax-xla", "num_kv_heads": 2, "confidence": 0.99},
    ],
    ids=["plain", "mask-softcap", "gqa-confidence"],
)
def test_the_mha_tolerance_alone_is_at_least_the_oracles(keywords):
    grouped = "num_kv_heads" in keywords
    params = MHAParams.random(16, seed=4, kv_width=8) if grouped else PARAMS
    oracle = mha_oracle(X, X, params, 4, **keywords)
    alone = mha_tolerance(X, X, params, 4, **keywords)
    np.testing.assert_array_equal(np.isfinite(alone), np.isfinite(oracle.tolerance))
    finite = np.isfinite(alone)
    assert finite.any()
    assert (alone[finite] >= oracle.tolerance[finite]).all()
    assert (alone[finite] > oracle.tolerance[finite]).any()


@pytest.mark.parametrize("num_heads", ["4", 4.0, 0, True])
@pytest.mark.parametrize("check", [mha_oracle, mha_tolerance], ids=["oracle", "tolerance"])
def test_a_bad_head_count_is_refused_by_name(check, num_heads):
    with pytest.raises(InvalidArgument, match=r"^num_heads: expected a positive integer, got"):
        check(X, X, PARAMS, num_heads)


@pytest.mark.parametrize("exponent", [-1074, -1060, -1022, -600, 0, 300, 500])
def test_the_mha_magnitude_bounds_the_exact_output_over_the_exponent_range(exponent):
    """``|exact|`` against its bound (:func:`mhanum.testing._mha_exact_magnitude`), on inputs and
    biases from the smallest subnormal to near overflow, with grouped key/value heads."""
    from mhanum import reference
    from mhanum.testing import _mha_exact_magnitude

    rng = np.random.default_rng(exponent + 2000)
    x = np.ldexp(rng.standard_normal((2, 5, 8)), exponent)
    x[0, :, 0] = np.ldexp(1.0, exponent)  # a key's entry at exactly 2^exponent
    wq, wk, wv = (
        rng.standard_normal((8, 8)),
        rng.standard_normal((8, 4)),
        rng.standard_normal((8, 4)),
    )
    wo, bo, bv = rng.standard_normal((8, 8)), rng.standard_normal(8), rng.standard_normal(4)
    params = MHAParams(wq, wk, wv, wo, bv=np.ldexp(bv, exponent), bo=np.ldexp(bo, exponent))
    exact = np.asarray(reference.multi_head_attention(x, x, params, 4, num_kv_heads=2))
    top = _mha_exact_magnitude(x, params, 2, 4)[..., None, :]
    assert np.isfinite(top).all()
    assert (np.abs(exact) <= top).all()
