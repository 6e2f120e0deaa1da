"""The report's view of the data: the fit's rows read again from its input, projected to 2-D
and coloured by cluster, and a few rows of each cluster (as numbers, or as small images
when the rows are pixels).

The rows are read with the loader the fit used (:func:`pipeline.io.tables.read_features`,
the feature columns named in ``summary.json``); a report whose input is gone, or holds other
rows than the assignments, goes without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from PIL import Image  # noqa: E402

from deepdpm_core.atomic_files import atomic_path  # noqa: E402
from deepdpm_core.errors import DeepDPMError  # noqa: E402
from pipeline.io.columns import summary_columns  # noqa: E402
from pipeline.io.tables import read_features  # noqa: E402

#: rows drawn in the projection (a random subset of larger inputs)
PROJECTED_ROWS = 5000
#: feature columns shown in a sample row (the first ones)
SHOWN_COLUMNS = 8


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
                    path: str | Path) -> Path:
    """Scatter of 2-D points coloured by cluster (20 colours, cycled), the rows of tiny
    clusters as black crosses; the largest clusters named in the legend."""
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    ids, counts = np.unique(clusters, return_counts=True)
    order = ids[np.argsort(-counts, kind="stable")]
    colours = plt.get_cmap("tab20").colors
    size = 6 if len(xy) > 2000 else 12
    for i, k in enumerate(order):
        at = clusters == k
        if int(k) in tiny:
            continue
        ax.scatter(xy[at, 0], xy[at, 1], s=size, color=colours[i % 20], alpha=0.7, linewidths=0,
                   label=f"cluster {k}" if i < 12 else None)
    small = np.isin(clusters, list(tiny))
    if small.any():
        ax.scatter(xy[small, 0], xy[small, 1], s=30, color="black", marker="x",
                   label="tiny clusters")
    ax.set_xlabel(f"PC 1 ({explained[0]:.0%} of the variance)")
    ax.set_ylabel(f"PC 2 ({explained[1]:.0%} of the variance)")
    ax.set_title(f"The rows in 2-D (PCA), coloured by cluster ({len(xy)} rows)")
    ax.legend(fontsize="x-small", markerscale=2, loc="best", ncol=2)
    ax.grid(alpha=0.2)
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


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


__all__ = ["PROJECTED_ROWS", "SHOWN_COLUMNS", "fit_rows", "pca_2d", "plot_projection",
           "row_image"]
