"""Pictures of stored adapters (matplotlib, written to files; no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from zoo.domain.palette import CATEGORIES, OTHER  # noqa: E402

if TYPE_CHECKING:
    from embed.serving.maps import LabelLegend, MapPoint, MapResource, MetricLegend
    from zoo.store.repository import ModuleDetail


def plot_spectra(name: str, modules: Sequence[ModuleDetail], path: Path) -> Path:
    """Singular values of every module (log scale), coloured by layer, one panel per module type."""
    types = sorted({m["module_type"] for m in modules})
    cols = min(3, len(types))
    rows = (len(types) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 1, 3.2 * rows), squeeze=False, layout="constrained")
    layers = [m["layer_index"] for m in modules if m["layer_index"] is not None]
    top = max(layers, default=0) or 1
    cmap = plt.get_cmap("viridis")
    for ax, mtype in zip(axes.flat, types, strict=False):
        for m in modules:
            if m["module_type"] != mtype or not m["singular_values"]:
                continue
            sv = list(m["singular_values"])
            layer = m["layer_index"]
            color = cmap(layer / top) if layer is not None else "black"
            ax.semilogy(range(1, len(sv) + 1), sv, marker=".", color=color, alpha=0.8, label=f"layer {layer}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(mtype)
        ax.set_xlabel("component")
        ax.set_ylabel("singular value")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(types) :]:
        ax.axis("off")
    if layers:
        sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, top))
        fig.colorbar(sm, ax=axes, label="layer", shrink=0.8)
    fig.suptitle(f"spectra of {name}")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def map_figure(zoo_map: MapResource) -> Figure:
    """The zoo map's points (embed/serving/maps.py `space_map`) in the legend's colours (zoo/domain/palette.py, as on the web
    page): one per label value, the less common ones past the palette in one "other" grey, a metric on a colour bar
    marked with its min and max; points without a value in light grey, beneath. Legends sit outside the axes, so
    they hide no point."""
    points, legend, color_by = zoo_map["points"], zoo_map["legend"], zoo_map["color_by"] or ""
    fig, ax = plt.subplots(figsize=(9.5 if legend else 7.5, 6), layout="constrained")
    if legend is None:
        ax.scatter([p["x"] for p in points], [p["y"] for p in points], s=8, color=CATEGORIES[0])
    elif legend["kind"] == "metric":
        _metric_points(fig, ax, points, legend, color_by)
    else:
        _label_points(fig, ax, points, legend, color_by)
    first, second = zoo_map["explained"]
    ax.set_xlabel(f"PC1 ({first:.0%} of the variance)")
    ax.set_ylabel(f"PC2 ({second:.0%})")
    ax.set_title(f"{zoo_map['space']}: {zoo_map['shown']} of {zoo_map['count']} adapters, {zoo_map['method']} embedding")
    ax.grid(True, alpha=0.3)
    return fig


def plot_map(zoo_map: MapResource, path: Path) -> Path:
    """`map_figure`, written to a PNG file."""
    fig = map_figure(zoo_map)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _scatter(ax: Axes, points: Sequence[MapPoint], colour: str, label: str, size: float = 10) -> None:
    if points:
        ax.scatter([p["x"] for p in points], [p["y"] for p in points], s=size, color=colour, label=label)


def _label_points(fig: Figure, ax: Axes, points: Sequence[MapPoint], legend: LabelLegend, color_by: str) -> None:
    """A colour per label value (the legend's), then "other" and "no value"; the legend right of the axes."""
    _scatter(ax, [p for p in points if p["value"] is None], legend["missing_colour"], f"no value ({legend['missing']})", 8)
    own = {v["value"]: v for v in legend["values"] if v["colour"] != OTHER}
    for value, v in own.items():
        _scatter(ax, [p for p in points if p["value"] == value], v["colour"], f"{value} ({v['count']})")
    rest = [p for p in points if p["value"] is not None and p["value"] not in own]
    _scatter(ax, rest, OTHER, f"other: {len(legend['values']) - len(own)} values ({len(rest)})", 8)
    handles, labels = ax.get_legend_handles_labels()
    if legend["missing"]:  # drawn first, beneath the others; listed last
        handles, labels = handles[1:] + handles[:1], labels[1:] + labels[:1]
    ncols = 1 if len(labels) <= 20 else 2
    fig.legend(handles, labels, loc="outside right upper", title=color_by, fontsize="small", markerscale=1.5, ncols=ncols)


def _metric_points(fig: Figure, ax: Axes, points: Sequence[MapPoint], legend: MetricLegend, color_by: str) -> None:
    """The points on the sequential scale (high reads high: light yellow), a colour bar with ticks at the min, the max
    and between; "no value" in a legend below the axes."""
    _scatter(ax, [p for p in points if p["value"] is None], legend["missing_colour"], f"no value ({legend['missing']})", 8)
    have = [(p, float(v)) for p in points if (v := p["value"]) is not None]  # a metric's values are numbers
    low, high = legend["min"], legend["max"]
    if have and low is not None and high is not None:
        cmap = LinearSegmentedColormap.from_list("zoo-sequential", legend["colours"])
        xs, ys, values = [p["x"] for p, _ in have], [p["y"] for p, _ in have], [v for _, v in have]
        dots = ax.scatter(xs, ys, c=values, s=10, cmap=cmap, vmin=low, vmax=high)
        bar = fig.colorbar(dots, ax=ax, label=color_by)
        if high > low:
            ticks = [low + (high - low) * i / 4 for i in range(5)]
            bar.set_ticks(ticks, labels=[f"min {low:.3g}", *(f"{t:.3g}" for t in ticks[1:-1]), f"max {high:.3g}"])
        else:
            bar.set_ticks([low], labels=[f"min = max {low:.3g}"])
    if legend["missing"]:
        fig.legend(loc="outside lower center", fontsize="small", markerscale=1.5)
