"""Pictures of stored adapters (matplotlib, written to files; no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

if TYPE_CHECKING:
    from embed.maps import MapResource
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


#: label values drawn in a colour of their own; the rest are grey
MAP_CATEGORIES = 20


def plot_map(zoo_map: MapResource, path: Path) -> Path:
    """The zoo map's points (embed/maps.py `space_map`): one colour per label value (the most common
    ones), a colour scale for a metric, grey where a point has no value."""
    points = zoo_map["points"]
    legend = zoo_map["legend"]
    fig, ax = plt.subplots(figsize=(7.5, 6), layout="constrained")
    bare = [p for p in points if p["value"] is None] if legend else points
    if bare:
        ax.scatter([p["x"] for p in bare], [p["y"] for p in bare], s=8, color="lightgrey" if legend else "tab:blue", label="no value")
    if legend and legend["kind"] == "metric":
        have = [(p, float(v)) for p in points if (v := p["value"]) is not None]  # a metric's values are numbers
        dots = ax.scatter([p["x"] for p, _ in have], [p["y"] for p, _ in have], c=[v for _, v in have], s=10, cmap="viridis")
        fig.colorbar(dots, ax=ax, label=zoo_map["color_by"])
    elif legend:
        top = [v["value"] for v in legend["values"][:MAP_CATEGORIES]]
        cmap = plt.get_cmap("tab20")  # 20 distinct colours: the demo zoo has 17 tasks
        for i, value in enumerate(top):
            group = [p for p in points if p["value"] == value]
            ax.scatter([p["x"] for p in group], [p["y"] for p in group], s=10, color=cmap(i), label=str(value))
        rest = [p for p in points if p["value"] is not None and p["value"] not in top]
        if rest:
            ax.scatter([p["x"] for p in rest], [p["y"] for p in rest], s=8, color="dimgrey", label="other")
        ax.legend(title=zoo_map["color_by"], fontsize="small", markerscale=1.5)
    first, second = zoo_map["explained"]
    ax.set_xlabel(f"PC1 ({first:.0%} of the variance)")
    ax.set_ylabel(f"PC2 ({second:.0%})")
    ax.set_title(f"{zoo_map['space']}: {zoo_map['shown']} of {zoo_map['count']} adapters, {zoo_map['method']} embedding")
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
