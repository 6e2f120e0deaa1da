"""The whole method on data it did not make: generated mixtures with known K, and digits.

Observed on the 2-core CI machine (seed 0), noted per case in ``CASES``.
"""

import numpy as np
import pytest
from sklearn.datasets import load_digits

from deepdpm_core import DeepDPM
from deepdpm_core.datasets import make_mixture
from deepdpm_core.embedding import umap_embed
from deepdpm_core.metrics import clustering_scores

# (n, D, true K, Dirichlet imbalance or None, initial K)
CASES = [
    (3000, 2, 5, None, 1),
    (4000, 8, 8, 1.0, 3),
    (4000, 8, 6, None, 30),
    (5000, 32, 6, 2.0, 3),
    (3000, 16, 4, 1.0, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("n", "d", "k", "imbalance", "init_k"), CASES)
def test_recovers_known_k(n, d, k, imbalance, init_k):
    X, y = make_mixture(n, d, k, imbalance=imbalance, min_weight=0.03, random_state=d + k)
    model = DeepDPM(random_state=0, init__n_clusters=init_k).fit(X)
    scores = clustering_scores(y, model.labels_)
    assert abs(model.n_clusters_ - k) <= 1, (model.n_clusters_, k, scores)
    assert scores["nmi"] >= 0.9, scores


@pytest.mark.slow
def test_digits_sensible_k():
    """Paper setting for classical comparisons: UMAP features (n2d), default prior."""
    X, y = load_digits(return_X_y=True)
    Z = umap_embed(X.astype(np.float32), 10, n_neighbors=20, min_dist=0.0, metric="euclidean", seed=0)
    model = DeepDPM(random_state=0).fit(Z)
    scores = clustering_scores(y, model.labels_)
    assert 8 <= model.n_clusters_ <= 13, (model.n_clusters_, scores)
    assert scores["nmi"] >= 0.8, scores
