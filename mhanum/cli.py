"""The ``mhanum`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from mhanum import demo

    result = demo.run(
        seed=args.seed, d_model=args.d_model, num_heads=args.heads, length=args.length
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else demo.render(result))
    return 0


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
