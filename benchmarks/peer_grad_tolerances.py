"""mhanum.testing's certified gradient tolerances against the thresholds kernel test suites use.

    python benchmarks/peer_grad_tolerances.py            # every configuration, every planted bug
    python benchmarks/peer_grad_tolerances.py --quick    # two configurations, fewer draws

Part 1 runs real backward passes on the CPU (torch autograd through SDPA's math and flash
backends, ``jax.vjp`` through ``jax.nn.dot_product_attention``) in float32, bfloat16 and float16,
with causal masks, grouped-query heads and biases, and prints per configuration and gradient:
the false alarms (elements outside mhanum's tolerance: must be 0), the worst error ÷ tolerance,
the median tolerance ÷ |error| over the elements with an error, and mhanum's tolerance ÷ each
peer's threshold (the median over the elements whose exact gradient is not 0, and the max). A configuration a descriptor refuses (a scale
or a length its placement or accumulation is not modelled for) is printed with the reason. The
peers (each a threshold on max|test − gold|, gold mhanum's certified reference):

* PyTorch (``test/test_transformers.py``, ``test_flash_attention_vs_math_ref_grads`` and its
  memory-efficient twin, ``check_out_and_grad``): ``max(1e-5, fudge · max|golden − lp_ref|)``
  with ``lp_ref`` the math backend's gradients in the test's dtype and the fudge factors
  ``grad_query`` 180, ``grad_key`` 16, ``grad_value`` 4;
* FlashAttention (``tests/test_flash_attn.py``): ``2 · max|dq_pt − dq_ref|`` with ``dq_ref``
  plain PyTorch attention upcast to float32 and ``dq_pt`` the same in the test's dtype (half
  precision only).

Part 2 plants backward bugs in a small FlashAttention-2-style numpy kernel of its own (bfloat16
inputs, float32 inside, dS and the probabilities of dV in bfloat16, gradients rounded to
bfloat16; its descriptor says exactly that) and prints, per bug over several draws, its own
effect (the bugged algorithm in float64 ÷ the correct kernel's tolerance: above 1 it is beyond
rounding), how often mhanum and each peer catch it, and the false alarms on the correct kernel.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from mhanum import Backward, InvalidArgument, Numerics
from mhanum.testing import BackwardKernel, attention_grad_oracle

DTYPES = {"float32": (np.float32, torch.float32), "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16),
          "float16": (np.float16, torch.float16)}  # fmt: skip
PT_FUDGE = {"dq": 180.0, "dk": 16.0, "dv": 4.0}
PT_ATOL = 1e-5
NAMES = ("dq", "dk", "dv", "dbias")

# (batch, heads, kv heads, Lq, Lk, d, causal, scale, bias)
CONFIGS = [
    (1, 2, 2, 32, 32, 16, False, None, False),
    (2, 4, 2, 32, 48, 16, True, 0.25, False),
    (1, 2, 2, 32, 64, 64, False, None, True),
    (1, 2, 2, 32, 32, 16, False, 0.25, True),
    (1, 2, 2, 96, 80, 16, True, None, False),
    (1, 2, 2, 200, 600, 16, True, None, False),  # CPU flash: 4 query blocks, 2 key blocks
    (1, 2, 2, 64, 64, 64, True, None, False),  # torch math: sqrt(1/8) on q and k
    (1, 2, 2, 48, 64, 128, True, None, False),  # 1/sqrt(128): no power of two, nor its root
]
QUICK = CONFIGS[:2]
KERNELS = ("torch-sdpa-math", "torch-sdpa-flash-cpu", "jax-xla")


def _inputs(config: tuple[Any, ...], dtype: str, seed: int) -> tuple[Any, ...]:
    b, h, hk, lq, lk, d, _, _, bias = config
    rng = np.random.default_rng(seed)
    cast = DTYPES[dtype][0]

    def draw(shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32).astype(cast)

    q, k, v, g = (
        draw((b, h, lq, d)),
        draw((b, hk, lk, d)),
        draw((b, hk, lk, d)),
        draw((b, h, lq, d)),
    )
    return q, k, v, g, (draw((lq, lk)) if bias else None)


def torch_grads(q, k, v, g, bias, *, backend, dtype, causal, scale, gqa) -> dict[str, np.ndarray]:
    """Torch autograd through SDPA with one backend (``"math"`` or ``"flash"``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    td = DTYPES[dtype][1]
    t = [torch.from_numpy(np.asarray(a, np.float64)).to(td).requires_grad_(True) for a in (q, k, v)]
    tb = None
    if bias is not None:  # the CPU flash backward returns no bias gradient
        tb = torch.from_numpy(np.asarray(bias, np.float64)).to(td)
        tb.requires_grad_(backend == "math")
    chosen = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    with sdpa_kernel([chosen]):
        out = torch.nn.functional.scaled_dot_product_attention(
            *t, attn_mask=tb, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    out.backward(torch.from_numpy(np.asarray(g, np.float64)).to(td))
    grads = {n: x.grad.double().numpy() for n, x in zip(NAMES, t, strict=False)}
    if tb is not None and tb.grad is not None:
        grads["dbias"] = tb.grad.double().numpy()
    return grads


def jax_grads(q, k, v, g, bias, *, dtype, causal, scale, gqa) -> dict[str, np.ndarray]:
    """``jax.vjp`` through ``jax.nn.dot_product_attention`` (``(B, L, H, d)`` inside)."""
    del gqa
    jd = DTYPES[dtype][0]
    args = [
        jnp.asarray(np.swapaxes(np.asarray(a, np.float64), -3, -2), dtype=jd) for a in (q, k, v)
    ]
    if bias is not None:
        args.append(jnp.asarray(np.asarray(bias, np.float64), dtype=jd))

    def f(*xs: Any) -> Any:
        b = xs[3] if len(xs) > 3 else None
        return jax.nn.dot_product_attention(*xs[:3], bias=b, is_causal=causal, scale=scale)

    _, vjp = jax.vjp(f, *args)
    gs = vjp(jnp.asarray(np.swapaxes(np.asarray(g, np.float64), -3, -2), dtype=jd))
    grads = {
        n: np.swapaxes(np.asarray(x, np.float64), -3, -2)
        for n, x in zip(NAMES, gs[:3], strict=False)
    }
    if bias is not None:
        grads["dbias"] = np.asarray(gs[3], np.float64)
    return grads


def run_kernel(kernel: str, q, k, v, g, bias, **kw: Any) -> dict[str, np.ndarray]:
    if kernel == "jax-xla":
        return jax_grads(q, k, v, g, bias, **kw)
    backend = "math" if kernel == "torch-sdpa-math" else "flash"
    return torch_grads(q, k, v, g, bias, backend=backend, **kw)


def _plain_torch_grads(q, k, v, g, *, dtype, causal, scale, upcast) -> list[np.ndarray]:
    """FlashAttention's ``attention_ref`` and its autograd, upcast to float32 or not."""
    td = torch.float32 if upcast else DTYPES[dtype][1]
    t = [torch.from_numpy(np.asarray(a, np.float64)).to(td).requires_grad_(True) for a in (q, k, v)]
    tq, tk, tv = t
    if tk.shape[-3] != tq.shape[-3]:
        group = tq.shape[-3] // tk.shape[-3]
        tk, tv = (x.repeat_interleave(group, dim=-3) for x in (tk, tv))
    c = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    s = tq @ tk.transpose(-1, -2) * c
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    out = torch.softmax(s, dim=-1) @ tv
    out.backward(torch.from_numpy(np.asarray(g, np.float64)).to(td))
    return [x.grad.double().numpy() for x in t]


def peer_thresholds(exact, q, k, v, g, bias, *, dtype, causal, scale, gqa) -> dict[str, dict]:
    """Each peer's threshold per gradient (a scalar)."""
    kw = {"dtype": dtype, "causal": causal, "scale": scale}
    lp = torch_grads(q, k, v, g, bias, backend="math", gqa=gqa, **kw)
    out: dict[str, dict] = {"pytorch": {}}
    for n in ("dq", "dk", "dv"):
        err = float(np.max(np.abs(exact[n] - lp[n])))
        out["pytorch"][n] = max(PT_ATOL, PT_FUDGE[n] * err)
    if dtype != "float32" and bias is None:
        ref = _plain_torch_grads(q, k, v, g, upcast=True, **kw)
        pt = _plain_torch_grads(q, k, v, g, upcast=False, **kw)
        out["flash-attention"] = {
            n: 2 * float(np.max(np.abs(a - b))) for n, a, b in zip(NAMES, pt, ref, strict=False)
        }
    return out


def run_configuration(kernel: str, dtype: str, config: tuple[Any, ...], seed: int = 0):
    """One row of part 1 per gradient, or the descriptor's refusal."""
    q, k, v, g, bias = _inputs(config, dtype, seed)
    causal, scale, gqa = config[6], config[7], config[1] != config[2]
    try:
        oracle = attention_grad_oracle(
            q, k, v, g, bias=bias, is_causal=causal, scale=scale, enable_gqa=gqa, kernel=kernel
        )
    except InvalidArgument as err:
        return {"refused": str(err).split(":")[0] + ": " + str(err).split(": ", 1)[1][:70]}
    kw = {"dtype": dtype, "causal": causal, "scale": scale, "gqa": gqa}
    grads = run_kernel(kernel, q, k, v, g, bias, **kw)
    grads = {n: x for n, x in grads.items() if n in oracle.oracles}
    peers = peer_thresholds(oracle.exact, q, k, v, g, bias, **kw)
    rows = {}
    for name, actual in grads.items():
        o = oracle[name]
        failing, ratio = o.check(actual)
        err = np.abs(actual - o.exact)
        tight = o.tolerance[err > 0] / err[err > 0]
        live = o.tolerance[o.exact != 0]  # a key no query attends has an exact 0 gradient
        vs = {p: (float(np.median(live / t[name])), float(np.max(o.tolerance / t[name])))
              for p, t in peers.items() if name in t}  # fmt: skip
        rows[name] = {
            "false_alarms": int(failing.sum()),
            "worst_ratio": float(ratio.max()),
            "tol_over_err": float(np.median(tight)) if tight.size else math.inf,
            "vs_peers": vs,
        }
    return rows


# -- part 2: planted backward bugs --------------------------------------------------------------

BUGS = (
    "missing D term",
    "dS without the diagonal",
    "dK accumulated in bf16",
    "dropped key block in dQ",
    "scale applied once",
)
BLOCK = 16
_BF16 = ml_dtypes.bfloat16


def own_numerics() -> tuple[Numerics, Backward]:
    """The numerics of :func:`own_backward`: bfloat16 in and out, float32 inside."""
    num = Numerics(
        input="bfloat16", accum="float32", score_format="float32", scale_format="float32",
        softmax_format="float32", prob_format="bfloat16", output_format="bfloat16",
        mask_mode="add", exp_ulps=4.0, div_ulps=2.0,
    )  # fmt: skip
    return num, Backward("flash2", block_q=BLOCK, block_k=BLOCK)


OWN = BackwardKernel(
    "own-bf16-flash2",
    {"bfloat16": (own_numerics(),)},
    ("benchmarks/peer_grad_tolerances.py: own_backward, FlashAttention-2's Algorithm 2 in numpy",),
)


def own_backward(q, k, v, g, *, bug: str | None = None, work: Any = np.float32, order=None):
    """FlashAttention-2's backward (recomputed P from the log-sum-exp, ``D = rowsum(dO ∘ O)``,
    ``dK``/``dV`` over query blocks, one ``dQ`` partial per key block added in ``order``) on
    bfloat16 inputs, float32 inside; ``work=np.float64`` runs the same algorithm (and bug)
    unrounded: the bug's own effect."""
    f = work
    half = (lambda x: x) if work is np.float64 else (lambda x: x.astype(_BF16).astype(f))
    q, k, v, g = (np.asarray(a, f) for a in (q, k, v, g))
    lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    c = f(1 / math.sqrt(d))
    s = (q @ np.swapaxes(k, -1, -2)) * c
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    ell = e.sum(axis=-1, keepdims=True)
    out = half(((half(e / ell)) @ v).astype(f))
    lse = (m + np.log(ell)).astype(f)
    p = np.exp(s - lse).astype(f)
    dv = half(np.swapaxes(half(p), -1, -2) @ g)
    dp = g @ np.swapaxes(v, -1, -2)
    big_d = (g * out).sum(axis=-1, keepdims=True)
    if bug == "missing D term":
        ds = p * dp
    elif bug == "dS without the diagonal":
        ds = -p * big_d
    else:
        ds = p * (dp - big_d)
    ds = half(ds.astype(f))
    blocks = list(range(-(-lk // BLOCK))) if order is None else list(order)
    dq = np.zeros(q.shape, f)
    for b in blocks:
        if bug == "dropped key block in dQ" and b == 1:
            continue
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        dq = (dq + ds[..., :, sl] @ k[..., sl, :]).astype(f)
    dk = np.zeros(k.shape, f)
    if bug == "dK accumulated in bf16":  # each query row's product added to a bfloat16 sum
        for i in range(lq):
            row = ds[..., i, :, None] * q[..., i, None, :]
            dk = (dk + row).astype(_BF16).astype(f)
    for b in range(-(-lq // BLOCK)) if bug != "dK accumulated in bf16" else ():
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        dk = (dk + np.swapaxes(ds[..., sl, :], -1, -2) @ q[..., sl, :]).astype(f)
    scale = f(1) if bug == "scale applied once" else c
    return {"dq": half(dq * scale), "dk": half(dk * scale), "dv": dv}


def _own_peers(exact, q, k, v, g) -> dict[str, dict]:
    return peer_thresholds(
        exact, q, k, v, g, None, dtype="bfloat16", causal=False, scale=None, gqa=False
    )


def planted_draw(bug: str, seed: int, length: int = 128, d: int = 16) -> dict[str, Any]:
    """One draw of one planted bug: its own effect (per gradient, the largest ``|bug64 -
    exact| / tolerance``), whether mhanum and each peer catch the bugged kernel, and the
    correct kernel's false alarms (over two dQ orders)."""
    rng = np.random.default_rng(200 + seed)
    q, k, v, g = (
        rng.standard_normal((2, length, d)).astype(np.float32).astype(_BF16) for _ in range(4)
    )
    oracle = attention_grad_oracle(q, k, v, g, kernel=OWN)
    blocks = -(-length // BLOCK)
    good_alarms = 0
    for order in (None, tuple(reversed(range(blocks)))):
        good = own_backward(q, k, v, g, order=order)
        good_alarms += sum(int(f.sum()) for f, _ in oracle.check(good).values())
    bad = own_backward(q, k, v, g, bug=bug)
    bug64 = own_backward(q, k, v, g, bug=bug, work=np.float64)
    effect = max(float(r.max()) for _, r in oracle.check(bug64).values())
    peers = _own_peers(oracle.exact, q, k, v, g)
    caught_by = {
        p: any(float(np.max(np.abs(bad[n] - oracle.exact[n]))) > t[n] for n in t)
        for p, t in peers.items()
    }
    diff = max(float(np.max(np.abs(bad[n] - oracle.exact[n]))) for n in ("dq", "dk", "dv"))
    tol = max(float(np.max(oracle[n].tolerance)) for n in ("dq", "dk", "dv"))
    return {
        "good_alarms": good_alarms,
        "effect": effect,
        "max_err": diff,
        "max_tol": tol,
        "caught": any(f.any() for f, _ in oracle.check(bad).values()),
        "peers": caught_by,
    }


def planted(draws: int) -> list[dict[str, Any]]:
    rows = []
    for bug in BUGS:
        results = [planted_draw(bug, seed) for seed in range(draws)]
        beyond = [r for r in results if r["effect"] > 1]
        row = {
            "bug": bug,
            "good_alarms": sum(r["good_alarms"] for r in results),
            "effect": min(r["effect"] for r in results),
            "max_err": max(r["max_err"] for r in results),
            "max_tol": max(r["max_tol"] for r in results),
            "beyond": len(beyond),
            "mhanum": sum(r["caught"] for r in beyond),
        }
        for name in ("pytorch", "flash-attention"):
            row[name] = sum(r["peers"][name] for r in beyond)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two configurations, 2 draws")
    args = parser.parse_args(argv)
    configs = QUICK if args.quick else CONFIGS
    print("part 1: real backward passes (false alarms must be 0; tolerance ÷ peer: median / max)")
    print(f"{'kernel':21s} {'dtype':9s} {'B,H,Hkv,Lq,Lk,d,causal,scale,bias':34s} {'grad':5s} "
          f"{'alarms':>6s} {'err/tol':>8s} {'tol/|err|':>9s}  vs pytorch        vs flash-attn")  # fmt: skip
    alarms = 0
    tight: dict[tuple[str, str, str], list[float]] = {}
    vs_pt: dict[tuple[str, str, str], list[float]] = {}
    for kernel in KERNELS:
        for dtype in DTYPES:
            for config in configs:
                label = ",".join(map(str, config))
                r = run_configuration(kernel, dtype, config)
                if "refused" in r:
                    print(f"{kernel:21s} {dtype:9s} {label:34s} refused: {r['refused']}")
                    continue
                for name, row in r.items():
                    alarms += row["false_alarms"]
                    tight.setdefault((name, dtype, kernel), []).append(row["tol_over_err"])
                    if "pytorch" in row["vs_peers"]:
                        key = (name, dtype, kernel)
                        vs_pt.setdefault(key, []).append(row["vs_peers"]["pytorch"][0])
                    peers = "  ".join(
                        f"{row['vs_peers'][p][0]:7.3g}/{row['vs_peers'][p][1]:<8.3g}"
                        if p in row["vs_peers"] else f"{'-':>16s}"
                        for p in ("pytorch", "flash-attention")
                    )  # fmt: skip
                    print(f"{kernel:21s} {dtype:9s} {label:34s} {name:5s} "
                          f"{row['false_alarms']:6d} {row['worst_ratio']:8.3g} "
                          f"{row['tol_over_err']:9.3g}  {peers}")  # fmt: skip
    print(f"false alarms in all: {alarms}")
    print("\nmedian over configurations, per gradient, dtype and kernel: tolerance / |error| "
          "(correct kernels) and tolerance / PyTorch's threshold (median over elements)")  # fmt: skip
    for (name, dtype, kernel), values in sorted(tight.items()):
        pt = vs_pt.get((name, dtype, kernel), [])
        pt_text = f"{statistics.median(pt):8.3g}" if pt else "       -"
        print(f"  {name:5s} {dtype:9s} {kernel:21s} tol/|err| {statistics.median(values):8.3g}   "
              f"tol/pytorch {pt_text}")  # fmt: skip
    draws = 2 if args.quick else 6
    print(
        f"\npart 2: planted bugs in a bfloat16 FlashAttention-2-style backward, {draws} draws each"
    )
    print("effect: the least over the draws of the bug's own effect (float64) ÷ the correct "
          "kernel's tolerance; the counts are of the draws beyond rounding (effect > 1)")  # fmt: skip
    print(f"{'bug':26s} {'effect':>9s} {'max|err|':>9s} {'max tol':>9s} {'beyond':>6s} "
          f"{'mhanum':>6s} {'pytorch':>7s} {'flash':>5s}")  # fmt: skip
    rows = planted(draws)
    for r in rows:
        print(f"{r['bug']:26s} {r['effect']:9.3g} {r['max_err']:9.3g} {r['max_tol']:9.3g} "
              f"{r['beyond']:6d} {r['mhanum']:6d} {r['pytorch']:7d} {r['flash-attention']:5d}")  # fmt: skip
    good = sum(r["good_alarms"] for r in rows)
    print(f"false alarms on the correct kernel (two dQ orders per draw): {good}")
    return 1 if alarms or good else 0


if __name__ == "__main__":
    sys.exit(main())
