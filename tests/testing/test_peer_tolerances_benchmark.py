"""``benchmarks/peer_tolerances.py``: the evidence for the oracle, checked.

Real kernels (torch's SDPA math and CPU flash, ``jax.nn``) raise no false alarm on the
configurations of their own test suites, and every planted bug whose own effect exceeds rounding
(the bugged algorithm in float64 moves some element beyond the correct kernel's certified
tolerance) fails the oracle in every draw, while the correct kernel passes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_tolerances.py"
_spec = importlib.util.spec_from_file_location("peer_tolerances", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("dtype", list(bench.DTYPES))
@pytest.mark.parametrize("kernel", list(bench.KERNELS))
def test_real_kernels_raise_no_false_alarm(kernel, dtype):
    for config in bench.QUICK:
        row = bench.run_configuration(kernel, dtype, config)
        assert row["false_alarms"] == 0, (kernel, dtype, config, row)
        assert row["worst_ratio"] <= 1


@pytest.mark.parametrize("bug", bench.BUGS)
def test_every_planted_bug_beyond_rounding_is_caught(bug):
    draws = [bench.planted_draw(bug, seed) for seed in range(2)]
    assert all(d["good_alarms"] == 0 for d in draws)  # the correct kernel meets its oracle
    beyond = [d for d in draws if d["effect"] > 1]
    assert beyond, f"{bug}: no draw beyond rounding, so the test could not fail"
    assert all(d["caught"] for d in beyond), (bug, draws)


@pytest.mark.parametrize(("family", "seed"), [("normal", 0), ("outlier", 4)])
def test_no_float32_tolerance_is_below_the_floor(family, seed):
    """The worst-case rounding (every sum in its worst order, which the kernel's float32 model
    allows) errs by at most the certified tolerance, and the 0.99 quantile of its randomly
    signed roundings by at most the probabilistic one: an adversarial check of both, with
    roundings chosen against them."""
    row = bench.floor_configuration(family, seed)
    assert np.all(row["floor"] <= row["certified"]), row
    assert np.all(row["quantile"] <= row["probabilistic"]), row
