"""``benchmarks/gpu_evidence.py``: its CPU smoke run writes every file with its structure, and the
kernels it judges on the CPU lie within their certified tolerance (no false alarm).

The GPU paths cannot run here; what can be checked of them without a GPU is: every descriptor a GPU
case names resolves to a registered kernel (or the provisional cuDNN candidates), and the
provisional candidates judge an output as the oracle does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

_ROOT = Path(__file__).resolve().parents[1]
_PATH = _ROOT / "benchmarks" / "gpu_evidence.py"
_spec = importlib.util.spec_from_file_location("gpu_evidence", _PATH)
assert _spec is not None
assert _spec.loader is not None
evidence = importlib.util.module_from_spec(_spec)
sys.modules["gpu_evidence"] = evidence  # its dataclasses look their module up
_spec.loader.exec_module(evidence)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CPU smoke run (about 50 s on 2 cores with an empty cache), as the documented command
    runs it."""
    out = tmp_path_factory.mktemp("evidence")
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    done = subprocess.run(
        [sys.executable, str(_PATH), "--out", str(out), "--cpu-smoke", "--workers", "2"],
        capture_output=True, text=True, cwd=_ROOT, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# The smoke run took 52 s with an empty compilation cache (tests/tiers.py's measure): it and every
# test that reads it run in the slow tier. A module fixture's cost falls on whichever of its tests
# runs first, so tests/slow.txt, which lists tests one by one, cannot move them together.
on_the_smoke_run = pytest.mark.slow


@on_the_smoke_run
def test_the_smoke_run_writes_every_file(smoke: Path) -> None:
    for name in evidence.FILES:
        assert (smoke / name).is_file(), name
    summary = (smoke / "summary.txt").read_text()
    assert "part 1:" in summary
    assert "part 2:" in summary
    assert "speed:" in summary
    assert "gpu_evidence: done" in summary


@on_the_smoke_run
def test_the_records_are_measure_records_and_all_hold(smoke: Path) -> None:
    from mhanum import devices

    records = devices.read_records(smoke / "records.jsonl")
    grid = evidence.records_grid(smoke=True)
    kinds = [r["kind"] for r in records]
    assert kinds.count("exp") == 1
    assert [r["id"] for r in records] == list(range(len(records)))
    assert {r["implementation"] for r in records if r["kind"] == "attention"} == set(
        grid.implementations
    )
    result = devices.check(records)
    assert result.ok
    assert result.counts["stale"] == 0
    assert result.counts["holds"] == sum(r["status"] == "measured" for r in records)
    assert "holds" in (smoke / "check.txt").read_text()


@on_the_smoke_run
def test_the_cpu_kernels_are_within_their_tolerance(smoke: Path) -> None:
    doc = json.loads((smoke / "kernels.json").read_text())
    assert doc["platform"] == "cpu"
    statuses = {"judged", "refused", "error", "judge-error", "not-judged"}
    assert {r["status"] for r in doc["cases"]} <= statuses
    judged = [r for r in doc["cases"] if r["status"] == "judged" and "worst_ratio" in r]
    kernels = {r["kernel"] for r in judged}
    assert {"torch-sdpa-math", "torch-sdpa-flash", "jax-xla"} <= kernels
    formats = {(r["kernel"], r["dtype"]) for r in judged}
    for dtype in ("float32", "bfloat16", "float16"):
        assert {("torch-sdpa-math", dtype), ("jax-xla", dtype)} <= formats
    configs = {r["config"] for r in judged}
    assert {"plain", "causal", "gqa-causal", "d128-causal", "softcap"} <= configs
    for r in judged:
        assert r["outside"] == 0, r
        assert 0 <= r["worst_ratio"] <= 1, r
        assert r["elements"] > 0
        assert r["identity"]
    # the GPU-only backends refuse on the CPU, and say why
    for r in doc["cases"]:
        if r["kernel"] in ("torch-sdpa-efficient", "torch-sdpa-cudnn", "jax-cudnn"):
            assert r["status"] == "refused", r
            assert r["reason"]
    assert not [r for r in doc["cases"] if r["status"] in ("judge-error", "not-judged")]


@on_the_smoke_run
def test_the_cpu_flash_backward_is_within_its_gradient_tolerance(smoke: Path) -> None:
    """Part 2b on the CPU: torch's CPU flash backward judged under its backward descriptor
    (the GPU run judges the CUDA one under ``torch-sdpa-flash-cuda``); FlashAttention-2's
    wheel is absent here, and the case says so."""
    doc = json.loads((smoke / "backward.json").read_text())
    judged = [r for r in doc["cases"] if r["status"] == "judged"]
    assert {(r["dtype"], r["config"]) for r in judged} == set(evidence.BACKWARD_CASES)
    for r in judged:
        assert r["descriptor"] == "torch-sdpa-flash-cpu"
        for grad in ("dq", "dk", "dv"):
            assert r[grad]["outside"] == 0, r
            assert 0 < r[grad]["worst_ratio"] <= 1, r
    refused = [r for r in doc["cases"] if r["kernel"] == "flash-attention-2"]
    assert all(r["status"] == "refused" and r["reason"] for r in refused)
    assert "part 2b:" in (smoke / "summary.txt").read_text()


@on_the_smoke_run
def test_the_probes_and_the_speed_rows(smoke: Path) -> None:
    from mhanum.tensorcore import PROBES

    probes = json.loads((smoke / "probes.json").read_text())
    assert len(probes["tensor_core"]["probes"]) == len(PROBES)
    math_bf16 = probes["fused"]["torch-sdpa-math"]["bfloat16"]
    assert math_bf16["status"] == "ran"
    assert len(math_bf16["probes"]) == len(evidence.CUDNN_PROBES["bfloat16"])
    by_name = {p["name"]: p for p in math_bf16["probes"]}
    # every probability is 1 and L = 64: the output is the sum over 64, which is exact
    assert by_name["ones"]["observed"] == 1.0
    assert by_name["output-rounding"]["observed"] == (1 + 2.0**-7) / 64
    # the math backend sums float32 values: 1 + 2^-8 + 2^-28 is 1 + 2^-8 in float32 whatever
    # the order (2^-28 is below half its ulp), a tie that rounds to 1 in bfloat16; exactly,
    # it rounds up
    tail = by_name["tie-tail-2^-28"]
    assert tail["observed"] == 1 / 64
    assert tail["predicted"]["exact"] == (1 + 2.0**-7) / 64
    assert "exact" not in math_bf16["matching_every_probe"]
    speed = json.loads((smoke / "speed.json").read_text())
    assert [r["length"] for r in speed["rows"]] == [256, 512]
    for row in speed["rows"]:
        bound = [e for e in row["events"] if e["event"] == "bound"]
        assert len(bound) == 1
        assert bound[0]["first_s"] > 0
        ratios = [e.get("bound_over_attention") for e in row["events"]]
        assert any(r is not None and r > 0 for r in ratios)


@pytest.mark.parametrize("kernel", evidence.KERNEL_NAMES)
def test_every_gpu_case_names_a_descriptor_that_exists(kernel: str) -> None:
    for dtype in ("bfloat16", "float16", "float32"):
        for precision in ("default", "highest"):
            name, covered = evidence.descriptor_for(kernel, "gpu", dtype, precision)
            assert covered
            assert name is not None
            if dtype != "float32" or kernel in ("torch-sdpa-math", "jax-xla", "flex-attention"):
                assert evidence.descriptor_object(name, dtype) is not None


def test_the_provisional_cudnn_candidates_judge_as_the_oracle() -> None:
    """Each candidate alone, and their union (the largest tolerance), on a real output."""
    from mhanum.testing import Kernel, attention_oracle

    config = evidence.configs(smoke=True)["gqa-causal"]
    data = evidence.case_inputs(config, "bfloat16", 2)
    out = evidence.run_torch_sdpa("torch-sdpa-math", *data, "bfloat16", config, "cpu")
    spec = {
        "dtype": "bfloat16",
        "config": dataclasses.asdict(config),
        "descriptor": evidence.PROVISIONAL,
    }
    q, k, v = (np.asarray(x.astype(np.float32), np.float64) for x in data)
    result = evidence.judge(spec, q, k, v, out)
    candidates = evidence.cudnn_candidates("bfloat16")
    assert len(result["candidates"]) == len(candidates)
    # the union's tolerance is the largest: its worst ratio is at most each candidate's
    assert result["worst_ratio"] <= min(c["worst_ratio"] for c in result["candidates"])
    one = Kernel("one", {"bfloat16": candidates[:1]}, "zero", ("test",))
    oracle = attention_oracle(
        q, k, v, kernel=one, dtype="bfloat16", is_causal=True, enable_gqa=True
    )
    assert result["candidates"][0]["worst_ratio"] == float(oracle.check(out)[1].max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_xla_is_judged_with_known_roundings_beside(dtype: str) -> None:
    """On a GPU, jax.nn's half-precision cases judged by ``jax-xla`` are also judged with the
    known roundings of ``jax-xla-cpu`` (``with_known_rounding``): the evidence that would let
    ``jax-xla`` take them there. Here the same path on the CPU's output, where they hold."""
    config = evidence.configs(smoke=True)["causal"]
    data = evidence.case_inputs(config, dtype, 1)
    out = evidence.run_jax(
        "jax-xla", *data, dtype, config, "default", evidence.jax.devices("cpu")[0]
    )
    data64 = tuple(np.asarray(x.astype(np.float32), np.float64) for x in data)
    spec = {"dtype": dtype, "config": dataclasses.asdict(config), "descriptor": "jax-xla"}
    result = evidence.judge(spec, *data64, out)
    known = result["with_known_rounding"]
    assert result["outside"] == 0
    assert known["outside"] == 0
    assert known["elements"] == result["elements"] == out.size
    assert known["median_tolerance_over_error"] < result["median_tolerance_over_error"]
    assert evidence.descriptor_for("jax-xla", "cpu", dtype, "default") == ("jax-xla-cpu", True)
    assert evidence.descriptor_for("jax-xla", "gpu", dtype, "default") == ("jax-xla", True)
