"""Theorems B.1/B.2 (and B.7 with a soft-cap) at the edges of the formats' ranges (property tests).

The inputs come from :data:`mhanum.strategies.RANGE_STRUCTURES`, as for the forward bound
(``tests/bounds/test_ranges.py``): values near each format's largest finite value and its square
root, near the smallest normal number and subnormal, scales and biases across the exponent range;
``d_out`` is drawn the same way. The assertion is the theorem: where a gradient's bound is finite
the computed gradient is finite and within it of the certified reference; where it is infinite,
``Bound.reasons`` says why. An input the bound refuses or the reference cannot certify is
skipped.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mhanum
from mhanum import Backward, CertificationError, InvalidArgument, Numerics, reference
from mhanum import strategies as mst
from mhanum.bounds.backward import attention_grad_bound

pytestmark = pytest.mark.slow  # every test here takes more than the fast tier's 3 s

SHAPES = ((2, 4, 4, 2), (3, 8, 8, 3))
"""``(q_len, kv_len, d_k, d_v)``: one compilation per numerics, algorithm and shape."""

ALGORITHMS = {"textbook": "textbook", "flash2": Backward("flash2", block_q=2, block_k=4)}
PRESETS = ("fp32", "tf32", "bf16-fp32acc", "fp16", "fp8-e4m3-fp32acc")
CAPS = st.sampled_from([None, 30.0, 1.0, 2.0**-20, 2.0**40])
"""Gemma 2's cap, and caps whose reciprocal or whose value leaves a narrow score format."""

RANGE_SETTINGS = settings(
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)


def theorem_at_the_edges(
    data: st.DataObject,
    num: Numerics,
    algorithm: str | Backward,
    softcap: float | None,
    *,
    bias: bool = True,
) -> None:
    q_len, kv_len, d_k, d_v = data.draw(st.sampled_from(SHAPES), label="shape")
    x = data.draw(
        mst.attention_inputs(
            q_len=q_len, kv_len=kv_len, d_k=d_k, d_v=d_v, structure="range", numerics=num
        )
    )
    d_out = data.draw(
        mst.attention_inputs(
            q_len=q_len, kv_len=q_len, d_k=d_v, d_v=d_v, structure="range", numerics=num
        )
    ).q
    mask = None
    if data.draw(st.booleans(), label="masked"):
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="mask seed"))
        mask = rng.random((q_len, kv_len)) < 0.5
        mask[np.arange(q_len), rng.integers(0, kv_len, q_len)] = True  # every row keeps a key
    kw = {"bias": x.bias if bias else None, "scale": x.scale, "softcap": softcap}
    backward = ALGORITHMS[algorithm] if isinstance(algorithm, str) else algorithm
    try:
        with np.errstate(all="ignore"):
            bounds = attention_grad_bound(
                x.q, x.k, x.v, d_out, mask, numerics=num, backward=backward, **kw
            )
        exact = reference.attention_grad(x.q, x.k, x.v, d_out, mask=mask, digits=17, **kw)
    except (InvalidArgument, CertificationError):
        assume(False)
        raise  # unreachable: assume(False) raises
    got = mhanum.attention_grad(x.q, x.k, x.v, d_out, mask, numerics=num, backward=backward, **kw)
    for name in ("dq", "dk", "dv", "dbias"):
        b, want = getattr(bounds, name), getattr(exact, name)
        if want is None:
            continue
        total = np.asarray(b.total, np.float64)
        computed = np.asarray(getattr(got, name), np.float64)
        finite = np.isfinite(total)
        where = f"{name}, {num.describe()}, {algorithm}, softcap {softcap!r}"
        assert finite.all() or b.reasons, f"{where}: an infinite bound must say why"
        assert np.isfinite(computed[finite]).all(), f"{where}: a non-finite gradient, finite bound"
        with np.errstate(over="ignore", invalid="ignore"):
            err = np.abs(computed - want)
        over = finite & ~(err <= total)
        assert not over.any(), f"{where}: error {err[over]} over the bound {total[over]}"


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("preset", PRESETS)
@RANGE_SETTINGS
@given(data=st.data())
def test_every_gradient_at_the_range_edges(preset, algorithm, data):
    theorem_at_the_edges(data, Numerics.preset(preset), algorithm, None)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@settings(RANGE_SETTINGS, max_examples=max(5, RANGE_SETTINGS.max_examples // 3))  # compiles each
@given(data=st.data())
def test_custom_numerics_gradients_at_the_range_edges(algorithm, data):
    num = data.draw(mst.numerics(presets=False, free=False, custom=True, bounded=True))
    theorem_at_the_edges(data, num, algorithm, None)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
@RANGE_SETTINGS
@given(data=st.data(), softcap=CAPS)
def test_soft_capped_gradients_at_the_range_edges(preset, algorithm, data, softcap):
    theorem_at_the_edges(data, Numerics.preset(preset), algorithm, softcap)


def test_an_operand_rounded_past_the_accumulation_format_is_named():
    # float16's largest finite 65504 rounds to 65536 in a bfloat16 operand format, which a
    # float16 accumulator cannot hold: the emulated dV is inf, and its bound must say so (it was
    # finite: the operand was checked against float16 before its rounding into bfloat16)
    num = Numerics(input="float16", accum="float16", operand_format="bfloat16")
    q = np.array([[0.125, -0.125, 0.625, 0.125], [-0.5, 0.375, 1.25, 0.875]])
    k = np.array([[-0.75, -1.25, -0.625, 0.0625], [-2.25, -0.25, -1.25, -0.75],
                  [-0.5, -0.3125, 0.375, 1.0], [-0.125, 1.375, -0.625, 0.375]])  # fmt: skip
    v = np.array(
        [[58592.0, 6096.0], [-48256.0, -59808.0], [-29696.0, 14288.0], [-65504.0, -13576.0]]
    )
    d_out = np.array([[12856.0, -13504.0], [65504.0, 10728.0]])
    got = mhanum.attention_grad(q, k, v, d_out, numerics=num, backward=ALGORITHMS["textbook"])
    assert not np.isfinite(np.asarray(got.dv, np.float64)).all()
    bounds = attention_grad_bound(q, k, v, d_out, numerics=num, backward=ALGORITHMS["textbook"])
    assert not np.isfinite(bounds.dv.total).any()
    assert any("read into the accumulation format" in r for r in bounds.dv.reasons)
