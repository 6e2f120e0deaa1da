"""Clustering metrics (paper Supmat "Evaluation Metrics"): NMI, ARI and ACC.

All three accept different numbers of clusters and classes and are computed from the
contingency table, so they cost O(N + K·C).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.special import comb


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
    c = contingency(labels_true, labels_pred)
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


def ari(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Adjusted Rand index (Hubert & Arabie)."""
    c = contingency(labels_true, labels_pred)
    n = c.sum()
    sum_cells = comb(c, 2).sum()
    sum_a = comb(c.sum(1), 2).sum()
    sum_b = comb(c.sum(0), 2).sum()
    expected = sum_a * sum_b / comb(n, 2) if n > 1 else 0.0
    max_index = 0.5 * (sum_a + sum_b)
    if max_index == expected:
        return 1.0
    return float((sum_cells - expected) / (max_index - expected))


def acc(labels_true: np.ndarray, labels_pred: np.ndarray) -> float:
    """Unsupervised accuracy: best one-to-one cluster→class map (Hungarian algorithm)."""
    c = contingency(labels_true, labels_pred)
    if c.size == 0:
        return 1.0
    rows, cols = linear_sum_assignment(-c)
    return float(c[rows, cols].sum() / c.sum())


def clustering_scores(labels_true: np.ndarray, labels_pred: np.ndarray) -> dict[str, float]:
    """``{"nmi": …, "ari": …, "acc": …}``."""
    return {
        "nmi": nmi(labels_true, labels_pred),
        "ari": ari(labels_true, labels_pred),
        "acc": acc(labels_true, labels_pred),
    }
