"""The ``mhanum`` command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO


def _demo(args: argparse.Namespace) -> int:
    from mhanum import demo

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
    from mhanum import InvalidArgument, devices

    out = Path(args.out)
    if out.exists() and not args.force:
        msg = f"out: expected a new file, got existing {str(out)!r} (pass --force to overwrite)"
        raise InvalidArgument(msg)
    grid = devices.Grid.gpu() if args.grid == "gpu" else devices.Grid.default()
    if args.seed is not None:
        grid = grid.with_seeds([args.seed])
    start = time.perf_counter()
    records = devices.measure(
        grid, args.backend, progress=_ProgressBar(sys.stderr), workers=args.workers
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
    from mhanum import devices

    result = devices.check(devices.read_records(args.records))
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.render())
    return result.exit_code


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
    measure.add_argument("--seed", type=int, default=None, help="input seed (the grid's: 0)")
    measure.add_argument("--json", action="store_true", help="print the summary as JSON")
    measure.set_defaults(func=_measure)

    check = commands.add_parser(
        "check", help="recompute the bounds of measured records and judge them (exit 1 if any fail)"
    )
    check.add_argument("records", help="a records file written by mhanum measure")
    check.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    check.set_defaults(func=_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mhanum`` console script."""
    args = _parser().parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)
    from mhanum import InvalidArgument

    try:
        return int(args.func(args))
    except InvalidArgument as exc:
        print(f"mhanum {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
