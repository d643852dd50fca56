"""The ``mhanum`` command: the demo prints its table and findings with the stated values."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from mhanum import cli, demo, devices


@pytest.fixture(scope="module")
def small_demo():
    return demo.run(seed=0, d_model=64, num_heads=8, length=32)


def test_demo_table_and_findings(small_demo):
    r = small_demo
    assert list(r.presets) == list(demo.DEMO_PRESETS)
    # Errors grow as the formats narrow: float32 < tf32 and fp16 < bf16 (u: 2^-24, 2^-11, 2^-8).
    rel = {name: e["normwise_max"] for name, e in r.presets.items()}
    assert 0 < rel["fp32"] < rel["tf32"] < rel["bf16-fp32acc"]
    assert rel["fp16-fp32acc"] < rel["bf16-fp32acc"]
    # Finding 1: the shifted logits are uniform, an O(1) error; finding 2: heads differ by O(1).
    assert r.mask_minus_1e9["errors"]["normwise_max"] > 0.1
    assert r.heads["difference"]["normwise_max"] > 0.1
    text = demo.render(r)
    assert "Finding 1" in text
    assert "ulp(1e9) = 64" in text
    assert "Finding 2" in text


@pytest.mark.slow
def test_demo_command_runs_the_default_layer_and_prints_json():
    out = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "demo", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["config"] == {
        "seed": 0,
        "d_model": 512,
        "num_heads": 8,
        "length": 64,
        "inputs": "x ~ N(0, 1); MHAParams.random(d_model, seed=seed)",
    }
    assert result["mask_minus_1e9"]["errors"]["normwise_max"] > 0.5


def test_cli_reports_bad_arguments_without_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "demo", "--heads", "7"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert "num_heads: expected a divisor of" in out.stderr
    assert "Traceback" not in out.stderr


def test_measure_refuses_to_overwrite_records_before_measuring(tmp_path):
    out = tmp_path / "records.jsonl"
    out.write_text("keep me\n")
    result = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "measure", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "--force" in result.stderr
    assert out.read_text() == "keep me\n"


def test_progress_bar_is_plain_text():
    stream = io.StringIO()
    bar = cli._ProgressBar(stream, width=10)
    bar(1, 4, {"kind": "attention", "status": "measured", "ratio": 0.031})
    bar(2, 4, {"kind": "attention", "status": "skipped"})
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[##........] 1/4 max ratio 0.031"
    assert lines[1] == "[#####.....] 2/4 max ratio 0.031"


def test_check_prints_the_summary_table_and_exits_by_verdict(tmp_path, capsys):
    grid = devices.Grid(
        shapes=((1, 1, 8, 4),),
        dtypes=("bfloat16",),
        structures=("normal",),
        masks=("causal",),
        precisions=("default",),
        implementations=("mhanum", "xla"),
        presets=("bf16-fp32acc",),
        exp=False,
    )
    records = devices.measure(grid, "cpu", workers=0)
    path = devices.write_records(tmp_path / "r.jsonl", records)
    assert cli.main(["check", str(path)]) == 0
    text = capsys.readouterr().out
    assert "worst err/bound" in text
    assert "xla-bf16" in text
    assert "2 records: 2 holds" in text
    assert cli.main(["check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["holds"] == 2
    records[0]["errors"]["max_abs"] *= 2 * records[0]["tightness"]
    bad = devices.write_records(tmp_path / "bad.jsonl", records)
    assert cli.main(["check", str(bad)]) == 1
    assert "VIOLATED" in capsys.readouterr().out
    assert cli.main(["check", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.slow
def test_measure_command_writes_records_that_check_accepts(tmp_path):
    out = tmp_path / "records.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "measure", "--out", str(out), "--workers", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "max ratio" in run.stderr
    assert "exp float32 on cpu" in run.stdout
    check = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "check", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout
