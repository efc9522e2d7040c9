"""Pictures of stored adapters (matplotlib, written to files; no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def plot_spectra(name: str, modules: Sequence[Mapping[str, object]], path: Path) -> Path:
    """Singular values of every module (log scale), coloured by layer, one panel per module type."""
    types = sorted({str(m["module_type"]) for m in modules})
    cols = min(3, len(types))
    rows = (len(types) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 1, 3.2 * rows), squeeze=False, layout="constrained")
    layers = [int(m["layer_index"]) for m in modules if m["layer_index"] is not None]  # type: ignore[call-overload]
    top = max(layers, default=0) or 1
    cmap = plt.get_cmap("viridis")
    for ax, mtype in zip(axes.flat, types, strict=False):
        for m in modules:
            if m["module_type"] != mtype or not m["singular_values"]:
                continue
            sv = list(m["singular_values"])  # type: ignore[call-overload]
            layer = m["layer_index"]
            color = cmap(int(layer) / top) if layer is not None else "black"  # type: ignore[call-overload]
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
