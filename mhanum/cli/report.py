"""``mhanum report``: the command behind the parser block in :mod:`mhanum.cli`."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from mhanum import parallel
from mhanum.report import build, default_toml

__all__ = ["ProgressBar", "run"]


class ProgressBar:
    """``[#####.....] 12/40 fp16 L=64 mask=causal`` on a stream: redrawn in place on a terminal,
    else a line every tenth of the way."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self.shown = -1

    def __call__(self, done: int, total: int, what: str) -> None:
        filled = self.width * done // max(total, 1)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if done == total else ""))
        elif 10 * done // max(total, 1) > self.shown or done == total:
            self.shown = 10 * done // max(total, 1)
            self.stream.write(line + "\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    """Build the report the arguments ask for; print where it went."""
    if args.print_default_config:
        print(default_toml(), end="")
        return 0
    start = time.perf_counter()
    with parallel.executor_for(args.workers, args.scheduler) as executor:
        report = build(
            args.config,
            args.out,
            cases=args.cases,
            records=args.records,
            force=args.force,
            progress=ProgressBar(sys.stderr),
            executor=executor,
            journal=args.journal,
        )
    ratios = [max(p["ratio"]) for p in report.data["attention"]["points"] if p["ratio"]]
    worst = max(ratios, default=float("nan"))
    print(
        f"report in {time.perf_counter() - start:.1f} s -> {report.html}, {report.markdown}, "
        f"{report.json}; largest error/bound {worst:.3g}"
    )
    return 0
