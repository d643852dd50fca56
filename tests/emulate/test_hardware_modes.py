"""Hardware dot units emulated on the CPU: bf16 passes, TF32, tensor cores, fp8 inputs.

Every emulated matmul is compared with the exact products (rational arithmetic on the binary
inputs) and must lie within the a priori bound of its unit (Theorems R.5, R.7, T.2).
"""

from __future__ import annotations

from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhanum import InvalidArgument, Numerics, round_to
from mhanum.bounds.summation import dot_factor
from mhanum.emulate import summation

F32_TINY = 2.0**-126


def _exact_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` exactly (as Fractions of the binary inputs), rounded to float64 at the end."""
    fa = [[Fraction(float(x)) for x in row] for row in a]
    fb = [[Fraction(float(x)) for x in row] for row in b.T]
    return np.array(
        [[float(sum(x * y for x, y in zip(r, c, strict=True))) for c in fb] for r in fa]
    )


def _relative(computed: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|computed - a b| / (|a| |b|)`` entrywise."""
    exact = _exact_matmul(a, b)
    return np.abs(np.asarray(computed, np.float64) - exact) / (np.abs(a) @ np.abs(b))


UNITS = [
    ("ieee", None),
    ("ieee", "tf32"),
    ("bf16x1", None),
    ("bf16x3", None),
    ("bf16x6", None),
    ("tensor-core(h100-tf32)", None),
]


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1),
    unit=st.sampled_from(UNITS),
    order=st.sampled_from(["native", "sequential", "pairwise", "blocked(8)"]),
    n=st.sampled_from([1, 3, 16, 33]),
    spread=st.sampled_from([0.0, 4.0, 20.0]),
)
def test_emulated_units_are_within_their_bound(seed, unit, order, n, spread):
    dot, operand = unit
    if dot.startswith("tensor-core") and order not in ("native", "sequential"):
        order = "sequential"
    rng = np.random.default_rng(seed)
    # float32 values over 2^±spread binades, with mixed signs (cancellation)
    a = (rng.standard_normal((3, n)) * 2.0 ** rng.uniform(-spread, spread, (3, n))).astype("f4")
    b = (rng.standard_normal((n, 2)) * 2.0 ** rng.uniform(-spread, spread, (n, 2))).astype("f4")
    got = summation.matmul(a, b, order=order, dot=dot, operand_format=operand)
    bound = dot_factor(n, order, "float32", dot=dot, operand=operand, input="float32")
    rel = _relative(np.asarray(got), a.astype(np.float64), b.astype(np.float64))
    assert np.all(rel <= bound), f"{np.max(rel / bound):.3g}"


def test_more_passes_are_more_accurate_by_the_expected_factors():
    # Each further bf16 piece carries 8 more bits: 1 -> 3 passes drops the error by about 2^8,
    # 3 -> 6 passes by 2^7 or more (down to float32's own accumulation error).
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 64)).astype(np.float32)
    b = rng.standard_normal((64, 5)).astype(np.float32)
    med = {}
    for dot in ("bf16x1", "bf16x3", "bf16x6"):
        rel = _relative(np.asarray(summation.matmul(a, b, dot=dot)), a, b)
        med[dot] = float(np.median(rel))
        assert np.max(rel) <= dot_factor(64, "native", "float32", dot=dot)
    assert med["bf16x1"] / med["bf16x3"] > 2**6
    assert med["bf16x3"] / med["bf16x6"] > 2**5
    # six passes are as accurate as float32 accumulation of exact products
    ieee = np.median(_relative(np.asarray(summation.matmul(a, b)), a, b))
    assert med["bf16x6"] < 4 * ieee


@settings(max_examples=50)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False))
def test_three_bf16_pieces_hold_a_float32_exactly(x):
    pieces = summation.split_bf16(jnp.asarray([x], jnp.float32), 3)
    values = [float(p[0]) for p in pieces]
    assert all(float(round_to(v, "bfloat16")) == v for v in values)  # each piece is a bf16
    if abs(x) >= 2.0**-100:  # every piece (down to x's last bit) is normal: the split is exact
        assert sum(Fraction(v) for v in values) == Fraction(x)
    else:  # pieces below 2^-126 may be flushed (the bound's 2^-125 operand term)
        assert abs(sum(Fraction(v) for v in values) - Fraction(x)) < 2 * F32_TINY


def test_split_pieces_follow_xla_truncation():
    # 1 + 2^-8 + 2^-9: truncation keeps 1 (rounding would give 1 + 2^-7), the rest is 3·2^-9
    x = jnp.asarray([1 + 2.0**-8 + 2.0**-9], jnp.float32)
    hi, lo = summation.split_bf16(x, 2)
    assert float(hi[0]) == 1.0
    assert float(lo[0]) == 3 * 2.0**-9


def test_one_pass_rounds_operands_to_bfloat16():
    # bf16x1 is XLA's BF16_BF16_F32: operands rounded to nearest bfloat16, exact products
    a = np.array([[1 + 2.0**-8 + 2.0**-9]], np.float32)
    b = np.array([[1.0]], np.float32)
    assert float(summation.matmul(a, b, dot="bf16x1")[0, 0]) == 1 + 2.0**-7


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dot": "bf16x2"}, "numerics.dot"),
        ({"dot": "tensor-core(b300-fp4)"}, "model"),
        ({"dot": "bf16x3", "input": "bfloat16", "accum": "bfloat16"}, "numerics.accum"),
        ({"dot": "bf16x3", "operand_format": "tf32"}, "numerics.operand_format"),
        ({"dot": "tensor-core(h100-fp16)", "summation": "pairwise"}, "numerics.summation"),
    ],
)
def test_bad_dot_units_are_refused(changes, field):
    with pytest.raises(InvalidArgument, match=field):
        Numerics(**changes)


@pytest.mark.parametrize(
    ("preset", "dot", "operand"),
    [
        ("tpu-bf16-1pass", "bf16x1", "bfloat16"),
        ("tpu-bf16-3pass", "bf16x3", None),
        ("tpu-bf16-6pass", "bf16x6", None),
        ("tensor-core-fp16", "tensor-core(h100-fp16)", "float16"),
        ("tensor-core-bf16", "tensor-core(h100-bf16)", "bfloat16"),
        ("fp8-e4m3-fp32acc", "ieee", None),
    ],
)
def test_presets_name_their_dot_unit(preset, dot, operand):
    num = Numerics.preset(preset)
    assert num.dot == dot
    got = num.operand_rounding
    assert (got.name if got is not None else None) == operand


def test_fp8_products_are_exact_in_float32():
    # e4m3 values have 4 significant bits: every product and every short sum is exact
    a = round_to(np.linspace(-3, 3, 16).reshape(2, 8), "float8_e4m3fn").astype(np.float32)
    b = round_to(np.linspace(0.1, 7, 24).reshape(8, 3), "float8_e4m3fn").astype(np.float32)
    got = np.asarray(summation.matmul(a, b, order="sequential"), np.float64)
    np.testing.assert_array_equal(got, _exact_matmul(a, b))
