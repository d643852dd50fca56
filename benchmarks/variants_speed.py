"""Cost of mhanum's emulation of today's attention variants against ``jax.nn``'s own.

    python benchmarks/variants_speed.py            # L = 4096
    python benchmarks/variants_speed.py --quick    # L = 1024

``mhanum.attention`` in native mode (``Numerics()``: float32, XLA's own dot and reduce) against
``jax.nn.dot_product_attention(implementation="xla")`` on the same float32 data, 8 query heads of
``d = 64``, one batch element: causal (mhanum builds ``masks.causal()`` inside the computation,
jax takes ``is_causal=True``), a sliding window of 256 keys (``local_window_size``) and
grouped-query attention with 2 key/value heads (jax takes the grouped k and v; mhanum repeats
them head by head, as the bound and the reference read them). Medians of wall-clock time per
call after compilation, measured side by side in one run, and the ratio mhanum ÷ jax (the goal
for causal and GQA at L = 4096 is ≤ 1.5×).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import mhanum
from mhanum import masks

HEADS, KV_HEADS, D = 8, 2, 64


def median_time(f: Callable[[], object], repeat: int) -> float:
    jax.block_until_ready(f())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 1024")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per case")
    args = parser.parse_args(argv)
    length = 1024 if args.quick else 4096
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((HEADS, length, D)), jnp.float32)
    k_kv, v_kv = (
        jnp.asarray(rng.standard_normal((KV_HEADS, length, D)), jnp.float32) for _ in "kv"
    )
    k, v = (jnp.repeat(x, HEADS // KV_HEADS, axis=0) for x in (k_kv, v_kv))
    num = mhanum.Numerics()

    def btnh(x: jax.Array) -> jax.Array:  # (H, L, d) -> jax.nn's (B, T, N, H)
        return jnp.swapaxes(x, 0, 1)[None]

    def jax_call(kk: jax.Array, vv: jax.Array, **kw: object) -> Callable[[], jax.Array]:
        f = jax.jit(
            lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation="xla", **kw)
        )
        return lambda: f(btnh(q), btnh(kk), btnh(vv))

    cases = {
        "causal": (
            lambda: mhanum.attention(q, k, v, masks.causal(), numerics=num),
            jax_call(k, v, is_causal=True),
        ),
        "sliding window 256": (
            lambda: mhanum.attention(q, k, v, masks.window(255, 0), numerics=num),
            jax_call(k, v, local_window_size=(255, 0)),
        ),
        f"GQA {HEADS}/{KV_HEADS} heads, causal": (
            lambda: mhanum.attention(
                q,
                jnp.repeat(k_kv, HEADS // KV_HEADS, axis=0),
                jnp.repeat(v_kv, HEADS // KV_HEADS, axis=0),
                masks.causal(),
                numerics=num,
            ),
            jax_call(k_kv, v_kv, is_causal=True),
        ),
    }
    print(f"L = {length}, {HEADS} heads of d = {D}, float32, medians of {args.repeat} calls")
    print(f"{'case':32s} {'mhanum s':>10s} {'jax.nn s':>10s} {'mhanum/jax':>11s}")
    for name, (ours, theirs) in cases.items():
        t_ours, t_jax = median_time(ours, args.repeat), median_time(theirs, args.repeat)
        print(f"{name:32s} {t_ours:10.4f} {t_jax:10.4f} {t_ours / t_jax:11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
