"""The Triton tutorial's fused attention (``kernel="triton-tutorial"``), checked without a GPU.

``tutorial`` below transcribes the kernel's forward loop into float32 numpy, step by step:
its base-2 scaled scores ``fl(qk·qk_scale)``, the ``-1.0e6`` it adds to the masked ones on the
causal diagonal, the running maximum, ``exp2`` of the differences, the rescaling by
``exp2(m_i - m_ij)``, the float16 probabilities, the carried accumulator and the final division.
Its dots round the exact dot once, one of the orders every candidate's bound covers. Each
output must meet the descriptor's tolerance; past the range where the masked exponentials are
proved to vanish, the tolerance is infinite and says so, and the transcription shows the leak
that the reason names.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum.testing import attention_oracle, get_kernel

f32, f16 = np.float32, np.float16


def tutorial(q, k, v, *, causal, block_n, scale=None):
    """The tutorial's forward for one head: q, k, v float16 ``(L, d)``, returns float16."""
    n, d = q.shape
    sm_scale = f32(1 / np.sqrt(d) if scale is None else scale)
    qk_scale = f32(sm_scale * f32(1.44269504))
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    m_i = np.full(n, -np.inf, f32)
    l_i = np.ones(n, f32)
    acc = np.zeros((n, v.shape[1]), f32)
    rows = np.arange(n)[:, None]
    for start in range(0, k.shape[0], block_n):
        cols = np.arange(start, min(start + block_n, k.shape[0]))[None, :]
        qk = (q64 @ k64[cols[0]].T).astype(f32)  # the dot, rounded once
        x = (qk * qk_scale).astype(f32)
        if causal:
            x = np.where(rows >= cols, x, (x + f32(-1.0e6)).astype(f32))
        m_ij = np.maximum(m_i, x.max(axis=1))
        p = np.exp2((x - m_ij[:, None]).astype(f32)).astype(f32)
        l_ij = p.sum(axis=1, dtype=f32)
        alpha = np.exp2((m_i - m_ij).astype(f32)).astype(f32)
        l_i = ((l_i * alpha).astype(f32) + l_ij).astype(f32)
        acc = (acc * alpha[:, None]).astype(f32)
        pv = p.astype(f16).astype(np.float64) @ v64[cols[0]]
        acc = (acc.astype(np.float64) + pv).astype(f32)  # the carried dot, rounded once
        m_i = m_ij
    return (acc / l_i[:, None]).astype(f32).astype(f16)


def _inputs(seed, shape, spread=1.0):
    rng = np.random.default_rng(seed)
    return tuple((rng.standard_normal(shape) * spread).astype(f16) for _ in range(3))


@pytest.mark.parametrize(("causal", "block_n"), [(True, 32), (True, 64), (False, 32)])
def test_the_transcribed_kernel_meets_its_tolerance(causal, block_n):
    q, k, v = _inputs(1 + block_n, (70, 32), spread=2.0)
    out = tutorial(q, k, v, causal=causal, block_n=block_n)
    oracle = attention_oracle(q, k, v, is_causal=causal, kernel="triton-tutorial")
    assert np.all(np.isfinite(oracle.tolerance))
    failing, ratio = oracle.check(out)
    assert not failing.any(), float(ratio.max())
    # and the tolerance means something: a key block dropped from the loop fails it
    dropped = tutorial(q, k[:64], v[:64], causal=causal, block_n=block_n)
    bad, _ = oracle.check(dropped)
    assert bad[64:].any()  # the rows that read the dropped keys
    assert bad[:64].any() != causal  # causal rows before key 64 never read them


def test_every_candidate_meets_the_tolerance():
    q, k, v = _inputs(5, (2, 40, 16))
    oracle = attention_oracle(q, k, v, is_causal=True, kernel="triton-tutorial")
    keep = np.tril(np.ones((40, 40), bool))
    for num in get_kernel("triton-tutorial").candidates("float16"):
        out = np.asarray(mn.attention(q, k, v, keep, numerics=num), np.float64)
        failing, ratio = oracle.check(out)
        assert not failing.any(), (num.describe(), float(ratio.max()))


def test_a_masked_key_that_may_not_vanish_gets_an_infinite_tolerance_and_leaks():
    # row 0 attends key 0 only; key 1 is masked but its base-2 scaled score is about 3e6 above
    # key 0's: fl(x + -1e6) still tops the row, and the kernel reads key 1's value
    d = 16
    q = np.zeros((4, d), f16)
    k = np.zeros((4, d), f16)
    v = np.arange(4 * d, dtype=np.float64).reshape(4, d).astype(f16)
    q[0] = 60.0
    k[1] = 60.0
    k[0], q[1:], k[2:] = 1.0, 1.0, 1.0
    oracle = attention_oracle(q, k, v, is_causal=True, kernel="triton-tutorial", scale=100.0)
    assert np.all(np.isinf(oracle.tolerance[0]))
    assert all(str(t).startswith("mask_add:") for t in oracle.term[0])
    out = tutorial(q, k, v, causal=True, block_n=32, scale=100.0)
    np.testing.assert_array_equal(out[0], v[1])  # the leak the reason names
    assert np.abs(out[0].astype(np.float64) - oracle.exact[0]).max() > 1


def test_rows_far_inside_the_range_keep_a_finite_tolerance():
    # scaled scores up to about 1e5 in base 2: the masked exponentials provably vanish
    q, k, v = _inputs(9, (24, 16), spread=8.0)
    oracle = attention_oracle(q, k, v, is_causal=True, kernel="triton-tutorial", scale=4.0)
    assert np.all(np.isfinite(oracle.tolerance))
    out = tutorial(q, k, v, causal=True, block_n=32, scale=4.0)
    assert not oracle.check(out)[0].any()


def test_the_multi_head_oracle_refuses_a_mask_it_cannot_prove_vanishes():
    from mhanum import MHAParams
    from mhanum.testing import mha_oracle

    params = MHAParams.random(16, seed=3)
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(f16)
    with pytest.raises(mn.InvalidArgument, match=r"^mask: expected None for kernel 'triton-tu"):
        mha_oracle(x, x, params, 2, mask=np.tril(np.ones((5, 5), bool)), kernel="triton-tutorial")
    oracle = mha_oracle(x, x, params, 2, kernel="triton-tutorial")
    out = np.asarray(mn.multi_head_attention(x, x, params, 2, numerics=_candidate()), np.float64)
    assert not oracle.check(out)[0].any()


def _candidate():
    return get_kernel("triton-tutorial").candidates("float16")[0]
