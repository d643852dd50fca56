"""``mhanum compare``: the frameworks side by side, or the causes of one difference."""

from __future__ import annotations

import argparse
import json

import numpy as np

from mhanum.params import MHAParams

MASKS = ("none", "causal", "padding")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mhanum compare``."""
    parser.add_argument(
        "--frameworks",
        default=None,
        help="comma-separated adapters (default: every installed one)",
    )
    parser.add_argument("--d-model", type=int, default=32, help="model width (32)")
    parser.add_argument("--heads", type=int, default=4, help="number of heads (4)")
    parser.add_argument("--length", type=int, default=16, help="sequence length (16)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (2)")
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
        "--independent --raw-mask-b ones)",
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
