"""Tightness where decisions are made: the probabilistic bounds' figures, against their goals.

    python benchmarks/decisions.py            # both tables
    python benchmarks/decisions.py --draws 2  # fewer draws (a quick look)
    python benchmarks/decisions.py --floor    # and, for fp32, the floor under each figure

1. **Theorem A.3 at** ``probability=0.99``, entrywise, on ``--draws`` random normal float32
   inputs (``L = d = 64``): the bound divided by the error at the 99th percentile of
   error/bound over the entries (the 1% of entries where the bound is tightest). Goals: at
   most 10 for ``fp32`` and ``tf32``, at most 3 for ``bf16-fp32acc`` and ``fp16-fp32acc``.
   The kernel reads the float32 inputs rounded into the preset's input format (``tf32``: and
   its dots read them rounded into TF32); the bound takes that rounding exactly
   (``input_rounding="exact"``: two certified references, and step 1k for the dots' reads),
   as A.2's default does.
2. **Multi-head attention at the README demo's size** (``d_model = 512``, 8 heads, ``L = 64``,
   random normal float32 inputs, ``MHAParams.random``): max bound / max error of Theorem A.2
   with ``probability=0.99`` (and deterministic, for comparison). Goal: at most 30 for the
   four presets.

The error is the computed output's distance to the certified reference
(:mod:`mhanum.reference`); every row prints its goal and whether it is met. The testing
oracle's figures are :mod:`benchmarks.peer_tolerances`'s.

``--floor`` adds, for ``fp32`` (float32 dots in any order: ``native``), the least figure any
bound of the model can reach, from ``benchmarks/rounding_floor.py`` with every sum in its worst
order: ``Q``, the 0.99 quantile of the first-order error over random signs of every rounding
(a bound that holds with probability 0.99 under A.3's independence model is at least ``Q`` at
every entry), and ``F``, the error of the worst-case signs (no certified bound is below it).
Each takes the table's metric with ``Q`` or ``F`` in the bound's place, over drawn entries
(A.3: 48 per draw; A.2: the 16 where the certified bound is largest and 16 at random); a bound
at least ``Q`` (``F``) at every entry has at least that figure.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

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


def _floor_module() -> Any:
    """``benchmarks/rounding_floor.py``, imported from beside this script."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import rounding_floor

    return rounding_floor


def _draw_entries(rng: np.random.Generator, shape: tuple[int, ...], n: int) -> list[Any]:
    picks = rng.choice(int(np.prod(shape)), n, replace=False)
    return [tuple(int(i) for i in np.unravel_index(j, shape)) for j in picks]


def a3_floor(draws: int) -> tuple[float, float]:
    """A.3's figure (fp32) with the floor's ``Q`` and ``F`` in the bound's place, over 48 drawn
    entries of each draw."""
    ratios_q, ratios_f = [], []
    for seed in range(draws):
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal((64, 64)).astype(np.float32).astype(np.float64)
                   for _ in range(3))  # fmt: skip
        out = np.asarray(mhanum.attention(q, k, v, numerics="fp32"), np.float64)
        err = np.abs(out - reference.attention(q, k, v))
        entries = _draw_entries(np.random.default_rng([1, seed]), err.shape, 48)
        f = _floor_module().attention_floor(
            q, k, v, "fp32", entries, order="worst", keep_increments=True
        )
        at = tuple(np.array(e) for e in zip(*entries, strict=True))
        ratios_q.append(err[at] / f.quantile(0.99))
        ratios_f.append(err[at] / np.abs(f.realised))
    return tuple(1.0 / float(np.percentile(np.concatenate(r), 99)) for r in (ratios_q, ratios_f))


def mha_floor_row() -> tuple[float, float]:
    """A.2's figure (fp32) with the floor's ``Q`` and ``F`` in the bound's place: their largest
    over 32 entries (the 16 of the largest certified bound, 16 at random) ÷ the largest error."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 512)).astype(np.float32).astype(np.float64)
    params = mhanum.MHAParams.random(512, seed=0)
    out = np.asarray(mhanum.multi_head_attention(x, x, params, 8, numerics="fp32"), np.float64)
    err = np.abs(out - reference.multi_head_attention(x, x, params, 8))[0]
    bound = np.asarray(mha_bound(x, x, params, 8, numerics="fp32").total)[0]
    top = np.argsort(bound, axis=None)[::-1][:16]
    entries = [tuple(int(i) for i in np.unravel_index(j, bound.shape)) for j in top]
    entries += [e for e in _draw_entries(np.random.default_rng(1), bound.shape, 16)
                if e not in entries]  # fmt: skip
    f = _floor_module().mha_floor(x[0], params, 8, "fp32", entries, order="worst",
                                  keep_increments=True)  # fmt: skip
    worst = float(np.max(err))
    return float(np.max(f.quantile(0.99))) / worst, float(np.max(np.abs(f.realised))) / worst


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
    parser.add_argument("--floor", action="store_true", help="the floor under fp32's figures")
    args = parser.parse_args(argv)
    print(f"A.3, probability 0.99, L = d = 64, {args.draws} draws: bound/error at the 99th "
          "percentile of error/bound")  # fmt: skip
    print(f"{'preset':14s} {'ratio':>8s} {'goal':>6s}")
    for preset in PRESETS:
        ratio = a3_row(preset, args.draws)
        goal = A3_GOALS[preset]
        print(f"{preset:14s} {ratio:8.1f} {goal:6g} {_met(ratio, goal):>8s}")
    if args.floor:
        fq, ff = a3_floor(args.draws)
        print(f"{'fp32 floor':14s} Q {fq:.3g} (at probability 0.99), F {ff:.3g} (certified): "
              "no bound of the model is below these")  # fmt: skip
    print()
    print("A.2 at the demo's size (d_model 512, 8 heads, L 64): max bound / max error")
    print(f"{'preset':14s} {'P 0.99':>8s} {'goal':>6s} {'':>8s} {'certain':>9s}")
    for preset in PRESETS:
        prob = mha_row(preset, 0.99)
        certain = mha_row(preset, None)
        print(f"{preset:14s} {prob:8.3g} {MHA_GOAL:6g} {_met(prob, MHA_GOAL):>8s} {certain:9.3g}")
    if args.floor:
        fq, ff = mha_floor_row()
        print(f"{'fp32 floor':14s} Q {fq:.3g} (at probability 0.99), F {ff:.3g} (certified): "
              "no bound of the model is below these")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
