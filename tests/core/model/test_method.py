"""The whole method on data it did not make: generated mixtures with known K, and digits.

Observed on the 2-core CI machine (seed 0), noted per case in ``CASES``.
"""

import numpy as np
import pytest
from sklearn.datasets import load_digits

from deepdpm_core import DeepDPM
from deepdpm_core.data import clustering_scores, make_mixture
from deepdpm_core.features.embedding import umap_embed

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


def _dp_gmm_reference(Z, y):
    """K and NMI of scikit-learn's DP-GMM on the same features (the model DeepDPM fits)."""
    import warnings

    from sklearn.mixture import BayesianGaussianMixture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning
        labels = BayesianGaussianMixture(
            n_components=30, weight_concentration_prior_type="dirichlet_process",
            covariance_type="full", max_iter=500, random_state=0).fit(Z).predict(Z)
    return len(np.unique(labels)), clustering_scores(y, labels)["nmi"]


@pytest.mark.slow
def test_digits_sensible_k():
    """Paper setting for classical comparisons: UMAP features (n2d), default prior, from
    one initial cluster (the default start from ten: ``docs/benchmarks.md``, K suite).

    UMAP blobs are not Gaussian, and both DP-GMMs split a few of them (digit 1's writing
    styles, mostly). Observed (seed 0): DeepDPM K = 14, NMI 0.907; scikit-learn's
    BayesianGaussianMixture(30, DP, full) on the same features K = 14, NMI 0.923.
    """
    X, y = load_digits(return_X_y=True)
    Z = umap_embed(X.astype(np.float32), 10, n_neighbors=20, min_dist=0.0, seed=0)
    model = DeepDPM(random_state=0, init__n_clusters=1).fit(Z)
    scores = clustering_scores(y, model.labels_)
    k_ref, nmi_ref = _dp_gmm_reference(Z, y)
    assert 8 <= model.n_clusters_ <= k_ref + 1, (model.n_clusters_, k_ref, scores)
    assert scores["nmi"] >= max(0.85, nmi_ref - 0.03), (scores, nmi_ref)
