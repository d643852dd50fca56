"""``benchmarks/peer_grad_tolerances.py``: the evidence for the gradient oracle, checked.

Real backward passes (torch autograd through SDPA's math and CPU flash backends, ``jax.vjp``
through ``jax.nn``) raise no false alarm on the quick configurations (a descriptor may refuse
one, naming why, but must check the others), and every planted backward bug whose own effect
exceeds rounding (the bugged algorithm in float64 moves some gradient element beyond the correct
kernel's certified tolerance) fails the oracle in every draw, while the correct kernel passes
with its dQ partials added in either order.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_grad_tolerances.py"
_spec = importlib.util.spec_from_file_location("peer_grad_tolerances", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("dtype", list(bench.DTYPES))
@pytest.mark.parametrize("kernel", list(bench.KERNELS))
def test_real_backward_passes_raise_no_false_alarm(kernel, dtype):
    checked = 0
    for config in bench.QUICK:
        rows = bench.run_configuration(kernel, dtype, config)
        if "refused" in rows:
            assert rows["refused"].split(":")[0] in ("enable_gqa", "scale", "q", "k"), rows
            continue
        checked += 1
        for name, row in rows.items():
            assert row["false_alarms"] == 0, (kernel, dtype, config, name, row)
            assert row["worst_ratio"] <= 1
    assert checked, f"{kernel} refused every quick configuration: the test could not fail"


def test_the_tolerance_is_tighter_than_pytorchs_on_dq_in_half_precision():
    for dtype in ("bfloat16", "float16"):
        rows = bench.run_configuration("torch-sdpa-flash-cpu", dtype, bench.QUICK[0])
        assert rows["dq"]["vs_peers"]["pytorch"][0] < 0.1, (dtype, rows["dq"])


@pytest.mark.parametrize("bug", bench.BUGS)
def test_every_planted_backward_bug_beyond_rounding_is_caught(bug):
    draws = [bench.planted_draw(bug, seed) for seed in range(2)]
    assert all(d["good_alarms"] == 0 for d in draws)  # the correct kernel meets its oracle
    beyond = [d for d in draws if d["effect"] > 1]
    assert beyond, f"{bug}: no draw beyond rounding, so the test could not fail"
    assert all(d["caught"] for d in beyond), (bug, draws)


@pytest.mark.slow
def test_the_benchmark_runs_in_quick_mode(capsys):
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "false alarms in all: 0" in out
    assert "false alarms on the correct kernel (two dQ orders per draw): 0" in out
