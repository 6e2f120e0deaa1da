"""Clustering metrics (paper Supmat "Evaluation Metrics"): NMI, ARI and ACC.

All three accept different numbers of clusters and classes and are computed from the
contingency table, so they cost O(N + K·C).
"""

from __future__ import annotations

import numpy as np


def contingency(labels_true: np.ndarray, labels_pred: np.ndarray) -> np.ndarray:
    """Counts c[a, b] of points with true class a and cluster b, shape (C, K), float64."""
    labels_true = np.asarray(labels_true)
    labels_pred = np.asarray(labels_pred)
    if labels_true.shape != labels_pred.shape or labels_true.ndim != 1:
        raise ValueError("labels_true and labels_pred must be 1-D arrays of the same length")
    _, t = np.unique(labels_true, return_inverse=True)
    _, p = np.unique(labels_pred, return_inverse=True)
    table = np.zeros((t.max(initial=-1) + 1, p.max(initial=-1) + 1), dtype=np.float64)
    np.add.at(table, (t, p), 1.0)
    return table


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def nmi(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Normalised mutual information, arithmetic-mean normalisation (scikit-learn's default)."""
    return _nmi(contingency(labels_true, labels_pred))


def ari(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Adjusted Rand index (Hubert & Arabie)."""
    return _ari(contingency(labels_true, labels_pred))


def acc(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Unsupervised accuracy: best one-to-one cluster→class map (Hungarian algorithm)."""
    return _acc(contingency(labels_true, labels_pred))


def clustering_scores(labels_true: np.ndarray, labels_pred: np.ndarray) -> dict[str, float]:
    """``{"nmi": …, "ari": …, "acc": …}``."""
    return contingency_scores(contingency(labels_true, labels_pred))


def contingency_scores(c: np.ndarray) -> dict[str, float]:
    """``{"nmi": …, "ari": …, "acc": …}`` of a contingency table c (C, K), float64 counts
    (:func:`contingency`, :meth:`ContingencyCounts.table`)."""
    return {"nmi": _nmi(c), "ari": _ari(c), "acc": _acc(c)}


class ContingencyCounts:
    """The contingency table of (class, cluster) pairs, counted batch by batch: the scores of
    N rows from memory that grows with the distinct pairs, not with N.

    ``table()`` after ``add`` of every batch equals :func:`contingency` of the
    concatenated labels (rows and columns in increasing label order), so the scores are
    the same to the last bit.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], int] = {}

    def add(self, labels_true: np.ndarray, labels_pred: np.ndarray) -> None:
        """Count a batch of pairs; both of shape (B,), integers."""
        labels_true, labels_pred = np.asarray(labels_true), np.asarray(labels_pred)
        if labels_true.shape != labels_pred.shape or labels_true.ndim != 1:
            raise ValueError("labels_true and labels_pred must be 1-D arrays of the same length")
        pairs, counts = np.unique(np.stack([labels_true, labels_pred]), axis=1, return_counts=True)
        for (t, p), n in zip(pairs.T.tolist(), counts.tolist(), strict=True):
            self._counts[t, p] = self._counts.get((t, p), 0) + n

    def table(self) -> np.ndarray:
        """Counts c[a, b] of pairs with the a-th smallest class and the b-th smallest
        cluster, shape (C, K), float64."""
        classes = sorted({t for t, _ in self._counts})
        clusters = sorted({p for _, p in self._counts})
        row = {t: i for i, t in enumerate(classes)}
        col = {p: j for j, p in enumerate(clusters)}
        table = np.zeros((len(classes), len(clusters)), dtype=np.float64)
        for (t, p), n in self._counts.items():
            table[row[t], col[p]] = n
        return table


def _nmi(c: np.ndarray) -> float:
    n = c.sum()
    if n == 0:
        return 1.0
    h_t, h_p = _entropy(c.sum(1)), _entropy(c.sum(0))
    if h_t == 0 and h_p == 0:
        return 1.0
    nz = c > 0
    outer = np.outer(c.sum(1), c.sum(0))
    mi = float((c[nz] / n * (np.log(c[nz] * n) - np.log(outer[nz]))).sum())
    denom = 0.5 * (h_t + h_p)
    return max(0.0, mi / denom) if denom > 0 else 0.0


def _ari(c: np.ndarray) -> float:
    # imported here: scipy.optimize and scipy.special take a second to import, which a
    # predict pays before it answers
    from scipy.special import comb

    n = c.sum()
    sum_cells = comb(c, 2).sum()
    sum_a = comb(c.sum(1), 2).sum()
    sum_b = comb(c.sum(0), 2).sum()
    expected = sum_a * sum_b / comb(n, 2) if n > 1 else 0.0
    max_index = 0.5 * (sum_a + sum_b)
    if max_index == expected:
        return 1.0
    return float((sum_cells - expected) / (max_index - expected))


def _acc(c: np.ndarray) -> float:
    if c.size == 0:
        return 1.0
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(-c)
    return float(c[rows, cols].sum() / c.sum())
