"""Step 1k: the operands a dot reads through its operand format (TF32, ``bf16x1``), computed
from exact inputs (``input_rounding="exact"``) instead of bounded by step 1
(tests/bounds/test_input_rounding.py checks the term against the references' difference)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mhanum as mn
from mhanum import reference
from mhanum.bounds import attention_bound, mha_bound
from mhanum.bounds.forward.operands import read_by_the_dot
from mhanum.formats import get_format, round_to

TF32 = mn.Numerics.preset("tf32")
NUMERICS = {
    "tf32": TF32,
    "tf32-q": TF32.replace(scale="q"),
    "tf32-qk": TF32.replace(scale="qk"),
    "bf16x1": mn.Numerics.preset("fp32").replace(dot="bf16x1"),
    "fp32-bf16-operands": mn.Numerics.preset("fp32").replace(operand_format="bfloat16"),
}
F32_MAX = float(np.finfo(np.float32).max)


def test_each_entry_is_read_where_its_rounding_is_known():
    """Closed forms in TF32 (p = 11): a value off the grid rounds to nearest; a tie, a value
    below the smallest normal number (it may be read as zero), one whose rounding overflows and
    zero stay as they are."""
    one_ulp = 2.0**-10  # TF32's spacing in [1, 2)
    x = np.array([
        1 + one_ulp / 4,  # -> 1
        1 + 3 * one_ulp / 4,  # -> 1 + ulp
        -(1 + 3 * one_ulp / 4),  # -> -(1 + ulp)
        1 + one_ulp / 2,  # a tie: stays
        -(3 + one_ulp),  # a tie in [2, 4): stays
        2.0**-127 * 1.5,  # below 2^-126: stays
        F32_MAX,  # rounds to inf in TF32: stays
        0.0,
        2.0**-126,  # the smallest normal number: a value of TF32
    ])  # fmt: skip
    expected = [1.0, 1 + one_ulp, -(1 + one_ulp), *x[3:]]
    assert read_by_the_dot(x, TF32).tolist() == expected


def test_nothing_changes_without_an_ieee_operand_rounding():
    x = np.array([1 + 2.0**-12, 3.0])
    for preset in ("fp32", "bf16-fp32acc"):
        assert read_by_the_dot(x, mn.Numerics.preset(preset)) is x


def _inputs(seed: int, n: int = 32, d: int = 16, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (scale * rng.standard_normal((n, d))).astype(np.float32).astype(np.float64)
        for _ in range(3)
    ]


def _read(q, k, v, num):
    """The inputs as step 1k passes them to A.1 (the dots' reads where known)."""
    return (
        read_by_the_dot(q, num) if num.scale == "scores" else q,
        read_by_the_dot(k, num) if num.scale != "qk" else k,
        read_by_the_dot(v, num),
    )


@pytest.mark.parametrize("name", NUMERICS)
def test_the_kernel_reads_the_same_operands(name):
    """Step 1k's premise, on the emulation: the kernel's output on the inputs is its output on
    what step 1k passes on, bit for bit (ties, tiny values and values near float32's largest
    finite number among them)."""
    num = NUMERICS[name]
    q, k, v = _inputs(5, n=16, d=8)
    q[0, :3] = [1 + 2.0**-11, 2.0**-127, 1 + 2.0**-9 + 2.0**-12]  # a TF32 tie, tiny, off-grid
    k[1, :2] = [2.0**-130, -(1 + 2.0**-8)]  # tiny; a bfloat16 tie
    v[2, :2] = [F32_MAX / 4, 2.0**-140]
    for mask in (None, np.tril(np.ones((16, 16), bool))):
        a = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
        b = np.asarray(mn.attention(*_read(q, k, v, num), mask, numerics=num), np.float64)
        np.testing.assert_array_equal(a, b)


def test_the_probabilistic_bound_holds_and_keeps_its_probability():
    """A.3 with step 1k, TF32: within the bound at every entry (the operands' roundings, the
    largest part of TF32's error, are computed, not drawn), at the stated probability."""
    q, k, v = _inputs(3, n=64, d=64)
    b = attention_bound(q, k, v, numerics=TF32, probability=0.99, input_rounding="exact")
    assert b.probability >= 0.99
    out = np.asarray(mn.attention(q, k, v, numerics=TF32), np.float64)
    err = np.abs(out - np.asarray(reference.attention(q, k, v), np.float64))
    assert np.all(err <= b.total)


_EDGE = st.sampled_from([1.0, 2.0**-100, 2.0**100, 2.0**-120, 2.0**120])


@given(
    name=st.sampled_from(sorted(NUMERICS)),
    seed=st.integers(0, 2**16),
    scales=st.tuples(_EDGE, _EDGE, _EDGE),
    ties=st.integers(0, 7),
)
def test_the_bound_holds_over_the_exponent_range(name, seed, scales, ties):
    """Over float32's exponent range (inputs scaled by ``2^±100``, ``2^±120``, with ties of
    the operand format planted), step 1k's bound holds on the emulation wherever it is finite,
    and the kernel reads the same operands from the inputs as from what step 1k passes on."""
    num = NUMERICS[name]
    rng = np.random.default_rng(seed)
    q, k, v = (s * rng.standard_normal((8, 4)) for s in scales)
    q, k, v = (round_to(x, "float32") for x in (q, k, v))
    p = get_format(num.operand_rounding).precision
    for x in (q, k, v):  # a tie of F_op: the midpoint of two neighbours
        flat = x.reshape(-1)[:ties]
        m, e = np.frexp(flat)
        flat[:] = np.ldexp(np.round(m * 2.0**p) / 2.0**p + 2.0 ** -(p + 1), e)
    if not all(np.isfinite(x).all() for x in (q, k, v)):
        return
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    np.testing.assert_array_equal(
        out, np.asarray(mn.attention(*_read(q, k, v, num), numerics=num), np.float64)
    )
    b = attention_bound(q, k, v, numerics=num, input_rounding="exact")
    exact = np.asarray(reference.attention(q, k, v), np.float64)
    total = np.asarray(b.total)
    finite = np.isfinite(total) & np.isfinite(exact)
    assert np.all(np.abs(out - exact)[finite] <= total[finite])
    assert not np.isnan(total).any()


def test_mha_reads_inputs_and_weights_as_the_projections_do():
    """A.2 with step 1k (TF32): the layer reads the same operands from the inputs and weights
    as from what step 1k passes on, bit for bit, and the bound holds on the emulation."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 32)).astype(np.float32).astype(np.float64)
    params = mn.MHAParams(
        **{
            n: None if a is None else round_to(a, "float32")  # values of the input format
            for n, a in vars(mn.MHAParams.random(32, seed=1)).items()
        }
    )
    read = mn.MHAParams(
        **{
            n: (read_by_the_dot(a, TF32) if n.startswith("w") else a)
            for n, a in vars(params).items()
        }
    )
    a = np.asarray(mn.multi_head_attention(x, x, params, 4, numerics=TF32), np.float64)
    x_read = read_by_the_dot(x, TF32)
    b = np.asarray(mn.multi_head_attention(x_read, x_read, read, 4, numerics=TF32), np.float64)
    np.testing.assert_array_equal(a, b)
    bound = mha_bound(x, x, params, 4, numerics=TF32, input_rounding="exact")
    bounded = mha_bound(x, x, params, 4, numerics=TF32, input_rounding="bounded")
    err = np.abs(a - np.asarray(reference.multi_head_attention(x, x, params, 4), np.float64))
    assert "input_rounding" in bound.terms
    assert np.all(err <= bound.total)
    # the projections' reads of x and the weights no longer charged u_op per product
    assert np.median(bound.total) < 0.5 * np.median(bounded.total)
    assert math.isfinite(float(np.max(bound.total)))
