"""The ``mhanum`` command: the demo prints its table and findings with the stated values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mhanum import demo


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
