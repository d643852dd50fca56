"""``mhanum compare``: the frameworks side by side, or the causes of one difference."""

from __future__ import annotations

import argparse
import json

import numpy as np

from mhanum.params import MHAParams

MASKS = ("none", "causal", "padding")
# Default sizes; --seed-example defaults to those of the PyTorch-vs-TensorFlow tutorial, so that
# `mhanum compare --seed-example` prints the tutorial's (and the README's) report, figure for
# figure where torch runs its AVX2 CPU kernels (with other kernels torch's own error differs).
SIZES = {"d_model": 32, "heads": 4, "length": 16, "batch": 2}
SEED_EXAMPLE_SIZES = {"d_model": 512, "heads": 8, "length": 64, "batch": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mhanum compare``."""
    parser.add_argument(
        "--frameworks",
        default=None,
        help="comma-separated adapters (default: every installed one)",
    )
    for flag, help_text in (
        ("--d-model", "model width"),
        ("--heads", "number of heads"),
        ("--length", "sequence length"),
        ("--batch", "batch size"),
    ):
        dest = flag[2:].replace("-", "_")
        small, seed_example = SIZES[dest], SEED_EXAMPLE_SIZES[dest]
        parser.add_argument(
            flag,
            type=int,
            default=None,
            help=f"{help_text} ({small}; {seed_example} with --seed-example)",
        )
    parser.add_argument("--seed", type=int, default=0, help="seed of inputs and weights (0)")
    parser.add_argument("--mask", choices=MASKS, default="none", help="mask (none)")
    parser.add_argument(
        "--attribute",
        nargs=2,
        metavar=("A", "B"),
        default=None,
        help="attribute the difference of two layers, each framework[/path] (e.g. torch/sdpa)",
    )
    parser.add_argument(
        "--independent",
        action="store_true",
        help="with --attribute: give B its own weights (seed + 1), as two separately "
        "initialised layers",
    )
    parser.add_argument(
        "--raw-mask-b",
        choices=("ones", "zeros"),
        default=None,
        help="with --attribute: pass B this mask untranslated, in its own convention",
    )
    parser.add_argument(
        "--seed-example",
        action="store_true",
        help="the classic report: torch/explicit vs keras/additive given mask = ones, "
        "separately initialised (same as --attribute torch/explicit keras/additive "
        "--independent --raw-mask-b ones), at the tutorial's sizes unless given",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


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
    from mhanum import adapters
    from mhanum.adapters import compare as cmp

    sizes = SEED_EXAMPLE_SIZES if args.seed_example else SIZES
    for name, default in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch, args.length, args.d_model)).astype(np.float32)
    params = MHAParams.random(args.d_model, seed=args.seed)
    mask = _mask(args.mask, args.batch, args.length, rng)
    if args.seed_example:
        args.attribute = ["torch/explicit", "keras/additive"]
        args.independent = True
        args.raw_mask_b = "ones"
    if args.attribute is None:
        names = None if args.frameworks is None else tuple(args.frameworks.split(","))
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
