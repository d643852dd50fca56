"""What steps 6k and 6r of Theorem A.1 buy, measured on mhanum's own emulation.

    python benchmarks/known_rounding.py            # L = 64, 256 and 1024
    python benchmarks/known_rounding.py --quick    # L = 64 only

1. ``attention_bound`` with and without the known roundings (``known_rounding=True`` /
   ``False``), on random normal inputs in the input format (``d = 64``), for the numerics of
   ``jax-xla`` (a float32 softmax whose probabilities are stored in the half format: step 6k)
   and of ``torch-sdpa-flash-cpu`` (an online softmax over blocks of 512 keys storing its
   unnormalised weights in the half format: step 6k online on rows of one block, ``L <= 512``,
   step 6r beyond; its half-precision exponential within 2^-12, the AVX2 kernels'), each in
   bfloat16 and float16: the median over the output entries of
   bound ÷ |error| against the certified reference (the error is the emulation's), side by side.
2. The testing oracle's tolerance for the tensor-core descriptors (``flash-attention-2``,
   ``torch-sdpa-efficient``), judged on their candidates' emulation: the median over the
   candidates of the median tolerance ÷ |error|, and the worst |error| ÷ tolerance (at most 1:
   no false alarm). Their weights are read exactly by the tensor core (the operand format holds
   the probability format), which the oracle no longer charges as a rounding.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

import mhanum
from mhanum import reference
from mhanum.bounds import attention_bound
from mhanum.formats import round_to
from mhanum.testing import KERNELS, attention_oracle


def _inputs(seed: int, shape: tuple[int, ...], fmt: str) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [round_to(rng.standard_normal(shape), fmt) for _ in range(3)]


def bound_row(kernel: str, fmt: str, length: int) -> tuple[float, float, int]:
    """Median bound ÷ |error| with and without the known roundings, and the entries outside."""
    num = KERNELS[kernel].candidates(fmt)[0]
    q, k, v = _inputs(length, (length, 64), fmt)
    err = np.abs(np.asarray(mhanum.attention(q, k, v, numerics=num), np.float64)
                 - np.asarray(reference.attention(q, k, v), np.float64))  # fmt: skip
    nz = err > 0
    known, classic = (
        np.asarray(attention_bound(q, k, v, numerics=num, known_rounding=flag).total)
        for flag in (True, False)
    )
    outside = int(np.sum(err > known))
    return float(np.median(known[nz] / err[nz])), float(np.median(classic[nz] / err[nz])), outside


def oracle_row(kernel: str, fmt: str, length: int) -> tuple[float, float]:
    """Median over the candidates of the median tolerance ÷ |error|, and the worst ratio."""
    q, k, v = (x[None, None] for x in _inputs(length, (length, 64), fmt))
    o = attention_oracle(q, k, v, kernel=kernel, dtype=fmt)
    medians, worst = [], 0.0
    for num in KERNELS[kernel].candidates(fmt):
        err = np.abs(np.asarray(mhanum.attention(q, k, v, numerics=num), np.float64) - o.exact)
        nz = err > 0
        medians.append(float(np.median(o.tolerance[nz] / err[nz])))
        worst = max(worst, float(np.max(err / o.tolerance)))
    return float(np.median(medians)), worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 64 only")
    args = parser.parse_args(argv)
    lengths = (64,) if args.quick else (64, 256, 1024)
    print("1. attention_bound on the emulation: median bound / |error| (d = 64)")
    print(f"{'numerics of':22s} {'dtype':9s} {'L':>5s} {'known':>7s} {'classic':>8s} {'gain':>6s}"
          f" {'outside':>8s}")  # fmt: skip
    for kernel in ("jax-xla", "torch-sdpa-flash-cpu"):
        for fmt in ("bfloat16", "float16"):
            for length in lengths:
                known, classic, outside = bound_row(kernel, fmt, length)
                print(f"{kernel:22s} {fmt:9s} {length:5d} {known:7.1f} {classic:8.1f} "
                      f"{classic / known:6.1f} {outside:8d}")  # fmt: skip
    print()
    print("2. the oracle on its candidates' emulation: median tolerance / |error|, worst ratio")
    for kernel in ("flash-attention-2", "torch-sdpa-efficient"):
        for fmt in ("float16", "bfloat16"):
            for length in lengths[:2]:
                median, worst = oracle_row(kernel, fmt, length)
                print(f"{kernel:22s} {fmt:9s} {length:5d} {median:7.1f} worst {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
