"""Valid finite tables with degenerate directions fit without error (the covariance floor)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits, make_blobs

from deepdpm_core import DeepDPM
from deepdpm_core.bayes import NIWPrior, SuffStats, log_marginal_likelihood
from deepdpm_core.config import Config
from deepdpm_core.data import clustering_scores
from deepdpm_core.errors import DataError
from deepdpm_core.training import start_fit

QUICK = {"optim__min_steps_per_epoch": 8}


def _blobs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    X, y = make_blobs(n_samples=[150, 150, 150, 150], n_features=5, cluster_std=1.0,
                      center_box=(-20, 20), random_state=seed)
    return X, y


def _fits_the_blobs(X: np.ndarray, y: np.ndarray) -> None:
    model = DeepDPM(random_state=0, **QUICK).fit(X)
    assert model.n_clusters_ == 4
    assert clustering_scores(y, model.labels_)["nmi"] > 0.95
    assert np.isfinite(model.predict_proba(X)).all()


def test_a_constant_feature():
    X, y = _blobs()
    _fits_the_blobs(np.column_stack([X, np.full(len(X), 3.5)]), y)


def test_duplicated_and_collinear_features():
    X, y = _blobs()
    _fits_the_blobs(np.column_stack([X, X[:, 0], 2.0 * X[:, 1] - X[:, 2]]), y)


def test_duplicate_rows_and_a_cluster_of_duplicates():
    X, y = _blobs()
    twice = np.concatenate([X, X[:200]])  # 200 rows twice
    lump = np.repeat(np.full((1, X.shape[1]), 60.0), 30, axis=0)  # 30 copies of one row, far out
    model = DeepDPM(random_state=0).fit(np.concatenate([twice, lump]))
    assert model.n_clusters_ == 5
    assert len(set(model.labels_[-30:])) == 1


def test_binary_columns_and_a_cluster_of_two_rows():
    rng = np.random.default_rng(0)
    X, y = _blobs()
    binary = (y[:, None] + rng.integers(0, 2, size=(len(y), 3)) > 2).astype(float)
    pair = np.full((2, X.shape[1] + 3), 80.0)
    pair[1, 0] += 0.5
    model = DeepDPM(random_state=0, **QUICK).fit(np.concatenate([np.column_stack([X, binary]), pair]))
    assert 4 <= model.n_clusters_ <= 6
    assert clustering_scores(y, model.labels_[:-2])["nmi"] > 0.9


@pytest.mark.slow
def test_raw_digit_pixels_with_constant_columns():
    X, y = load_digits(return_X_y=True)  # 3 of the 64 pixels are 0 in every image
    assert (X.std(0) == 0).sum() == 3
    model = DeepDPM(random_state=0).fit(X)  # failed numerically before the floor
    assert np.isfinite(model.predict_proba(X)).all()
    # 64 features: the coarsening grows with the parameters, so the fit does not
    # collapse to one cluster as it did at a fixed c (without COARSENING_PER_PARAMETER)
    assert model.n_clusters_ > 1


def test_the_floor_adds_n_delta_to_the_scatter():
    """ln f with the floor δ is the paper's ln f of the statistics with n·diag(δ) added to
    Σ x xᵀ: the points' own statistics plus independent N(0, diag(δ)) noise, in expectation."""
    rng = np.random.default_rng(1)
    x = torch.as_tensor(rng.normal(size=(9, 3)))
    x[:, 2] = 1.0  # a constant feature: without the floor the scatter is singular there
    stats = SuffStats(torch.tensor([9.0], dtype=torch.float64), x.sum(0)[None], (x.T @ x)[None])
    delta = torch.tensor([1e-3, 2e-3, 5e-4], dtype=torch.float64)
    floored = NIWPrior.from_shape(torch.zeros(3), torch.ones(3), 0.1, None, 0.0, floor=delta)
    paper = NIWPrior.from_shape(torch.zeros(3), torch.ones(3), 0.1, None, 0.0)
    noisy = SuffStats(stats.n, stats.s1, stats.s2 + 9.0 * torch.diag(delta)[None])
    # s = 0: only the floor keeps Λn positive-definite
    assert torch.isfinite(log_marginal_likelihood(floored, stats)).all()
    torch.testing.assert_close(log_marginal_likelihood(floored, stats), log_marginal_likelihood(paper, noisy),
                               rtol=1e-12, atol=1e-9)


def test_a_factorisation_that_fails_on_the_data_is_one_data_error():
    """The paper's model (no floor) on 4 rows repeated 150 times each, times 1e25, at a fixed
    prior 1e27 times smaller than the clusters: a cluster's posterior is singular, and the
    fit raises one line saying what to change, not the linear-algebra error."""
    rng = np.random.default_rng(0)
    X = np.repeat(rng.normal(size=(4, 6)) * 6, 150, axis=0)
    X[::150] += 0.5
    config = Config().with_overrides({
        "seed": 0, "prior.psi": "identity", "prior.sigma_scale": 0.005, "prior.kappa": 1e-4, "prior.nu": None,
        "init.n_clusters": 3, "schedule.warmup_epochs": 2, "schedule.move_every": 2, "schedule.max_epochs": 12})
    search = start_fit(config, torch.as_tensor(X * 1e25, dtype=torch.float32))
    fit = search.prior_fit
    fit.priors = [replace(prior, floor=None) for prior in fit.priors]
    fit.prior = fit.priors[0]
    with pytest.raises(DataError) as info:
        search.fit()
    message = str(info.value)
    assert message.startswith("the fit failed numerically at epoch ") and "\n" not in message
    assert "data.transform=standard" in message and "prior.sigma_scale=auto, not 0.005" in message
