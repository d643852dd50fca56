"""mhanum.testing's certified tolerance against the tolerances kernel test suites use.

    python benchmarks/peer_tolerances.py            # every configuration and every planted bug
    python benchmarks/peer_tolerances.py --quick    # two configurations, fewer draws
    python benchmarks/peer_tolerances.py --probabilistic-only   # part 3 alone
    python benchmarks/peer_tolerances.py --floor-only           # part 4 alone

Part 1 runs real kernels (torch's SDPA math and CPU flash backends, ``jax.nn.dot_product_attention``)
on configurations of the kinds their test suites use and prints, per configuration: the false
alarms (elements outside mhanum's tolerance: must be 0), the worst error ÷ tolerance, and the
largest mhanum tolerance ÷ each peer's threshold. The peers (each a threshold on max|test − gold|):

* PyTorch (``test/test_transformers.py``, ``_check_equal``): ``max(1e-5, fudge · max|golden −
  lp_ref|)`` with ``golden`` the float64 math reference, ``lp_ref`` the math backend in the test's
  dtype, and the output's fudge factor 5 (``check_out_and_grad``'s default);
* FlashAttention (``tests/test_flash_attn.py``, ``test_flash_attn_output``): ``2 · max|out_pt −
  out_ref|`` with ``out_ref`` plain PyTorch attention upcast to float32 and ``out_pt`` the same in
  the test's dtype (half precision only);
* JAX (``tests/nn_test.py``, ``testDotProductAttention``): ``atol = rtol = 0.01`` element by
  element (half precision only).

mhanum's ``golden`` is its certified reference (the peers use float64 or float32 attention).

Part 2 plants bugs in a small bfloat16 kernel of its own (float32 inside, float32
probabilities, output rounded to bfloat16; its descriptor says exactly that) and counts, for each
bug over several input draws, how often mhanum and each peer catch it, and whether the bug moves
the output beyond rounding at all (beyond the correct kernel's certified tolerance).

Part 3 sets the probabilistic tolerance (``confidence=0.99``, Theorem A.3) beside the certified
one on the correct kernels of part 1, over 300 configurations per input format (the three
kernels, five input families, 20 draws each; shapes, causal masks and scales drawn as the
peers' suites parametrize them): random normal inputs, large logits, near ties, outlier
channels and long rows. Per format it prints the median over the configurations of the median
tolerance ÷ |error| (over the elements with a nonzero error), the false alarms (elements and
configurations outside the tolerance), the goals beside them, and which bound terms govern the
probabilistic tolerance.

Part 4 sets the float32 tolerances of ``jax-xla-cpu`` beside the floor (``rounding_floor.py``):
the error of a worst-case rounding that the kernel's model allows, every sum in its worst order
(float32 sums in any order, as the model states). No sound certified tolerance is below it, so
its median ÷ |error| is the least figure any certified tolerance of that model can reach on
these inputs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
import torch

from mhanum import Numerics
from mhanum.testing import Kernel, attention_oracle

jax.config.update("jax_enable_x64", True)

DTYPES = {"float32": (np.float32, torch.float32), "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16),
          "float16": (np.float16, torch.float16)}  # fmt: skip
PT_FUDGE = 5.0
PT_ATOL = 1e-5
JAX_TOL = 0.01

# (batch, heads, Lq, Lk, d, causal, scale): shapes of the kinds the SDPA and flash tests use
CONFIGS = [
    (1, 2, 64, 64, 64, False, None),
    (2, 2, 128, 128, 32, True, None),
    (1, 2, 96, 160, 128, False, 0.5),
    (1, 1, 256, 256, 64, True, None),
]
QUICK = CONFIGS[:2]


def _inputs(config: tuple[Any, ...], dtype: str, seed: int) -> tuple[np.ndarray, ...]:
    b, h, lq, lk, d, _, _ = config
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype][0]
    shapes = ((b, h, lq, d), (b, h, lk, d), (b, h, lk, d))
    return tuple(rng.standard_normal(s).astype(np.float32).astype(np_dtype) for s in shapes)


def _torch_sdpa(q, k, v, *, backend, dtype, causal, scale, device_dtype=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    td = device_dtype or DTYPES[dtype][1]
    t = [torch.from_numpy(np.asarray(a, np.float64)).to(td) for a in (q, k, v)]
    chosen = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    with torch.no_grad(), sdpa_kernel([chosen]):
        out = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=causal, scale=scale)
    return out.double().numpy()


def _plain_torch(q, k, v, *, dtype, causal, scale, upcast):
    """FlashAttention's ``attention_ref``: plain softmax(q kᵀ·scale) v, upcast or not."""
    td = torch.float32 if upcast else DTYPES[dtype][1]
    tq, tk, tv = (torch.from_numpy(np.asarray(a, np.float64)).to(td) for a in (q, k, v))
    s = tq @ tk.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    out = torch.softmax(s, dim=-1) @ tv
    return out.double().numpy()


def _jax(q, k, v, *, dtype, causal, scale):
    jd = DTYPES[dtype][0]
    t = [jax.numpy.asarray(np.swapaxes(np.asarray(a), 1, 2), dtype=jd) for a in (q, k, v)]
    out = jax.nn.dot_product_attention(*t, is_causal=causal, scale=scale)
    return np.swapaxes(np.asarray(out, np.float64), 1, 2)


KERNELS: dict[str, Callable[..., np.ndarray]] = {
    "torch-sdpa-math": lambda q, k, v, **kw: _torch_sdpa(q, k, v, backend="math", **kw),
    "torch-sdpa-flash-cpu": lambda q, k, v, **kw: _torch_sdpa(q, k, v, backend="flash", **kw),
    "jax-xla-cpu": _jax,
}


def peer_thresholds(gold, q, k, v, *, dtype, causal, scale) -> dict[str, Any]:
    """Each peer's threshold on |test - gold| (a scalar, or an array for JAX's rtol)."""
    lp_ref = _torch_sdpa(q, k, v, backend="math", dtype=dtype, causal=causal, scale=scale)
    out: dict[str, Any] = {"pytorch": max(PT_ATOL, PT_FUDGE * float(np.max(np.abs(gold - lp_ref))))}
    if dtype != "float32":
        kw = {"dtype": dtype, "causal": causal, "scale": scale}
        out_ref = _plain_torch(q, k, v, upcast=True, **kw)
        out_pt = _plain_torch(q, k, v, upcast=False, **kw)
        out["flash-attention"] = 2 * float(np.max(np.abs(out_pt - out_ref)))
        out["jax"] = JAX_TOL + JAX_TOL * np.abs(gold)
    return out


def caught_by_peers(test: np.ndarray, gold: np.ndarray, peers: dict[str, Any]) -> dict[str, bool]:
    err = np.abs(test - gold)
    bad = ~np.isfinite(test)
    return {name: bool(bad.any() or np.any(err > t)) for name, t in peers.items()}


def run_configuration(kernel: str, dtype: str, config: tuple[Any, ...], seed: int = 0):
    """One row of part 1: false alarms, worst err/tol, and mhanum tolerance ÷ peer thresholds."""
    q, k, v = _inputs(config, dtype, seed)
    causal, scale = config[5], config[6]
    out = KERNELS[kernel](q, k, v, dtype=dtype, causal=causal, scale=scale)
    oracle = attention_oracle(q, k, v, is_causal=causal, scale=scale, kernel=kernel)
    failing, ratio = oracle.check(out)
    peers = peer_thresholds(oracle.exact, q, k, v, dtype=dtype, causal=causal, scale=scale)
    vs = {}
    for name, t in peers.items():
        per = oracle.tolerance / t
        vs[name] = (float(np.median(per)), float(np.max(per)))
    return {
        "false_alarms": int(failing.sum()),
        "worst_ratio": float(ratio.max()),
        "tolerance_max": float(oracle.tolerance.max()),
        "vs_peers": vs,
    }


# -- part 2: planted bugs ----------------------------------------------------------------------

BUGS = (
    "scale x1.001",
    "scale x1.01",
    "dropped key block",
    "stale row maximum",
    "causal off by one",
    "P rounded to bf16",
    "missing final rescale",
    "fully-masked rows uniform",
)
BLOCK = 32


def own_kernel_numerics() -> Numerics:
    """The numerics of :func:`own_kernel` (bfloat16 in and out, float32 inside)."""
    return Numerics(
        input="bfloat16", accum="float32", score_format="float32", scale_format="float32",
        softmax_format="float32", prob_format="float32", output_format="bfloat16",
        softmax=f"online({BLOCK})", mask_mode="add", div_ulps=0.5,
    )  # fmt: skip


OWN = Kernel(
    "own-bf16-online",
    {"bfloat16": (own_kernel_numerics(),)},
    fully_masked="zero",
    evidence=("benchmarks/peer_tolerances.py: own_kernel, a numpy online softmax in float32",),
)


def own_kernel(q, k, v, mask, *, bug: str | None = None, work: Any = np.float32) -> np.ndarray:
    """A float32 online-softmax kernel on bfloat16 inputs, output rounded to bfloat16.

    ``work=np.float64`` runs the same algorithm (with the same bug) in float64 and returns the
    output unrounded: the bug's own effect, nearly free of rounding.
    """
    f = work
    q32, k32, v32 = (np.asarray(a, f) for a in (q, k, v))
    lq, lk, d = q32.shape[-2], k32.shape[-2], q32.shape[-1]
    scale = f(1 / math.sqrt(d))
    if bug == "scale x1.001":
        scale = f(scale * 1.001)
    if bug == "scale x1.01":
        scale = f(scale * 1.01)
    keep = np.ones((lq, lk), bool) if mask is None else np.asarray(mask, bool)
    if bug == "causal off by one":
        keep = keep | np.eye(lq, lk, k=1, dtype=bool)
    if bug == "dropped key block":
        keep = keep.copy()
        keep[:, BLOCK : 2 * BLOCK] = False
        keep[:, 0] |= ~keep.any(axis=-1)
    s = (q32 @ np.swapaxes(k32, -1, -2)) * scale
    s = np.where(keep, s, f(-np.inf))
    n_blocks = -(-lk // BLOCK)
    m = np.full((*s.shape[:-1], 1), -np.inf, f)
    l = np.zeros((*s.shape[:-1], 1), f)
    acc = np.zeros((*s.shape[:-1], v32.shape[-1]), f)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(n_blocks):
            sb, vb = s[..., b * BLOCK : (b + 1) * BLOCK], v32[..., b * BLOCK : (b + 1) * BLOCK, :]
            m_new = np.maximum(m, sb.max(axis=-1, keepdims=True))
            safe = np.where(np.isfinite(m_new), m_new, f(0))
            alpha = np.where(np.isfinite(m), np.exp(m - safe), f(0)).astype(f)
            if bug == "stale row maximum" and b == 1:
                alpha = np.ones_like(alpha)
            e = np.exp(sb - safe).astype(f)
            if bug == "P rounded to bf16":
                e = e.astype(ml_dtypes.bfloat16).astype(f)
            l = (alpha * l + e.sum(axis=-1, keepdims=True)).astype(f)
            rescale = alpha
            if bug == "missing final rescale" and b == n_blocks - 1:
                rescale = np.ones_like(alpha)
            acc = (rescale * acc + e @ vb).astype(f)
            m = m_new
        out = np.where(l > 0, acc / np.where(l > 0, l, 1), f(0)).astype(f)
    dead = ~keep.any(axis=-1)
    if bug == "fully-masked rows uniform":
        out = np.where(dead[..., None], v32.mean(axis=-2, keepdims=True), out)
    if work is np.float64:
        return out
    return out.astype(ml_dtypes.bfloat16).astype(np.float64)


def _bug_inputs(bug: str, seed: int, length: int, d: int):
    rng = np.random.default_rng(100 + seed)
    q, k, v = (
        rng.standard_normal((2, length, d)).astype(np.float32).astype(ml_dtypes.bfloat16)
        for _ in range(3)
    )
    mask = None
    if bug == "causal off by one":
        mask = np.tril(np.ones((length, length), bool))
    if bug == "fully-masked rows uniform":
        mask = rng.random((length, length)) < 0.9
        mask[::17] = False
    return q, k, v, mask


def planted_draw(bug: str, seed: int, length: int = 128, d: int = 64) -> dict[str, Any]:
    """One draw of one planted bug: its own effect, and who catches it.

    ``effect`` is the bug's own effect in units of the correct kernel's certified tolerance: the
    largest ``|bug64 - exact| / tolerance`` with ``bug64`` the bugged algorithm run in float64
    (unrounded). Above 1 the bug alone moves some element farther than every rounding of the
    kernel's numerics may: it is *beyond rounding*, and a sound oracle with a useful tolerance
    should catch it. ``caught`` says whether the bugged kernel's real output fails the check.
    """
    q, k, v, mask = _bug_inputs(bug, seed, length, d)
    oracle = attention_oracle(q, k, v, mask=mask, kernel=OWN)
    good = own_kernel(q, k, v, mask)
    bad = own_kernel(q, k, v, mask, bug=bug)
    bug64 = own_kernel(q, k, v, mask, bug=bug, work=np.float64)
    good_failing, good_ratio = oracle.check(good)
    _, effect = oracle.check(bug64)
    peers = _peers_for_own(oracle.exact, q, k, v, mask)
    return {
        "good_alarms": int(good_failing.sum()),
        "good_ratio": float(good_ratio.max()),
        "effect": float(effect.max()),
        "max_diff": float(np.nanmax(np.abs(bad - good))),
        "caught": bool(oracle.check(bad)[0].any()),
        "peers": caught_by_peers(bad, np.nan_to_num(oracle.exact), peers),
    }


def planted(draws: int, length: int = 128, d: int = 64) -> list[dict[str, Any]]:
    """Part 2: per bug, how often it moves the output beyond rounding and who catches it."""
    rows = []
    for bug in BUGS:
        results = [planted_draw(bug, seed, length, d) for seed in range(draws)]
        beyond = [r for r in results if r["effect"] > 1]
        within = [r for r in results if r["effect"] <= 1]
        row = {
            "bug": bug,
            "draws": draws,
            "good_alarms": sum(r["good_alarms"] for r in results),
            "effect": max(r["effect"] for r in results),
            "max_diff": max(r["max_diff"] for r in results),
            "beyond": len(beyond),
            "mhanum": sum(r["caught"] for r in beyond),
            "mhanum_within": sum(r["caught"] for r in within),
        }
        for name in ("pytorch", "flash-attention", "jax"):
            row[name] = sum(r["peers"][name] for r in beyond)
        rows.append(row)
    return rows


def _peers_for_own(gold, q, k, v, mask):
    """The peers' thresholds for the own kernel: low-precision references in bfloat16."""
    tq, tk, tv = (torch.from_numpy(np.asarray(a, np.float64)) for a in (q, k, v))
    tm = None if mask is None else torch.from_numpy(mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        lp = (
            torch.nn.functional.scaled_dot_product_attention(
                tq.bfloat16(), tk.bfloat16(), tv.bfloat16(), attn_mask=tm
            )
            .double()
            .numpy()
        )
        up = (
            torch.nn.functional.scaled_dot_product_attention(
                tq.float(), tk.float(), tv.float(), attn_mask=tm
            )
            .double()
            .numpy()
        )
    g = np.nan_to_num(gold)
    return {
        "pytorch": max(PT_ATOL, PT_FUDGE * float(np.nanmax(np.abs(g - lp)))),
        "flash-attention": 2 * float(np.nanmax(np.abs(lp - up))),
        "jax": JAX_TOL + JAX_TOL * np.abs(g),
    }


# -- part 3: the probabilistic tolerance -------------------------------------------------------

CONFIDENCE = 0.99
FAMILIES = ("normal", "large-logit", "near-tie", "outlier", "long-row")
DRAWS = 20  # per kernel, format and family: 3 x 5 x 20 = 300 configurations per format
# (batch, heads, Lq, Lk, d): lengths and head dimensions of the kinds the peers' suites take
P_SHAPES = [(1, 2, 64, 64, 64), (2, 2, 128, 128, 32), (1, 2, 113, 203, 64), (1, 1, 256, 256, 128),
            (2, 4, 32, 32, 16)]  # fmt: skip
LONG_SHAPES = [(1, 2, 16, 1024, 64), (1, 1, 8, 2048, 128)]
GOALS = {"float32": 30.0, "bfloat16": 5.0, "float16": 5.0}  # median tolerance ÷ |error|


def family_inputs(family: str, dtype: str, seed: int) -> tuple[tuple[Any, ...], ...]:
    """One configuration of a family: ``(config, (q, k, v))``, the config as in part 1.

    ``normal``: standard normal entries. ``large-logit``: q and k times 4 (logits with a
    standard deviation of 16: a peaked softmax). ``near-tie``: every key one random vector
    plus a perturbation of 2^-6 of it (logits that nearly tie: a flat softmax). ``outlier``:
    two channels of q and k and one of v 20 times larger (the outlier features of trained
    models). ``long-row``: standard normal with 1024 or 2048 keys.
    """
    rng = np.random.default_rng([FAMILIES.index(family), seed])
    shapes = LONG_SHAPES if family == "long-row" else P_SHAPES
    b, h, lq, lk, d = shapes[seed % len(shapes)]
    causal = bool(rng.integers(2))
    scale = 0.5 / math.sqrt(d) if rng.integers(4) == 0 else None
    q, k, v = (rng.standard_normal((b, h, n, d)) for n in (lq, lk, lk))
    if family == "large-logit":
        q, k = 4 * q, 4 * k
    elif family == "near-tie":
        k = k[..., :1, :] + 2.0**-6 * k
    elif family == "outlier":
        q[..., :2] *= 20
        k[..., :2] *= 20
        v[..., :1] *= 20
    np_dtype = DTYPES[dtype][0]
    inputs = tuple(a.astype(np.float32).astype(np_dtype) for a in (q, k, v))
    return (b, h, lq, lk, d, causal, scale), inputs


def probabilistic_configuration(kernel: str, dtype: str, family: str, seed: int) -> dict[str, Any]:
    """One configuration of part 3: for the certified and the probabilistic tolerance, the
    false alarms and the median tolerance ÷ |error|; and the terms that govern the
    probabilistic tolerance (element counts)."""
    config, (q, k, v) = family_inputs(family, dtype, seed)
    causal, scale = config[5], config[6]
    out = KERNELS[kernel](q, k, v, dtype=dtype, causal=causal, scale=scale)
    row: dict[str, Any] = {"config": config}
    for name, confidence in (("certified", None), ("probabilistic", CONFIDENCE)):
        oracle = attention_oracle(
            q, k, v, is_causal=causal, scale=scale, kernel=kernel, confidence=confidence
        )
        failing, _ = oracle.check(out)
        err = np.abs(out - oracle.exact)
        some = (err > 0) & np.isfinite(oracle.tolerance)
        row[name] = {
            "alarms": int(failing.sum()),
            "median": float(np.median(oracle.tolerance[some] / err[some]))
            if some.any()
            else math.inf,
        }
        if confidence is not None:
            terms, counts = np.unique(oracle.term.astype(str), return_counts=True)
            row["terms"] = dict(zip(terms.tolist(), counts.tolist(), strict=True))
    return row


def probabilistic(draws: int) -> dict[str, list[dict[str, Any]]]:
    """Part 3, per format: the configurations' rows, over every kernel and family."""
    results: dict[str, list[dict[str, Any]]] = {}
    for dtype in DTYPES:
        rows = results.setdefault(dtype, [])
        for kernel in KERNELS:
            for family in FAMILIES:
                for seed in range(draws):
                    row = probabilistic_configuration(kernel, dtype, family, seed)
                    rows.append({**row, "kernel": kernel, "family": family})
    return results


def summary(rows: list[dict[str, Any]], name: str) -> tuple[float, int, int]:
    """Over some configurations: the median of their median tolerance ÷ |error|, the elements
    and the configurations outside the tolerance ``name`` (certified or probabilistic)."""
    medians = [r[name]["median"] for r in rows]
    alarms = [r[name]["alarms"] for r in rows]
    return float(np.median(medians)), sum(alarms), sum(a > 0 for a in alarms)


def print_probabilistic(results: dict[str, list[dict[str, Any]]], draws: int) -> bool:
    """Print part 3; True when its goals are met."""
    n = len(KERNELS) * len(FAMILIES) * draws
    print(f"\npart 3: the probabilistic tolerance (confidence={CONFIDENCE}) beside the certified "
          f"one, {n} configurations per format ({len(KERNELS)} kernels x {len(FAMILIES)} families "
          f"x {draws} draws)")  # fmt: skip
    print("median: over the configurations, of the median tolerance ÷ |error| over the elements "
          "with an error; alarms: elements (configurations) outside the tolerance")  # fmt: skip
    print(f"{'dtype':9s} {'configurations':22s} {'certified':>10s} {'alarms':>10s} "
          f"{'probabilistic':>14s} {'alarms':>10s}")  # fmt: skip
    met = True
    for dtype, rows in results.items():
        groups = [(f, [r for r in rows if r["family"] == f]) for f in FAMILIES]
        groups += [(kern, [r for r in rows if r["kernel"] == kern]) for kern in KERNELS]
        for label, sel in [*groups, ("all", rows)]:
            cm, ca, cc = summary(sel, "certified")
            pm, pa, pc = summary(sel, "probabilistic")
            print(f"{dtype:9s} {label:22s} {cm:10.3g} {f'{ca} ({cc})':>10s} {pm:14.3g} "
                  f"{f'{pa} ({pc})':>10s}")  # fmt: skip
        pm, pa, _ = summary(rows, "probabilistic")
        ok = pm <= GOALS[dtype] and pa == 0
        met &= ok
        print(f"{dtype:9s} goal: median <= {GOALS[dtype]:g} and 0 false alarms: "
              f"{'met' if ok else 'not met'} (median {pm:.3g}, {pa} false alarms)")  # fmt: skip
        terms: dict[str, int] = {}
        for r in rows:
            for t, c in r["terms"].items():
                terms[t] = terms.get(t, 0) + c
        total = sum(terms.values())
        shares = sorted(terms.items(), key=lambda tc: -tc[1])
        print(f"{dtype:9s} the probabilistic tolerance is governed by: "
              + ", ".join(f"{t} {100 * c / total:.1f}%" for t, c in shares[:4]))  # fmt: skip
    return met


# -- part 4: the floor under the certified tolerance ------------------------------------------

FLOOR_KERNEL = "jax-xla-cpu"  # float32: the model of benchmarks/rounding_floor.py (fp32 preset)
FLOOR_ENTRIES = 12


def _floor_module() -> Any:
    """``benchmarks/rounding_floor.py``, imported from beside this script."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import rounding_floor

    return rounding_floor


def floor_configuration(family: str, seed: int) -> dict[str, Any]:
    """On the first head of a part-3 configuration in float32, at ``FLOOR_ENTRIES`` drawn
    elements with an error: the kernel's error, the certified and the probabilistic
    tolerance, and the worst-case rounding's error ``F`` (``rounding_floor.attention_floor``,
    every sum in its worst order). That rounding is one the kernel's model allows (float32
    sums in any order, every operation within ``u``, an exact product, a correctly rounded
    exponential), so no sound certified tolerance can be below ``|F|``; and ``Q``, the 0.99
    quantile of the first-order error over random signs of the same roundings in the same
    orders (``Floor.quantile``), which no tolerance that holds with probability 0.99 under
    A.3's independence model can be below."""
    config, (q, k, v) = family_inputs(family, "float32", seed)
    _, _, lq, lk, d, causal, scale = config
    out = KERNELS[FLOOR_KERNEL](q, k, v, dtype="float32", causal=causal, scale=scale)
    tol = {}
    for name, confidence in (("certified", None), ("probabilistic", CONFIDENCE)):
        oracle = attention_oracle(
            q, k, v, is_causal=causal, scale=scale, kernel=FLOOR_KERNEL, confidence=confidence
        )
        tol[name] = oracle.tolerance[0, 0]
    err = np.abs(out - oracle.exact)[0, 0]
    rng = np.random.default_rng([len(FAMILIES) + FAMILIES.index(family), seed])
    where = np.flatnonzero(err > 0)
    picks = rng.choice(where, min(FLOOR_ENTRIES, where.size), replace=False)
    entries = [tuple(int(i) for i in np.unravel_index(j, err.shape)) for j in picks]
    mask = np.tril(np.ones((lq, lk), bool)) if causal else None
    c = 1 / math.sqrt(d) if scale is None else scale
    head = [np.asarray(a[0, 0], np.float64) for a in (q, k, v)]
    f = _floor_module().attention_floor(
        *head, "fp32", entries, scale=c, mask=mask, order="worst", keep_increments=True
    )
    at = tuple(np.array(e) for e in zip(*entries, strict=True))
    return {
        "err": err[at],
        "certified": tol["certified"][at],
        "probabilistic": tol["probabilistic"][at],
        "floor": np.abs(f.realised),
        "quantile": f.quantile(CONFIDENCE),
    }


def print_floor(draws: int) -> bool:
    """Print part 4; True when no certified tolerance is below the floor's error."""
    print(
        f"\npart 4: the floor under the certified tolerance, {FLOOR_KERNEL} in float32, "
        f"{FLOOR_ENTRIES} elements of the first head of {draws} configurations per family"
    )
    print("F: the error of a worst-case rounding the kernel's model allows (every sum in its "
          "worst order), which no sound certified tolerance can be below; Q: the 0.99 quantile "
          "of the error with those roundings' signs drawn at random, which no tolerance at "
          "probability 0.99 under A.3's model can be below; medians over the elements")  # fmt: skip
    print(f"{'family':12s} {'certified/err':>14s} {'F/err':>8s} {'certified/F':>12s} "
          f"{'probabilistic/err':>18s} {'Q/err':>8s} {'prob./Q':>8s} {'below F':>8s}")  # fmt: skip
    sound = True
    every: dict[str, list[np.ndarray]] = {}
    for family in FAMILIES:
        rows = [floor_configuration(family, seed) for seed in range(draws)]
        col = {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
        for key, val in col.items():
            every.setdefault(key, []).append(val)
        below = int(np.sum(col["certified"] < col["floor"]))
        sound &= below == 0
        _floor_row(family, col, below)
    col = {key: np.concatenate(val) for key, val in every.items()}
    _floor_row("all", col, int(np.sum(col["certified"] < col["floor"])))
    return sound


def _floor_row(label: str, col: dict[str, np.ndarray], below: int) -> None:
    err, cert, prob, fl, qu = (col[key] for key in ("err", "certified", "probabilistic",
                                                    "floor", "quantile"))  # fmt: skip
    print(f"{label:12s} {np.median(cert / err):14.3g} {np.median(fl / err):8.3g} "
          f"{np.median(cert / fl):12.3g} {np.median(prob / err):18.3g} "
          f"{np.median(qu / err):8.3g} {np.median(prob / qu):8.3g} {below:8d}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two configurations, 3 draws")
    parser.add_argument(
        "--probabilistic-only",
        action="store_true",
        help="part 3 alone (the probabilistic tolerance)",
    )
    parser.add_argument(
        "--floor-only",
        action="store_true",
        help="part 4 alone (the floor under the float32 certified tolerance)",
    )
    args = parser.parse_args(argv)
    p_draws = 2 if args.quick else DRAWS
    f_draws = 2 if args.quick else 4
    if args.floor_only:
        return 0 if print_floor(f_draws) else 1
    if args.probabilistic_only:
        met = print_probabilistic(probabilistic(p_draws), p_draws)
        return 0 if met else 2
    configs = QUICK if args.quick else CONFIGS
    print("part 1: real kernels (false alarms must be 0; tolerance ÷ peer: median / max)")
    print(f"{'kernel':22s} {'dtype':9s} {'B,H,Lq,Lk,d,causal,scale':28s} {'alarms':>6s} "
          f"{'err/tol':>8s}  vs pytorch      vs flash-attn    vs jax")  # fmt: skip
    alarms = 0
    for kernel in KERNELS:
        for dtype in DTYPES:
            for config in configs:
                r = run_configuration(kernel, dtype, config)
                alarms += r["false_alarms"]
                peers = "  ".join(
                    f"{r['vs_peers'][p][0]:6.3g}/{r['vs_peers'][p][1]:<7.3g}"
                    if p in r["vs_peers"] else f"{'-':>14s}"
                    for p in ("pytorch", "flash-attention", "jax")
                )  # fmt: skip
                print(f"{kernel:22s} {dtype:9s} {','.join(map(str, config)):28s} "
                      f"{r['false_alarms']:6d} {r['worst_ratio']:8.3g}  {peers}")  # fmt: skip
    print(f"false alarms in all: {alarms}")
    draws = 3 if args.quick else 8
    print(f"\npart 2: planted bugs in a bfloat16 online-softmax kernel, {draws} draws each")
    print("effect: the bug's own effect (float64) ÷ the correct kernel's tolerance; the counts are "
          "of the draws beyond rounding (effect > 1)")  # fmt: skip
    print(f"{'bug':26s} {'effect':>8s} {'max|bad-good|':>13s} {'beyond':>6s} {'mhanum':>6s} "
          f"{'pytorch':>7s} {'flash':>5s} {'jax':>4s} {'within, caught':>14s}")  # fmt: skip
    rows = planted(draws)
    for r in rows:
        print(f"{r['bug']:26s} {r['effect']:8.3g} {r['max_diff']:13.3g} {r['beyond']:6d} "
              f"{r['mhanum']:6d} {r['pytorch']:7d} {r['flash-attention']:5d} {r['jax']:4d} "
              f"{r['mhanum_within']:14d}")  # fmt: skip
    alarms += sum(r["good_alarms"] for r in rows)
    moving = [r for r in rows if r["beyond"]]
    missed = [r for r in moving if min(r["pytorch"], r["flash-attention"], r["jax"]) < r["beyond"]]
    print(
        f"mhanum caught {sum(r['mhanum'] == r['beyond'] for r in moving)} of the {len(moving)} "
        "bugs beyond rounding in every draw where they are"
    )
    print(
        f"of the {len(missed)} bugs beyond rounding that some peer misses in some draw, mhanum "
        f"caught {sum(r['mhanum'] == r['beyond'] for r in missed)}"
    )
    print(f"false alarms on the correct kernel: {sum(r['good_alarms'] for r in rows)}")
    print_probabilistic(probabilistic(p_draws), p_draws)
    sound = print_floor(f_draws)
    return 1 if alarms or not sound else 0


if __name__ == "__main__":
    sys.exit(main())
