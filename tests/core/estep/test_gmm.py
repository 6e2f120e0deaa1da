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


def _mixture_params(seed, k=5, d=6):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, d, d + 4, dtype=torch.float64, generator=g)
    return (torch.randn(k, d, dtype=torch.float64, generator=g), a @ a.mT / (d + 4),
            torch.log_softmax(torch.randn(k, dtype=torch.float64, generator=g), 0))


def test_a_mixture_writes_its_factors_over_a_recycled_ones():
    old = GaussianMixture(*_mixture_params(0))
    memory = old.prec_chol.data_ptr(), old.prec_chol_work.data_ptr()
    new = GaussianMixture(*_mixture_params(1), recycled=old)
    fresh = GaussianMixture(*_mixture_params(1))
    assert (new.prec_chol.data_ptr(), new.prec_chol_work.data_ptr()) == memory
    assert torch.equal(new.prec_chol, fresh.prec_chol) and torch.equal(new.prec_chol_work, fresh.prec_chol_work)
    assert torch.equal(new.log_norm, fresh.log_norm)
    # the recycled mixture has lost its factors: reading them fails instead of reading new ones
    assert not hasattr(old, "prec_chol") and not hasattr(old, "prec_chol_work")
    # factors of another shape do not fit: fresh memory, the same factors
    other = GaussianMixture(*_mixture_params(2, k=3), recycled=new)
    assert torch.equal(other.prec_chol, GaussianMixture(*_mixture_params(2, k=3)).prec_chol)
    assert other.prec_chol.data_ptr() != memory[0]
