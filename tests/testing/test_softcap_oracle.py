"""The oracle for soft-capped kernels: ``attention_oracle(..., softcap=c)``.

A user's soft-capped attention written with ``jax.numpy`` (the scores divided by the cap, XLA's
``tanh``) lies within its tolerance, and the same kernel without the cap does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mhanum.testing import attention_oracle

CAP = 5.0


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    # scores up to about 20, well beyond the cap of 5: capping changes the output
    q, k, v = (rng.standard_normal((2, 8, 16)).astype(np.float32) * 2.0 for _ in range(3))
    return q, k, v


@jax.jit
def _capped_jax(q, k, v):
    s = jnp.einsum("hqd,hkd->hqk", q, k) * (1.0 / np.sqrt(q.shape[-1]))
    s = jnp.tanh(s / CAP) * CAP
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


@jax.jit
def _uncapped_jax(q, k, v):
    s = jnp.einsum("hqd,hkd->hqk", q, k) * (1.0 / np.sqrt(q.shape[-1]))
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


def test_a_soft_capped_jax_kernel_is_within_its_tolerance_and_its_uncapped_twin_is_not():
    q, k, v = _inputs()
    oracle = attention_oracle(q, k, v, kernel="jax-xla", softcap=CAP)
    oracle.assert_close(_capped_jax(q, k, v))
    failing, ratio = oracle.check(_uncapped_jax(q, k, v))
    assert failing.any()
    assert np.max(ratio) > 100  # not a near miss: the cap moves the output by far more


def test_a_sink_kernel_is_within_its_tolerance_and_one_that_drops_the_sink_is_not():
    q, k, v = _inputs(2)
    sink = np.array([3.0, -1.0], np.float32)

    @jax.jit
    def with_sink(q, k, v):
        s = jnp.einsum("hqd,hkd->hqk", q, k) * (1.0 / np.sqrt(q.shape[-1]))
        column = jnp.broadcast_to(sink[:, None, None], (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("hqk,hkd->hqd", p, v)

    oracle = attention_oracle(q, k, v, kernel="jax-xla", sink=sink)
    oracle.assert_close(with_sink(q, k, v))
    assert oracle.check(_uncapped_jax(q, k, v))[0].any()
