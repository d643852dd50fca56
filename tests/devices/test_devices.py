"""mhanum.devices: measured records hold their bounds, round-trip, and check catches tampering."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhanum import InvalidArgument, Numerics, attention, cli, devices, reference
from mhanum.bounds import analyze_numerics, attention_bound

TINY = devices.Grid(
    shapes=((1, 2, 16, 8),),
    dtypes=("float32", "bfloat16"),
    structures=("normal", "large_norm", "cancel"),
    masks=("none", "causal"),
    precisions=("default", "highest"),
    implementations=devices.IMPLEMENTATIONS,
    presets=("fp32", "bf16-fp32acc"),
)


@pytest.fixture(scope="module")
def measured():
    calls = []
    records = devices.measure(
        TINY, "cpu", workers=2, progress=lambda done, total, r: calls.append((done, total))
    )
    return records, calls


def _attention_records(records, status="measured"):
    return [r for r in records if r["kind"] == "attention" and r["status"] == status]


def test_measure_records_errors_within_bounds(measured):
    records, calls = measured
    assert calls[-1] == (len(records), len(records))
    assert [r["id"] for r in records] == list(range(len(records)))
    done = _attention_records(records)
    # float32 and bfloat16: mhanum (fp32 at two precisions, bf16-fp32acc) and xla, per input
    assert len(done) == 3 * 2 * (2 + 1 + 2 + 1)
    for r in done:
        assert 0 < r["errors"]["max_abs"] <= r["bound"]["max"]
        assert r["errors"]["max_abs"] <= r["bound"]["at_argmax_error"]
        assert 0 < r["ratio"] <= 1
        assert r["tightness"] == pytest.approx(r["bound"]["max"] / r["errors"]["max_abs"])
        assert r["device"]["platform"] == "cpu"
        assert set(r["versions"]) >= {"jax", "jaxlib", "mhanum", "python"}
        model = Numerics.from_dict(r["model"]["numerics"])  # the model is a valid Numerics
        assert r["model"]["numerics"] == model.to_dict()  # strict JSON
    # cuDNN is recorded as skipped off a GPU, with the reason
    skipped = _attention_records(records, "skipped")
    assert {r["implementation"] for r in skipped} == {"cudnn"}
    assert all("GPU" in r["reason"] for r in skipped)
    (exp,) = [r for r in records if r["kind"] == "exp"]
    assert 0 < exp["max_ulps"] <= exp["assumed_exp_ulps"]
    assert exp["exp_zero_is_one"]


def test_records_round_trip_through_json(measured, tmp_path):
    records, _ = measured
    path = devices.write_records(tmp_path / "r.jsonl", records)
    assert devices.read_records(path) == records


def test_write_records_never_overwrites_without_force(measured, tmp_path):
    records, _ = measured
    path = tmp_path / "r.jsonl"
    devices.write_records(path, records[:2])
    with pytest.raises(InvalidArgument, match="force"):
        devices.write_records(path, records)
    assert len(devices.read_records(path)) == 2
    devices.write_records(path, records, force=True)
    assert len(devices.read_records(path)) == len(records)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (json.dumps({"schema": "mhanum.devices/0", "kind": "exp"}), "schema"),
        ("{not json", "JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_read_records_rejects_bad_files(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(InvalidArgument, match=match):
        devices.read_records(path)
    with pytest.raises(InvalidArgument, match="readable"):
        devices.read_records(tmp_path / "missing.jsonl")


def _planted(records):
    """A violating record (its error beyond its bound), a tampered bound, a failed exp."""
    honest = _attention_records(records)[0]
    violated = copy.deepcopy(honest)
    violated["errors"]["max_abs"] *= 2 * honest["tightness"]
    tampered = copy.deepcopy(honest)
    tampered["bound"]["max"] *= 1 + 1e-6
    exp = copy.deepcopy(next(r for r in records if r["kind"] == "exp"))
    exp["max_ulps"] = 3.5
    for i, r in enumerate((violated, tampered, exp)):
        r["id"] = len(records) + i
    return violated, tampered, exp


def test_check_passes_honest_records_and_flags_planted_ones(measured):
    records, _ = measured
    result = devices.check(records)
    assert result.ok
    assert result.exit_code == 0
    assert result.counts["holds"] == len(_attention_records(records)) + 1
    assert result.counts["skipped"] == len(_attention_records(records, "skipped"))
    violated, tampered, exp = _planted(records)
    bad = devices.check([*records, violated, tampered, exp])
    assert [v.verdict for v in bad.verdicts[-3:]] == ["VIOLATED", "inconsistent", "exp-assumption"]
    assert bad.verdicts[-3].ratio > 1
    assert not bad.ok
    assert bad.exit_code == 1
    assert "VIOLATED" in bad.render()


def test_check_flags_inputs_that_do_not_regenerate_other_models_and_vacuous_bounds(measured):
    records, _ = measured
    first = _attention_records(records)[0]
    moved = copy.deepcopy(first)
    moved["seed"] = 1  # the recorded digest is of seed 0's inputs
    swapped = copy.deepcopy(first)
    swapped["model"]["numerics"] = Numerics.preset("tf32").to_dict()
    large = next(r for r in _attention_records(records) if r["structure"] == "large_norm")
    vacuous = copy.deepcopy(large)
    # float16 naive softmax: exp(40) overflows float16, so Theorem A.1 gives inf
    naive = Numerics(input="float16", accum="float16", softmax="naive")
    vacuous["model"]["numerics"] = naive.to_dict()
    verdicts = devices.check([moved, swapped, vacuous]).verdicts
    assert [v.verdict for v in verdicts] == ["inconsistent", "inconsistent", "vacuous"]
    assert "regenerated inputs" in verdicts[0].reason


def test_check_command_exit_codes(measured, tmp_path):
    records, _ = measured
    honest = devices.write_records(tmp_path / "honest.jsonl", records)
    assert cli.main(["check", str(honest)]) == 0
    bad = devices.write_records(tmp_path / "bad.jsonl", [*records, *_planted(records)])
    assert cli.main(["check", str(bad), "--json"]) == 1
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"schema": "mhanum.devices/99"}) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "check", str(other)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert "schema" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("dtype", devices.DTYPES)
@pytest.mark.parametrize("structure", devices.STRUCTURES)
def test_inputs_are_deterministic(dtype, structure):
    a = devices.inputs((1, 2, 16, 8), dtype, structure, 3)
    b = devices.inputs((1, 2, 16, 8), dtype, structure, 3)
    c = devices.inputs((1, 2, 16, 8), dtype, structure, 4)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))
    assert a[0].tobytes() != c[0].tobytes()
    assert all(str(x.dtype) == dtype and x.shape == (1, 2, 16, 8) for x in a)


def _logits(q, k):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    return q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])


@pytest.mark.parametrize("dtype", devices.DTYPES)
def test_structures_have_their_stated_property(dtype):
    shape = (1, 2, 32, 16)
    q, k, _ = devices.inputs(shape, dtype, "normal", 0)
    assert np.abs(_logits(q, k)).max() < 10
    q, k, _ = devices.inputs(shape, dtype, "large_norm", 0)
    assert np.abs(_logits(q, k)).max() >= 30
    for x in devices.inputs(shape, dtype, "outlier", 0):
        norms = np.sort(np.abs(np.asarray(x, np.float64)).max(axis=(0, 1, 2)))
        assert norms[-devices.OUTLIER_CHANNELS] > 30 * np.median(norms)
    q, k, v = (np.asarray(x, np.float64) for x in devices.inputs(shape, dtype, "cancel", 0))
    p = np.exp(_logits(q, k))
    p /= p.sum(-1, keepdims=True)
    assert np.median(np.abs(p @ v) / (p @ np.abs(v))) < 0.1  # the outputs cancel


def test_masks():
    assert devices.mask_array("none", 8) is None
    causal = devices.mask_array("causal", 8)
    assert causal.shape == (1, 1, 8, 8)
    assert causal[0, 0, 2, 2]
    assert not causal[0, 0, 2, 3]
    padding = devices.mask_array("padding", 8)
    assert padding[0, 0].sum(axis=-1).tolist() == [6] * 8


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((("1", 2, 8, 4), "float32", "normal", 0), "shape"),
        (((1, 2, 8, 4), "float64", "normal", 0), "dtype"),
        (((1, 2, 8, 4), "float32", "spiky", 0), "structure"),
        (((1, 2, 8, 4), "float32", "normal", -1), "seed"),
    ],
)
def test_inputs_reject_bad_arguments(args, match):
    with pytest.raises(InvalidArgument, match=match):
        devices.inputs(*args)


def test_model_table():
    assert devices.model_for("mhanum", "float32", "high", "gpu", "tf32")[1] == Numerics.preset(
        "tf32"
    )
    label, cpu = devices.model_for("xla", "float32", "default", "cpu")
    assert label == "xla-f32"
    assert cpu.operand_format is None
    assert cpu.mask_value == "0.7*finfo.min"
    assert devices.model_for("xla", "float32", "highest", "cpu")[1] == cpu
    assert devices.model_for("xla", "float32", "high", "gpu")[1].operand_format == "tf32"
    assert devices.model_for("xla", "float32", "highest", "gpu")[1] == cpu
    _, bf16 = devices.model_for("xla", "bfloat16", "default", "gpu")
    assert (bf16.input, bf16.accum, bf16.score_format, bf16.softmax_format) == (
        "bfloat16",
        "float32",
        "float32",
        "float32",
    )
    assert (bf16.prob_format, bf16.output_format) == ("bfloat16", "bfloat16")
    _, flash = devices.model_for("cudnn", "float16", "default", "gpu")
    assert flash == devices.model_for("xla", "float16", "default", "gpu")[1].replace(
        softmax=f"online({devices.ONLINE_BLOCK})"
    )
    with pytest.raises(InvalidArgument, match="GPU"):
        devices.model_for("cudnn", "bfloat16", "default", "cpu")
    with pytest.raises(InvalidArgument, match="GPU"):
        devices.model_for("cudnn", "float32", "default", "gpu")
    with pytest.raises(InvalidArgument, match="preset"):
        devices.model_for("mhanum", "float32", "default", "cpu")
    if "dot" in {f.name for f in dataclasses.fields(Numerics)}:
        assert devices.model_for("xla", "float32", "high", "tpu")[1].dot == "bf16x3"
    else:
        with pytest.raises(InvalidArgument, match="dot"):
            devices.model_for("xla", "float32", "high", "tpu")


def test_grids():
    gpu = devices.Grid.gpu()
    assert {"fp32", "tf32", "bf16-fp32acc", "fp16-fp32acc"} <= set(gpu.presets)
    assert gpu.shapes == ((1, 2, 64, 64), (1, 2, 256, 64))
    assert devices.Grid.default().with_seeds([5]).seeds == (5,)
    with pytest.raises(InvalidArgument, match=r"grid\.masks"):
        dataclasses.replace(gpu, masks=("sliding",))


def _jax_nn_xla(q, k, v, causal):
    t = (0, 2, 1, 3)
    out = jax.nn.dot_product_attention(
        jnp.asarray(q).transpose(t),
        jnp.asarray(k).transpose(t),
        jnp.asarray(v).transpose(t),
        is_causal=causal,
        implementation="xla",
    )
    return np.asarray(out.transpose(t), np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("structure", "mask"),
    [("normal", "none"), ("large_norm", "causal"), ("outlier", "none"), ("cancel", "causal")],
)
def test_jax_nn_xla_on_cpu_lies_within_its_model_bound(dtype, structure, mask):
    """The soundness of the model table's CPU rows: jax.nn's own output against Theorem A.1."""
    q, k, v = devices.inputs((1, 2, 32, 16), dtype, structure, 0)
    keep = devices.mask_array(mask, 32)
    out = _jax_nn_xla(q, k, v, causal=mask == "causal")
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    ref = reference.attention(q64, k64, v64, mask=keep)
    _, model = devices.model_for("xla", dtype, "default", "cpu")
    checked = model
    if keep is not None:  # the fill constant leaks nothing (M.5): the same as -inf
        assert analyze_numerics(model, 100.0, n_keys=32).leakage_is_zero
        checked = model.replace(mask_value=-math.inf)
    bound = attention_bound(q64, k64, v64, keep, numerics=checked).total
    err = np.abs(out - ref)
    assert err.max() > 0
    assert (err <= bound).all()
    # mhanum under the model reproduces jax.nn: their difference is within the bound too
    ours = np.asarray(attention(q, k, v, keep, numerics=model), np.float64)
    assert (np.abs(ours - out) <= bound).all()


def test_committed_h100_records_hold_when_rechecked_here():
    # The GPU records in papers/measurements, re-judged on this machine: the inputs regenerate
    # to the recorded hashes and every recomputed bound holds the recorded error (a sample of
    # each model; `mhanum check` on the whole file is the same check).
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "papers" / "measurements" / "h100-records.jsonl"
    records = devices.read_records(path)
    seen: set[tuple[str, str]] = set()
    sample = []
    for r in records:
        key = (r.get("implementation", ""), (r.get("model") or {}).get("label", r["kind"]))
        if r["status"] == "measured" and key not in seen:
            seen.add(key)
            sample.append(r)
    result = devices.check(sample)
    assert result.ok
    # written with bound revision 1: today's sharper bound makes them stale, checked at the
    # largest error and against the recorded bound
    assert result.counts["holds"] + result.counts["stale"] == len(sample) >= 20
    attention = [
        v for v, r in zip(result.verdicts, sample, strict=True) if r["kind"] == "attention"
    ]
    assert all(v.ratio <= 1 for v in attention)


def test_a_record_of_an_earlier_bound_revision_is_stale_not_inconsistent(measured):
    # Records keep no per-entry errors: a record written with an earlier evaluation of A.1 is
    # judged against the bound it was measured with and at its largest error against today's.
    records, _ = measured
    honest = _attention_records(records)[0]
    old = copy.deepcopy(honest)
    del old["bound"]["revision"]
    old["bound"]["max"] *= 1.5
    [verdict] = devices.check([old]).verdicts
    assert verdict.verdict == "stale"
    assert "re-measure" in verdict.reason
    broken = copy.deepcopy(old)
    broken["errors"]["max_abs"] *= 2 * honest["tightness"]
    assert devices.check([broken]).verdicts[0].verdict == "VIOLATED"
