"""Tightness where decisions are made: the probabilistic bounds' figures, against their goals.

    python benchmarks/decisions.py            # both tables
    python benchmarks/decisions.py --draws 2  # fewer draws (a quick look)

1. **Theorem A.3 at** ``probability=0.99``, entrywise, on ``--draws`` random normal float32
   inputs (``L = d = 64``): the bound divided by the error at the 99th percentile of
   error/bound over the entries (the 1% of entries where the bound is tightest). Goals: at
   most 10 for ``fp32`` and ``tf32``, at most 3 for ``bf16-fp32acc`` and ``fp16-fp32acc``.
   The kernel reads the float32 inputs rounded into the preset's input format; the bound takes
   that rounding exactly (``input_rounding="exact"``: two certified references), as A.2's
   default does.
2. **Multi-head attention at the README demo's size** (``d_model = 512``, 8 heads, ``L = 64``,
   random normal float32 inputs, ``MHAParams.random``): max bound / max error of Theorem A.2
   with ``probability=0.99`` (and deterministic, for comparison). Goal: at most 30 for the
   four presets.

The error is the computed output's distance to the certified reference
(:mod:`mhanum.reference`); every row prints its goal and whether it is met. The testing
oracle's figures are :mod:`benchmarks.peer_tolerances`'s.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import mhanum
from mhanum import reference
from mhanum.bounds import attention_bound, mha_bound

PRESETS = ("fp32", "tf32", "bf16-fp32acc", "fp16-fp32acc")
A3_GOALS = {"fp32": 10.0, "tf32": 10.0, "bf16-fp32acc": 3.0, "fp16-fp32acc": 3.0}
MHA_GOAL = 30.0


def _met(value: float, goal: float) -> str:
    return "met" if value <= goal else "not met"


def a3_row(preset: str, draws: int) -> float:
    """Bound / error at the 99th percentile of error/bound over every entry of the draws."""
    num = mhanum.Numerics.preset(preset)
    ratios = []
    for seed in range(draws):
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((64, 64)).astype(np.float32).astype(np.float64)
                   for _ in range(3))  # fmt: skip
        out = np.asarray(mhanum.attention(q, k, v, numerics=num), np.float64)
        err = np.abs(out - reference.attention(q, k, v))
        bound = attention_bound(q, k, v, numerics=num, probability=0.99, input_rounding="exact")
        bound = np.asarray(bound.total)
        ratios.append((err / bound).ravel())
    return 1.0 / float(np.percentile(np.concatenate(ratios), 99))


def mha_row(preset: str, probability: float | None) -> float:
    """Max bound / max error of Theorem A.2 at the demo's size."""
    num = mhanum.Numerics.preset(preset)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 512)).astype(np.float32).astype(np.float64)
    params = mhanum.MHAParams.random(512, seed=0)
    out = np.asarray(mhanum.multi_head_attention(x, x, params, 8, numerics=num), np.float64)
    err = np.abs(out - reference.multi_head_attention(x, x, params, 8))
    kwargs = {} if probability is None else {"probability": probability}
    bound = np.asarray(mha_bound(x, x, params, 8, numerics=num, **kwargs).total)
    return float(np.max(bound) / np.max(err))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=6, help="random inputs per preset (A.3)")
    args = parser.parse_args(argv)
    print(f"A.3, probability 0.99, L = d = 64, {args.draws} draws: bound/error at the 99th "
          "percentile of error/bound")  # fmt: skip
    print(f"{'preset':14s} {'ratio':>8s} {'goal':>6s}")
    for preset in PRESETS:
        ratio = a3_row(preset, args.draws)
        goal = A3_GOALS[preset]
        print(f"{preset:14s} {ratio:8.1f} {goal:6g} {_met(ratio, goal):>8s}")
    print()
    print("A.2 at the demo's size (d_model 512, 8 heads, L 64): max bound / max error")
    print(f"{'preset':14s} {'P 0.99':>8s} {'goal':>6s} {'':>8s} {'certain':>9s}")
    for preset in PRESETS:
        prob = mha_row(preset, 0.99)
        certain = mha_row(preset, None)
        print(f"{preset:14s} {prob:8.3g} {MHA_GOAL:6g} {_met(prob, MHA_GOAL):>8s} {certain:9.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
