"""The clustering net's distillation start: the mixture's linear discriminant, against the
exact responsibilities of Gaussians that share one covariance."""

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal

from deepdpm_core.nets import ClusterNet, discriminant_start


def _shared_covariance_mixture(k: int, d: int, span: int, seed: int = 0):
    """K means in a ``span``-dimensional subspace of D, one random covariance, uneven weights."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(d, span)))[0]
    means = rng.normal(scale=3.0, size=(k, span)) @ basis.T
    a = rng.normal(size=(d, d))
    cov = a @ a.T / d + 0.5 * np.eye(d)
    weights = rng.dirichlet(np.full(k, 2.0))
    x = rng.normal(scale=3.0, size=(300, d))
    return means, np.broadcast_to(cov, (k, d, d)).copy(), weights, x


def _exact_log_posterior(means, covs, weights, x) -> np.ndarray:
    logp = np.stack([np.log(w) + multivariate_normal(m, c).logpdf(x) for m, c, w in zip(means, covs, weights,
                                                                                      strict=True)], axis=1)
    return logp - np.logaddexp.reduce(logp, axis=1, keepdims=True)


@pytest.mark.parametrize(("k", "d", "span", "hidden", "rank"), [
    (6, 3, 3, 50, 3),    # full LDA: 2D units and K - 1 >= D directions
    (4, 40, 2, 50, 3),   # reduced rank: the means span 2 of 40 features, r = K - 1 = 3
    (30, 40, 5, 50, 25),  # r = H // 2 = 25 holds the 5 directions the means span
])
def test_the_net_starts_at_the_exact_responsibilities_of_a_shared_covariance(k, d, span, hidden, rank):
    means, covs, weights, x = _shared_covariance_mixture(k, d, span)
    net = ClusterNet(d, hidden, k, torch.Generator().manual_seed(0)).double()
    held = discriminant_start(net, torch.from_numpy(means), torch.from_numpy(covs),
                              torch.from_numpy(np.log(weights)))
    assert held == rank
    with torch.no_grad():
        log_r = torch.log_softmax(net(torch.from_numpy(x)), dim=1).numpy()
    np.testing.assert_allclose(log_r, _exact_log_posterior(means, covs, weights, x), atol=1e-6)


def test_units_beyond_the_discriminant_keep_their_weights_and_have_no_say():
    means, covs, weights, x = _shared_covariance_mixture(5, 2, 2)
    net = ClusterNet(2, 50, 5, torch.Generator().manual_seed(0))
    before = net.hidden.weight.detach().clone()
    assert discriminant_start(net, torch.from_numpy(means), torch.from_numpy(covs),
                              torch.from_numpy(np.log(weights))) == 2
    assert torch.equal(net.hidden.weight[4:], before[4:])
    assert not net.out.weight[:, 4:].any()
