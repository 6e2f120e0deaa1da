"""The M-step: the MAP mixture of the epoch's statistics, written over the last M-step's memory."""

import torch
from sklearn.datasets import make_blobs

from deepdpm_core.bayes import map_estimate, posterior_mean
from deepdpm_core.config import Config
from deepdpm_core.estep import GaussianMixture
from deepdpm_core.training import start_fit
from deepdpm_core.training.fit_context import partition_stats


def test_the_m_step_is_the_map_mixture_over_the_last_ones_memory():
    # 33 clusters of 24-D: the covariances are written in blocks, one of which is 17 rows
    x, y = make_blobs(33 * 30, centers=33, n_features=24, cluster_std=1.0, random_state=0)
    search = start_fit(Config().with_overrides({"small_data.max_rows": 0}), torch.tensor(x, dtype=torch.float32))
    labels = torch.tensor(y)
    search.initialize(labels)
    half = torch.arange(len(y)) % 2
    soft, _ = partition_stats(search.ctx, labels, 33)
    sub, _ = partition_stats(search.ctx, 2 * labels + half, 66)
    memory = search.mixture.covariances.data_ptr(), search.mixture.prec_chol.data_ptr()
    search.m_step(soft, sub)
    state, mixture, prior = search.state, search.mixture, search.prior_fit.prior
    assert (state.covariances.data_ptr(), mixture.prec_chol.data_ptr()) == memory
    means, covs = map_estimate(prior, soft)
    assert torch.equal(state.means, means) and torch.equal(state.covariances, covs)
    assert mixture.covariances is state.covariances
    fresh = GaussianMixture(means, covs, state.log_weights)
    for name in ("prec_chol", "prec_chol_work", "log_norm", "means_work"):
        assert torch.equal(getattr(mixture, name), getattr(fresh, name)), name
    assert torch.equal(state.sub_means, posterior_mean(prior, sub).view(33, 2, 24))
    assert torch.equal(state.sub_covariances, map_estimate(prior, sub)[1].view(33, 2, 24, 24))
