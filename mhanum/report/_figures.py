"""The report's figures, drawn with matplotlib's object API (no pyplot, no global state) as PNG.

Each function takes a section of the report's data and returns PNG bytes, or ``None`` when the
section has nothing to draw. PNGs carry no software or date metadata, so the same data gives the
same bytes under the same matplotlib.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

__all__ = ["device_records", "error_vs_length", "heads", "term_breakdown"]

_DPI = 100
_MASK_STYLE: tuple[Literal["-", "--", ":", "-."], ...] = ("-", "--", ":", "-.")


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 2)
    return math.ceil(n / cols), cols


def _by_preset(points: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        groups.setdefault(p["preset"], []).append(p)
    return groups


def _positive(values: Sequence[float | None]) -> list[float]:
    """Values for a log axis: missing, non-positive and non-finite ones become NaN (a gap)."""
    return [v if v is not None and v > 0 and math.isfinite(v) else math.nan for v in values]


def _max(values: Sequence[float] | None) -> float:
    """The largest of per-sample values; NaN for a bound that was not evaluated."""
    return max(values) if values else math.nan


def error_vs_length(attention: Mapping[str, Any]) -> bytes:
    """Log–log error against sequence length, one panel per preset, one line style per mask."""
    groups = _by_preset(attention["points"])
    rows, cols = _grid(len(groups))
    fig = Figure(figsize=(5.2 * cols, 3.6 * rows + 0.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    series = (
        ("worst measured", "C3", lambda p: p["error_worst"], "o"),
        ("median measured", "C1", lambda p: p["error_median"], "s"),
        ("a posteriori (A.1)", "C0", lambda p: _max(p["bound_a_posteriori"]), None),
        ("probabilistic (A.3)", "C2", lambda p: _max(p["bound_probabilistic"]), None),
        ("a priori (A.4)", "C4", lambda p: _max(p["bound_a_priori"]), None),
    )
    drawn: dict[str, tuple[str, str | None]] = {}
    for ax, (preset, points) in zip(axes, groups.items(), strict=False):
        masks = list(dict.fromkeys(p["mask"] for p in points))
        for m_index, mask in enumerate(masks):
            mine = sorted((p for p in points if p["mask"] == mask), key=lambda p: p["length"])
            lengths = [p["length"] for p in mine]
            for label, color, get, marker in series:
                values = _positive([get(p) for p in mine])
                if all(math.isnan(v) for v in values):
                    continue
                ax.plot(
                    lengths,
                    values,
                    color=color,
                    marker=marker,
                    linestyle=_MASK_STYLE[m_index % len(_MASK_STYLE)],
                )
                drawn[label] = (color, marker)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        fmt = points[0]["output_format"]
        ax.set_title(f"{preset} (output {fmt}, u = 2^{round(math.log2(points[0]['u']))})")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("max |error| over entries")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    # One legend for all panels, below them: colour = series, line style = mask.
    masks = list(dict.fromkeys(p["mask"] for p in attention["points"]))
    handles = [Line2D([], [], color=c, marker=m, label=name) for name, (c, m) in drawn.items()]
    handles += [
        Line2D([], [], color="0.4", linestyle=_MASK_STYLE[i % len(_MASK_STYLE)], label=f"mask {m}")
        for i, m in enumerate(masks)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), fontsize=8)
    return _png(fig)


def term_breakdown(attention: Mapping[str, Any]) -> bytes:
    """Stacked bars: each term's share of the A.1 bound at its largest entry, per preset and L."""
    groups = _by_preset(attention["points"])
    names = sorted({n for p in attention["points"] for n in p["terms_at_max"]})
    sources = sorted({n for p in attention["points"] for n in p.get("logits_parts_at_max", {})})
    # the logits term is drawn as its sources (they add up to it), the others as they are
    segments: list[tuple[str, Any]] = []
    for name in names:
        if name == "logits" and sources:
            segments += [
                (
                    f"logits: {src}",
                    lambda p, src=src: p.get("logits_parts_at_max", {}).get(src, 0.0),
                )
                for src in sources
            ]
        else:
            segments.append((name, lambda p, name=name: p["terms_at_max"].get(name, 0.0)))
    rows, cols = _grid(len(groups))
    fig = Figure(figsize=(5.2 * cols, 3.4 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, (preset, points) in zip(axes, groups.items(), strict=False):
        labels = [f"L={p['length']}\n{p['mask']}" for p in points]
        bottom = np.zeros(len(points))
        for i, (name, pick) in enumerate(segments):
            values = np.array([pick(p) for p in points])
            totals = np.array([sum(p["terms_at_max"].values()) for p in points])
            share = np.divide(values, totals, out=np.zeros_like(values), where=totals > 0)
            ax.bar(labels, share, bottom=bottom, color=f"C{i}", label=name)
            bottom += share
        ax.set_ylim(0, 1)
        ax.set_title(f"{preset}: share of each term in the bound")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel("fraction of the bound")
        if segments:
            ax.legend(fontsize=6, loc="lower right")
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    return _png(fig)


def heads(section: Mapping[str, Any]) -> bytes:
    """Error and bound per number of heads at fixed ``d_model``; difference to one head."""
    rows = section["rows"]
    hs = [r["num_heads"] for r in rows]
    fig = Figure(figsize=(10.4, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    presets = list(rows[0]["presets"])
    for i, preset in enumerate(presets):
        errors = _positive([r["presets"][preset]["error_max_abs"] for r in rows])
        bound = _positive([r["presets"][preset]["bound_max"] for r in rows])
        left.plot(hs, errors, marker="o", color=f"C{i}", label=f"{preset} measured")
        left.plot(hs, bound, linestyle="--", color=f"C{i}", label=f"{preset} bound (A.2)")
        prior = _positive([r["presets"][preset].get("bound_a_priori") for r in rows])
        if not all(math.isnan(v) for v in prior):
            left.plot(hs, prior, linestyle=":", color=f"C{i}", label=f"{preset} a priori (A.4)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("number of heads h (d_k = d_model / h)")
    left.set_ylabel("max |error|")
    left.set_title(f"MHA error at d_model = {section['d_model']}, L = {section['length']}")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=6)
    diffs = [
        (r["num_heads"], r["difference_to_one_head"]["normwise_max"])
        for r in rows
        if "difference_to_one_head" in r
    ]
    if diffs:
        right.bar([str(h) for h, _ in diffs], [d for _, d in diffs], color="C5")
    right.set_xlabel("number of heads h")
    right.set_ylabel("‖y_h − y_1‖∞ / ‖y_1‖∞")
    right.set_title("h heads vs 1 head, same weights (exact)")
    return _png(fig)


def device_records(section: Mapping[str, Any]) -> bytes | None:
    """Measured error against the bound for every device record (log–log), by implementation."""
    points = [p for f in section["files"] for p in f["points"]]
    if not points:
        return None
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    impls = list(dict.fromkeys(p["implementation"] for p in points))
    for i, impl in enumerate(impls):
        mine = [p for p in points if p["implementation"] == impl]
        ax.scatter(
            _positive([p["bound_max"] for p in mine]),
            _positive([p["error_max_abs"] for p in mine]),
            s=10,
            color=f"C{i}",
            label=impl,
            alpha=0.7,
        )
    finite = [
        p["bound_max"] for p in points if p["bound_max"] > 0 and math.isfinite(p["bound_max"])
    ]
    if finite:
        lo, hi = min(finite), max(finite)
        ax.plot([lo, hi], [lo, hi], color="k", linewidth=0.8, label="error = bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bound (max over entries)")
    ax.set_ylabel("measured max |error|")
    ax.set_title("device records")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)
