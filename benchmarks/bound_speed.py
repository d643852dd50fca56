"""Cost of a bound against the attention call it bounds.

    python benchmarks/bound_speed.py            # L = 1024 and 4096, attention and MHA
    python benchmarks/bound_speed.py --quick    # L = 1024, attention only
    python benchmarks/bound_speed.py --blas-threads   # and attention_bound with BLAS's threads

``attention_bound`` (Theorem A.1) and ``mha_bound`` (A.2) against ``mhanum.attention`` and
``mhanum.multi_head_attention`` with the same numerics (``fp32``: XLA's own dot and reduce), on
the same float32 data, ``d_k = d_v = 64`` (MHA: ``d_model = 512``, 8 heads). Medians of wall-clock
time per call after a warm-up (the attention after compilation), measured side by side in one
run, and the ratio bound ÷ attention (the goal for L ≥ 1024 is ≤ 5×).

The row ``floor`` times only the heaviest float64 work of the bound's evaluation of Theorem A.1,
on the same chunks of query rows: the two ``L × L × d`` products of the logits (``q kᵀ``,
``|q||k|ᵀ``), the nine products of ``L × L`` weights with ``v`` or ``|v|`` that give the output and
the terms (``p v``, ``p|v|``, and one each for the logits, softmax, probability-rounding, operand,
P·V, ``p̃|v|`` and the row-sum terms), and five exponentials of ``L × L`` arrays (``e^s``, ``e^δ``
and the ``expm1`` of the per-key factors). The rest of the bound's time is its elementwise passes
over ``L × L`` arrays: without them, this evaluation would still cost the floor. The floor runs
with one BLAS thread, as the bounds do (``mhanum/_threads.py``); ``--blas-threads`` runs
``attention_bound`` a second time with the BLAS library's own number of threads (one per core
by default), in the row ``BLAS threads``, for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from threadpoolctl import threadpool_limits

import mhanum
from mhanum.bounds import attention_bound, mha_bound

jax.config.update("jax_enable_x64", True)


def median_time(f: Callable[[], object], repeat: int) -> float:
    f()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def floor(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """The float64 products and exponentials of Theorem A.1's terms, alone (module docstring)."""
    with threadpool_limits(limits=1, user_api="blas"):
        _floor(q, k, v)


def _floor(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    step = max(1, 2**18 // k.shape[0])
    v_abs = np.abs(v)
    for start in range(0, q.shape[0], step):
        qs = q[start : start + step]
        t = qs @ k.T
        _ = np.abs(qs) @ np.abs(k).T
        p = np.exp(t - t.max(axis=-1, keepdims=True))
        _ = np.exp(p), np.expm1(p), np.expm1(p), np.expm1(p)
        _ = p @ v
        for _i in range(8):
            _ = p @ v_abs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 1024, attention only")
    parser.add_argument(
        "--blas-threads", action="store_true",
        help="attention_bound also with the BLAS library's own threads",
    )  # fmt: skip
    args = parser.parse_args(argv)
    num = mhanum.Numerics.preset("fp32")
    rng = np.random.default_rng(0)
    params = mhanum.MHAParams.random(512, seed=0)
    print(f"{'case':32s} {'attention s':>12s} {'bound s':>10s} {'bound/attention':>16s}")
    for length in (1024,) if args.quick else (1024, 4096):
        repeat = 5 if length <= 1024 else 3
        q, k, v = (rng.standard_normal((length, 64)).astype(np.float32) for _ in range(3))
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))

        def attend(q=q, k=k, v=v) -> object:
            return np.asarray(mhanum.attention(q, k, v, numerics=num))

        t_a = median_time(attend, repeat)
        t_b = median_time(lambda q=q, k=k, v=v: attention_bound(q, k, v, numerics=num), repeat)
        print(f"{f'attention L={length} d=64':32s} {t_a:12.4f} {t_b:10.4f} {t_b / t_a:16.1f}")
        if args.blas_threads:
            own = attention_bound.__wrapped__  # type: ignore[attr-defined]
            t_o = median_time(lambda q=q, k=k, v=v, f=own: f(q, k, v, numerics=num), repeat)
            print(f"{f'  BLAS threads L={length} d=64':32s} {t_a:12.4f} {t_o:10.4f} "
                  f"{t_o / t_a:16.1f}")  # fmt: skip
        t_f = median_time(lambda q=q, k=k, v=v: floor(q, k, v), repeat)
        print(f"{f'  floor L={length} d=64':32s} {t_a:12.4f} {t_f:10.4f} {t_f / t_a:16.1f}")
        if args.quick:
            continue
        x = np.asarray(rng.standard_normal((1, length, 512)).astype(np.float32), np.float64)

        def mha(x=x) -> object:
            return np.asarray(mhanum.multi_head_attention(x, x, params, 8, numerics=num))

        t_a = median_time(mha, repeat)
        t_b = median_time(lambda x=x: mha_bound(x, x, params, 8, numerics=num), repeat)
        print(f"{f'MHA L={length} 8x64':32s} {t_a:12.4f} {t_b:10.4f} {t_b / t_a:16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
