"""Cost of a bound against the attention call it bounds.

    python benchmarks/bound_speed.py            # L = 1024 and 4096, attention and MHA
    python benchmarks/bound_speed.py --quick    # L = 1024, attention only
    python benchmarks/bound_speed.py --blas-threads   # and attention_bound with BLAS's threads
    python benchmarks/bound_speed.py --long     # and the peak memory at L = 32,768, d = 128
    python benchmarks/bound_speed.py --allocator   # and attention_bound with glibc keeping freed memory

Every row prints its goal and whether it is met: ``attention_bound`` at most 5× its attention call
(L = 1024 and 4096; ``fp32`` and ``bf16-fp32acc``, ``d = 64``), ``mha_bound`` at most 5×
``multi_head_attention`` (L = 1024, ``d_model = 512``, 8 heads), ``attention_tolerance`` at most
20× the PyTorch CPU math kernel it checks (L = 1024, ``d = 64``, float32 and bfloat16; needs
torch; and, without a goal, on a batch of 2 × 8 heads of L = 128, where its fixed cost per head
shows), ``attention_grad_tolerance`` at most 20× that kernel's forward and backward (autograd)
on the same data, and, with ``--long``, a bound at L = 32,768, ``d = 128``, one head, within
2 GiB of peak memory (measured in a fresh process: the growth of its peak resident set over
the inputs').

``attention_bound`` (Theorem A.1) and ``mha_bound`` (A.2) against ``mhanum.attention`` and
``mhanum.multi_head_attention`` with the same numerics (``fp32``: XLA's own dot and reduce;
``bf16-fp32acc``), on
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
by default), in the row ``BLAS threads``, for comparison. The row ``jitted floor`` runs the same
float64 work as one XLA program (``jax.jit``, float64, whole rows): what a jitted evaluation of
the theorem could cost at best here (papers/evaluation.md states that evaluation's error model).

``--allocator`` times ``attention_bound`` and its attention call again in a fresh process whose
glibc ``malloc`` keeps up to 1 GiB of what it frees (``MALLOC_MMAP_THRESHOLD_=33554432``,
``MALLOC_TRIM_THRESHOLD_=1073741824``), in the row ``glibc keeps freed memory``. The bounds
themselves make glibc keep up to 64 MiB per thread (``mhanum/_threads.py``); what a thread
frees beyond that goes back to the system and is faulted in again, page by page. Every
attention row prints the bound's minor page faults per call: how much of its time is the
system's, not its arithmetic.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from threadpoolctl import threadpool_limits

import mhanum
from mhanum.bounds import attention_bound, mha_bound
from mhanum.bounds.forward.head import rows_per_chunk

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
    step = rows_per_chunk(k.shape[0])  # the bound's chunks of query rows
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


def _row(
    case: str, t_a: float, t_b: float, goal: float | None, faults: float | None = None
) -> None:
    ratio = t_b / t_a
    met = "" if goal is None else ("met" if ratio <= goal else "not met")
    shown = "" if goal is None else f"<= {goal:g}"
    paged = "" if faults is None else f"{faults:10.0f}"
    print(f"{case:34s} {t_a:12.4f} {t_b:10.4f} {ratio:16.1f} {shown:>6s} {met:>8s}{paged}")


def _attention_data(length: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((length, 64)).astype(np.float32) for _ in range(3))
    return tuple(np.asarray(x, np.float64) for x in (q, k, v))


def _faults() -> int:
    """This process's minor page faults so far (memory the system maps in on first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _bound_time(bound: Callable[[], object], repeat: int) -> tuple[float, float]:
    """:func:`median_time` of ``bound`` after a first call, and its minor page faults per call."""
    bound()
    before = _faults()
    seconds = median_time(bound, repeat)
    return seconds, (_faults() - before) / (repeat + 1)


KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
"""glibc's malloc settings under which it keeps what it frees (up to 1 GiB) for reuse."""


def _allocator_row(length: int, preset: str, repeat: int) -> None:
    """The attention row again, in a fresh process with :data:`KEEP_FREED`."""
    done = subprocess.run(
        [sys.executable, __file__, "--one", str(length), preset, str(repeat)],
        capture_output=True, text=True, check=True, env={**os.environ, **KEEP_FREED},
    )  # fmt: skip
    t_a, t_b, faults = (float(x) for x in done.stdout.split())
    _row("  glibc keeps freed memory", t_a, t_b, 5.0, faults)


def _one(length: int, preset: str, repeat: int) -> None:
    """``--one``: the attention and bound times and the bound's faults per call, for
    :func:`_allocator_row`."""
    num = mhanum.Numerics.preset(preset)
    q, k, v = _attention_data(length)
    t_a = median_time(lambda: np.asarray(mhanum.attention(q, k, v, numerics=num)), repeat)
    t_b, faults = _bound_time(lambda: attention_bound(q, k, v, numerics=num), repeat)
    print(t_a, t_b, faults)


def _attention_rows(length: int, preset: str, repeat: int, blas: bool) -> None:
    num = mhanum.Numerics.preset(preset)
    q, k, v = _attention_data(length)

    def attend() -> object:
        return np.asarray(mhanum.attention(q, k, v, numerics=num))

    t_a = median_time(attend, repeat)
    t_b, faults = _bound_time(lambda: attention_bound(q, k, v, numerics=num), repeat)
    _row(f"attention {preset} L={length} d=64", t_a, t_b, 5.0, faults)
    if blas:
        own = attention_bound.__wrapped__  # type: ignore[attr-defined]
        t_o = median_time(lambda: own(q, k, v, numerics=num), repeat)
        _row(f"  BLAS threads L={length}", t_a, t_o, None)
    t_f = median_time(lambda: floor(q, k, v), repeat)
    _row(f"  floor L={length} d=64", t_a, t_f, None)
    qj, kj, vj = (jnp.asarray(x) for x in (q, k, v))
    t_j = median_time(lambda: jit_floor(qj, kj, vj), repeat)
    _row(f"  jitted floor L={length} d=64", t_a, t_j, None)


def _mha_row(length: int, repeat: int) -> None:
    num = mhanum.Numerics.preset("fp32")
    params = mhanum.MHAParams.random(512, seed=0)
    rng = np.random.default_rng(0)
    x = np.asarray(rng.standard_normal((1, length, 512)).astype(np.float32), np.float64)

    def mha() -> object:
        return np.asarray(mhanum.multi_head_attention(x, x, params, 8, numerics=num))

    t_a = median_time(mha, repeat)
    t_b = median_time(lambda: mha_bound(x, x, params, 8, numerics=num), repeat)
    _row(f"MHA fp32 L={length} 8x64", t_a, t_b, 5.0 if length == 1024 else None)


def _tolerance_rows(repeat: int) -> None:
    """``attention_tolerance`` against the PyTorch CPU math kernel it certifies (L = 1024)."""
    try:
        import torch
    except ImportError:
        print("tolerance rows: torch is not installed (pip install -e .[frameworks])")
        return
    rng = np.random.default_rng(0)
    for dtype in (torch.float32, torch.bfloat16):
        _tolerance_row(torch, dtype, rng, repeat)
    _tolerance_row(torch, torch.float32, rng, repeat, MANY_HEADS)
    for dtype in (torch.float32, torch.bfloat16):
        _grad_tolerance_row(torch, dtype, rng, repeat)


MANY_HEADS = (2, 8, 128, 64)
"""A batch of many short heads, as a kernel's test suite checks them: the tolerance's cost
there is mostly its fixed cost per head (row ``tolerance ... 2x8 L=128``, no goal)."""


def _tolerance_row(
    torch: Any,
    dtype: Any,
    rng: np.random.Generator,
    repeat: int,
    shape: tuple[int, int, int, int] = (1, 1, 1024, 64),
) -> None:
    from mhanum.testing import attention_oracle, attention_tolerance

    q, k, v = (torch.tensor(rng.standard_normal(shape), dtype=dtype) for _ in range(3))

    def kernel() -> object:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    t_a = median_time(kernel, repeat)
    t_b = median_time(lambda: attention_tolerance(q, k, v, kernel="torch-sdpa-math"), repeat)
    name = str(dtype).removeprefix("torch.")
    batch, heads, length, d = shape
    case = f"L={length} d={d}" if batch * heads == 1 else f"{batch}x{heads} L={length} d={d}"
    _row(f"tolerance {name} {case}", t_a, t_b, 20.0 if batch * heads == 1 else None)
    t_o = median_time(lambda: attention_oracle(q, k, v, kernel="torch-sdpa-math"), repeat)
    _row(f"  oracle {name} {case}", t_a, t_o, None)


def _grad_tolerance_row(torch: Any, dtype: Any, rng: np.random.Generator, repeat: int) -> None:
    """``attention_grad_tolerance`` against the PyTorch CPU math kernel's forward and backward
    (autograd through ``scaled_dot_product_attention``, L = 1024, d = 64)."""
    from mhanum.testing import attention_grad_oracle, attention_grad_tolerance

    q, k, v, g = (
        torch.tensor(rng.standard_normal((1, 1, 1024, 64)), dtype=dtype) for _ in range(4)
    )

    def kernel() -> object:
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv)
        out.backward(g)
        return qq.grad

    t_a = median_time(kernel, repeat)
    t_b = median_time(
        lambda: attention_grad_tolerance(q, k, v, g, kernel="torch-sdpa-math"), repeat
    )
    name = str(dtype).removeprefix("torch.")
    _row(f"grad tolerance {name} L=1024 d=64", t_a, t_b, 20.0)
    t_o = median_time(lambda: attention_grad_oracle(q, k, v, g, kernel="torch-sdpa-math"), repeat)
    _row(f"  grad oracle {name} L=1024 d=64", t_a, t_o, None)


def _peak_memory(length: int, d: int) -> float:
    """The growth of a fresh process's peak resident set (GiB) while it bounds one head."""
    script = f"""
import resource, numpy as np, jax
jax.config.update("jax_enable_x64", True)
from mhanum.bounds import attention_bound
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal(({length}, {d})).astype(np.float32) for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
attention_bound(q, k, v, numerics="bf16-fp32acc")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


@jax.jit
def _jit_floor_kernel(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    t = q @ k.T
    qk = jnp.abs(q) @ jnp.abs(k).T
    p = jnp.exp(t - t.max(axis=-1, keepdims=True))
    w = jnp.stack([p, jnp.exp(p), jnp.expm1(p), jnp.expm1(qk * 2.0**-60), jnp.expm1(p * 0.5)])
    v_abs = jnp.abs(v)
    return (p @ v).sum() + jnp.einsum("wij,jd->wid", jnp.concatenate([w, w[:4]]), v_abs).sum()


def jit_floor(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """The floor's float64 work (:func:`floor`) jitted by XLA in one program, whole (no chunks):
    what a jitted evaluation of Theorem A.1 could cost at best on this machine."""
    _jit_floor_kernel(q, k, v).block_until_ready()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 1024, attention only")
    parser.add_argument(
        "--blas-threads", action="store_true",
        help="attention_bound also with the BLAS library's own threads",
    )  # fmt: skip
    parser.add_argument(
        "--long", action="store_true", help="the peak memory of a bound at L = 32,768, d = 128"
    )
    parser.add_argument(
        "--allocator", action="store_true",
        help="attention_bound also in a process whose glibc malloc keeps freed memory",
    )  # fmt: skip
    parser.add_argument(
        "--tolerances", action="store_true",
        help="the tolerance rows alone (attention_tolerance, attention_oracle, the gradients')",
    )  # fmt: skip
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(int(args.one[0]), args.one[1], int(args.one[2]))
        return 0
    if args.tolerances:
        _tolerance_rows(5)
        return 0
    print(
        f"{'case':34s} {'attention s':>12s} {'bound s':>10s} {'bound/attention':>16s} "
        f"{'goal':>6s} {'':>8s} {'faults':>9s}"
    )
    for length in (1024,) if args.quick else (1024, 4096):
        repeat = 5 if length <= 1024 else 3
        for preset in ("fp32",) if args.quick else ("fp32", "bf16-fp32acc"):
            _attention_rows(length, preset, repeat, args.blas_threads)
            if args.allocator:
                _allocator_row(length, preset, repeat)
        if not args.quick:
            _mha_row(length, repeat)
    if not args.quick:
        _tolerance_rows(5)
    if args.long:
        start = time.perf_counter()
        gib = _peak_memory(32_768, 128)
        seconds = time.perf_counter() - start
        met = "met" if gib <= 2.0 else "not met"
        print(f"bound L=32768 d=128, one head: peak memory +{gib:.2f} GiB (goal <= 2: {met}), "
              f"{seconds:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
