"""FlashAttention-2's backward with its exp2 recomputation (``exp_form="exp2-folded"``,
papers/backward.md, step 3f): the emulation, Theorems B.2 and B.3 against the certified
gradients, the ``flash-attention-2`` descriptor of :mod:`mhanum.testing`, and the refusals."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum
from mhanum import Backward, InvalidArgument, Numerics, reference
from mhanum.bounds import attention_grad_bound, dq_order_difference, mha_grad_bound
from mhanum.bounds.backward import attention_grad_bound_a_priori
from mhanum.formats import round_to
from mhanum.testing import BACKWARD_NOT_MODELLED, attention_grad_oracle, get_backward_kernel
from tests.test_backward_ranges import RANGE_SETTINGS, theorem_at_the_edges

jax.config.update("jax_enable_x64", True)


def fa2(fmt: str, block: int = 16, **kw: object) -> Numerics:
    """FlashAttention-2's forward numerics (its descriptor's, on the native dot unit)."""
    return Numerics(
        input=fmt, accum="float32", score_format="float32", softmax_format="float32",
        prob_format=fmt, output_format=fmt, softmax=f"online({block})", online_sums="running",
        exp_form="exp2-folded", mask_mode="fill", mask_value=-math.inf, div_ulps=2.0,
        exp_ulps=4.0, **kw,
    )  # fmt: skip


BACKWARD = Backward("flash2", block_q=8, block_k=8)


def _case(seed: int, fmt: str, lq: int = 24, lk: int = 24, d: int = 16, spread: float = 0.0):
    rng = np.random.default_rng(seed)
    q, k = (round_to(rng.standard_normal((lq if i == 0 else lk, d)) * 2.0**spread, fmt)
            for i in range(2))  # fmt: skip
    v, g = round_to(rng.standard_normal((lk, d)), fmt), round_to(rng.standard_normal((lq, d)), fmt)
    return q, k, v, g


def _check(q, k, v, g, mask, num, bw, scale=None) -> dict[str, float]:
    """B.2: every gradient within its bound of the certified one; the worst error/bound."""
    bound = attention_grad_bound(q, k, v, g, mask, numerics=num, backward=bw, scale=scale)
    got = mhanum.attention_grad(q, k, v, g, mask, numerics=num, backward=bw, scale=scale)
    exact = reference.attention_grad(q, k, v, g, mask=mask, scale=scale)
    worst = {}
    for name in ("dq", "dk", "dv"):
        err = np.abs(np.asarray(getattr(got, name), np.float64) - getattr(exact, name))
        total = getattr(bound, name).total
        assert np.all(err <= total), name
        worst[name] = float(np.max(err / total))
    return worst


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_gradient_is_within_theorem_b2_with_the_exp2_recomputation(fmt, causal):
    """The bound holds and is not vacuous (some gradient within 1/100 of it), with logits up
    to 2^5 times the usual spread (the fold's error grows with the row's largest logit)."""
    mask = np.tril(np.ones((24, 24), bool)) if causal else None
    worst = {}
    for seed, spread in enumerate((0.0, 2.5)):
        q, k, v, g = _case(seed, fmt, spread=spread)
        for name, r in _check(q, k, v, g, mask, fa2(fmt), BACKWARD).items():
            worst[name] = max(worst.get(name, 0.0), r)
    assert max(worst.values()) > 0.01


def test_the_recomputation_is_in_base_2():
    """The exp2 path runs: the gradients differ from those of the exp form on the same
    inputs (in their last bits), and both are within their own bounds."""
    q, k, v, g = _case(3, "float32", spread=2.0)
    folded = mhanum.attention_grad(q, k, v, g, numerics=fa2("float32"), backward=BACKWARD)
    plain = dataclasses.replace(fa2("float32"), exp_form="exp")
    exp = mhanum.attention_grad(q, k, v, g, numerics=plain, backward=BACKWARD)
    assert not np.array_equal(np.asarray(folded.dq), np.asarray(exp.dq))
    _check(q, k, v, g, None, plain, BACKWARD)


def test_a_scale_away_from_one_and_every_dq_order():
    """A given scale, several key blocks added in two orders: B.2 for each, and B.3 bounds
    their difference."""
    q, k, v, g = _case(5, "bfloat16", lq=16, lk=40)
    forward = Backward("flash2", block_q=16, block_k=8)
    backward = Backward("flash2", block_q=16, block_k=8, dq_order=(4, 3, 2, 1, 0))
    for bw in (forward, backward):
        _check(q, k, v, g, None, fa2("bfloat16"), bw, scale=0.3)
    a, b = (mhanum.attention_grad(q, k, v, g, numerics=fa2("bfloat16"), backward=bw, scale=0.3)
            for bw in (forward, backward))  # fmt: skip
    diff = dq_order_difference(q, k, v, g, numerics=fa2("bfloat16"), backward=forward, scale=0.3)
    assert np.all(np.abs(np.asarray(a.dq, np.float64) - np.asarray(b.dq, np.float64)) <= diff.total)


@pytest.mark.slow
@settings(RANGE_SETTINGS, max_examples=max(5, RANGE_SETTINGS.max_examples // 3))
@given(data=st.data(), fmt=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_the_exp2_recomputation_at_the_range_edges(data, fmt):
    """Theorem B.2 at the edges of the formats' ranges (the inputs of
    ``tests/test_backward_ranges.py``, no bias: the folded exp2 takes none)."""
    theorem_at_the_edges(data, fa2(fmt, block=4), Backward("flash2", block_q=2, block_k=4),
                         None, bias=False)  # fmt: skip


def test_the_descriptor_judges_its_own_candidates():
    """Each candidate of ``flash-attention-2``'s backward, emulated, is within the oracle's
    tolerance (causal, two heads); dK and dV as one chain over every query."""
    kernel = get_backward_kernel("flash-attention-2")
    assert "flash-attention-2" not in BACKWARD_NOT_MODELLED
    assert "torch-sdpa-flash-cuda" not in BACKWARD_NOT_MODELLED
    rng = np.random.default_rng(0)
    q, k, v, g = (round_to(rng.standard_normal((2, 48, 32)), "bfloat16") for _ in range(4))
    oracle = attention_grad_oracle(q, k, v, g, kernel=kernel, dtype="bfloat16", is_causal=True)
    mask = np.tril(np.ones((48, 48), bool))
    pairs = kernel.candidates("bfloat16", 48)
    assert {b.block_q for _, b in pairs} == {48}
    for num, bw in pairs[::5]:
        got = mhanum.attention_grad(q, k, v, g, mask, numerics=num, backward=bw)
        for name in ("dq", "dk", "dv"):
            o = oracle.oracles[name]
            err = np.abs(np.asarray(getattr(got, name), np.float64) - o.exact)
            assert np.all(err <= o.tolerance), name


@pytest.mark.parametrize("name", ["flash-attention-2", "torch-sdpa-flash-cuda"])
def test_the_descriptor_judges_grouped_heads(name):
    """Grouped heads as ``mha_bwd`` computes them (flash_api.cpp): each query head's dK, dV in
    the input type (``dk_expanded``), then each group's sum in float32, rounded to the input
    type (``at::sum_out``), within the oracle's ``enable_gqa`` tolerance; a kernel that
    returns one head's dK instead of the group's sum is outside it."""
    kernel = get_backward_kernel(name)
    assert kernel.grouped == "per-head"
    rng = np.random.default_rng(1)
    q, g = (round_to(rng.standard_normal((4, 40, 32)), "bfloat16") for _ in range(2))
    k, v = (round_to(rng.standard_normal((2, 40, 32)), "bfloat16") for _ in range(2))
    oracle = attention_grad_oracle(
        q, k, v, g, kernel=kernel, dtype="bfloat16", is_causal=True, enable_gqa=True
    )
    mask = np.tril(np.ones((40, 40), bool))
    num, bw = kernel.candidates("bfloat16", 40)[0]
    got = mhanum.attention_grad(q, np.repeat(k, 2, 0), np.repeat(v, 2, 0), g, mask,
                                numerics=num, backward=bw)  # fmt: skip
    grads = {"dq": np.asarray(got.dq, np.float64)}
    for n in ("dk", "dv"):
        per_head = np.asarray(getattr(got, n), np.float64).reshape(2, 2, 40, 32)
        grads[n] = round_to(per_head.astype(np.float32).sum(axis=1, dtype=np.float32), "bfloat16")
    for n, x in grads.items():
        o = oracle.oracles[n]
        assert x.shape == o.exact.shape, n
        assert np.all(np.abs(x - o.exact) <= o.tolerance), n
    one_head = round_to(np.asarray(got.dk, np.float64)[::2], "bfloat16")
    assert np.any(np.abs(one_head - oracle.oracles["dk"].exact) > oracle.oracles["dk"].tolerance)


def test_theorems_without_the_exp2_refuse_it_by_name():
    q, k, v, g = _case(0, "bfloat16", lq=4, lk=4, d=4)
    num = fa2("bfloat16")
    with pytest.raises(
        InvalidArgument,
        match=r"exp_form: expected 'exp' for the backward pass, or 'exp2-folded' with",
    ):
        mhanum.attention_grad(q, k, v, g, numerics=num, backward="textbook")
    with pytest.raises(InvalidArgument, match=r"exp_form: expected 'exp' for Theorem B\.5"):
        attention_grad_bound(q, k, v, g, numerics=num, backward=BACKWARD, lam=4.0)
    with pytest.raises(InvalidArgument, match=r"exp_form: expected 'exp' for Theorem B\.4"):
        attention_grad_bound_a_priori(
            4, 4, 4, q_norm=1.0, k_norm=1.0, v_max=1.0, d_out_max=1.0, numerics=num,
            backward=BACKWARD,
        )  # fmt: skip
    with pytest.raises(InvalidArgument, match="prob_offset: expected 0 for the backward"):
        mhanum.attention_grad(
            q, k, v, g, numerics=dataclasses.replace(num, prob_offset=3), backward=BACKWARD
        )
    params, x = mhanum.MHAParams.random(8, seed=0), np.ones((4, 8))
    with pytest.raises(InvalidArgument, match=r"exp_form: expected 'exp' for Theorem B\.6"):
        mha_grad_bound(x, x, x, params, 2, numerics=num, backward=BACKWARD)
