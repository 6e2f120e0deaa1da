"""The clusters of a fit as the report counts them: one row each, the tiny ones, and K."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from deepdpm_core.model import tiny_cluster_rows, tiny_clusters


@dataclass
class ClusterRow:
    """One line of the cluster table."""

    cluster: int
    size: int
    confidence: float | None
    majority_label: int | None
    purity: float | None


def cluster_rows(assignments: pa.Table) -> list[ClusterRow]:
    """Per-cluster size, mean confidence and majority label/purity, largest first."""
    cluster = assignments.column("cluster").to_numpy().astype(np.int64)
    conf = (
        assignments.column("confidence").to_numpy().astype(np.float64)
        if "confidence" in assignments.column_names
        else None
    )
    labels = None
    if "label" in assignments.column_names:
        col = assignments.column("label")
        if col.null_count < len(col):
            labels = np.asarray(col.fill_null(-1).to_numpy(), dtype=np.int64)
    ids, counts = np.unique(cluster, return_counts=True)
    rows = []
    for k, n in zip(ids, counts, strict=True):
        members = cluster == k
        majority = purity = None
        if labels is not None:
            known = labels[members & (labels >= 0)]
            if len(known):
                values, freq = np.unique(known, return_counts=True)
                majority = int(values[freq.argmax()])
                purity = float(freq.max() / len(known))
        rows.append(
            ClusterRow(
                int(k), int(n), float(conf[members].mean()) if conf is not None else None,
                majority, purity,
            )
        )  # fmt: skip
    rows.sort(key=lambda r: (-r.size, r.cluster))
    return rows


def tiny_of(summary: dict[str, Any], rows: list[ClusterRow]) -> tuple[list[int], int]:
    """The tiny clusters and the size below which a cluster is tiny: from ``summary.json``,
    or (summaries written before they were) from the assignments' cluster sizes."""
    if "tiny_clusters" in summary:
        return list(summary["tiny_clusters"]), int(summary.get("tiny_cluster_rows") or 0)
    sizes = np.zeros(max((r.cluster for r in rows), default=-1) + 1, dtype=np.int64)
    for r in rows:
        sizes[r.cluster] = r.size
    threshold = tiny_cluster_rows(int(sizes.sum()), int((sizes > 0).sum()))
    return tiny_clusters(sizes, threshold), threshold


@dataclass
class KCount:
    """K and its parts, the one count the header, the overview and the tables give.

    Attributes
    ----------
    k : int
        Clusters of the fit (``summary.json``'s ``n_clusters``; the assignments' clusters
        when it is missing).
    clusters, tiny, empty : int
        Of them: the clusters that are not tiny, the tiny ones, and those that own no row
        of the assignments (k = clusters + tiny + empty).
    """

    k: int
    clusters: int
    tiny: int
    empty: int

    @classmethod
    def of(cls, summary: dict[str, Any], rows: list[ClusterRow], tiny: list[int]) -> KCount:
        owned = {r.cluster for r in rows}
        n_tiny = len(owned & set(tiny)) if rows else len(tiny)
        k = int(summary.get("n_clusters") or len(owned))
        clusters = len(owned) - n_tiny if rows else k - n_tiny
        return cls(k, clusters, n_tiny, max(k - clusters - n_tiny, 0))

    def parts(self) -> str:
        """``3 clusters + 2 tiny`` (empty when every cluster is a plain one)."""
        if not (self.tiny or self.empty):
            return ""
        out = [f"{self.clusters} cluster{'s' * (self.clusters != 1)}"]
        out += [f"{self.tiny} tiny"] if self.tiny else []
        out += [f"{self.empty} owning no row"] if self.empty else []
        return " + ".join(out)
