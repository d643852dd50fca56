"""mhanum.Numerics: presets, resolution of formats, validation."""

from __future__ import annotations

import math

import jax
import pytest

from mhanum import InvalidArgument, Numerics
from mhanum.numerics import PRESETS


def test_presets_are_hashable_static_arguments():
    assert len({hash(n) for n in PRESETS.values()}) == len(PRESETS)
    f = jax.jit(lambda x, numerics: x * 2, static_argnames="numerics")
    assert float(f(1.0, numerics=Numerics.preset("fp32"))) == 2.0


@pytest.mark.parametrize(
    ("name", "input_", "accum", "softmax", "score", "operand"),
    [
        ("fp64", "float64", "float64", "float64", "float64", "float64"),
        ("fp32", "float32", "float32", "float32", "float32", "float32"),
        ("tf32", "float32", "float32", "float32", "float32", "tf32"),
        ("bf16", "bfloat16", "bfloat16", "bfloat16", "bfloat16", "bfloat16"),
        ("bf16-fp32acc", "bfloat16", "float32", "float32", "bfloat16", "bfloat16"),
        ("fp16", "float16", "float16", "float16", "float16", "float16"),
        ("fp16-fp32acc", "float16", "float32", "float32", "float16", "float16"),
    ],
)
def test_preset_stage_formats(name, input_, accum, softmax, score, operand):
    num = Numerics.preset(name)
    got = tuple(num.format_of(r).name for r in ("input", "accum", "softmax", "score", "operand"))
    assert got == (input_, accum, softmax, score, operand)


def test_orders_and_algorithms_are_canonicalised():
    num = Numerics(summation=" Blocked(16) ", softmax="ONLINE(8)")
    assert (num.summation, num.summation_kind, num.summation_block) == (
        "blocked(16)",
        "blocked",
        16,
    )
    assert (num.softmax, num.softmax_kind, num.softmax_block) == ("online(8)", "online", 8)


@pytest.mark.parametrize(
    ("value", "fmt", "stored"),
    [
        (-1e9, "float16", -math.inf),
        (-1e9, "float32", -1e9),
        ("finfo.min", "bfloat16", -3.3895313892515355e38),
        ("0.7*finfo.min", "float32", -0.7 * 3.4028234663852886e38),
        (-math.inf, "float32", -math.inf),
    ],
)
def test_mask_constant_is_stored_in_the_score_format(value, fmt, stored):
    num = Numerics(input=fmt, accum="float32", mask_value=value)
    expected = float(__import__("mhanum").round_to(stored, fmt))
    assert num.mask_constant() == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input": "fp99"}, "numerics.input: expected one of"),
        ({"accum": "tf32"}, "numerics.accum: expected one of"),
        ({"input": "float32", "accum": "bfloat16"}, "numerics.accum: expected a format at least"),
        ({"operand_format": "float32", "input": "bf16", "accum": "bf16"}, "numerics.accum"),
        ({"summation": "blocked(0)"}, "numerics.summation"),
        ({"summation": "random"}, "numerics.summation"),
        ({"softmax": "online"}, "numerics.softmax"),
        ({"mask_mode": "multiply"}, "numerics.mask_mode"),
        ({"mask_value": 1.0}, "numerics.mask_value"),
        ({"mask_value": math.nan}, "numerics.mask_value"),
        ({"mask_value": "finfo.max"}, "numerics.mask_value"),
        ({"scale": "k"}, "numerics.scale"),
        ({"exp_ulps": -1}, "numerics.exp_ulps"),
        ({"softmax_format": "float8_e4m3fn"}, "numerics.softmax_format"),
    ],
)
def test_invalid_numerics_raise(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        Numerics(**kwargs)


def test_unknown_preset_raises():
    with pytest.raises(InvalidArgument, match="name: expected one of fp64, fp32"):
        Numerics.preset("fp8")
