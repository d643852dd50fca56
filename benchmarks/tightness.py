"""Tightness of the a posteriori attention bound (Theorem A.1) against measured errors.

Run with ``python benchmarks/tightness.py`` (``--full`` for the larger grid). For every
configuration (preset × softmax × summation order × ``L``, ``d``) it draws ``--n`` inputs from each
input family below, rounds them into the preset's input format (so only the computation's error is
measured), and compares the bound ``mhanum.bounds.attention_bound`` with the measured error
``|mhanum.attention(q, k, v, mask, numerics) − mhanum.reference.attention(q, k, v, mask=mask)|``
(the reference is certified, float64). ``L`` is the number of queries and of keys,
``d = d_k = d_v``.

Tightness is printed two ways:

* ``max/max``: max(bound) / max(error) over every entry of every input of the configuration;
* ``med min``: the median over inputs of min over entries of bound/error (how close the bound gets
  where it is closest), skipping entries whose error is zero.

``dominant`` is the term of the bound (``Bound.terms``) with the largest finite value over all
inputs of the configuration (an infinite bound is reported as ``vacuous``). The goal is
``max/max <= 10`` at ``L, d <= 64``; the script lists the configurations above it and what
dominates there. It marks nothing as passed or failed, but it prints loudly, with a command that
reproduces it, every input whose measured error the bound does not cover, and exits with status

* 1 if a finite measured error exceeds its bound anywhere, or a bound is NaN (a soundness
  violation);
* 2 if not, but some output is not finite while its bound is (overflow, outside A.1's assumption 4,
  which ``attention_bound`` does not check: the naive softmax with large logits in ``--full``);
* 0 otherwise.

``--presets``, ``--softmax``, ``--summation``, ``--sizes`` and ``--families`` narrow the grid (to
reproduce one case). Input draws depend only on the seed, the family, the input's index and
``L``, ``d``, so a narrowed run measures the same inputs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)  # fp64 numerics; before mhanum creates arrays

import mhanum as mn
from mhanum import InvalidArgument, Numerics, reference
from mhanum.bounds import attention_bound
from mhanum.formats import Format, get_format
from mhanum.numerics import PRESETS

GOAL = 10.0
Inputs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]


# Input families. Each takes a generator, L (queries = keys), d (= d_k = d_v) and the input format,
# and returns q, k, v (values of the format) and a mask (True = attend) or None.


def _rounded(fmt: Format, *xs: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(mn.round_to(x, fmt), np.float64) for x in xs)


def random_normal(rng: np.random.Generator, L: int, d: int, fmt: Format) -> Inputs:
    """q, k, v with independent N(0, 1) entries: the typical case."""
    q, k, v = _rounded(fmt, *(rng.standard_normal((L, d)) for _ in range(3)))
    return q, k, v, None


def large_norm(rng: np.random.Generator, L: int, d: int, fmt: Format) -> Inputs:
    """q and k scaled by a factor in [4, 8]: logits of standard deviation 16 to 64.

    The logit errors grow with |q|·|k| (A.1, step 3) while the softmax is nearly one-hot.
    """
    scale = rng.uniform(4.0, 8.0)
    q, k, v = (rng.standard_normal((L, d)) for _ in range(3))
    q, k, v = _rounded(fmt, scale * q, scale * k, v)
    return q, k, v, None


def near_ties(rng: np.random.Generator, L: int, d: int, fmt: Format) -> Inputs:
    """All keys equal to one key up to relative perturbations of about 8 units of roundoff.

    The logits of a row are nearly equal and the softmax nearly uniform; the keys still differ
    after rounding into the input format.
    """
    k0 = rng.standard_normal(d)
    k = k0 * (1 + 8 * fmt.u * rng.standard_normal((L, d)))
    q, k, v = _rounded(fmt, 2.0 * rng.standard_normal((L, d)), k, rng.standard_normal((L, d)))
    return q, k, v, None


def cancellation_in_v(rng: np.random.Generator, L: int, d: int, fmt: Format) -> Inputs:
    """v of magnitude ~32 with column mean zero under near-uniform weights: p·v is near zero.

    Each column of v is ±32 (random signs) plus N(0, 1) noise, with its mean over the keys
    subtracted; q and k are small (N(0, 1/16)) so the weights are close to uniform and the output
    is a small difference of large terms. The bound's P V terms scale with p|v|, not with |o|.
    """
    v = 32.0 * rng.choice([-1.0, 1.0], size=(L, d)) + rng.standard_normal((L, d))
    v -= v.mean(axis=0, keepdims=True)
    q, k = (0.25 * rng.standard_normal((L, d)) for _ in range(2))
    q, k, v = _rounded(fmt, q, k, v)
    return q, k, v, None


def outlier_channel(rng: np.random.Generator, L: int, d: int, fmt: Format) -> Inputs:
    """One channel of q and of k 30× larger than the others (as in LLM activation outliers).

    The logits are dominated by one product per dot, so |q|·|k| is far above |q·k| for most keys.
    """
    q, k, v = (rng.standard_normal((L, d)) for _ in range(3))
    channel = rng.integers(d)
    q[:, channel] *= 30.0
    k[:, channel] *= 30.0
    q, k, v = _rounded(fmt, q, k, v)
    return q, k, v, None


def long_masked_rows(rng: np.random.Generator, L: int, d: int, fmt: Format) -> Inputs:
    """N(0, 1) inputs with a random mask keeping about 90% of the L keys of each row.

    Key 0 is always kept, so no row is fully masked; sums still run over all L keys.
    """
    q, k, v = _rounded(fmt, *(rng.standard_normal((L, d)) for _ in range(3)))
    mask = rng.random((L, L)) < 0.9
    mask[:, 0] = True
    return q, k, v, mask


FAMILIES: dict[str, Callable[[np.random.Generator, int, int, Format], Inputs]] = {
    "random": random_normal,
    "large_norm": large_norm,
    "near_ties": near_ties,
    "cancel_v": cancellation_in_v,
    "outlier": outlier_channel,
    "masked": long_masked_rows,
}


@dataclass
class Case:
    """One input of a family, rounded into one format, with its certified reference."""

    family: str
    index: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    ref: np.ndarray


@dataclass
class Result:
    """Measurements of one configuration over all its inputs.

    ``*_finite`` maxima skip the entries whose bound is infinite (term ``vacuous``: the computed
    softmax sum may be off by 100%); per-family values are keyed by family name.
    """

    max_err: float = 0.0
    max_bound: float = 0.0
    max_err_finite: float = 0.0
    max_bound_finite: float = 0.0
    min_ratios: list[float] = field(default_factory=list)
    term_max: dict[str, float] = field(default_factory=dict)
    family_err: dict[str, float] = field(default_factory=dict)
    family_bound: dict[str, float] = field(default_factory=dict)
    family_terms: dict[str, dict[str, float]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    vacuous: list[str] = field(default_factory=list)
    infinite_entries: int = 0
    non_finite: list[str] = field(default_factory=list)


def make_cases(
    fmt: Format, L: int, d: int, n: int, seed: int, families: list[str]
) -> dict[str, list[Case]]:
    """``n`` inputs of every family in ``fmt``; the same draws for every format."""
    cases: dict[str, list[Case]] = {}
    for name in families:
        f_index = list(FAMILIES).index(name)  # draws do not depend on which families run
        drawn = [
            FAMILIES[name](np.random.default_rng([seed, f_index, i, L, d]), L, d, fmt)
            for i in range(n)
        ]
        q, k, v = (np.stack([x[j] for x in drawn]) for j in range(3))
        mask = None if drawn[0][3] is None else np.stack([x[3] for x in drawn])
        ref = reference.attention(q, k, v, mask=mask)
        cases[name] = [
            Case(name, i, q[i], k[i], v[i], None if mask is None else mask[i], ref[i])
            for i in range(n)
        ]
    return cases


@dataclass(frozen=True)
class Config:
    """One configuration of the grid."""

    preset: str
    softmax: str
    order: str
    L: int
    d: int

    @property
    def name(self) -> str:
        return f"{self.preset} {self.softmax} {self.order} L={self.L} d={self.d}"

    def numerics(self) -> Numerics:
        return Numerics.preset(self.preset).replace(summation=self.order, softmax=self.softmax)

    def command(self, family: str, index: int, seed: int) -> str:
        """The command line that measures this configuration on this input (and the ones before)."""
        return (
            f"python benchmarks/tightness.py --presets {self.preset} --softmax '{self.softmax}' "
            f"--summation '{self.order}' --sizes {self.L}x{self.d} --families {family} "
            f"--n {index + 1} --seed {seed}"
        )


@dataclass
class Problem:
    """A measured error that the bound does not cover, with what is needed to reproduce it."""

    kind: str  # "violation", "nan bound" or "non-finite output"
    config: Config
    family: str
    index: int
    detail: str


def softmax_note(num: Numerics, c: Case) -> str:
    """For the naive softmax: how large the exact row sums of exponentials get in ``F_m``.

    Above ``1/smallest_normal`` the reciprocal of the sum is subnormal (XLA divides by a
    broadcast sum as a product by its reciprocal, and flushes subnormals to zero); above
    ``max_finite`` the sum overflows.
    """
    if num.softmax_kind != "naive":
        return ""
    s = (c.q @ c.k.T) / math.sqrt(c.q.shape[-1])
    if c.mask is not None:
        s = np.where(c.mask, s, -np.inf)
    top = s.max(axis=-1)
    lse = float(np.max(top + np.log(np.exp(s - top[:, None]).sum(axis=-1))))
    fmt = num.format_of("softmax")
    return (
        f"; naive softmax: max row log-sum-exp {lse:.2f}, ln(1/smallest normal of {fmt.name}) "
        f"= {-math.log(fmt.smallest_normal):.2f}, ln(max finite) = {math.log(fmt.max_finite):.2f}"
    )


def run_config(config: Config, cases: dict[str, list[Case]], problems: list[Problem]) -> Result:
    """Measure every case under ``config``; append what the bound does not cover to ``problems``."""
    num = config.numerics()
    res = Result()
    for family, group in cases.items():
        q, k, v = (np.stack([getattr(c, a) for c in group]) for a in "qkv")
        mask = None if group[0].mask is None else np.stack([c.mask for c in group])
        out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
        for c, o in zip(group, out, strict=True):
            try:
                bound = attention_bound(c.q, c.k, c.v, c.mask, numerics=num)
            except InvalidArgument as exc:
                res.refused.append(f"{family}[{c.index}]: {exc}")
                continue
            total = np.asarray(bound.total)
            if np.isnan(total).any():
                detail = f"{np.isnan(total).sum()} NaN entries in the bound"
                problems.append(Problem("nan bound", config, family, c.index, detail))
                continue
            if not np.all(np.isfinite(o)):
                res.non_finite.append(f"{family}[{c.index}]")
                if np.all(np.isfinite(total)):
                    detail = f"{np.sum(~np.isfinite(o))} non-finite output entries"
                    detail += softmax_note(num, c)
                    problems.append(Problem("non-finite output", config, family, c.index, detail))
                continue
            err = np.abs(o - c.ref)
            if np.any(err > total):
                bad = err > total
                worst = float(np.max(err[bad] / total[bad]))
                detail = (
                    f"{bad.sum()} entries (rows {sorted(set(np.nonzero(bad)[0].tolist()))}) with "
                    f"error > bound, worst error/bound = {worst:.4g}, worst error "
                    f"{float(err[bad].max()):.3g}" + softmax_note(num, c)
                )
                problems.append(Problem("violation", config, family, c.index, detail))
            finite = np.isfinite(total)
            if not finite.all():
                res.vacuous.append(f"{family}[{c.index}]")
                res.infinite_entries += int((~finite).sum())
            res.max_err = max(res.max_err, float(err.max()))
            res.max_bound = max(res.max_bound, float(total.max()))
            if finite.any():
                res.max_err_finite = max(res.max_err_finite, float(err[finite].max()))
                res.max_bound_finite = max(res.max_bound_finite, float(total[finite].max()))
            res.family_err[family] = max(res.family_err.get(family, 0.0), float(err.max()))
            res.family_bound[family] = max(res.family_bound.get(family, 0.0), float(total.max()))
            terms = res.family_terms.setdefault(family, {})
            for term, value in bound.terms.items():
                value = np.asarray(value)
                top = float(np.max(value[finite])) if finite.any() else 0.0
                if term in ("vacuous", "overflow"):
                    top = math.inf if np.isinf(value).any() else 0.0
                res.term_max[term] = max(res.term_max.get(term, 0.0), top)
                terms[term] = max(terms.get(term, 0.0), top)
            nonzero = err > 0
            if nonzero.any():
                res.min_ratios.append(float(np.min(total[nonzero] / err[nonzero])))
    return res


def ratio(bound: float, err: float) -> float:
    if err == 0.0:
        return math.nan
    return bound / err


def fmt_ratio(x: float) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.3g}"


def dominant(term_max: dict[str, float]) -> str:
    """The largest finite term (maximum over entries with a finite bound), else ``vacuous``."""
    finite = {t: x for t, x in term_max.items() if t not in ("vacuous", "overflow")}
    if not finite or max(finite.values()) == 0.0:
        infinite = [t for t in ("vacuous", "overflow") if term_max.get(t, 0.0) > 0]
        return infinite[0] if infinite else "-"
    return max(finite, key=lambda t: finite[t])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3, help="inputs per family (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the input draws")
    parser.add_argument(
        "--full",
        action="store_true",
        help="add pairwise, blocked(8), kahan, the naive softmax and L, d in {16, 64}",
    )
    parser.add_argument(
        "--presets", default=",".join(PRESETS), help="comma-separated presets (default: all)"
    )
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated input families (default: {','.join(FAMILIES)})",
    )
    parser.add_argument(
        "--softmax", default="", help="comma-separated softmax algorithms (overrides the grid's)"
    )
    parser.add_argument(
        "--summation", default="", help="comma-separated summation orders (overrides the grid's)"
    )
    parser.add_argument(
        "--sizes", default="", help="comma-separated LxD, e.g. 16x64 (overrides the grid's)"
    )
    parser.add_argument(
        "--search",
        type=int,
        default=0,
        metavar="BUDGET",
        help="also run mhanum.search.worst_case (error/bound, this budget) per configuration and "
        "print bound ÷ error at its worst case beside the families' figures",
    )
    parser.add_argument(
        "--probabilistic",
        type=int,
        default=0,
        metavar="N",
        help="also print Theorem A.3 (λ for a stated probability >= 0.99) against the 99th "
        "percentile of the error over N random normal inputs per preset, at the first size",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also print, per preset at the first size, the least any deterministic bound can be "
        "(benchmarks/rounding_floor.py: a worst-case rounding realised) beside A.1 and the error",
    )
    parser.add_argument(
        "--mha",
        action="store_true",
        help="also print A.2 and A.4 against the measured error at the README demo size "
        "(d_model 512, 8 heads, L 64)",
    )
    args = parser.parse_args()
    presets = [p for p in args.presets.split(",") if p]
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if f not in FAMILIES:
            parser.error(f"--families: unknown family {f!r}; expected some of {list(FAMILIES)}")
    for p in presets:
        if p not in PRESETS:
            parser.error(f"--presets: unknown preset {p!r}; expected some of {list(PRESETS)}")
    if args.full:
        softmaxes = ["naive", "safe", "online(16)"]
        orders = ["native", "sequential", "pairwise", "blocked(8)", "kahan"]
        sizes = [(L, d) for L in (16, 64) for d in (16, 64)]
    else:
        softmaxes = ["safe", "online(16)"]
        orders = ["native", "sequential"]
        sizes = [(64, 64)]
    softmaxes = args.softmax.split(",") if args.softmax else softmaxes
    orders = args.summation.split(",") if args.summation else orders
    if args.sizes:
        try:
            sizes = [(int(a), int(b)) for a, b in (x.split("x") for x in args.sizes.split(","))]
        except ValueError:
            parser.error(f"--sizes: expected LxD[,LxD...], got {args.sizes!r}")
    for softmax in softmaxes:
        for order in orders:
            try:
                Numerics(softmax=softmax, summation=order)
            except InvalidArgument as exc:
                parser.error(str(exc))

    start = time.perf_counter()
    problems: list[Problem] = []
    rows: list[tuple[Config, Result]] = []
    formats = {get_format(Numerics.preset(p).input).name for p in presets}
    for L, d in sizes:
        cases = {
            fmt: make_cases(get_format(fmt), L, d, args.n, args.seed, families)
            for fmt in sorted(formats)
        }
        for preset in presets:
            for softmax in softmaxes:
                for order in orders:
                    config = Config(preset, softmax, order, L, d)
                    fmt = get_format(config.numerics().input).name
                    rows.append((config, run_config(config, cases[fmt], problems)))
    elapsed = time.perf_counter() - start

    print(f"cores: os.cpu_count() = {os.cpu_count()}, usable = {len(os.sched_getaffinity(0))}")
    print(f"inputs: {args.n} per family, families {', '.join(families)}; seed {args.seed}")
    print("max/max = max(bound)/max(error) over all entries of all inputs")
    print("med min = median over inputs of min over entries of bound/error (zero errors skipped)")
    print("fin m/m = max/max over the entries whose bound is finite (differs if some are vacuous)")
    print("dominant = largest finite term of Bound.terms over all inputs")
    print()
    named = [(config.name, res) for config, res in rows]
    width = max(len(name) for name, _ in named) + 1
    head = (
        f"{'configuration':<{width}} {'max err':>9} {'max bound':>9} {'max/max':>8} "
        f"{'med min':>8} {'fin m/m':>8} {'dominant':<20} {'notes'}"
    )
    print(head)
    print("-" * len(head))
    for name, res in named:
        notes = []
        if res.vacuous:
            notes.append(
                f"inf on {len(res.vacuous)} inputs ({res.infinite_entries} entries): "
                + " ".join(res.vacuous)
            )
        if res.non_finite:
            notes.append(f"non-finite output (skipped) on {' '.join(res.non_finite)}")
        if res.refused:
            notes.append(f"{len(res.refused)} refused, e.g. {res.refused[0]}")
        med = statistics.median(res.min_ratios) if res.min_ratios else math.nan
        print(
            f"{name:<{width}} {res.max_err:>9.2e} {res.max_bound:>9.2e} "
            f"{fmt_ratio(ratio(res.max_bound, res.max_err)):>8} {fmt_ratio(med):>8} "
            f"{fmt_ratio(ratio(res.max_bound_finite, res.max_err_finite)):>8} "
            f"{dominant(res.term_max):<20} {'; '.join(notes)}"
        )

    print()
    print(
        "max/max per input family (inf: some input got a vacuous bound; refused / non-fin: no "
        "input measured, the bound refused it or the output was not finite)"
    )
    head = f"{'configuration':<{width}} " + " ".join(f"{f:>10}" for f in families)
    print(head)
    print("-" * len(head))
    for name, res in named:
        cells = [
            fmt_ratio(ratio(res.family_bound[f], res.family_err[f]))
            if f in res.family_err
            else ("refused" if any(x.startswith(f"{f}[") for x in res.refused) else "non-fin")
            for f in families
        ]
        print(f"{name:<{width}} " + " ".join(f"{c:>10}" for c in cells))

    print()
    worst = sorted(
        ((ratio(r.max_bound, r.max_err), name, r) for name, r in named if r.max_err > 0),
        key=lambda t: (-t[0], -ratio(t[2].max_bound_finite, t[2].max_err_finite)),
    )
    above = [(x, name, r) for x, name, r in worst if not x <= GOAL]
    print(f"configurations with ratio > {GOAL:g} (max/max): {len(above)} of {len(rows)}")
    for x, name, r in above:
        top = dominant(r.term_max)
        share = r.term_max.get(top, math.nan) / r.max_bound_finite if r.max_bound_finite else 0.0
        finite_fams = [f for f in r.family_err if math.isfinite(r.family_bound[f])]
        text = f"  {name}: {fmt_ratio(x)}"
        if r.vacuous:
            vac = sorted({v.split("[")[0] for v in r.vacuous})
            fin = fmt_ratio(ratio(r.max_bound_finite, r.max_err_finite))
            text += f" (vacuous on {', '.join(vac)}; finite entries {fin})"
        text += f"; dominant {top} ({share:.0%} of the largest finite bound)"
        if finite_fams:
            fam = max(finite_fams, key=lambda f: ratio(r.family_bound[f], r.family_err[f]))
            text += (
                f"; loosest finite family {fam} "
                f"({fmt_ratio(ratio(r.family_bound[fam], r.family_err[fam]))}, "
                f"dominant {dominant(r.family_terms[fam])})"
            )
        print(text)
    if refused := [(name, r.refused) for name, r in named if r.refused]:
        print()
        print("refused by attention_bound (outside Theorem A.1's hypotheses):")
        for name, items in refused:
            print(f"  {name}: {len(items)} inputs, e.g. {items[0]}")
    if args.search:
        print_search(rows, args.search, args.seed)
    if args.floor:
        print_floor(presets, sizes[0], args.seed)
    if args.probabilistic:
        print_probabilistic(presets, sizes[0], args.probabilistic, args.seed)
    if args.mha:
        print_mha(presets, args.seed)
    print()
    print(f"wall time: {elapsed:.1f} s")
    return report_problems(problems, args.seed)


def print_search(rows: list[tuple[Config, Result]], budget: int, seed: int) -> None:
    """The search's worst case per configuration: bound ÷ error there, beside the families'."""
    import jax

    from mhanum import search

    jax.config.update("jax_enable_x64", True)
    print()
    print(f"mhanum.search.worst_case (objective error/bound, budget {budget}, seed {seed}):")
    print("search b/e = bound ÷ error at the search's worst input (the goal: <= 10)")
    width = max(len(c.name) for c, _ in rows) + 1
    print(f"{'configuration':<{width}} {'search b/e':>10} {'families':>9} {'dominant':<12}")
    for config, res in rows:
        shape = {"q_len": config.L, "kv_len": config.L, "d_k": config.d}
        try:
            case = search.worst_case(config.numerics(), shape, budget=budget, seed=seed)
        except InvalidArgument as exc:
            print(f"{config.name:<{width}} {'refused':>10}  {exc}")
            continue
        families = fmt_ratio(ratio(res.max_bound, res.max_err))
        print(
            f"{config.name:<{width}} {fmt_ratio(1 / case.ratio if case.ratio else math.inf):>10} "
            f"{families:>9} {case.dominant_term:<12}"
        )


def _floor_module() -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import rounding_floor

    return rounding_floor


def _entries(rng: np.random.Generator, shape: tuple[int, ...], *first: Any) -> list[Any]:
    """The given entries, then 14 more drawn at random."""
    picks = [np.unravel_index(int(np.argmax(a)), shape) for a in first]
    picks += [np.unravel_index(int(i), shape) for i in rng.choice(math.prod(shape), 14)]
    return [tuple(int(i) for i in e) for e in dict.fromkeys(tuple(p) for p in picks)]


def print_floor(presets: list[str], size: tuple[int, int], seed: int) -> None:
    """A.1 against the floor (a realised worst-case rounding) and the measured error."""
    floor = _floor_module()
    L, d = size
    print()
    print(f"The floor on one random normal input per preset, L={L} d={d}: F = the error of a")
    print("worst-case rounding of the standard model, run (benchmarks/rounding_floor.py); no sound")
    print("deterministic bound is below F. At the entry of the largest error and the largest A.1,")
    print("then the median over them and 14 random entries: A.1/F is the derivation's own slack,")
    print("F/err what no deterministic bound can remove")
    head = ("preset", "max error", "max A.1", "A.1/err", "F/err", "A.1/F", "med A.1/F")
    print(f"{head[0]:<18} {head[1]:>10} {head[2]:>10} {head[3]:>9} {head[4]:>9} {head[5]:>8} "
          f"{head[6]:>9}")  # fmt: skip
    for preset in presets:
        num = Numerics.preset(preset)
        fmt = get_format(num.input)
        rng = np.random.default_rng(seed)
        q, k, v = (
            np.asarray(mn.round_to(rng.standard_normal((L, d)), fmt), np.float64) for _ in range(3)
        )
        out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
        err = np.abs(out - np.asarray(reference.attention(q, k, v), np.float64))
        a1 = np.asarray(attention_bound(q, k, v, numerics=num).total)
        entries = _entries(rng, err.shape, err, a1)
        try:
            f = floor.attention_floor(q, k, v, num, entries)
        except InvalidArgument:
            print(
                f"{preset:<18} {'-':>10}  not modelled by the floor (operand roundings, exp2, ...)"
            )
            continue
        big = np.abs(f.realised)
        at = [float(a1[e]) for e in entries]
        print(
            f"{preset:<18} {err.max():10.3g} {a1.max():10.3g} {fmt_ratio(ratio(a1.max(), err.max())):>9} "
            f"{fmt_ratio(ratio(big.max(), err.max())):>9} {fmt_ratio(ratio(at[0], big[0])):>8} "
            f"{fmt_ratio(float(np.median(np.array(at) / big))):>9}"
        )


def lam_for(probability: float, numerics: Numerics, L: int, d: int) -> tuple[float, float]:
    """The λ that A.1 solves for ``probability`` at this size, and the probability it states
    (both depend on the number of rounding chains only, not on the values)."""
    z = np.ones((L, d))
    bound = attention_bound(z, z, z, numerics=numerics, probability=probability)
    assert bound.lam is not None
    return bound.lam, bound.probability


def print_probabilistic(presets: list[str], size: tuple[int, int], n: int, seed: int) -> None:
    """A.3 with a stated probability >= 0.99 against the 99th percentile of the error."""
    L, d = size
    print()
    print(f"Theorem A.3 on {n} random normal inputs per preset, L={L} d={d} (goal: A.3 <= 3× p99,")
    print("stated probability >= 0.99); A.3 and A.1 as the median over entries, beside the")
    print("99th percentile of the error over every entry; 'over' counts entries above A.3")
    print("'ideal/p99': the least an Azuma-Hoeffding bound with this lam can be (the exact")
    print("first-order sensitivities, benchmarks/rounding_floor.py), median over 16 entries of the")
    print("first input")
    head = ("preset", "lam", "prob", "p99 error", "A.3", "A.3/p99", "A.1/p99", "over", "ideal/p99")
    print(f"{head[0]:<18} {head[1]:>6} {head[2]:>7} {head[3]:>10} {head[4]:>10} {head[5]:>8} "
          f"{head[6]:>8} {head[7]:>6} {head[8]:>9}")  # fmt: skip
    for preset in presets:
        num = Numerics.preset(preset)
        fmt = get_format(num.input)
        try:
            lam, prob = lam_for(0.99, num, L, d)
        except InvalidArgument as exc:
            print(f"{preset:<18} {'-':>6} {'-':>7}  not covered: {exc}")
            continue
        rng = np.random.default_rng(seed)
        errs, a3, a1, first = [], [], [], None
        for _ in range(n):
            q, k, v = (
                np.asarray(mn.round_to(rng.standard_normal((L, d)), fmt), np.float64)
                for _ in range(3)
            )
            first = first or (q, k, v)
            out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
            errs.append(np.abs(out - np.asarray(reference.attention(q, k, v), np.float64)))
            a3.append(attention_bound(q, k, v, numerics=num, lam=lam).total)
            a1.append(attention_bound(q, k, v, numerics=num).total)
        e, b3, b1 = (np.concatenate([x.ravel() for x in xs]) for xs in (errs, a3, a1))
        p99 = float(np.quantile(e, 0.99))
        print(
            f"{preset:<18} {lam:6.2f} {prob:7.4f} {p99:10.3g} {np.median(b3):10.3g} "
            f"{fmt_ratio(np.median(b3) / p99):>8} {fmt_ratio(np.median(b1) / p99):>8} "
            f"{int(np.sum(e > b3)):>6} {ideal_ratio(num, first, lam, p99, seed):>9}"
        )


def ideal_ratio(
    num: Numerics, qkv: tuple[np.ndarray, ...] | None, lam: float, p99: float, seed: int
) -> str:
    """The median over 16 entries of the least Azuma-Hoeffding bound with ``lam``, ÷ ``p99``."""
    if qkv is None:
        return "-"
    q = qkv[0]
    try:
        f = _floor_module().attention_floor(
            *qkv, num, _entries(np.random.default_rng(seed), (q.shape[0], qkv[2].shape[1]))
        )
    except InvalidArgument:
        return "-"
    return fmt_ratio(float(np.median(f.hoeffding(lam))) / p99)


def admissible_inputs(
    params: mn.MHAParams, heads: int, length: int, x_max: float, seed: int
) -> list[np.ndarray]:
    """Inputs with ``|x| <= x_max`` built to reach A.4's worst case: per head, row 0 a query along
    the top singular vector of ``W_q W_kᵀ`` (entries ``±x_max``), keys 1–15 at the largest logit
    the box allows against it, less a random drop (coordinates of least logit slope per value
    weight flipped, so the values move apart while the logits stay within the drop), and every
    other row that key negated (its logit far below)."""
    rng = np.random.default_rng(seed)
    d_k = params.qk_width // heads
    c = 1 / math.sqrt(d_k)
    found = []
    for h in range(min(heads, 4)):
        s = slice(h * d_k, (h + 1) * d_k)
        wq, wk, wv = params.wq[:, s], params.wk[:, s], params.wv[:, s]
        m = wq @ wk.T
        xq = x_max * np.sign(np.linalg.svd(m)[0][:, 0])
        bq = np.zeros(d_k) if params.bq is None else params.bq[s]
        g = c * (m.T @ xq + wk @ bq)  # the logit's slope in the key's row
        top = x_max * np.sign(g)
        order = np.argsort(np.abs(g) / (np.abs(wv).sum(axis=1) + 1e-300))
        for drop in (2.0, 8.0, 32.0):
            x = np.tile(-top, (length, 1))
            x[0] = xq
            for j in range(1, min(16, length)):
                key, budget = top.copy(), drop * rng.random()
                for t in order:
                    budget -= 2 * x_max * abs(g[t])
                    if budget < 0:
                        break
                    if rng.random() < 0.5:
                        key[t] = -key[t]
                x[j] = key
            found.append(x[None])
    return found


def admissible_worst(
    params: mn.MHAParams, heads: int, x_max: float, num: Numerics, seed: int, length: int = 64
) -> float:
    """The largest error of ``mhanum.multi_head_attention`` over :func:`admissible_inputs` (every
    entry a value of the input format, at most ``x_max``): a lower bound on A.4's worst case."""
    a = float(mn.round_to(x_max, num.input))
    if a > x_max:
        a = float(mn.round_to(x_max * (1 - 2 * get_format(num.input).u), num.input))
    worst = 0.0
    for x in admissible_inputs(params, heads, length, a, seed):
        x = np.clip(np.asarray(mn.round_to(x, num.input), np.float64), -a, a)
        out = np.asarray(mn.multi_head_attention(x, x, params, heads, numerics=num), np.float64)
        ref = np.asarray(reference.multi_head_attention(x, x, params, heads), np.float64)
        worst = max(worst, float(np.max(np.abs(out - ref))))
    return worst


def print_mha(presets: list[str], seed: int) -> None:
    """A.2 (a posteriori), A.3 (probability 0.99) and A.4 (a priori) at the README demo size
    against the error."""
    from mhanum.bounds import mha_bound, mha_bound_a_priori

    heads, length, width = 8, 64, 512
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, length, width))
    params = mn.MHAParams.random(width, seed=seed)
    exact = np.asarray(reference.multi_head_attention(x, x, params, heads), np.float64)
    print()
    print(f"MHA at the README demo size (d_model {width}, {heads} heads, L {length}; goals: "
          "A.2 <= 30× and A.4 <= 100× the measured error)")  # fmt: skip
    print("F: the error of a worst-case rounding, run, at the entry of the largest error (no sound")
    print("deterministic bound is below it; benchmarks/rounding_floor.py); ideal: the least an")
    print("Azuma-Hoeffding bound with A.3's lam can be there; adv: the largest error over inputs")
    print("with |x| <= max|x| built to reach large near-tied logits (A.4 covers them, so no sound")
    print("bound from max|x| alone is below it)")
    print(f"{'preset':<18} {'max error':>10} {'max A.2':>10} {'A.2/err':>9} {'A.3/err':>9} "
          f"{'A.4':>10} {'A.4/err':>9} {'adv/err':>8} {'A.4/adv':>8} {'F/err':>8} {'A.2/F':>8} {'ideal/err':>9} "
          f"{'A.2 dominant':<14}")  # fmt: skip
    for preset in presets:
        num = Numerics.preset(preset)
        xr = np.asarray(mn.round_to(x, num.input), np.float64)
        out = np.asarray(mn.multi_head_attention(xr, xr, params, heads, numerics=num), np.float64)
        exact_r = exact if num.input == "float64" else np.asarray(
            reference.multi_head_attention(xr, xr, params, heads), np.float64
        )  # fmt: skip
        errs = np.abs(out - exact_r)
        err = float(np.max(errs))
        a2 = mha_bound(xr, xr, params, heads, numerics=num)
        b3 = mha_bound(xr, xr, params, heads, numerics=num, probability=0.99)
        a3 = float(np.max(b3.total))
        at = np.unravel_index(int(np.argmax(errs)), errs.shape)
        try:
            f = _floor_module().mha_floor(xr[0], params, heads, num, [at[1:]])
            assert b3.lam is not None
            big, ideal = abs(float(f.realised[0])), float(f.hoeffding(b3.lam)[0])
            floor_cols = (
                f"{fmt_ratio(ratio(big, err)):>8} {fmt_ratio(ratio(float(a2.total[at]), big)):>8} "
                f"{fmt_ratio(ratio(ideal, err)):>9}"
            )
        except InvalidArgument:
            floor_cols = f"{'-':>8} {'-':>8} {'-':>9}"
        a4 = mha_bound_a_priori(
            params, heads, length, length, x_max=float(np.abs(xr).max()), numerics=num
        )
        top = max(a2.terms, key=lambda t: float(np.max(a2.terms[t])))
        a2max, a4max = float(np.max(a2.total)), float(np.max(a4.total))
        adv = admissible_worst(params, heads, float(np.abs(xr).max()), num, seed, length)
        assert adv <= a4max, f"{preset}: A.4 = {a4max:.4g} below an admissible error {adv:.4g}"
        print(
            f"{preset:<18} {err:10.3g} {a2max:10.3g} {fmt_ratio(ratio(a2max, err)):>9} "
            f"{fmt_ratio(ratio(a3, err)):>9} {a4max:10.3g} {fmt_ratio(ratio(a4max, err)):>9} "
            f"{fmt_ratio(ratio(adv, err)):>8} {fmt_ratio(ratio(a4max, adv)):>8} "
            f"{floor_cols} {top:<14}"
        )


def report_problems(problems: list[Problem], seed: int) -> int:
    """Print what the bound does not cover, loudly; the exit status (0, or 1 on any violation)."""
    if not problems:
        print("soundness: every measured error is within its bound")
        return 0
    violations = [p for p in problems if p.kind != "non-finite output"]
    non_finite = [p for p in problems if p.kind == "non-finite output"]
    print()
    print("!" * 100)
    if violations:
        print(f"!!! {len(violations)} SOUNDNESS VIOLATION(S): measured error above a finite bound")
        for p in violations:
            print(f"!!! {p.kind.upper()}: {p.config.name}, family {p.family}, input {p.index}, "
                  f"seed {seed}: {p.detail}")  # fmt: skip
            print(f"!!!     reproduce: {p.config.command(p.family, p.index, seed)}")
    if non_finite:
        configs: dict[Config, list[Problem]] = {}
        for p in non_finite:
            configs.setdefault(p.config, []).append(p)
        print(
            f"!!! NON-FINITE OUTPUT under a finite bound on {len(non_finite)} inputs in "
            f"{len(configs)} configurations (a violation: A.1 proves the range on the values "
            "and must be inf where the output may overflow):"
        )
        for config, items in configs.items():
            where = " ".join(f"{p.family}[{p.index}]" for p in items)
            print(f"!!!   {config.name}: {where}")
        first = non_finite[0]
        print(f"!!!   e.g. {first.config.name} {first.family}[{first.index}]: {first.detail}")
        print(f"!!!     reproduce: {first.config.command(first.family, first.index, seed)}")
    print("!" * 100)
    return 1


if __name__ == "__main__":
    sys.exit(main())
