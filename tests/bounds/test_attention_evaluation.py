"""How Theorem A.1 is evaluated does not change what it says.

The bound is evaluated on chunks of query rows (every quantity belongs to one row), and Step 4's
extremes directly where the logits' errors are at most 1 and in log space elsewhere. Each way is
the bound up to its own float64 evaluation, which the bound charges (``EVALUATION``, 2^-40
relative, of the bound and of the output ``|o| <= max|v|``: step 7' reads ``fl(o) - o``), so
two ways agree to twice that; the reasons and the infinite entries agree exactly.
"""

from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest

import mhanum as mn
import mhanum.bounds.forward.extremes as extremes_module
import mhanum.bounds.forward.head as head_module
from mhanum import Numerics
from mhanum.bounds import attention_bound, forward, mha_bound
from mhanum.bounds.factors import EVALUATION

RNG = np.random.default_rng(7)
Q, K, V = (RNG.standard_normal((2, 24, 8)) for _ in range(3))
MASK = RNG.random((2, 24, 24)) < 0.7
MASK[0, 3] = False  # a row that attends no key
BIAS = RNG.standard_normal((2, 24, 24))
CASES = {
    "plain": ({}, "fp32"),
    "mask": ({"mask": MASK}, "fp32"),
    "bias": ({"bias": BIAS, "mask": MASK}, "bf16-fp32acc"),
    "fill": ({"mask": MASK}, Numerics(mask_mode="fill", mask_value=-1e4)),
    "add": ({"mask": MASK}, Numerics(input="float16", accum="float32", mask_value=-3e4)),
    "online": ({"mask": MASK}, Numerics(softmax="online(4)", input="bfloat16")),
    "lam": ({"lam": 5.0}, "fp32"),
}

# every module of the forward bounds, each of which binds the shortcuts it uses
_FORWARD_MODULES = [
    importlib.import_module(f"mhanum.bounds.forward.{info.name}")
    for info in pkgutil.iter_modules(forward.__path__)
]


def _same(a: mn.bounds.Bound, b: mn.bounds.Bound, vmax: float) -> None:
    assert a.reasons == b.reasons
    assert a.terms.keys() == b.terms.keys()
    for x, y in [(a.total, b.total)] + [(a.terms[n], b.terms[n]) for n in a.terms]:
        x, y = np.broadcast_to(x, a.total.shape), np.broadcast_to(y, a.total.shape)
        np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
        f = np.isfinite(x)
        np.testing.assert_allclose(x[f], y[f], rtol=2 * EVALUATION, atol=2 * EVALUATION * vmax)


@pytest.mark.parametrize("keys", [1, 2, 3, 100, 1024, 2047, 2048, 2049, 4096, 5000, 32768,
                                  2**19, 2**19 + 1, 2**20, 10**7])  # fmt: skip
@pytest.mark.parametrize("logits", [head_module.CHUNK, head_module.CHUNK // 2])
def test_a_chunk_holds_about_its_logits_and_many_rows_within_chunk_max(keys, logits):
    rows = head_module.rows_per_chunk(keys, logits)
    least, most = head_module.CHUNK_ROWS, head_module.CHUNK_MAX
    assert rows >= 1
    # never more logits than the larger of the chunk's (or one row) and CHUNK_MAX
    assert rows * keys <= max(logits, most, keys)
    # at least CHUNK_ROWS rows wherever they fit within CHUNK_MAX logits, and the chunk's
    # rows wherever those are more
    if least * keys <= most:
        assert rows >= least
    assert rows >= logits // keys
    # and no more than either rule asks
    assert rows <= max(logits // keys, least, 1)


def test_a_chunk_is_halved_where_the_probabilities_are_stored_coarser():
    def logits(preset: str, known: bool = True) -> int:
        setting = forward.stage.Setting(Numerics.preset(preset), 1.0, False, known_rounding=known)
        return head_module.chunk_logits(setting)

    assert logits("fp32") == logits("bf16") == head_module.CHUNK  # no coarser probabilities
    assert logits("bf16-fp32acc") == logits("fp16-fp32acc") == head_module.CHUNK // 2
    assert logits("bf16-fp32acc", known=False) == head_module.CHUNK  # steps 6k, 6r not taken


@pytest.mark.parametrize("case", list(CASES))
def test_chunks_of_rows_give_the_whole_bound(case, monkeypatch):
    kwargs, numerics = CASES[case]
    whole = attention_bound(Q, K, V, numerics=numerics, **kwargs)
    monkeypatch.setattr(head_module, "CHUNK", 5 * 24)  # chunks of 5 rows, the last of 4
    monkeypatch.setattr(head_module, "CHUNK_ROWS", 1)
    _same(attention_bound(Q, K, V, numerics=numerics, **kwargs), whole, np.abs(V).max())


def test_chunks_of_rows_give_the_whole_mha_bound(monkeypatch):
    params = mn.MHAParams.random(8, seed=3)
    x = RNG.standard_normal((1, 20, 8))
    mask = RNG.random((1, 2, 20, 20)) < 0.8
    whole = mha_bound(x, x, params, 2, mask=mask, numerics="bf16-fp32acc")
    monkeypatch.setattr(head_module, "CHUNK", 3 * 20)
    monkeypatch.setattr(head_module, "CHUNK_ROWS", 1)
    chunked = mha_bound(x, x, params, 2, mask=mask, numerics="bf16-fp32acc")
    _same(chunked, whole, 0.0)  # terms after the output projection: relative only


@pytest.mark.parametrize("case", list(CASES))
def test_direct_and_log_space_extremes_agree(case, monkeypatch):
    kwargs, numerics = CASES[case]
    direct = attention_bound(Q, K, V, numerics=numerics, **kwargs)
    monkeypatch.setattr(extremes_module, "extremes_direct", extremes_module.extremes_log)
    logspace = attention_bound(Q, K, V, numerics=numerics, **kwargs)
    _same(direct, logspace, np.abs(V).max())


def test_rows_with_large_logit_errors_take_the_log_space_path():
    # q rows scaled over the exponent range: their logits' errors exceed 1 in bfloat16, the
    # other rows' do not; the bound is the same as with every row in log space
    q = Q[0] * np.where(np.arange(24) % 3 == 0, 2.0**10, 1.0)[:, None]
    num = Numerics(input="bfloat16", accum="float32")
    mixed = attention_bound(q, K[0], V[0], numerics=num)
    bound = extremes_module.extremes
    calls = []

    def spy(sc, delta, live):
        calls.append(float(np.where(live, delta, 0.0).max()))
        return bound(sc, delta, live)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(extremes_module, "extremes", spy)
        mp.setattr(extremes_module, "extremes_direct", extremes_module.extremes_log)
        logspace = attention_bound(q, K[0], V[0], numerics=num)
    assert calls
    assert calls[0] > 1  # the case reaches the fallback
    _same(mixed, logspace, np.abs(V).max())
    # and it is a bound: the measured error of the emulation lies within it
    out = np.asarray(mn.attention(q, K[0], V[0], numerics=num), np.float64)
    exact = np.asarray(mn.reference.attention(q, K[0], V[0]), np.float64)
    assert np.all(np.abs(out - exact) <= mixed.total)


@pytest.mark.parametrize("delta", [0.5, 5.0, 17.0, 30.0])
def test_two_tied_keys_each_keep_the_other_in_their_lower_extreme(delta):
    """Lemma 4 with two tied keys: the least ``p̃_j`` over the box is ``e^{-2δ}/(1 + e^{-2δ})``
    (the partner raised, ``j`` lowered). In log space, with ``δ`` of 17 or more, the computed
    shares of ``log_p + δ`` are both just above one half; only one key may then leave the
    rest out of its sum, or the other's lower extreme would be 1. (A logit of 0.3 gives
    the same in :func:`log_sum_excluding` directly.)"""
    sc = np.array([[0.0, 0.0, -np.inf]])
    live = np.array([[True, True, False]])
    least = np.exp(-2 * delta) / (1 + np.exp(-2 * delta))
    for how in (extremes_module.extremes_log, extremes_module.extremes):
        _, hi, lo, _ = how(sc, np.full(sc.shape, delta), live)
        assert np.all(lo[0, :2] <= least * (1 + 2.0**-40))
        assert np.all(hi[0, :2] >= (1 - least) * (1 - 2.0**-40))
    rest = extremes_module.log_sum_excluding(np.array([[0.3, 0.3, -np.inf]]))
    assert np.allclose(rest[0, :2], 0.3, rtol=0, atol=2.0**-50)


@pytest.mark.parametrize("case", list(CASES))
def test_the_shortcuts_of_all_live_keys_and_exact_operands_change_nothing(case, monkeypatch):
    # every key live, operands read exactly, values without error: the bound skips np.where
    # passes and products with zero factors; evaluated without the shortcuts it is the same, bit
    # for bit
    kwargs, numerics = CASES[case]
    fast = attention_bound(Q, K, V, numerics=numerics, **kwargs)
    for module in _FORWARD_MODULES:
        if hasattr(module, "on"):
            monkeypatch.setattr(module, "on", lambda where, x, other: np.where(where, x, other))
        if hasattr(module, "dot"):
            monkeypatch.setattr(module, "dot", lambda a, b, nonzero=None: a @ b)
    slow = attention_bound(Q, K, V, numerics=numerics, **kwargs)
    for name in fast.terms:
        np.testing.assert_array_equal(fast.terms[name], slow.terms[name])
    np.testing.assert_array_equal(fast.total, slow.total)


def test_the_given_errors_move_the_logits_by_at_most_the_charged_amount():
    # A.2's float64 projections are off the exact ones by `given`; the charge takes the row's
    # largest logit move as Σ_d g_q (max|k| + max g_k) + |q| max g_k, never below the largest
    # entry of the L × L product it replaces
    q, k, v = (np.abs(RNG.standard_normal((24, 8))) for _ in range(3))
    g = tuple(RNG.random((24, 8)) * 1e-12 for _ in range(3))
    keep = MASK[0]
    p = np.where(keep, 1.0, 0.0) / np.maximum(keep.sum(-1, keepdims=True), 1)
    charged = head_module.given_error(q, k, v, p, p @ v, keep, 0.5, g)
    moved = 0.5 * (g[0] @ k.T + q @ g[1].T + g[0] @ g[1].T)
    big = np.max(np.where(keep, moved, 0.0), axis=-1, keepdims=True)
    exact_charge = np.expm1(2 * big) * (p @ v) + np.exp(2 * big) * (p @ g[2])
    assert np.all(charged >= exact_charge)
    assert np.any(charged > exact_charge)
