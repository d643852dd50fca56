"""mhanum.formats: exact rounding, checked exhaustively against ml_dtypes and by definition."""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mhanum import InvalidArgument
from mhanum.formats import FORMATS, get_format, representable, round_jax, round_to, ulp

EXHAUSTIVE = [
    ("bfloat16", ml_dtypes.bfloat16, np.uint16),
    ("float16", np.float16, np.uint16),
    ("float8_e4m3fn", ml_dtypes.float8_e4m3fn, np.uint8),
    ("float8_e5m2", ml_dtypes.float8_e5m2, np.uint8),
]


def _every_finite_value(dtype, uint) -> np.ndarray:
    bits = np.arange(np.iinfo(uint).max + 1, dtype=np.uint64).astype(uint)
    with np.errstate(invalid="ignore"):  # the NaN bit patterns
        values = bits.view(dtype).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def _probes(values: np.ndarray) -> np.ndarray:
    """Every value, every midpoint, and their float32 neighbours, plus overflow probes."""
    mids = (values[1:] + values[:-1]) / 2  # exact in float64
    base = np.concatenate([values, mids]).astype(np.float32)
    up = np.nextafter(base, np.float32(np.inf))
    down = np.nextafter(base, np.float32(-np.inf))
    top = float(values.max())
    with np.errstate(over="ignore"):
        far = np.float32([top * 1.0625, top * 1.125, top * 2, 1e30, -1e30])
    probes = np.concatenate([base, up, down, far])
    return probes[np.isfinite(probes)]


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b) & (np.signbit(a) == np.signbit(b)) | (np.isnan(a) & np.isnan(b))


@pytest.mark.parametrize(("name", "dtype", "uint"), EXHAUSTIVE)
def test_round_to_matches_ml_dtypes_on_every_value_and_midpoint(name, dtype, uint):
    # ml_dtypes rounds float32 correctly (its float64 path went through float32 before 0.7).
    probes = _probes(_every_finite_value(dtype, uint))
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow probes
        expected = probes.astype(dtype).astype(np.float64)
    assert _same(round_to(probes, name), expected).all()


@pytest.mark.parametrize(("name", "dtype", "uint"), EXHAUSTIVE)
@pytest.mark.parametrize("carrier", [np.float32, np.float64])
def test_round_jax_matches_round_to(name, dtype, uint, carrier):
    probes = _probes(_every_finite_value(dtype, uint))
    got = np.asarray(round_jax(jnp.asarray(probes.astype(carrier)), name), np.float64)
    assert _same(got, round_to(probes, name)).all()


def _float64_patterns() -> np.ndarray:
    """float64 bit patterns of every class: uniform random bits (NaNs with payloads, infinities,
    subnormals, both signs, every exponent), each format's normal and subnormal ranges and its
    overflow threshold densely, and the special values."""
    rng = np.random.default_rng(20261201)
    bits = rng.integers(0, 2**64, 2**16, dtype=np.uint64, endpoint=False).view(np.float64)
    spread = np.ldexp(rng.uniform(1.0, 2.0, 2**16), rng.integers(-1080, 1024, 2**16))
    with np.errstate(over="ignore"):  # (float64's own overflow threshold: inf, a class too)
        edges = [
            np.float64(f.max_finite) * rng.uniform(0.99, 1.01, 512) for f in FORMATS.values()
        ] + [np.float64(f.smallest_normal) * rng.uniform(0.0, 1.01, 512) for f in FORMATS.values()]
    special = np.array([0.0, np.inf, np.nan, 2.0**-1074, 2.0**-1022, 1 + 2.0**-8 + 2.0**-30])
    values = np.concatenate([bits, spread, *edges, special])
    return np.concatenate([values, -values])


@pytest.mark.parametrize("mode", ["nearest", "toward_zero"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_to_is_round_jax_bit_for_bit_on_every_pattern_class(name, mode):
    # round_to runs the rounding in place in numpy, round_jax as a JAX expression: one
    # algorithm, two implementations, the same bits (NaN payloads aside: any NaN is NaN)
    x = _float64_patterns()
    with np.errstate(invalid="ignore"):
        numpy_bits = round_to(x, name, mode)
    jax_bits = np.asarray(round_jax(jnp.asarray(x), name, mode))
    both_nan = np.isnan(numpy_bits) & np.isnan(jax_bits)
    assert (both_nan | (numpy_bits.view(np.uint64) == jax_bits.view(np.uint64))).all()


def test_round_to_is_one_rounding_from_float64():
    # Just above the midpoint between 1 and 1 + 2**-7: rounds up. Via float32 it would tie to 1.
    x = 1 + 2.0**-8 + 2.0**-30
    assert float(round_to(x, "bfloat16")) == 1 + 2.0**-7
    assert float(np.float64(x).astype(np.float32).astype(ml_dtypes.bfloat16)) == 1.0


def _tf32_by_definition(x: np.ndarray) -> np.ndarray:
    """float32 with the low 13 fraction bits rounded off, ties to even (10-bit fraction)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def test_tf32_is_float32_with_a_ten_bit_fraction():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(100_000).astype(np.float32)
            * np.float32(2.0) ** rng.integers(-120, 120, 100_000),
            # every fraction pattern of the 13 dropped bits, around 1 and around a subnormal-free binade
            (np.uint32(0x3F800000) + np.arange(1 << 14, dtype=np.uint32)).view(np.float32),
        ]
    )
    assert _same(round_to(x, "tf32"), _tf32_by_definition(x)).all()
    assert get_format("tf32").precision == 11
    assert get_format("tf32").emin == -126


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(x=st.floats(allow_nan=False, allow_infinity=False, width=64))
@example(x=0.0)
@example(x=-0.0)
@example(x=5e-324)
def test_toward_zero_is_the_largest_value_not_above(name, x):
    fmt = FORMATS[name]
    r = float(round_to(x, fmt, mode="toward_zero"))
    assert math.copysign(1, r) == math.copysign(1, x)
    assert abs(r) <= abs(x)
    assert representable(r, fmt)
    if abs(r) < fmt.max_finite:
        # the next value of the format above |r| exceeds |x|
        assert abs(r) + float(ulp(abs(r) if r else 0.0, fmt)) > abs(x) or abs(r) == abs(x)


@pytest.mark.parametrize("name", sorted(FORMATS))
@given(x=st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_nearest_is_within_half_an_ulp(name, x):
    fmt = FORMATS[name]
    r = float(round_to(x, fmt))
    if math.isfinite(r):
        assert representable(r, fmt)
        assert abs(r - x) <= float(ulp(x, fmt)) / 2


@pytest.mark.parametrize(
    ("x", "name", "expected"),
    [
        (-1e9, "float16", -math.inf),  # masking constant overflows
        (65519.99, "float16", 65504.0),
        (65520.0, "float16", math.inf),  # the midpoint ties to the even 2**16: overflow
        (464.0, "float8_e4m3fn", 448.0),  # tie to even below the top
        (465.0, "float8_e4m3fn", math.nan),  # no infinity in e4m3fn
        (61440.0, "float8_e5m2", math.inf),
        (1e9, "float32", 1e9),
        (2.0**-150, "float32", 0.0),  # half the smallest subnormal ties to zero
        (3 * 2.0**-150, "float32", 2.0**-148),
    ],
)
def test_round_to_named_values(x, name, expected):
    got = float(round_to(x, name))
    assert got == expected or (math.isnan(got) and math.isnan(expected))


def test_toward_zero_overflow_saturates():
    assert float(round_to(1e6, "float16", mode="toward_zero")) == 65504.0
    assert float(round_to(-1e6, "float8_e4m3fn", mode="toward_zero")) == -448.0
    assert float(round_to(math.inf, "float16", mode="toward_zero")) == math.inf
    assert math.isnan(float(round_to(math.inf, "float8_e4m3fn", mode="toward_zero")))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_constants_agree_with_ml_dtypes(name):
    fmt = FORMATS[name]
    info = ml_dtypes.finfo(fmt.numpy_dtype) if name != "tf32" else None
    if info is not None:
        assert fmt.max_finite == float(info.max)
        assert fmt.smallest_normal == float(info.smallest_normal)
        assert fmt.smallest_subnormal == float(info.smallest_subnormal)
        assert fmt.eps == float(info.eps)
    assert fmt.u == fmt.eps / 2


def test_ulp_of_1e9_in_float32_is_64():
    assert float(ulp(1e9, "float32")) == 64.0
    assert float(ulp(0.0, "float16")) == 2.0**-24
    assert isinstance(ulp(1e9, "float32"), np.float64)  # a scalar for a scalar


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_ulp_of_an_infinity_is_infinite_and_of_a_nan_nan(name):
    # frexp reads inf as exponent 0: the spacing of 0.5, a finite number far below the truth
    fmt = FORMATS[name]
    got = ulp(np.array([np.inf, -np.inf, np.nan, fmt.max_finite]), name)
    assert np.isposinf(got[:2]).all()
    assert np.isnan(got[2])
    top = math.frexp(fmt.max_finite)[1] - 1  # 2**top <= max_finite < 2**(top + 1)
    assert got[3] == 2.0 ** (top + 1 - fmt.precision)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: get_format("fp99"), "fmt: expected one of"),
        (lambda: round_to([1.0], "float32", mode="up"), "mode: expected one of"),
        (lambda: round_to(np.array(["a"]), "float32"), "x: expected a real numeric array"),
        (
            lambda: round_jax(jnp.asarray([1], jnp.int32), "float16"),
            "x: expected a float32 or float64",
        ),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()
