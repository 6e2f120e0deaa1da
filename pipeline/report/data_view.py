"""The report's view of the data: the fit's rows read again from its input, projected to 2-D
in the fit's own coordinates and coloured by cluster, and a few rows of each cluster (as
numbers, or as small images when the rows are pixels).

The rows are read with the loader the fit used (:func:`pipeline.io.tables.read_features`,
the feature columns named in ``summary.json``); a report whose input is gone, or holds other
rows than the assignments, goes without them. The projection is of the coordinates the fit
clustered (:func:`fit_view`: its ``data.transform``, rebuilt from the same rows and config),
not of the raw units, where one large-unit feature is all a PCA sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from PIL import Image  # noqa: E402

from deepdpm_core.config import FIXED_KEYS, DataConfig  # noqa: E402
from deepdpm_core.data import fit_coordinates, readonly_tensor  # noqa: E402
from deepdpm_core.errors import DeepDPMError  # noqa: E402
from deepdpm_core.runtime import LocalCommunicator  # noqa: E402
from pipeline.io.columns import summary_columns  # noqa: E402
from pipeline.io.tables import read_features  # noqa: E402
from pipeline.report import plots  # noqa: E402

#: rows drawn in the projection (a random subset of larger inputs)
PROJECTED_ROWS = 5000
#: feature columns shown in a sample row (the first ones)
SHOWN_COLUMNS = 8
#: clusters named in the projection's legend (the largest ones)
LEGEND_CLUSTERS = 40
#: what each ``data.transform`` makes of the features, as the projection names it
TRANSFORM_NAMES = {
    "none": "the features as given",
    "standard": "standardised features",
    "normalize": "rows scaled to unit length",
    "min_max": "features scaled to [0, 1]",
}
#: point markers, cycled beside the colours: a second cue where two colours look alike
MARKERS = ("o", "s", "^", "D", "v", "P")


def _lab(rgb: np.ndarray) -> np.ndarray:
    """CIELAB (D65) of sRGB colours in [0, 1], (n, 3) -> (n, 3)."""
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = linear @ np.array([[0.4124, 0.2126, 0.0193], [0.3576, 0.7152, 0.1192],
                             [0.1805, 0.0722, 0.9505]]) / np.array([0.9505, 1.0, 1.089])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], 1)


def _distinct_colours(n: int = LEGEND_CLUSTERS) -> list[str]:
    """``n`` colours: matplotlib's ten but its grey, then colours picked one by one, each
    the farthest (in CIELAB) from those already picked (as Glasbey's palettes are made),
    among sRGB colours neither pale nor dark (lightness 30 to 70: every one shows on white
    and none looks like the black crosses of tiny clusters) nor grey (chroma above 30)."""
    seeds = np.array([rgb for rgb in plt.get_cmap("tab10").colors if len(set(rgb)) > 1])
    steps = np.linspace(0.0, 1.0, 16)
    rgb = np.stack(np.meshgrid(steps, steps, steps, indexing="ij"), -1).reshape(-1, 3)
    lab = _lab(rgb)
    keep = (lab[:, 0] >= 30) & (lab[:, 0] <= 70) & (np.hypot(lab[:, 1], lab[:, 2]) > 30)
    rgb, lab = rgb[keep], lab[keep]
    picked = list(seeds[:n])
    nearest = np.linalg.norm(lab[:, None] - _lab(seeds)[None], axis=-1).min(1)
    while len(picked) < n:
        best = int(nearest.argmax())
        picked.append(rgb[best])
        nearest = np.minimum(nearest, np.linalg.norm(lab - lab[best], axis=1))
    return [to_hex(c) for c in picked]


#: the clusters' colours, largest cluster first
PALETTE = _distinct_colours()


def cluster_styles(order: list[int]) -> dict[int, tuple[str, str]]:
    """Colour (hex) and marker of each cluster id in ``order`` (largest first): the
    projection's, and the report table's swatches."""
    return {int(k): (PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)])
            for i, k in enumerate(order)}


def fit_rows(summary: dict[str, Any], assignments: pa.Table | None) -> tuple[np.ndarray, list[str]] | None:
    """The rows the fit clustered, float32 (N, D), and the names of their columns, read from
    its input; None when the input is gone, unreadable, or holds other rows than the
    assignments (by count and keys)."""
    path = summary.get("input")
    if not path or assignments is None or not Path(path).exists():
        return None
    try:
        table = read_features(path, summary_columns(summary))
    except (DeepDPMError, OSError, ValueError):
        return None
    X = table.X.reshape(len(table.X), -1) if table.X.ndim > 2 else table.X
    if X.ndim != 2 or len(X) != assignments.num_rows:
        return None
    keys = assignments.column("key").to_pylist()
    if [str(k) for k in table.keys[:100]] != [str(k) for k in keys[:100]]:
        return None
    names = table.feature_names or [f"x{j}" for j in range(X.shape[1])]
    return np.asarray(X, dtype=np.float32), list(names)


def fit_view(X: np.ndarray, config: dict[str, Any] | None) -> tuple[np.ndarray, str]:
    """The rows in the fit's coordinates x̃ (its ``data.transform``, centred, one scale;
    :func:`deepdpm_core.data.fit_coordinates` on the same rows and ``data`` config), and
    what the transform made of the features; the rows as given when ``config`` has no
    usable ``data`` section (a summary of another version)."""
    try:
        stored = dict((config or {}).get("data") or {})
        data = DataConfig(**{k: v for k, v in stored.items() if f"data.{k}" not in FIXED_KEYS})
    except (TypeError, ValueError):  # pydantic's ValidationError is a ValueError
        return X, "the features as given (the fit's transform is unknown)"
    x = readonly_tensor(X)  # read-only rows (a memory map, Arrow) are only read here
    coords, _, _ = fit_coordinates(x, data, LocalCommunicator(), torch.device("cpu"))
    return coords.apply(x).numpy(), TRANSFORM_NAMES.get(coords.kind, coords.kind)


def pca_2d(X: np.ndarray, max_rows: int = PROJECTED_ROWS, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows on their first two principal axes (each feature centred; a subset of at
    most ``max_rows`` rows).

    Returns
    -------
    xy : ndarray of shape (n, 2)
    rows : ndarray of shape (n,)
        Which rows of X they are.
    explained : ndarray of shape (2,)
        Share of the variance along each axis.
    """
    rows = np.arange(len(X))
    if len(X) > max_rows:
        rows = np.sort(np.random.default_rng(seed).choice(len(X), max_rows, replace=False))
    Z = X[rows].astype(np.float64)
    Z -= Z.mean(0)
    _, s, vt = np.linalg.svd(Z, full_matrices=False)
    axes = vt[:2] if vt.shape[0] >= 2 else np.vstack([vt, np.zeros_like(vt)])
    xy = Z @ axes.T
    total = float((s**2).sum()) or 1.0
    explained = np.array([(s[i] ** 2) / total if i < len(s) else 0.0 for i in range(2)])
    return xy, rows, explained


def plot_projection(xy: np.ndarray, clusters: np.ndarray, tiny: set[int], explained: np.ndarray,
                    path: str | Path, styles: dict[int, tuple[str, str]] | None = None,
                    space: str = "the features as given") -> Path:
    """Scatter of 2-D points, each cluster in its colour and marker (``styles``, by default
    :func:`cluster_styles` of the clusters largest first), the rows of tiny clusters as
    black crosses; the legend, beside the axes, names the :data:`LEGEND_CLUSTERS` largest
    clusters. ``space`` says what was projected."""
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    ids, counts = np.unique(clusters, return_counts=True)
    order = [int(k) for k in ids[np.argsort(-counts, kind="stable")] if int(k) not in tiny]
    styles = styles or cluster_styles(order)
    size = 8 if len(xy) > 2000 else 16
    for i, k in enumerate(order):
        at = clusters == k
        colour, marker = styles[k]
        ax.scatter(xy[at, 0], xy[at, 1], s=size, color=colour, marker=marker, alpha=0.75,
                   linewidths=0, label=f"cluster {k}" if i < LEGEND_CLUSTERS else None)
    small = np.isin(clusters, list(tiny))
    if small.any():
        ax.scatter(xy[small, 0], xy[small, 1], s=30, color="black", marker="x",
                   label="tiny clusters")
    ax.set_xlabel(f"PC 1 ({explained[0]:.0%} of the variance)")
    ax.set_ylabel(f"PC 2 ({explained[1]:.0%} of the variance)")
    named = "" if len(order) <= LEGEND_CLUSTERS else f"; the {LEGEND_CLUSTERS} largest named"
    ax.set_title(f"{len(xy)} rows on their first two principal axes\n(of {space}){named}")
    entries = min(len(order), LEGEND_CLUSTERS) + int(small.any())
    ax.legend(fontsize="x-small", markerscale=1.5, loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0.0, frameon=False, ncol=1 if entries <= 16 else 2)
    ax.grid(alpha=0.2)
    return plots.save_figure(fig, path)


def row_image(rows: np.ndarray, shape: tuple[int, int], size: int = 64) -> bytes:
    """Rows of pixels (n, H·W) drawn side by side as one grey PNG strip (dark: high), each
    row scaled to its own range and enlarged to about ``size`` pixels."""
    import io

    h, w = shape
    scale = max(1, size // max(h, w))
    tiles = []
    for row in rows:
        img = row.reshape(h, w).astype(np.float64)
        lo, hi = img.min(), img.max()
        img = (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img)
        tile = Image.fromarray((255 * (1 - img)).astype(np.uint8)).resize(
            (w * scale, h * scale), Image.NEAREST)
        tiles.append(tile)
    strip = Image.new("L", (len(tiles) * (w * scale + 4), h * scale), 255)
    for i, tile in enumerate(tiles):
        strip.paste(tile, (i * (w * scale + 4), 0))
    buf = io.BytesIO()
    strip.save(buf, format="PNG")
    return buf.getvalue()


__all__ = ["LEGEND_CLUSTERS", "MARKERS", "PALETTE", "PROJECTED_ROWS", "SHOWN_COLUMNS", "TRANSFORM_NAMES",
           "cluster_styles", "fit_rows", "fit_view", "pca_2d", "plot_projection", "row_image"]
