"""Speed of ``mhanum.attention``: native numerics against ``jax.nn.dot_product_attention``.

Run with ``python benchmarks/attention_speed.py`` (``--quick`` skips the slowest emulated
orders). JAX on CPU, float32, ``B = 1``, ``L = 1024``, ``h = 8`` heads of ``d_k = d_v = 64``.
Prints medians of wall-clock time per call after compilation (``block_until_ready``), measured
side by side in one run, and the ratios:

* ``mhanum.attention`` with ``Numerics()`` (XLA's own dot and reduce: ``summation="native"``)
  against ``jax.jit(jax.nn.dot_product_attention)`` on the same data, and a direct jitted
  implementation ``softmax(q k^T / sqrt(d)) v`` as a second baseline;
* the emulated summation orders (sequential, pairwise, blocked(32), Kahan) and the online softmax
  (``online(128)``) against native.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import mhanum
from mhanum import Numerics

B, L, H, D = 1, 1024, 8, 64


def median_seconds(fn: Callable[[], jax.Array], repeats: int) -> float:
    """Median seconds per call of ``fn`` after a warm-up call (which compiles)."""
    fn().block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@jax.jit
def direct(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention written directly in jax.numpy, ``(B, H, L, D)`` layout."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def main() -> None:
    quick = "--quick" in sys.argv
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, L, D)), dtype=jnp.float32) for _ in range(3))
    # jax.nn.dot_product_attention takes (B, T, N, H).
    qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    reference = jax.jit(jax.nn.dot_product_attention)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    print(f"cores: usable = {len(os.sched_getaffinity(0))}; B={B}, L={L}, h={H}, d_k={D}, float32")
    print()
    print(f"{'implementation':<44} {'median ms':>10}  ratio")
    base = median_seconds(lambda: reference(qt, kt, vt), repeats=21)
    print(f"{'jax.nn.dot_product_attention (jit)':<44} {base * 1e3:>10.2f}")
    plain = median_seconds(lambda: direct(q, k, v), repeats=21)
    print(
        f"{'direct jnp softmax(q k^T/sqrt d) v (jit)':<44} {plain * 1e3:>10.2f}  {plain / base:.2f}x"
    )
    native_numerics = Numerics()
    native = median_seconds(lambda: mhanum.attention(q, k, v, numerics=native_numerics), repeats=21)
    print(
        f"{'mhanum.attention, native':<44} {native * 1e3:>10.2f}  {native / base:.2f}x jax.nn, "
        f"{native / plain:.2f}x direct"
    )
    emulated = ["pairwise", "blocked(32)", "kahan", "sequential"]
    if quick:
        emulated = emulated[:2]
    for order in emulated:
        numerics = Numerics(summation=order)
        seconds = median_seconds(
            lambda n=numerics: mhanum.attention(q, k, v, numerics=n), repeats=3
        )
        print(
            f"{'mhanum.attention, summation=' + order:<44} {seconds * 1e3:>10.2f}  {seconds / native:.1f}x native"
        )
    numerics = Numerics(softmax="online(128)")
    seconds = median_seconds(lambda: mhanum.attention(q, k, v, numerics=numerics), repeats=5)
    print(
        f"{'mhanum.attention, softmax=online(128)':<44} {seconds * 1e3:>10.2f}  {seconds / native:.1f}x native"
    )


if __name__ == "__main__":
    main()
