"""``mhanum compare``: the frameworks side by side, or the causes of one difference."""

from __future__ import annotations

import argparse
import json

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.adapters import ADAPTERS
from mhanum.cli import _options
from mhanum.params import MHAParams

__all__ = ["MASKS", "RAW_MASKS", "SEED_EXAMPLE_SIZES", "SIZES", "add_arguments", "run"]

MASKS = ("none", "causal", "padding")
RAW_MASKS = ("ones", "zeros")
# Default sizes; --seed-example defaults to those of the PyTorch-vs-TensorFlow tutorial, so that
# `mhanum compare --seed-example` prints the tutorial's (and the README's) report, figure for
# figure where torch runs its AVX2 CPU kernels (with other kernels torch's own error differs).
SIZES = {"d_model": 32, "heads": 4, "length": 16, "batch": 2}
SEED_EXAMPLE_SIZES = {"d_model": 512, "heads": 8, "length": 64, "batch": 1}


def _framework_list(text: str) -> list[str]:
    """``--frameworks a,b``, the old spelling of ``--framework a --framework b``."""
    names = text.split(",")
    unknown = [name for name in names if name not in ADAPTERS]
    if unknown:
        msg = f"expected names from {', '.join(ADAPTERS)}, got {unknown[0]!r}"
        raise argparse.ArgumentTypeError(msg)
    return names


def _layer(text: str) -> str:
    """``--attribute``'s ``framework[/path]``, its framework one of :data:`ADAPTERS`."""
    if text.partition("/")[0] not in ADAPTERS:
        msg = f"expected framework[/path], the framework one of {', '.join(ADAPTERS)}, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mhanum compare``."""
    parser.add_argument(
        "--framework",
        action="append",
        dest="frameworks",
        choices=tuple(ADAPTERS),
        default=None,
        metavar="NAME",
        help=f"an adapter to run, repeatable (default: every installed one), "
        f"{_options.one_of(ADAPTERS)}",
    )
    parser.add_argument(
        "--frameworks", action="extend", dest="frameworks", type=_framework_list,
        help=argparse.SUPPRESS,
    )  # fmt: skip
    for flag, help_text in (
        ("--d-model", "model width"),
        ("--heads", "number of attention heads"),
        ("--length", "sequence length"),
        ("--batch", "batch size"),
    ):
        dest = flag[2:].replace("-", "_")
        small, seed_example = SIZES[dest], SEED_EXAMPLE_SIZES[dest]
        parser.add_argument(
            flag,
            type=int,
            default=None,
            metavar="N",
            help=f"{help_text} ({small}; {seed_example} with --seed-example)",
        )
    parser.add_argument("--seed", type=int, default=0, help="seed of inputs and weights (0)")
    parser.add_argument(
        "--mask",
        choices=MASKS,
        default="none",
        metavar="KIND",
        help=f"mask (none), {_options.one_of(MASKS)}",
    )
    parser.add_argument(
        "--attribute",
        nargs=2,
        type=_layer,
        metavar=("A", "B"),
        default=None,
        help="attribute the difference of two layers, each framework[/path] (e.g. torch/sdpa), "
        f"the framework {_options.one_of(ADAPTERS)}",
    )
    parser.add_argument(
        "--independent",
        action="store_true",
        help="with --attribute: give B its own weights (seed + 1), as two separately "
        "initialised layers",
    )
    parser.add_argument(
        "--raw-mask-b",
        choices=RAW_MASKS,
        default=None,
        metavar="FILL",
        help="with --attribute: pass B this mask untranslated, in its own convention, "
        f"{_options.one_of(RAW_MASKS)}",
    )
    parser.add_argument(
        "--seed-example",
        action="store_true",
        help="the classic report: torch/explicit vs keras/additive given mask = ones, "
        "separately initialised (same as --attribute torch/explicit keras/additive "
        "--independent --raw-mask-b ones), at the tutorial's sizes unless given",
    )
    _options.add_json(parser, "the result")


def _mask(kind: str, batch: int, length: int, rng: np.random.Generator) -> np.ndarray | None:
    if kind == "none":
        return None
    if kind == "causal":
        return np.broadcast_to(np.tril(np.ones((length, length), bool)), (batch, length, length))
    keep = rng.integers(1, length + 1, size=batch)
    mask = np.arange(length)[None, None, :] < keep[:, None, None]
    return np.broadcast_to(mask, (batch, length, length))


def _spec(text: str) -> tuple[str, str | None]:
    name, _, path = text.partition("/")
    return name, (path or None)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; 0 on success."""
    from mhanum import adapters, demo
    from mhanum.adapters import compare as cmp

    sizes = SEED_EXAMPLE_SIZES if args.seed_example else SIZES
    for name, default in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    demo.check_arguments(
        seed=args.seed, d_model=args.d_model, num_heads=args.heads, length=args.length,
        names={"seed": "--seed", "d_model": "--d-model", "num_heads": "--heads",
               "length": "--length"},
    )  # fmt: skip
    if args.batch < 1:
        msg = f"--batch: expected a positive integer, got {args.batch}"
        raise InvalidArgument(msg)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch, args.length, args.d_model)).astype(np.float32)
    params = MHAParams.random(args.d_model, seed=args.seed)
    mask = _mask(args.mask, args.batch, args.length, rng)
    if args.seed_example:
        args.attribute = ["torch/explicit", "keras/additive"]
        args.independent = True
        args.raw_mask_b = "ones"
    if args.attribute is None:
        names = None if args.frameworks is None else tuple(args.frameworks)
        config = {"seed": args.seed, "mask": args.mask}
        table = cmp.compare(x, x, params, args.heads, mask=mask, frameworks=names, config=config)
        print(json.dumps(table.as_dict(), indent=2) if args.json else table.render())
        return 0
    (name_a, path_a), (name_b, path_b) = (_spec(s) for s in args.attribute)
    ad_a, ad_b = adapters.get(name_a), adapters.get(name_b)
    params_b = MHAParams.random(args.d_model, seed=args.seed + 1) if args.independent else params
    layer_a, layer_b = ad_a.load(params, args.heads), ad_b.load(params_b, args.heads)
    raw = None
    if args.raw_mask_b is not None:
        fill = np.ones if args.raw_mask_b == "ones" else np.zeros
        raw = fill((args.length, args.length), np.float32)
        if name_b in ("torch", "jax"):  # these take boolean masks
            raw = raw.astype(bool)
    if mask is None:
        mask = np.ones((args.batch, args.length, args.length), bool)
    result = cmp.attribute(
        cmp.Side(name_a, layer_a, path_a),
        cmp.Side(name_b, layer_b, path_b, raw_mask=raw),
        x,
        x,
        args.heads,
        mask=mask,
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.render())
    return 0
