"""``attention_tolerance`` without the certified reference: at least the oracle's tolerance and
at most ``2^-51·max_j |v_j|`` above it, element by element, in every stage the oracle has."""

from __future__ import annotations

import numpy as np
import pytest

from mhanum.rope import Rope
from mhanum.testing import attention_oracle, attention_tolerance

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
