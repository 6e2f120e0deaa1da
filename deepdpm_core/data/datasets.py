"""Generated Gaussian mixtures with known K (tests, benchmarks, demos).

Like scikit-learn's ``make_blobs`` but with full, elongated covariances and Dirichlet
(imbalanced) weights, so the truth is a mixture DeepDPM can be checked against.
"""

from __future__ import annotations

import numpy as np


def make_mixture(
    n_samples: int,
    n_features: int,
    n_clusters: int,
    *,
    imbalance: float | None = None,
    separation: float = 6.0,
    elongation: float = 4.0,
    min_weight: float = 0.0,
    random_state: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample a Gaussian mixture with random full covariances.

    Parameters
    ----------
    imbalance : float, optional
        Concentration of the Dirichlet the weights are drawn from (1.0: uniform over the
        simplex, as the paper's imbalanced ImageNet-50); None gives equal weights.
    separation : float
        Standard deviation of the cluster centres, in units of the clusters' mean scale.
    elongation : float
        Ratio of the largest to the smallest axis of each cluster.
    min_weight : float
        Floor on each weight (before renormalising), so no cluster is vanishingly small.

    Returns
    -------
    X : ndarray of shape (n_samples, n_features), float32
    y : ndarray of shape (n_samples,), int64
    """
    rng = np.random.default_rng(random_state)
    if imbalance is None:
        weights = np.full(n_clusters, 1.0 / n_clusters)
    else:
        weights = rng.dirichlet(np.full(n_clusters, imbalance))
    weights = np.maximum(weights, min_weight)
    weights /= weights.sum()
    y = rng.choice(n_clusters, size=n_samples, p=weights)
    centers = rng.normal(0.0, separation, size=(n_clusters, n_features))
    # random rotation x axis lengths in [1, elongation] (geometric spacing, shuffled)
    factors = np.empty((n_clusters, n_features, n_features))
    for k in range(n_clusters):
        q, _ = np.linalg.qr(rng.normal(size=(n_features, n_features)))
        axes = np.geomspace(1.0, elongation, n_features) * rng.uniform(0.5, 1.0)
        factors[k] = q * (axes / np.sqrt(elongation))[None, :]
    noise = rng.normal(size=(n_samples, n_features))
    X = np.empty((n_samples, n_features), dtype=np.float32)
    step = max(1, (1 << 22) // (n_features * n_features))  # bounds the (rows, D, D) gather
    for s in range(0, n_samples, step):
        ys = y[s : s + step]
        X[s : s + step] = centers[ys] + np.einsum("nde,ne->nd", factors[ys], noise[s : s + step])
    return X, y.astype(np.int64)
