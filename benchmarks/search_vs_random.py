"""Targeted worst-case search vs random sampling at equal budget, and evaluation speed.

For each preset and seed, ``mhanum.search.worst_case`` and ``mhanum.search.random_search`` get the
same budget of objective evaluations (objective ``error/bound``, Theorem A.1); the table prints the
median over seeds of the worst ratio each confirmed against the certified reference, and the ratio
of the two medians (goal: targeted >= 3x random). Then the evaluations per second of the cheap
objective (random search: inputs, attention, float64 attention and both bounds) and of the whole
targeted search (Hypothesis and refinement included), for a small and a medium shape.

    python benchmarks/search_vs_random.py [--budget 200] [--seeds 0 1 2] [--presets ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from mhanum import search

PRESETS = (
    "bf16-fp32acc",
    "fp16-fp32acc",
    "fp32",
    "tf32",
    "bf16",
    "fp16",
    "tpu-bf16-3pass",
    "tensor-core-fp16",
    "fp64",
)
SHAPE = search.Shape(q_len=4, kv_len=32, d_k=16)
SPEED_SHAPES = {
    "small (q 4, kv 16, d 8)": search.Shape(q_len=4, kv_len=16, d_k=8),
    "medium (q 16, kv 64, d 64)": search.Shape(q_len=16, kv_len=64, d_k=64),
}


def compare(presets: list[str], seeds: list[int], budget: int) -> None:
    print(f"shape {SHAPE.as_dict()}, budget {budget} evaluations, seeds {seeds}\n")
    print("| preset | targeted (median) | random (median) | targeted / random | >= 3x | "
          "targeted dominant term | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for preset in presets:
        start = time.perf_counter()
        found = [search.worst_case(preset, SHAPE, budget=budget, seed=s) for s in seeds]
        rand = [search.random_search(preset, SHAPE, budget=budget, seed=s) for s in seeds]
        t = statistics.median(c.ratio for c in found)
        r = statistics.median(c.ratio for c in rand)
        best = max(found, key=lambda c: c.ratio)
        gain = t / r if r > 0 else float("inf")
        print(
            f"| {preset} | {t:.3f} | {r:.3f} | {gain:.2f} | {'yes' if gain >= 3 else 'no'} | "
            f"{best.dominant_term} | {time.perf_counter() - start:.0f} |",
            flush=True,
        )


def speed(budget: int) -> None:
    print("\n| shape | preset | cheap objective (random), eval/s | targeted search, eval/s |")
    print("|---|---|---|---|")
    for name, shape in SPEED_SHAPES.items():
        for preset in ("bf16-fp32acc", "fp32"):
            search.random_search(preset, shape, budget=2)  # compile first
            rand = search.random_search(preset, shape, budget=budget, seed=9)
            found = search.worst_case(preset, shape, budget=budget, seed=9)
            print(
                f"| {name} | {preset} | {rand.evaluations / rand.seconds:.0f} | "
                f"{found.evaluations / found.seconds:.0f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--speed-budget", type=int, default=60)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    start = time.perf_counter()
    compare(args.presets, args.seeds, args.budget)
    speed(args.speed_budget)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
