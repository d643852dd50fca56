"""Speed of the certified reference: exact (integer) backend against the naive mpmath backend.

Run with ``python benchmarks/reference_speed.py``. Prints medians of wall-clock time
(``time.perf_counter``) for attention with ``L = 64``, ``d_k = d_v = 64`` (one head) on both
backends and their ratio from the same run, and for the exact backend on an 8-head MHA layer with
``d_model = 512``, ``L = 64`` (``MHAParams.random(512, seed=0)``, standard normal input). All
results are certified to 20 digits.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from mhanum import MHAParams, reference

DIGITS = 20


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((64, 64)) for _ in range(3))
    params = MHAParams.random(512, seed=0)
    x = np.random.default_rng(0).standard_normal((64, 512))

    def single_head(backend: str) -> Callable[[], object]:
        return lambda: reference.attention(q, k, v, digits=DIGITS, backend=backend)

    exact = median_seconds(single_head("exact"), repeats=5)
    naive = median_seconds(single_head("mpmath"), repeats=3)
    mha = median_seconds(
        lambda: reference.multi_head_attention(x, x, params, 8, digits=DIGITS), repeats=3
    )
    print(f"cores: os.cpu_count() = {os.cpu_count()}, usable = {len(os.sched_getaffinity(0))}")
    print(f"certified digits: {DIGITS}")
    print()
    print(f"{'case':<44} {'backend':<8} {'median s':>9}")
    print(f"{'attention L=64, d_k=d_v=64, 1 head':<44} {'exact':<8} {exact:>9.3f}")
    print(f"{'attention L=64, d_k=d_v=64, 1 head':<44} {'mpmath':<8} {naive:>9.3f}")
    print(f"{'  ratio mpmath / exact':<44} {'':<8} {naive / exact:>9.1f}")
    print(f"{'MHA d_model=512, 8 heads, L=64':<44} {'exact':<8} {mha:>9.3f}")


if __name__ == "__main__":
    main()
