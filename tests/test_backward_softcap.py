"""The soft-capped backward (``softcap=c``: ``dA = dS ∘ sech²(s/c)`` for dq and dk): the
emulation against the certified reference within Theorem B.7's bound, from caps far above the
logits to caps that saturate ``tanh`` (where the reference needs ``sech²``, not ``1 - tanh²``)."""

from __future__ import annotations

import numpy as np
import pytest

import mhanum
from mhanum import Backward, InvalidArgument, reference
from mhanum.bounds.backward import attention_grad_bound

MASK = np.tril(np.ones((6, 6), bool))
# (input scale, cap): logits well inside the cap, around it, and 10^3 times past it
CASES = [(0.3, 30.0), (3.0, 2.0), (30.0, 0.5)]


def _inputs(scale: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [scale * rng.standard_normal((2, 6, 4)) for _ in range(4)]


@pytest.mark.parametrize("algorithm", ["textbook", "flash2"])
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16", "tensor-core-bf16"])
@pytest.mark.parametrize(("scale", "cap"), CASES)
def test_soft_capped_gradients_are_within_theorem_b7(preset, algorithm, scale, cap):
    q, k, v, g = _inputs(scale)
    backward = Backward(algorithm, block_q=4, block_k=2) if algorithm == "flash2" else algorithm
    got = mhanum.attention_grad(q, k, v, g, MASK, numerics=preset, backward=backward, softcap=cap)
    exact = reference.attention_grad(q, k, v, g, mask=MASK, softcap=cap, digits=17)
    bounds = attention_grad_bound(q, k, v, g, MASK, numerics=preset, backward=backward, softcap=cap)
    for name in ("dq", "dk", "dv", "dbias"):
        b = getattr(bounds, name)
        err = np.abs(np.asarray(getattr(got, name), np.float64) - getattr(exact, name))
        assert np.isfinite(b.total).all(), (name, b.reasons)
        assert (err <= b.total).all(), (name, float(np.max(err / b.total)))


def test_a_saturated_cap_all_but_stops_dq():
    """Past the cap, sech²(s/c) is below 1e-50: the exact dq nearly vanishes, while dbias (taken
    before the cap) does not. float32's ``1 - t̂²`` cancels to exactly 0, so the computed dq is
    0, and the bound, which charges ``σ̂`` its absolute error (about u), covers the gap."""
    q, k, v, g = _inputs(30.0)
    exact = reference.attention_grad(q, k, v, g, mask=MASK, softcap=0.05, digits=17)
    got = mhanum.attention_grad(q, k, v, g, MASK, numerics="fp32", softcap=0.05)
    bounds = attention_grad_bound(q, k, v, g, MASK, numerics="fp32", softcap=0.05)
    assert np.max(np.abs(exact.dq)) < 1e-50
    assert np.max(np.abs(exact.dbias)) > 1.0
    assert np.all(np.asarray(got.dq) == 0)
    assert (np.abs(exact.dq) <= bounds.dq.total).all()


def test_a_cap_is_checked_by_name():
    q, k, v, g = _inputs(1.0)
    with pytest.raises(InvalidArgument, match="softcap"):
        mhanum.attention_grad(q, k, v, g, softcap=-1.0)
    with pytest.raises(InvalidArgument, match="softcap"):
        attention_grad_bound(q, k, v, g, softcap=0.0)
