"""E-step log-probabilities against scipy."""

import numpy as np
import torch
from scipy.stats import multivariate_normal

from deepdpm_core.estep import GaussianMixture, log_weights_from_counts


def test_weighted_log_prob_matches_scipy():
    rng = np.random.default_rng(0)
    k, d = 4, 3
    means = rng.normal(size=(k, d)) * 3
    covs = np.stack([a @ a.T + 0.1 * np.eye(d) for a in rng.normal(size=(k, d, d))])
    logw = np.log(rng.dirichlet(np.ones(k)))
    x = rng.normal(size=(50, d)) * 3
    gmm = GaussianMixture(torch.tensor(means), torch.tensor(covs), torch.tensor(logw))
    ours = gmm.weighted_log_prob(torch.tensor(x)).numpy()
    ref = np.stack([logw[j] + multivariate_normal(means[j], covs[j]).logpdf(x) for j in range(k)], 1)
    np.testing.assert_allclose(ours, ref, rtol=1e-10)


def test_weights_pseudocount_added_to_counts():
    lw = log_weights_from_counts(torch.tensor([98.0, 0.0, 2.0]), 1.0)
    np.testing.assert_allclose(lw.exp().numpy(), np.array([99, 1, 3]) / 103)
