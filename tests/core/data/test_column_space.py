"""Features that are constant or exact linear combinations of others are left out of the fit."""

import numpy as np
import pytest
import torch
from sklearn.datasets import make_classification

from deepdpm_core import DeepDPM
from deepdpm_core.config import DataConfig
from deepdpm_core.data import FeatureCoordinates, clustering_scores, fit_coordinates
from deepdpm_core.data.coordinates import independent_features
from deepdpm_core.runtime import LocalCommunicator


def _coords(X: np.ndarray, transform: str = "auto") -> FeatureCoordinates:
    coords, _, _ = fit_coordinates(torch.as_tensor(X), DataConfig(transform=transform),
                                   LocalCommunicator(), torch.device("cpu"))
    return coords


def _dependent_rows(seed: int = 0) -> np.ndarray:
    """(400, 6): 4 free features, their sum and a constant."""
    free = np.random.default_rng(seed).normal(size=(400, 4)) * [1.0, 2.0, 0.5, 3.0] + 10.0
    return np.column_stack([free, free.sum(1), np.full(400, 7.0)]).astype(np.float32)


def test_full_rank_rows_keep_every_feature():
    X = np.random.default_rng(1).normal(size=(300, 5)).astype(np.float32)
    coords = _coords(X)
    assert coords.kept is None and coords.dim == coords.n_features == 5
    cov = torch.as_tensor(np.cov(X.T))
    assert independent_features(cov, cov.diagonal()) is None


@pytest.mark.parametrize("transform", ["none", "standard"])
def test_a_sum_column_and_a_constant_are_left_out(transform):
    X = _dependent_rows()
    coords = _coords(X, transform)
    assert (coords.n_features, coords.dim) == (6, 4) and coords.kept.tolist() == [0, 1, 2, 3]
    # the kept features are x̃'s coordinates as they were
    full = (torch.as_tensor(X, dtype=torch.float64) - coords.center) * coords.mult
    xt = coords.apply(torch.as_tensor(X))
    torch.testing.assert_close(xt, full[:, :4])
    np.testing.assert_allclose(coords.axis_std.numpy(), coords.feature_std[:4].numpy())
    # the lift gives back the sum and the constant: every feature's mean and covariance
    np.testing.assert_allclose(coords.means_to_features(xt.mean(0, keepdim=True))[0].numpy(),
                               X.astype(np.float64).mean(0), rtol=1e-5)
    features = coords.covariances_to_features(torch.cov(xt.T)[None])[0].numpy()
    np.testing.assert_allclose(features, np.cov(X.astype(np.float64).T), rtol=1e-4, atol=1e-6)
    again = FeatureCoordinates.from_state(coords.state_dict())
    torch.testing.assert_close(again.apply(torch.as_tensor(X)), xt)


def test_a_duplicated_feature_keeps_its_first_copy():
    free = np.random.default_rng(3).normal(size=(500, 3))
    X = np.column_stack([free[:, 0], free[:, 1], free[:, 0] * 2.5 - 1.0, free[:, 2]]).astype(np.float32)
    assert _coords(X).kept.tolist() == [0, 1, 3]


def test_a_feature_that_varies_outside_the_sample_is_kept():
    # a rare binary column: no spread in the sampled rows, some over all of them
    free = np.random.default_rng(5).normal(size=(4096, 3))
    sample = np.column_stack([free, np.zeros(4096), free[:, 0] + free[:, 1]])
    cov = torch.as_tensor(np.cov(sample.T))
    variance = cov.diagonal().clone()
    variance[3] = 1e-4
    kept, lift = independent_features(cov, variance)
    assert kept.tolist() == [0, 1, 2, 3]  # the sum is left out, the rare column kept
    np.testing.assert_allclose(lift[4].numpy(), [1.0, 1.0, 0.0, 0.0], atol=1e-9)
    variance[3] = 0.0  # constant over all rows too: left out
    assert independent_features(cov, variance)[0].tolist() == [0, 1, 2]


def test_few_rows_leave_the_features_as_they_are():
    # fewer than 4 D rows: a sample covariance cannot tell a dependence from chance
    assert _coords(_dependent_rows()[:20]).kept is None


def test_all_constant_rows_keep_their_features():
    assert _coords(np.ones((50, 3), dtype=np.float32)).kept is None


def test_redundant_columns_do_not_merge_the_clusters():
    """make_classification's 10 Gaussian clusters with 3 redundant columns: fitted in all 12
    features the floor-level variance along the 3 empty directions made one cluster score
    highest (K = 1 at this seed); in the rows' own 9 directions the clusters are found."""
    X, _ = make_classification(n_samples=5000, n_features=12, n_informative=7, n_redundant=3,
                               n_classes=5, n_clusters_per_class=2, class_sep=2.0, flip_y=0.0,
                               shuffle=False, random_state=0)
    y = np.repeat(np.arange(10), 500)
    model = DeepDPM(random_state=1).fit(X.astype(np.float32))
    assert model.n_clusters_ in (9, 10, 11)
    assert clustering_scores(y, model.labels_)["nmi"] > 0.9
    assert model.means_.shape == (model.n_clusters_, 12) and model.predict(X[:7]).shape == (7,)
