"""Numerics.to_dict / from_dict: the one serialisation of a Numerics (and a Backward), strict
JSON, read back equal, and the forms earlier versions wrote still read."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mhanum.report
from mhanum import InvalidArgument, Numerics, attention, cases
from mhanum import search as ms
from mhanum import strategies as mst
from mhanum.numerics import BACKWARD_ALGORITHMS, PRESETS, SCALE_AT, Backward

ROOT = Path(__file__).resolve().parents[1]
RECORDS = sorted((ROOT / "papers" / "measurements").glob("*.jsonl"))

BF16_FP32ACC = {
    "input": "bfloat16",
    "accum": "float32",
    "summation": "native",
    "softmax": "safe",
    "softmax_format": None,
    "score_format": None,
    "prob_format": None,
    "output_format": None,
    "operand_format": None,
    "dot": "ieee",
    "mask_mode": "fill",
    "mask_value": "-inf",
    "scale": "scores",
    "scale_format": None,
    "exp_form": "exp",
    "online_sums": "block",
    "exp_ulps": 2.0,
    "div_ulps": 1.0,
    "kv_splits": None,
    "tanh_ulps": 8.0,
    "prob_offset": 0,
}

# What the first saved cases held (mhanum/cases.py as first committed: every field Numerics
# had then, -inf as "-inf", the division assumed correctly rounded).
FIRST_CASE_NUMERICS = {
    "input": "bfloat16",
    "accum": "float32",
    "summation": "native",
    "softmax": "safe",
    "softmax_format": None,
    "score_format": None,
    "prob_format": None,
    "output_format": None,
    "operand_format": None,
    "dot": "ieee",
    "mask_mode": "fill",
    "mask_value": "-inf",
    "scale": "scores",
    "scale_format": None,
    "exp_ulps": 2.0,
    "div_ulps": 0.5,
}


def _through_json(fields):
    return json.loads(json.dumps(fields, allow_nan=False))


def _plain(value):
    """Whether ``value`` is plain JSON data: no str subclass, no tuple, no non-finite float."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if type(value) is float:
        return math.isfinite(value)
    return type(value) in (str, int, type(None))


# Round trips ---------------------------------------------------------------------------------


# fields added after the first records were written: in a record only where not their default
LATER = {"prob_underflow": "flush"}


def _written(num):
    return [
        f.name
        for f in dataclasses.fields(Numerics)
        if f.name not in LATER or getattr(num, f.name) != LATER[f.name]
    ]


def test_the_bf16_fp32acc_preset_is_written_field_by_field():
    assert Numerics.preset("bf16-fp32acc").to_dict() == BF16_FP32ACC
    assert list(BF16_FP32ACC) == _written(Numerics.preset("bf16-fp32acc"))


def test_a_field_added_later_is_written_where_it_is_not_its_default():
    """A record of an earlier version is written back as it was; a gradual underflow is
    written and read back."""
    num = Numerics.preset("fp16-fp32acc")
    assert "prob_underflow" not in num.to_dict()
    gradual = num.replace(prob_underflow="gradual")
    fields = _through_json(gradual.to_dict())
    assert fields["prob_underflow"] == "gradual"
    assert Numerics.from_dict(fields) == gradual != num


def test_an_unknown_underflow_is_refused_by_name():
    with pytest.raises(InvalidArgument, match=r"numerics\.prob_underflow: expected one of"):
        Numerics(prob_underflow="ftz")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_strict_json(name):
    num = PRESETS[name]
    fields = num.to_dict()
    assert list(fields) == _written(num)
    assert all(_plain(v) for v in fields.values()), fields
    again = Numerics.from_dict(_through_json(fields))
    assert again == num
    assert hash(again) == hash(num)
    assert again.describe() == num.describe()


@given(mst.numerics(custom=True))
def test_drawn_numerics_round_trip_through_strict_json(num):
    fields = num.to_dict()
    assert all(_plain(v) for v in fields.values()), fields
    assert Numerics.from_dict(_through_json(fields)) == num


@st.composite
def _backwards(draw):
    algorithm = draw(st.sampled_from(BACKWARD_ALGORITHMS))
    order = None
    if algorithm == "flash2":
        order = draw(st.none() | st.permutations(range(draw(st.integers(1, 5)))))
    formats = st.none() | st.sampled_from(["float32", "float64", "bfloat16", "float16"])
    return Backward(
        algorithm,
        block_q=draw(st.integers(1, 128)),
        block_k=draw(st.integers(1, 128)),
        grad_format=draw(formats),
        ds_format=draw(formats),
        dq_order=order,
        scale_at=draw(st.sampled_from(SCALE_AT)),
        dp_format=draw(formats),
    )


@given(_backwards())
def test_drawn_backward_passes_round_trip_through_strict_json(bw):
    """Every field, but ``scale_at`` and ``dp_format`` at their defaults (omitted, so that
    earlier records are written back as they were), and back."""
    fields = bw.to_dict()
    defaults = {"scale_at": "output", "dp_format": None}
    names = [f.name for f in dataclasses.fields(Backward)]
    assert list(fields) == [n for n in names if getattr(bw, n) != defaults.get(n, object())]
    assert all(_plain(v) for v in fields.values()), fields
    assert Backward.from_dict(_through_json(fields)) == bw


# Older forms ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask_value",
    [float("-inf"), "-inf", json.loads("-Infinity")],
)
def test_minus_infinity_reads_in_every_form_it_was_written(mask_value):
    fields = {"input": "bfloat16", "accum": "float32", "mask_value": mask_value}
    assert Numerics.from_dict(fields) == Numerics.preset("bf16-fp32acc")


def test_a_field_added_since_takes_its_default():
    num = Numerics.from_dict(FIRST_CASE_NUMERICS)
    assert num == Numerics.preset("bf16-fp32acc").replace(div_ulps=0.5)
    assert (num.exp_form, num.kv_splits, num.tanh_ulps, num.prob_offset) == ("exp", None, 8.0, 0)


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.name)
def test_every_committed_device_record_reads_its_model(path):
    records = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    models = [r["model"]["numerics"] for r in records if "numerics" in r.get("model", {})]
    assert models
    for fields in models:
        num = Numerics.from_dict(fields)
        assert num == Numerics(**fields)  # as the records were read before
        assert Numerics.from_dict(_through_json(num.to_dict())) == num
    # the first record, written before strict JSON: -Infinity and no exp_form, kv_splits, ...
    assert '"mask_value": -Infinity' in json.dumps(models[0])
    assert "exp_form" not in models[0]


def _first_format_case(tmp_path: Path) -> tuple[Path, Numerics]:
    """A case written as the first case format had it: no input digest, fewer numerics fields."""
    num = Numerics.from_dict(FIRST_CASE_NUMERICS)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((1, 1, 2, 4), (1, 1, 8, 4), (1, 1, 8, 3)))
    output = np.asarray(attention(q, k, v, numerics=num), np.float64)
    stem = tmp_path / "bf16-fp32acc-error-over-bound-targeted-seed2"
    np.savez(stem.with_suffix(".npz"), q=q, k=k, v=v, output=output)
    info = {
        "mhanum_version": "0.1.0",
        "numerics": FIRST_CASE_NUMERICS,
        "preset": "bf16-fp32acc",
        "shape": {"batch": 1, "heads": 1, "q_len": 2, "kv_len": 8, "d_k": 4, "d_v": 3},
        "seed": 2,
        "objective": "error/bound",
        "error": 0.001,
        "bound": 0.01,
        "ratio": 0.1,
        "dominant_term": "logits",
        "created": "2025-06-01T00:00:00+00:00",
        "violation": False,
        "normwise": 0.001,
        "index": [0, 0, 1, 2],
        "method": "targeted",
        "budget": 12,
        "evaluations": 12,
        "cheap_ratio": 0.1,
        "slack": 1.0,
        "seconds": 1.5,
        "structure": [],
        "masked": False,
    }
    stem.with_suffix(".json").write_text(json.dumps(info, indent=2, allow_nan=False) + "\n")
    return stem.with_suffix(".npz"), num


def test_a_case_of_the_first_format_loads_and_replays(tmp_path):
    npz, num = _first_format_case(tmp_path)
    case = cases.load(npz)
    assert case.numerics == num
    result = cases.replay(npz)
    assert result.bit_for_bit
    assert result.ok
    assert not result.digest_checked
    saved = json.loads(cases.save(case, tmp_path / "again").with_suffix(".json").read_text())
    assert saved["numerics"] == num.to_dict()


def test_a_search_journal_result_of_the_previous_format_reads_back(tmp_path):
    npz, num = _first_format_case(tmp_path)
    record = cases.load(npz).record()
    assert record["numerics"] == num.to_dict()  # what a journal holds now
    # what it held before: every field, -inf as a float, so Python's json wrote -Infinity
    previous = {**num.to_dict(), "mask_value": float("-inf")}
    text = json.dumps(record | {"numerics": previous})
    assert '"mask_value": -Infinity' in text
    assert ms.WorstCase.from_record(json.loads(text)).numerics == num


def test_a_gradient_case_writes_and_reads_its_backward(tmp_path):
    small = {"q_len": 2, "kv_len": 4, "d_k": 4}
    bw = Backward("flash2", block_q=1, block_k=2, dq_order=(1, 0))
    found = ms.gradient_worst_case("fp32", small, backward=bw, budget=2)
    npz = cases.save_gradient(found, tmp_path / "gradient")
    info = json.loads(npz.with_suffix(".json").read_text())
    assert info["numerics"] == Numerics.preset("fp32").to_dict()
    assert info["backward"] == bw.to_dict()
    assert info["backward"]["dq_order"] == [1, 0]
    assert cases.load_gradient(npz).backward == bw


def test_the_report_writes_a_cases_numerics_in_the_one_form(tmp_path):
    old = {"preset": "bf16-fp32acc", "ratio": 0.1, "numerics": FIRST_CASE_NUMERICS}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "float.json").write_text(
        json.dumps({"ratio": 0.2, "numerics": {"mask_value": float("-inf")}})
    )
    read = {Path(c["file"]).name: c["numerics"] for c in mhanum.report.read_cases([tmp_path])}
    assert read["old.json"] == Numerics.from_dict(FIRST_CASE_NUMERICS).to_dict()
    assert read["float.json"] == Numerics().to_dict()
    (tmp_path / "bad.json").write_text(json.dumps({"numerics": {"summation": "zigzag"}}))
    with pytest.raises(InvalidArgument, match=r"bad\.json.*numerics\.summation: expected"):
        mhanum.report.read_cases([tmp_path])


# Refusals ------------------------------------------------------------------------------------

BAD_NUMERICS = [
    ({"precision": "high"}, "numerics.precision: expected a field of this mhanum's Numerics"),
    ({"input": None}, "numerics.input: expected a string, got None"),
    ({"input": "float99"}, "numerics.input: expected one of"),
    ({"accum": "float8_e4m3fn"}, "numerics.accum: expected one of"),
    ({"summation": "zigzag"}, "numerics.summation: expected 'native'"),
    ({"summation": 3}, "numerics.summation: expected a string, got 3"),
    ({"softmax": "online(0)"}, "numerics.softmax: expected"),
    ({"softmax_format": 32}, "numerics.softmax_format: expected a string or null, got 32"),
    ({"dot": "bf16x2"}, "numerics.dot: expected"),
    ({"mask_mode": "multiply"}, "numerics.mask_mode: expected"),
    ({"mask_value": "+inf"}, "numerics.mask_value: expected"),
    ({"mask_value": float("nan")}, "numerics.mask_value: expected"),
    ({"mask_value": 1.0}, "numerics.mask_value: expected"),
    ({"mask_value": True}, "numerics.mask_value: expected a number or a string, got True"),
    ({"mask_value": None}, "numerics.mask_value: expected a number or a string, got None"),
    ({"scale": ["q"]}, "numerics.scale: expected a string"),
    ({"exp_form": "exp10"}, "numerics.exp_form: expected one of"),
    ({"online_sums": "carried"}, "numerics.online_sums: expected one of"),
    ({"exp_ulps": "2"}, "numerics.exp_ulps: expected a number, got '2'"),
    ({"exp_ulps": float("inf")}, "numerics.exp_ulps: expected a finite number"),
    ({"div_ulps": -1}, "numerics.div_ulps: expected a finite number >= 0"),
    ({"kv_splits": 2.0}, "numerics.kv_splits: expected an integer or null, got 2.0"),
    ({"kv_splits": 0}, "numerics.kv_splits: expected None or an integer >= 1"),
    ({"tanh_ulps": None}, "numerics.tanh_ulps: expected a number, got None"),
    ({"prob_offset": True}, "numerics.prob_offset: expected an integer, got True"),
    ({"prob_offset": 8}, "numerics.prob_offset: expected 0 unless"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_NUMERICS, ids=lambda x: str(x)[:40])
def test_a_bad_numerics_dict_is_refused_naming_the_field(fields, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        Numerics.from_dict(fields)


BAD_BACKWARD = [
    ({"block": 64}, "backward.block: expected a field of this mhanum's Backward"),
    ({"algorithm": "reverse"}, "backward.algorithm: expected one of"),
    ({"block_q": 0}, "backward.block_q: expected an integer >= 1"),
    ({"block_k": 1.5}, "backward.block_k: expected an integer, got 1.5"),
    ({"grad_format": "float8_e5m2"}, "backward.grad_format: expected one of"),
    ({"ds_format": 16}, "backward.ds_format: expected a string or null, got 16"),
    ({"dq_order": "10"}, "backward.dq_order: expected a list or null, got '10'"),
    ({"algorithm": "flash2", "dq_order": [1, 1]}, "backward.dq_order: expected a permutation"),
    ({"dq_order": [0]}, "backward.dq_order: expected None with algorithm='textbook'"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_BACKWARD, ids=lambda x: str(x)[:40])
def test_a_bad_backward_dict_is_refused_naming_the_field(fields, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        Backward.from_dict(fields)


@pytest.mark.parametrize("data", [None, ["input", "float32"], "fp32", Numerics()])
def test_what_is_not_a_mapping_is_refused(data):
    with pytest.raises(InvalidArgument, match=r"^numerics: expected a mapping of Numerics fields"):
        Numerics.from_dict(data)
    with pytest.raises(InvalidArgument, match=r"^backward: expected a mapping of Backward fields"):
        Backward.from_dict(data)


# One way in, one way out ---------------------------------------------------------------------

SOURCES = sorted((ROOT / "mhanum").rglob("*.py"))
RETIRED = re.compile(
    r"\bnumerics_dict\b|\bnumerics_from_fields\b"  # the helpers to_dict/from_dict replace
    r"|asdict\([^)]*\b(n|num|numerics|against|other|backward|bw)\b"  # a Numerics by asdict
    r"|\b(Numerics|Backward)\(\*\*\w+\["  # a record's fields passed straight to the constructor
)


def test_no_other_serialisation_of_numerics_remains_in_the_package():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in SOURCES
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if RETIRED.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_retired_pattern_catches_each_old_way():
    for line in (
        '"numerics": numerics_dict(case.numerics),',
        "num = numerics_from_fields(record)",
        '"numerics": [dataclasses.asdict(n) for n in nums],',
        '"numerics": dataclasses.asdict(case.numerics),',
        'numerics=Numerics(**info["numerics"]),',
        'backward=Backward(**info["backward"]),',
    ):
        assert RETIRED.search(line), line
