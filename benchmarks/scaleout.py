"""Speed-up of the report grid on 2 worker processes over 1.

    python benchmarks/scaleout.py              # the default report grid, 3 warm runs each
    python benchmarks/scaleout.py --quick      # a smaller grid, 2 warm runs each

The grid's cells (:func:`mhanum.report.build`'s sections, run by :mod:`mhanum.parallel`) on a
:func:`mhanum.parallel.default_executor` of 1 and of 2 spawned processes, side by side in one
run. For each pool: the *cold* run (spawning the workers, importing JAX, compiling every
function a worker meets) and the median of the *warm* runs that follow on the same workers
(compiled). The ratios are 1 worker ÷ 2 workers; the data of every run are checked equal to
those of the first. Each worker runs with one BLAS thread, as the tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax

from mhanum import parallel
from mhanum.report import _compute, load_config

QUICK = {"presets": ["fp32", "bf16-fp32acc"], "lengths": [16, 64], "masks": ["causal"]}


def timed(config: object, executor: object) -> tuple[float, str]:
    start = time.perf_counter()
    data = _compute.compute(config, executor=executor)  # type: ignore[arg-type]
    return time.perf_counter() - start, json.dumps(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid, 2 warm runs")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    config = load_config(QUICK if args.quick else None)
    repeat = 2 if args.quick else 3
    print(f"{'quick' if args.quick else 'default'} report grid, {os.cpu_count()} CPUs")
    first = None
    times: dict[int, tuple[float, float]] = {}
    for workers in (1, 2):
        with parallel.default_executor(workers) as pool:
            cold, data = timed(config, pool)
            first = first or data
            warm = []
            for _ in range(repeat):
                seconds, again = timed(config, pool)
                warm.append(seconds)
                if again != first:
                    print("the data differ between runs", file=sys.stderr)
                    return 1
            if data != first:
                print("the data differ between 1 and 2 workers", file=sys.stderr)
                return 1
        times[workers] = (cold, statistics.median(warm))
    print(f"{'workers':>8s} {'cold s':>8s} {'warm s (median)':>16s}")
    for workers, (cold, warm) in times.items():
        print(f"{workers:8d} {cold:8.1f} {warm:16.2f}")
    (c1, w1), (c2, w2) = times[1], times[2]
    print(f"speed-up of 2 workers over 1: cold {c1 / c2:.2f}x, warm {w1 / w2:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
