"""Tightness of the backward bounds (Theorems B.1, B.2) and their size against PyTorch's tolerance.

    python benchmarks/backward_tightness.py            # L = d = 64, and PyTorch's shapes
    python benchmarks/backward_tightness.py --full     # adds L = 1024, d = 64 (minutes)
    python benchmarks/backward_tightness.py --search 20   # the search's worst input beside random
    python benchmarks/backward_tightness.py --floor       # B.1, B.2 against the rounding floor
    python benchmarks/backward_tightness.py --floor --causal   # the same with a causal mask
    python benchmarks/backward_tightness.py --probabilistic 20   # B.5 against the 99th percentile

Part 1: for each float32-accumulated preset and both algorithms (textbook, FlashAttention-2 with
blocks of 64), ``--n`` random normal inputs (rounded into the preset's input format, so only the
computation's error is measured), with and without a causal mask. Per gradient it prints
``max/max``, the largest bound over the largest measured error against
:func:`mhanum.reference.attention_grad` (the goal: at most 10), and ``violations`` (entries
whose error exceeds the bound: must be 0; the script exits 1 if any).

``--search BUDGET`` (instead of Parts 1 and 2): for fp32, tf32, bf16-fp32acc and fp16-fp32acc,
both algorithms, at ``--length`` = ``--d`` (64), :func:`mhanum.search.gradient_worst_case` with
``BUDGET`` evaluations, no mask. Per gradient it prints ``max/max`` at the search's worst input
beside the same ratio on ``--n`` random normal inputs, and the search's own figure: the least
entrywise bound ÷ error (``1/ratio``), the gradient attaining it and the bound's dominant term
there (``max/max`` over the entries whose bound is finite; ``inf`` where every entry's bound is
infinite at that input, with its reason).

``--floor`` (instead of Parts 1 and 2): B.1 and B.2 (one block) against the rounding floor of
``benchmarks/rounding_floor.py`` on one random normal input per preset (``--length``), with a
causal mask under ``--causal``. ``Fmax/err`` is the largest floor over the entries evaluated (the
four largest bounds, the largest error, 14 random entries) ÷ the largest error: no sound bound of
the model has max/max below it on that input.

``--probabilistic N`` (instead of Parts 1 and 2): Theorem B.5 with a stated probability of at
least 0.99, the median over every entry of ``N`` random normal inputs ÷ the 99th percentile of the
error (the goal: at most 3), B.1/B.2 likewise, the entries above B.5, and ``ideal``: the
least bound of B.5's form with the same ``λ`` on the exact first-order sensitivities
(``Floor.hoeffding`` of ``benchmarks/rounding_floor.py``: the largest roundings taken
deterministically, Azuma-Hoeffding on all the others together), the median over 16 random entries
of the first input, ÷ the same 99th percentile (``nan`` where the floor does not model the
numerics: TF32's operand rounding).

Part 2: PyTorch's SDPA tests (``test/test_transformers.py``) accept a gradient when
``max|test - golden| <= max(1e-5, fudge · max|golden - lp_ref|)`` with ``golden`` the float64 math
reference, ``lp_ref`` the math backend in the test's dtype and the fudge factors of the
memory-efficient test (dq 180, dk 16, dv 4). Here ``golden`` is the certified reference; the
script prints mhanum's largest bound over that tolerance, and how many elements of torch's math
and CPU flash gradients leave the bound (false alarms: must be 0). The bound is Theorem B.1 for
the numerics of torch's math path: float32 throughout, or for half precision the
``*-fp32acc`` preset (dots accumulated and the softmax computed in float32, every stored tensor
rounded to the dtype) with ``dP``, ``D`` and ``dS`` in the dtype
(``Backward(grad_format=dtype)``: autograd's tensors are of the dtype).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

from mhanum import Backward, InvalidArgument, attention_grad, reference
from mhanum.adapters import torch as torch_adapter
from mhanum.bounds import attention_grad_bound
from mhanum.formats import round_to
from mhanum.numerics import PRESETS
from mhanum.search import gradient_worst_case

GOAL = 10.0
PRESET_NAMES = ("fp32", "tf32", "bf16-fp32acc", "fp16-fp32acc", "tensor-core-bf16")
FUDGE = {"dq": 180.0, "dk": 16.0, "dv": 4.0}
TORCH_SHAPES = [(2, 64, 64, False), (2, 128, 32, True), (1, 256, 64, True)]  # (B·H, L, d, causal)
NAMES = ("dq", "dk", "dv")


def _draw(seed: int, shape: tuple[int, ...], fmt: str) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [round_to(rng.standard_normal(shape), fmt) for _ in range(4)]


@functools.lru_cache(maxsize=8)
def _exact(seed: int, shape: tuple[int, ...], fmt: str, causal: bool) -> tuple[np.ndarray, ...]:
    """The certified gradients of one draw (shared by the presets of one input format)."""
    q, k, v, g = _draw(seed, shape, fmt)
    length = shape[-2]
    mask = np.tril(np.ones((length, length), bool)) if causal else None
    return tuple(reference.attention_grad(q, k, v, g, mask=mask, digits=17))


def tightness(length: int, d: int, draws: int) -> bool:
    """Part 1; ``True`` when no bound is exceeded."""
    ok = True
    print(f"\nPart 1: L = {length}, d = {d}, {draws} draws, bound/error as max/max")
    print(f"{'preset':18} {'algorithm':9} {'mask':6} " + " ".join(f"{n:>8}" for n in NAMES)
          + "  violations  seconds (bound, emulation)")  # fmt: skip
    for name in PRESET_NAMES:
        fmt = PRESETS[name].input
        for algorithm in ("textbook", "flash2"):
            bw = Backward(algorithm, block_q=64, block_k=64) if algorithm == "flash2" else None
            for causal in (False, True):
                mask = np.tril(np.ones((length, length), bool)) if causal else None
                worst = dict.fromkeys(NAMES, 0.0)
                top = dict.fromkeys(NAMES, 0.0)
                bad, t_bound, t_emul = 0, [], []
                for seed in range(draws):
                    q, k, v, g = _draw(seed, (length, d), fmt)
                    exact = _exact(seed, (length, d), fmt, causal)
                    t0 = time.perf_counter()
                    grads = attention_grad(q, k, v, g, mask, numerics=name, backward=bw)
                    jax.block_until_ready(grads.dq)
                    t1 = time.perf_counter()
                    bounds = attention_grad_bound(q, k, v, g, mask, numerics=name, backward=bw)
                    t2 = time.perf_counter()
                    t_emul.append(t1 - t0)
                    t_bound.append(t2 - t1)
                    for n, got, want, b in zip(NAMES, grads, exact, bounds, strict=False):
                        err = np.abs(np.asarray(got, np.float64) - want)
                        bad += int(np.sum(~(err <= b.total)))
                        worst[n] = max(worst[n], float(err.max()))
                        top[n] = max(top[n], float(np.max(b.total)))
                ok = ok and bad == 0
                ratios = " ".join(f"{top[n] / worst[n]:8.1f}" for n in NAMES)
                print(f"{name:18} {algorithm:9} {'causal' if causal else 'none':6} {ratios}  "
                      f"{bad:10d}  {statistics.median(t_bound):.2f}, "
                      f"{statistics.median(t_emul):.2f}")  # fmt: skip
    return ok


SEARCH_PRESETS = ("fp32", "tf32", "bf16-fp32acc", "fp16-fp32acc")


def _floor_module() -> Any:
    """``benchmarks/rounding_floor.py``, imported from beside this script."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import rounding_floor

    return rounding_floor


def _ideal(preset: str, algorithm: str, name: str, length: int, d: int, lam: float) -> float:
    """The median over 16 random entries of gradient ``name`` of the first draw of the least
    bound of B.5's form on the exact sensitivities (``Floor.hoeffding(lam)``: the largest
    roundings deterministic, Azuma-Hoeffding on the rest); NaN where the floor refuses the
    numerics (operand roundings: TF32) or, for FlashAttention-2, ``L > 64``."""
    fmt = PRESETS[preset].input
    q, k, v, g = _draw(0, (length, d), fmt)
    rng = np.random.default_rng(1)
    shape = (length, d)
    entries = [tuple(int(i) for i in np.unravel_index(j, shape))
               for j in rng.choice(length * d, 16, replace=False)]  # fmt: skip
    try:
        f = _floor_module().attention_grad_floor(q, k, v, g, preset, name, entries, algorithm)
    except InvalidArgument:
        return math.nan
    return float(np.median(f.hoeffding(lam)))


def probabilistic_tightness(length: int, d: int, draws: int) -> bool:
    """Theorem B.5 with a stated probability >= 0.99 against the 99th percentile of the error
    over every entry of ``draws`` random normal inputs (the goal: at most 3×); ``True``
    when no entry leaves B.1/B.2 (B.5's entries above the error are counted, not failed: its
    independence is a model)."""
    print(f"\nTheorem B.5 (probability >= 0.99) on {draws} random normal inputs, L = {length}, "
          f"d = {d}: the median of B.5 over the entries ÷ the 99th percentile of the error "
          "(goal: <= 3), B.1/B.2 likewise, and the entries above B.5")  # fmt: skip
    print(
        f"{'preset':14} {'algorithm':9} {'lam':>5} {'prob':>7} "
        + " ".join(f"{n + ' B.5/p99':>12} {'B.1/p99':>8} {'ideal':>8} {'over':>5}" for n in NAMES)
    )
    ok = True
    for name in SEARCH_PRESETS:
        fmt = PRESETS[name].input
        for algorithm in ("textbook", "flash2"):
            bw = Backward(algorithm, block_q=64, block_k=64) if algorithm == "flash2" else None
            errs: dict[str, list[np.ndarray]] = {n: [] for n in NAMES}
            prob_b = {n: [] for n in NAMES}
            det_b = {n: [] for n in NAMES}
            lam, stated = 0.0, 0.0
            for seed in range(draws):
                q, k, v, g = _draw(seed, (length, d), fmt)
                exact = _exact(seed, (length, d), fmt, False)
                grads = attention_grad(q, k, v, g, numerics=name, backward=bw)
                det = attention_grad_bound(q, k, v, g, numerics=name, backward=bw)
                pb = attention_grad_bound(q, k, v, g, numerics=name, backward=bw, probability=0.99)
                lam, stated = pb.dq.lam or 0.0, pb.dq.probability
                for n, got, want, b, b1 in zip(NAMES, grads, exact, pb, det, strict=False):
                    err = np.abs(np.asarray(got, np.float64) - want)
                    ok = ok and bool(np.all(err <= b1.total))
                    errs[n].append(err.ravel())
                    prob_b[n].append(np.asarray(b.total).ravel())
                    det_b[n].append(np.asarray(b1.total).ravel())
            cols = []
            for n in NAMES:
                e, b5, b1 = (np.concatenate(x[n]) for x in (errs, prob_b, det_b))
                p99 = float(np.quantile(e, 0.99))
                ideal = _ideal(name, algorithm, n, length, d, lam)
                cols.append(f"{np.median(b5) / p99:12.3g} {np.median(b1) / p99:8.3g} "
                            f"{ideal / p99:8.3g} {int(np.sum(e > b5)):5d}")  # fmt: skip
            print(f"{name:14} {algorithm:9} {lam:5.2f} {stated:7.4f} " + " ".join(cols))
    return ok


def _max_over_max(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    exact: tuple[np.ndarray, ...],
    name: str,
    bw: Backward | None,
) -> tuple[dict[str, tuple[float, float]], int]:
    """Per gradient ``(largest bound, largest error)`` over the entries whose bound is finite
    (``inf`` for none), and the violations (a NaN or infinite gradient counts as an infinite
    error: within an infinite bound, which states a possible overflow, not beyond a finite one)."""
    grads = attention_grad(q, k, v, g, numerics=name, backward=bw)
    bounds = attention_grad_bound(q, k, v, g, numerics=name, backward=bw)
    out, bad = {}, 0
    for n, got, want, b in zip(NAMES, grads, exact, bounds, strict=False):
        got = np.asarray(got, np.float64)
        err = np.abs(np.where(np.isfinite(got), got, np.inf) - want)
        bad += int(np.sum(~(err <= b.total)))
        finite = np.isfinite(b.total)
        if not finite.any():
            out[n] = (np.inf, 1.0)
            continue
        out[n] = (float(np.max(b.total[finite])), float(np.max(err[finite])))
    return out, bad


def search_tightness(length: int, d: int, budget: int, draws: int) -> bool:
    """``--search``: bound/error at the search's worst input beside random inputs."""
    ok = True
    print(f"\nL = {length}, d = {d}: max bound / max error, random ({draws} draws, the least of "
          f"them) | at the search's worst input ({budget} evaluations)")  # fmt: skip
    print(f"{'preset':14} {'algorithm':9} " + " ".join(f"{'rand ' + n:>9}" for n in NAMES)
          + " | " + " ".join(f"{'search ' + n:>10}" for n in NAMES)
          + "   least entry bound/error (gradient, dominant term)  seconds")  # fmt: skip
    shape = {"q_len": length, "kv_len": length, "d_k": d}
    for name in SEARCH_PRESETS:
        fmt = PRESETS[name].input
        for algorithm in ("textbook", "flash2"):
            bw = Backward(algorithm, block_q=64, block_k=64) if algorithm == "flash2" else None
            rand = dict.fromkeys(NAMES, np.inf)
            for seed in range(draws):
                q, k, v, g = _draw(seed, (length, d), fmt)
                exact = _exact(seed, (length, d), fmt, False)
                ratios, bad = _max_over_max(q, k, v, g, exact, name, bw)
                ok = ok and bad == 0
                for n, (b, e) in ratios.items():
                    rand[n] = min(rand[n], b / e)
            case = gradient_worst_case(name, shape, backward=bw or "textbook", budget=budget)
            ok = ok and not case.violation
            exact = tuple(reference.attention_grad(case.q, case.k, case.v, case.d_out, digits=17))
            found, bad = _max_over_max(case.q, case.k, case.v, case.d_out, exact, name, bw)
            ok = ok and bad == 0
            cells = " ".join(f"{rand[n]:9.1f}" for n in NAMES)
            cells += " | " + " ".join(
                f"{b / e if e > 0 else np.inf:10.1f}" for b, e in found.values()
            )
            least = 1 / case.ratio if case.ratio > 0 else np.inf
            where = f"({case.gradient}, {case.dominant_term})"
            print(f"{name:14} {algorithm:9} {cells}   {least:10.1f} {where:22} "
                  f"{case.seconds:7.1f}")  # fmt: skip
    return ok


def torch_tolerances() -> bool:
    """Part 2; ``True`` when torch's gradients are all within the bound."""
    ok = True
    print("\nPart 2: mhanum's bound / PyTorch's SDPA test tolerance (largest over the elements)")
    print(f"{'dtype':9} {'shape':18} " + " ".join(f"{n:>8}" for n in NAMES)
          + "  false alarms (math, flash)")  # fmt: skip
    models = (("float32", "fp32"), ("bfloat16", "bf16-fp32acc"), ("float16", "fp16-fp32acc"))
    for dtype, preset in models:
        bw = Backward("textbook", grad_format=dtype)
        for batch, length, d, causal in TORCH_SHAPES:
            q, k, v, g = _draw(7, (batch, length, d), dtype)
            mask = np.tril(np.ones((length, length), bool)) if causal else None
            exact = reference.attention_grad(q, k, v, g, mask=mask, digits=17)
            lp = torch_adapter.sdpa_grad(q, k, v, g, mask, backend="math", dtype=dtype)
            flash = torch_adapter.sdpa_grad(q, k, v, g, mask, backend="flash", dtype=dtype)
            bounds = attention_grad_bound(q, k, v, g, mask, numerics=preset, backward=bw)
            ratios, alarms = [], [0, 0]
            for i, n in enumerate(NAMES):
                tol = max(1e-5, FUDGE[n] * float(np.max(np.abs(exact[i] - lp[i]))))
                total = bounds[i].total
                ratios.append(float(np.max(total)) / tol)
                alarms[0] += int(np.sum(~(np.abs(lp[i] - exact[i]) <= total)))
                alarms[1] += int(np.sum(~(np.abs(flash[i] - exact[i]) <= total)))
            ok = ok and alarms == [0, 0]
            shape = f"{batch}x{length}x{d}{' causal' if causal else ''}"
            print(f"{dtype:9} {shape:18} " + " ".join(f"{r:8.3g}" for r in ratios)
                  + f"  {alarms[0]}, {alarms[1]}")  # fmt: skip
    return ok


def floor_tightness(length: int, d: int, causal: bool = False) -> bool:
    """B.1 (textbook) and B.2 (FlashAttention-2, one block of 64) against the floor: one random
    normal input per preset; per gradient, the
    largest error and bound, ``F/err`` (the floor's error at the entry of the largest error
    over that error: what no deterministic bound removes) and ``B/F`` at the entry of the
    largest bound and the median over 16 entries (the derivation's own slack)."""
    rounding_floor = _floor_module()
    mask = np.tril(np.ones((length, length), bool)) if causal else None
    print(f"B.1 and B.2 against the floor, one random normal input, L = d = {length}"
          + (", causal mask:" if causal else ":"))  # fmt: skip
    print(f"{'preset':<14} {'algorithm':<9} {'grad':<4} {'max err':>10} {'max B':>10} "
          f"{'B/err':>8} {'F/err':>8} {'Fmax/err':>8} {'B/F':>7} {'med B/F':>8}")  # fmt: skip
    ok = True
    algorithms = ("textbook", "flash2") if length <= 64 else ("textbook",)
    for preset, algorithm in itertools.product(
        ("fp32", "bf16-fp32acc", "fp16-fp32acc"), algorithms
    ):
        fmt = PRESETS[preset].format_of("input")
        rng = np.random.default_rng(0)
        q, k, v, g = (
            np.asarray(round_to(rng.standard_normal((length, d)), fmt), np.float64)
            for _ in range(4)
        )
        bw = Backward(algorithm)
        out = attention_grad(q, k, v, g, mask, numerics=preset, backward=bw)
        ref = reference.attention_grad(q, k, v, g, mask=mask)
        bounds = attention_grad_bound(q, k, v, g, mask, numerics=preset, backward=bw)
        for name in NAMES:
            err = np.abs(np.asarray(getattr(out, name), np.float64) - getattr(ref, name))
            bound = np.asarray(getattr(bounds, name).total)
            ok = ok and bool(np.all(err <= bound))
            top_e = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
            order = np.argsort(bound, axis=None)[::-1][:4]  # the four largest bounds
            tops = [tuple(int(i) for i in np.unravel_index(j, bound.shape)) for j in order]
            top_b = tops[0]
            picks = rng.choice(bound.size, 14, replace=False)
            rest = [tuple(int(i) for i in np.unravel_index(j, bound.shape)) for j in picks]
            entries = list(dict.fromkeys([top_e, *tops, *rest]))
            f = rounding_floor.attention_grad_floor(
                q, k, v, g, preset, name, entries, algorithm, mask
            )
            big = np.abs(f.realised)
            at = np.array([bound[e] for e in entries])
            print(
                f"{preset:<14} {algorithm:<9} {name:<4} {err.max():10.3g} {bound.max():10.3g} "
                f"{bound.max() / err.max():8.3g} {big[0] / err.max():8.3g} "
                f"{big.max() / err.max():8.3g} {bound[top_b] / big[entries.index(top_b)]:7.3g} "
                f"{float(np.median(at / big)):8.3g}"
            )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="add L = 1024, d = 64")
    parser.add_argument("--n", type=int, default=3, help="draws per configuration")
    parser.add_argument("--torch-only", action="store_true", help="Part 2 only")
    parser.add_argument(
        "--search", type=int, default=None, metavar="BUDGET",
        help="the gradient search's worst input beside random inputs (instead of Parts 1, 2)",
    )  # fmt: skip
    parser.add_argument("--length", type=int, default=64, help="L = d for --search and --floor")
    parser.add_argument("--causal", action="store_true", help="--floor with a causal mask")
    parser.add_argument(
        "--floor", action="store_true",
        help="the bounds against the floor (benchmarks/rounding_floor.py; instead of "
        "Parts 1, 2)",
    )  # fmt: skip
    parser.add_argument(
        "--probabilistic", type=int, default=None, metavar="N",
        help="B.5 (probability 0.99) against the 99th percentile of the error over N random "
        "inputs at --length (instead of Parts 1, 2)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.probabilistic is not None:
        ok = probabilistic_tightness(args.length, args.length, args.probabilistic)
        return 0 if ok else 1
    if args.floor:
        return 0 if floor_tightness(args.length, args.length, args.causal) else 1
    if args.search is not None:
        ok = search_tightness(args.length, args.length, args.search, args.n)
        print(f"\ngoal: max/max <= {GOAL:g}; every bound holds: {'yes' if ok else 'NO'}")
        return 0 if ok else 1
    ok = True
    if not args.torch_only:
        ok = tightness(64, 64, args.n)
    if args.full:
        ok = tightness(1024, 64, 1) and ok
    ok = torch_tolerances() and ok
    print(f"\ngoal: max/max <= {GOAL:g} (Part 1); every bound holds: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
