"""Speed of the certified reference: every backend, side by side, in one run.

Run with ``python benchmarks/reference_speed.py`` (``--quick`` skips ``auto`` and ``arb`` on the
MHA layer). The reference runs its products with one BLAS thread by itself; with
``OPENBLAS_NUM_THREADS=1`` the numpy float64 baseline does too (the figures in README.md and
docs/performance.md). Prints medians of wall-clock time (``time.perf_counter``) and ratios
measured in the same run:

* attention with ``L = 64``, ``d_k = d_v = 64`` (one head, standard normal inputs): the naive
  ``mpmath`` backend against ``exact``, ``dd``, ``auto`` and ``arb`` (if python-flint is
  installed), and float64 numpy attention of the same size;
* an 8-head MHA layer, ``d_model = 512``, ``L = 512`` (``MHAParams.random(512, seed=0)``,
  standard normal input): ``dd``, ``auto`` (``dd`` plus the rows it does not certify, refined:
  their probabilities as Arb balls and the output exactly, ``papers/reference.md`` Theorem 2)
  and ``arb``, against float64 numpy MHA of the same size.

All results are certified to 20 digits. The number of rows ``auto`` refines is printed: a block
of such rows costs about 0.5 s with python-flint (recomputing a row with ``arb`` from scratch,
as before, cost about 3 s; with ``exact``, without python-flint, about 10-20 s).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from mhanum import MHAParams, reference
from mhanum.reference import _fastref

DIGITS = 20


def median_seconds(fn: Callable[[], object], repeats: int, *, warm_up: bool = True) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``fn`` (after one warm-up call)."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Plain float64 attention."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def numpy_mha(x: np.ndarray, params: MHAParams, heads: int) -> np.ndarray:
    """Plain float64 multi-head attention."""

    def split(a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a.reshape(a.shape[0], heads, -1), 1, 0)

    q, k, v = (
        split(x @ w + b)
        for w, b in ((params.wq, params.bq), (params.wk, params.bk), (params.wv, params.bv))
    )
    o = numpy_attention(q, k, v)
    return np.moveaxis(o, 0, 1).reshape(x.shape[0], -1) @ params.wo + params.bo


def uncertified_rows(x: np.ndarray, params: MHAParams, heads: int) -> int:
    """Rows of the MHA output the ``dd`` enclosure alone does not certify."""
    weights = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    excluded = np.zeros((heads, x.shape[0], x.shape[0]), dtype=bool)
    with np.errstate(all="ignore"):
        out, _ = _fastref.multi_head_attention(x, x, weights, heads, excluded, None, "nan")
    return int((~_fastref.certified(out, DIGITS).all(axis=-1)).sum())


def row(case: str, backend: str, seconds: float, note: str = "") -> None:
    print(f"{case:<34} {backend:<14} {seconds:>10.4f}  {note}")


def main() -> None:
    quick = "--quick" in sys.argv
    has_arb = importlib.util.find_spec("flint") is not None
    print(f"cores: os.cpu_count() = {os.cpu_count()}, usable = {len(os.sched_getaffinity(0))}")
    print(f"OPENBLAS_NUM_THREADS = {os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}")
    print(f"certified digits: {DIGITS}; python-flint installed: {has_arb}")
    print()
    print(f"{'case':<34} {'backend':<14} {'median s':>10}  ratio")

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((64, 64)) for _ in range(3))
    small = "attention L=64, d_k=d_v=64"

    def single(backend: str) -> Callable[[], object]:
        return lambda: reference.attention(q, k, v, digits=DIGITS, backend=backend)

    naive = median_seconds(single("mpmath"), repeats=3)
    row(small, "mpmath", naive)
    backends = ["exact", "dd", "auto"] + (["arb"] if has_arb else [])
    for backend in backends:
        seconds = median_seconds(single(backend), repeats=3 if backend == "exact" else 7)
        row(small, backend, seconds, f"mpmath / {backend} = {naive / seconds:.1f}")
    floats = median_seconds(lambda: numpy_attention(q, k, v), repeats=51)
    auto = median_seconds(single("auto"), repeats=7)
    row(small, "numpy float64", floats, f"auto / numpy = {auto / floats:.0f}")

    params = MHAParams.random(512, seed=0)
    x = np.random.default_rng(0).standard_normal((512, 512))
    large = "MHA d_model=512, 8 heads, L=512"

    def layer(backend: str) -> Callable[[], object]:
        return lambda: reference.multi_head_attention(
            x, x, params, 8, digits=DIGITS, backend=backend
        )

    floats = median_seconds(lambda: numpy_mha(x, params, 8), repeats=11)
    row(large, "numpy float64", floats)
    failed = uncertified_rows(x, params, 8)
    weights = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    excluded = np.zeros((8, 512, 512), dtype=bool)

    def enclosure() -> object:
        with np.errstate(all="ignore"):
            return _fastref.multi_head_attention(x, x, weights, 8, excluded, None, "nan")

    seconds = median_seconds(enclosure, repeats=3, warm_up=False)
    row(
        large,
        "dd enclosure",
        seconds,
        f"/ numpy = {seconds / floats:.0f}; rows not certified: {failed}",
    )
    if not quick:
        seconds = median_seconds(layer("auto"), repeats=1, warm_up=False)
        row(large, "auto", seconds, f"/ numpy = {seconds / floats:.0f} ({failed} rows refined)")
        if has_arb:
            seconds = median_seconds(layer("arb"), repeats=1, warm_up=False)
            row(large, "arb", seconds, f"/ numpy = {seconds / floats:.0f}")


if __name__ == "__main__":
    main()
