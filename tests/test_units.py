"""mhanum.units: each choice parsed once into a frozen value whose str is today's spelling."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from mhanum import InvalidArgument, Numerics
from mhanum.numerics import PRESETS
from mhanum.units import (
    Add,
    Blocked,
    Fill,
    IEEEDot,
    Kahan,
    Naive,
    Native,
    Online,
    Pairwise,
    Safe,
    Sequential,
    SplitBF16,
    TensorCoreDot,
    dot_unit,
    mask_mode,
    softmax_algorithm,
    summation_order,
)

UNITS = [
    (summation_order, "native", Native()),
    (summation_order, "sequential", Sequential()),
    (summation_order, "pairwise", Pairwise()),
    (summation_order, "kahan", Kahan()),
    (summation_order, "blocked(8)", Blocked(8)),
    (softmax_algorithm, "naive", Naive()),
    (softmax_algorithm, "safe", Safe()),
    (softmax_algorithm, "online(64)", Online(64)),
    (dot_unit, "ieee", IEEEDot()),
    (dot_unit, "bf16x1", SplitBF16(1)),
    (dot_unit, "bf16x6", SplitBF16(6)),
    (dot_unit, "tensor-core(h100-fp16)", TensorCoreDot("h100-fp16")),
    (mask_mode, "fill", Fill()),
    (mask_mode, "add", Add()),
]


@pytest.mark.parametrize(("parse", "text", "unit"), UNITS, ids=[u[1] for u in UNITS])
def test_a_unit_is_its_spelling_and_survives_every_copy(parse, text, unit):
    spelled = text.upper() if "(" not in text and parse is not mask_mode else text
    parsed = parse(spelled)  # case-insensitive where Numerics always was
    assert parsed == unit == text
    assert type(parsed) is type(unit)
    assert str(parsed) == text
    assert hash(parsed) == hash(text)
    assert json.dumps(parsed) == json.dumps(text)
    for copied in (pickle.loads(pickle.dumps(parsed)), copy.deepcopy(parsed)):
        assert copied == parsed
        assert type(copied) is type(parsed)
    assert parse(parsed) is parsed  # parsed once: a unit passes through untouched
    with pytest.raises(AttributeError):
        parsed.block = 3


def test_typed_fields_and_heights():
    assert Blocked(8).block == 8
    assert Online(16).block == 16
    assert Native().block is None
    assert SplitBF16(3).passes == 3
    assert SplitBF16(3).kind == "split"
    assert SplitBF16(1).kind == "ieee"
    assert SplitBF16(1).operand_format == "bfloat16"
    assert TensorCoreDot("a100-bf16").operand_format == "bfloat16"
    assert TensorCoreDot("h100-fp16").model == "h100-fp16"
    heights = {o: [summation_order(o).height(n) for n in (1, 2, 3, 9, 16)] for o in
               ("sequential", "pairwise", "blocked(4)")}  # fmt: skip
    assert heights == {
        "sequential": [0, 1, 2, 8, 15],
        "pairwise": [0, 1, 2, 4, 4],
        "blocked(4)": [0, 1, 2, 3 + 2, 3 + 3],
    }
    with pytest.raises(InvalidArgument, match="tree order"):
        Kahan().height(4)


@pytest.mark.parametrize(
    ("parse", "value", "argname"),
    [
        (summation_order, "blocked(0)", "summation"),
        (summation_order, 3, "summation"),
        (softmax_algorithm, "online", "softmax"),
        (softmax_algorithm, "online(0)", "softmax"),
        (dot_unit, "bf16x2", "dot"),
        (dot_unit, "tensor-core(b200-fp4)", "model"),
        (mask_mode, "multiply", "mask_mode"),
    ],
)
def test_bad_spellings_name_the_argument(parse, value, argname):
    with pytest.raises(InvalidArgument, match=rf"^{argname}: expected"):
        parse(value)


def test_bad_constructor_arguments_are_refused():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidArgument, match="block"):
            Blocked(bad)
    with pytest.raises(InvalidArgument, match="passes"):
        SplitBF16(2)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_hold_units_and_round_trip_through_json(name):
    num = PRESETS[name]
    assert isinstance(num.order, type(summation_order(num.summation)))
    assert num.summation is num.order
    assert num.softmax is num.softmax_algorithm
    again = Numerics.from_dict(json.loads(json.dumps(num.to_dict(), allow_nan=False)))
    assert again == num
    assert hash(again) == hash(num)
    assert again.describe() == num.describe()


def test_numerics_built_from_units_or_spellings_are_one_jit_key():
    a = Numerics(summation="blocked(8)", softmax="online(4)", dot="bf16x3")
    b = Numerics(summation=Blocked(8), softmax=Online(4), dot=SplitBF16(3))
    assert a == b
    assert hash(a) == hash(b)
    assert a.describe() == (
        "Numerics(input='float32', accum='float32', summation='blocked(8)', "
        "softmax='online(4)', dot='bf16x3')"
    )
    assert (a.summation_kind, a.summation_block, a.softmax_kind, a.softmax_block) == (
        "blocked", 8, "online", 4,
    )  # fmt: skip
