"""The small-data polish: the settled partition against k-means partitions of K and K − 1
clusters, each scored by ln p(X, z) with the prior fitted to it."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer

from deepdpm_core import DeepDPM
from deepdpm_core.bayes import partition_evidence
from deepdpm_core.config import Config
from deepdpm_core.data import clustering_scores
from deepdpm_core.training import Search, start_fit
from deepdpm_core.training.settling import partition_score, polish, same_partition


def _blobs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three unit Gaussians 10 apart in 3-D, 200 rows each."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(3), 200)
    return (rng.normal(size=(600, 3)) + 10.0 * np.eye(3)[y]).astype(np.float32), y


def _trainer_at(x: np.ndarray, labels: np.ndarray) -> Search:
    search = start_fit(Config().with_overrides({"seed": 0}), torch.as_tensor(x))
    search.initialize(torch.as_tensor(labels))
    return search


def _polish(search: Search) -> torch.Tensor | None:
    """:func:`polish` of the search's settled partition (its anchors after an E-step)."""
    search.estep_targets()
    return polish(search.ctx, search.config, search.prior_fit, search.anchors, search.n_clusters, search.rng)


def _final_labels(search: Search) -> np.ndarray:
    search.estep_targets()
    return search.anchors.numpy()


def test_the_partition_score_is_the_partitions_evidence():
    x, y = _blobs()
    search = _trainer_at(x, y)
    assert partition_score(search.ctx, search.config, search.prior_fit, torch.as_tensor(y), 3) == pytest.approx(
        partition_evidence(x, y).log_joint, rel=1e-6)


def test_partitions_are_the_same_whatever_their_groups_names():
    x, y = _blobs()
    search = _trainer_at(x, y)
    labels = torch.as_tensor(y)
    assert same_partition(search.ctx, (labels, 3), ((labels + 1) % 3, 3))
    assert same_partition(search.ctx, (labels, 3), (2 * labels, 5))  # groups 1 and 3 empty
    moved = labels.clone()
    moved[0] = 1  # one row to another group
    assert not same_partition(search.ctx, (labels, 3), (moved, 3))
    assert not same_partition(search.ctx, (labels, 3), (torch.where(labels == 2, 1, labels), 2))
    assert not same_partition(search.ctx, (torch.where(labels == 2, 1, labels), 2), (labels, 3))


def test_a_settled_partition_that_joins_two_blobs_is_replaced_by_a_better_one():
    """Blobs 0 and 1 in one cluster, blob 2 cut in two: K = 3, but a partition of as many
    clusters that the model scores far higher is one k-means run away."""
    x, y = _blobs()
    bad = np.where(y == 2, 1 + (x[:, 0] > np.median(x[y == 2, 0])), 0)
    search = _trainer_at(x, bad)
    before = partition_evidence(x, bad).log_joint
    chosen = _polish(search)
    assert chosen is not None
    search.initialize(chosen)
    after = _final_labels(search)
    assert search.n_clusters == 3
    assert clustering_scores(y, after)["nmi"] == pytest.approx(1.0)
    assert partition_evidence(x, after).log_joint > before + 100


def test_the_best_partition_is_kept():
    x, y = _blobs()
    search = _trainer_at(x, y)
    assert _polish(search) is None
    np.testing.assert_array_equal(_final_labels(search), y)


@pytest.mark.slow
def test_breast_cancer_ends_in_the_two_groups_kmeans_finds_not_a_cluster_and_its_outliers():
    """scikit-learn's breast cancer table (569 x 30, raw units): the search settles at a
    wide cluster and a few outliers (NMI 0.004); the k-means partition of two clusters
    scores over a thousand nats higher with the prior fitted to it."""
    X, y = load_breast_cancer(return_X_y=True)
    fit = DeepDPM(random_state=0).fit(X)
    assert fit.history_[-1]["polished"] == 1
    assert fit.n_clusters_ == 2
    assert clustering_scores(y, fit.labels_)["nmi"] > 0.45
