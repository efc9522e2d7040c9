"""The colours the zoo map is drawn in, on the web page and in `zoo map --plot`: one place for both.

`CATEGORIES`: a label's values, most common first. A glasbey-like list: each colour was picked greedily as the one
farthest (CIELAB distance) from those before it, from the background (white), the greys below and black (the
highlighted adapter), over moderately light, saturated sRGB colours; so any first n of them stay apart, the first
ones most.

`SEQUENTIAL`: a metric, low to high: viridis (dark blue to bright yellow, lightness rising with the value), as stops
to interpolate between.
"""

from __future__ import annotations

from collections.abc import Sequence

CATEGORIES: tuple[str, ...] = (
    "#1d77b6", "#14da14", "#e314e3", "#e31414", "#e3b614", "#14daa4", "#ad1d65", "#144ada",
    "#537714", "#925314", "#c889e3", "#d1bf80", "#e38989", "#9bc81d", "#14d1e3", "#148065",
    "#891d9b", "#7714e3", "#6e4a80", "#1dad41", "#ad262f", "#e36e14", "#e314a4", "#5377e3",
)  # fmt: skip
#: a point whose value is one of the less common ones, past the palette
OTHER = "#6b7280"
#: a point without a value
MISSING = "#c3c9d1"
#: viridis at 0, 0.1, ..., 1
SEQUENTIAL: tuple[str, ...] = (
    "#440154", "#482475", "#414487", "#355f8d", "#2a788e", "#21918c", "#22a884", "#44bf70", "#7ad151", "#bddf26", "#fde725",
)  # fmt: skip


def category_colours(n: int) -> list[str]:
    """The colours of n label values, most common first: the palette's, then `OTHER` for the rest."""
    return [CATEGORIES[i] if i < len(CATEGORIES) else OTHER for i in range(n)]


def rgb(colour: str) -> tuple[int, int, int]:
    """ "#rrggbb" as (r, g, b), 0..255."""
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def cielab(colour: str) -> tuple[float, float, float]:
    """ "#rrggbb" (sRGB, D65) in CIELAB: (L, a, b)."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in rgb(colour))]
    r, g, b = linear
    xyz = (
        (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
        0.2126 * r + 0.7152 * g + 0.0722 * b,
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883,
    )
    fx, fy, fz = (t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def distance(first: str, second: str) -> float:
    """How far apart two colours look: the CIELAB distance (ΔE*76; about 2.3 is just noticeable)."""
    return sum((p - q) ** 2 for p, q in zip(cielab(first), cielab(second), strict=True)) ** 0.5


def closest_pair(colours: Sequence[str]) -> float:
    """The smallest `distance` between two of the colours (inf for fewer than two)."""
    return min((distance(c, d) for i, c in enumerate(colours) for d in colours[i + 1 :]), default=float("inf"))
