"""RoPE's share of the logit error against position, beside Theorem P.1's bound (papers/rope.md).

For tables (and rotations) in float32, bfloat16 and float16, bases 10,000 and 500,000, positions
up to 131,072: a query and a key (random normal, ``d = 128``, in the table's format) rotated by
:func:`mhanum.rope.apply_rope` at every position, and the logit ``q_rot(p) · k_rot(0)`` against
the exact one; the bound is P.1's entries carried through the dot (Corollary P.4):
``Σ_t e_q|k| + |q| e_k + e_q e_k``, the dot itself exact (its rounding is Theorem A.1's).

Run: ``python papers/rope_figure.py [--out papers/figures/rope.png] [--max-position 131072]``
(about a minute). Prints, per configuration and position decade, the largest measured logit
error and the largest bound, and writes the figure.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import numpy as np

from mhanum.formats import round_to
from mhanum.rope import Rope, apply_rope, reference_rope, rope_error

FORMATS = ("float32", "bfloat16", "float16")
BASES = (10_000.0, 500_000.0)


def logit_errors(fmt: str, base: float, positions: np.ndarray, d: int = 128) -> tuple[Any, Any]:
    """The measured RoPE logit error and its bound, per position (float16 positions are
    float32: float16 represents positions exactly only up to 2048)."""
    rng = np.random.default_rng(0)
    q = round_to(rng.standard_normal((positions.size, d)), fmt)
    q[:] = q[0]  # one query at every position
    k = round_to(rng.standard_normal((1, d)), fmt)
    rope = Rope(dim=d, base=base, table_format=fmt, rotation_format=fmt)
    start = np.zeros(1, np.int64)
    q_hat, k_hat = apply_rope(q, positions, rope), apply_rope(k, start, rope)
    (q_ref, q_ref_err), (k_ref, k_ref_err) = (
        reference_rope(q, positions, rope),
        reference_rope(k, start, rope),
    )
    e_q = rope_error(q, positions, rope) + q_ref_err
    e_k = rope_error(k, start, rope) + k_ref_err
    measured = np.abs(q_hat @ k_hat[0] - q_ref @ k_ref[0])
    q_abs, k_abs = np.abs(q_ref) + q_ref_err, np.abs(k_ref[0]) + k_ref_err[0]
    bound = e_q @ k_abs + q_abs @ e_k[0] + e_q @ e_k[0]
    # the measured error is against the float64 reference: its own distance is in the bound
    reference = q_ref_err @ k_abs + q_abs @ k_ref_err[0]
    return measured, bound + reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the figure here")
    parser.add_argument("--max-position", type=int, default=131_072)
    args = parser.parse_args(argv)
    positions = np.unique(np.geomspace(1, args.max_position - 1, 400).astype(np.int64))
    positions = np.concatenate([[0], positions])
    results = {}
    print(f"{'table':9s} {'base':>8s} {'positions':>17s} {'max error':>10s} {'max bound':>10s}")
    for fmt in FORMATS:
        for base in BASES:
            measured, bound = logit_errors(fmt, base, positions)
            assert np.all(measured <= bound), (fmt, base)
            results[fmt, base] = (measured, bound)
            for lo in (1, 1_000, 10_000, 100_000):
                sel = (positions >= lo) & (positions < lo * 10)
                if sel.any():
                    print(f"{fmt:9s} {base:8.0f} {f'[{lo}, {lo * 10})':>17s} "
                          f"{measured[sel].max():10.3g} {bound[sel].max():10.3g}")  # fmt: skip
    if args.out is not None:
        _plot(positions, results, args.out)
        print(f"wrote {args.out}")
    return 0


def _plot(positions: np.ndarray, results: dict, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colours = {"float32": "C0", "bfloat16": "C1", "float16": "C2"}
    for ax, base in zip(axes, BASES, strict=True):
        for fmt in FORMATS:
            measured, bound = results[fmt, base]
            ax.loglog(positions[1:], np.maximum(measured[1:], 1e-12), ".", ms=2,
                      color=colours[fmt], label=f"{fmt}: measured")  # fmt: skip
            ax.loglog(positions[1:], bound[1:], "-", color=colours[fmt], label=f"{fmt}: P.4 bound")
        ax.set_title(f"base {base:,.0f}, d = 128")
        ax.set_xlabel("position")
    axes[0].set_ylabel("|logit error| from RoPE")
    axes[1].legend(fontsize=7)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
