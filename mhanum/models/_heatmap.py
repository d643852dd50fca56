"""A layer × head heatmap of one preset's audit, drawn with matplotlib's object API.

Two panels share one logarithmic colour scale: the bounds (per head Theorem A.1 of the head's
attention, before the output projection; per layer Theorem A.2 and its probabilistic variant
A.3) and the measured errors (per head and per layer). With a tolerance every figure is divided
by its layer's tolerance, so 1 is the line between within and above it and the diverging colour
map turns there; without one, the figures are absolute. matplotlib is imported when a figure is
drawn, never by ``import mhanum``.
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import TYPE_CHECKING

import numpy as np

from mhanum.models._audit import Audit, layer_tolerance

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["HeatmapData", "heatmap_data", "heatmap_png", "heatmap_svg"]

_DPI = 100
_DECADES = 6
"""The relative scale spans at most 10^±6 about the tolerance; figures beyond take its ends."""


@dataclasses.dataclass(frozen=True)
class HeatmapData:
    """What one preset's heatmap shows.

    Attributes:
        preset: the preset's name.
        layers: the layers' indices (the rows).
        bound_columns: the bound panel's column labels: ``"head 0"``, ..., then ``"layer A.2"``
            and ``"layer A.3"``.
        bound: ``(layers, heads + 2)``: each head's A.1 bound, the layer's A.2 bound and its
            probabilistic bound (NaN where missing, ``inf`` where infinite).
        error_columns: the error panel's column labels: ``"head 0"``, ..., then ``"layer"``.
        error: ``(layers, heads + 1)``: each head's measured error, then the layer's.
        relative: whether the figures are divided by each layer's tolerance.
    """

    preset: str
    layers: tuple[int, ...]
    bound_columns: tuple[str, ...]
    bound: np.ndarray
    error_columns: tuple[str, ...]
    error: np.ndarray
    relative: bool


def _value(x: float | None) -> float:
    return math.nan if x is None else float(x)


def heatmap_data(result: Audit, preset: str) -> HeatmapData:
    """The figures of ``preset``'s heatmap (see :class:`HeatmapData`).

    Raises:
        InvalidArgument: for a preset that was not audited.
    """
    judged = result.tolerance is not None or result.rtol is not None
    n_heads = max(
        (h.head + 1 for layer in result.layers for h in layer.preset(preset).heads), default=0
    )
    bound_rows, error_rows = [], []
    for layer in result.layers:
        p = layer.preset(preset)
        tol = layer_tolerance(layer.output_scale, result.tolerance, result.rtol) if judged else 1.0
        head_bound = [math.nan] * n_heads
        head_error = [math.nan] * n_heads
        for h in p.heads:
            head_bound[h.head], head_error[h.head] = h.bound, h.error
        bound_rows.append([*head_bound, _value(p.bound), _value(p.probable_bound)])
        error_rows.append([*head_error, p.error])
        bound_rows[-1] = [b / tol for b in bound_rows[-1]]
        error_rows[-1] = [e / tol for e in error_rows[-1]]
    heads = tuple(f"head {h}" for h in range(n_heads))
    return HeatmapData(
        preset=preset,
        layers=tuple(layer.layer for layer in result.layers),
        bound_columns=(*heads, "layer A.2", "layer A.3"),
        bound=np.array(bound_rows, np.float64).reshape(len(result.layers), n_heads + 2),
        error_columns=(*heads, "layer"),
        error=np.array(error_rows, np.float64).reshape(len(result.layers), n_heads + 1),
        relative=judged,
    )


def _limits(data: HeatmapData) -> tuple[float, float]:
    """The colour scale's ends: symmetric about 1 in decades for relative figures (so that the
    diverging map turns at the tolerance), the figures' range otherwise."""
    values = np.concatenate([data.bound.ravel(), data.error.ravel()])
    finite = values[np.isfinite(values) & (values > 0)]
    if finite.size == 0:
        return 0.1, 10.0
    lo, hi = float(finite.min()), float(finite.max())
    if data.relative:
        decades = math.ceil(max(abs(math.log10(lo)), abs(math.log10(hi))))
        decades = min(max(1, decades), _DECADES)
        return 10.0**-decades, 10.0**decades
    if lo == hi:
        return lo / 10, hi * 10
    return lo, hi


def heatmap_figure(data: HeatmapData) -> Figure:
    """The heatmap as a matplotlib ``Figure`` (no pyplot, no global state)."""
    import matplotlib as mpl
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    n_rows = len(data.layers)
    widths = [len(data.bound_columns), len(data.error_columns)]
    fig = Figure(figsize=(0.42 * sum(widths) + 2.6, 0.42 * n_rows + 1.9), layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=widths)
    lo, hi = _limits(data)
    cmap = mpl.colormaps["RdBu_r" if data.relative else "viridis"].with_extremes(bad="0.85")
    norm = LogNorm(vmin=lo, vmax=hi, clip=False)
    unit = " / tolerance" if data.relative else ""
    panels = (
        (axes[0], data.bound, data.bound_columns, f"bound{unit}"),
        (axes[1], data.error, data.error_columns, f"measured error{unit}"),
    )
    image = None
    for ax, values, columns, title in panels:
        shown = np.where(values > 0, np.clip(values, lo, hi), np.nan)  # inf shows as hi
        image = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(columns)), [c.removeprefix("head ") for c in columns])
        ax.tick_params(axis="x", labelrotation=90, labelsize=8)
        ax.set_yticks(range(n_rows), [str(i) for i in data.layers])
        ax.set_ylabel("layer")
        ax.set_xlabel("head, then the whole layer")
        whole = len(columns) - (2 if values is data.bound else 1)
        ax.axvline(whole - 0.5, color="white", lw=3, zorder=2)
        for (r, c), v in np.ndenumerate(values):
            if c >= whole:
                text = "inf" if math.isinf(v) else "-" if math.isnan(v) else f"{v:.2g}"
                red, green, blue, _ = cmap(norm(np.clip(v, lo, hi))) if v > 0 else (1, 1, 1, 1)
                dark = 0.3 * red + 0.6 * green + 0.1 * blue < 0.5
                ax.text(c, r, text, ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")  # fmt: skip
            if data.relative and v > 1:  # above the tolerance: outlined, whatever its shade
                ax.add_patch(
                    Rectangle(
                        (c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.5, zorder=4,
                        clip_on=False,
                    )
                )  # fmt: skip
    assert image is not None
    bar = fig.colorbar(image, ax=axes, extend="both", shrink=0.9)
    bar.set_label("figure / tolerance (outlined: above 1)" if data.relative else "absolute")
    layer = ", ".join(c.removeprefix("layer ") for c in data.bound_columns[-2:])
    fig.suptitle(f"{data.preset}: heads' attention (A.1) and whole layers ({layer})", fontsize=11)
    return fig


def heatmap_png(data: HeatmapData) -> bytes:
    """The heatmap as PNG bytes (no software or date metadata: same data, same bytes)."""
    buf = io.BytesIO()
    heatmap_figure(data).savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


def heatmap_svg(data: HeatmapData) -> str:
    """The heatmap as SVG text (no date, fixed element ids: same data, same text)."""
    import matplotlib as mpl

    buf = io.StringIO()
    with mpl.rc_context({"svg.hashsalt": "mhanum-audit", "svg.fonttype": "none"}):
        heatmap_figure(data).savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()
