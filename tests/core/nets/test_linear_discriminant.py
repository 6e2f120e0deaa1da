"""The clustering net's distillation start: the mixture's linear discriminant, against the
exact responsibilities of Gaussians that share one covariance."""

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal

from deepdpm_core.nets import Adam, ClusterNet, discriminant_start, widen_hidden
from deepdpm_core.nets.linear_discriminant import HINGE_SLOPE


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
                              torch.from_numpy(np.log(weights)), torch.Generator().manual_seed(1))
    assert held == rank
    with torch.no_grad():
        log_r = torch.log_softmax(net(torch.from_numpy(x)), dim=1).numpy()
    np.testing.assert_allclose(log_r, _exact_log_posterior(means, covs, weights, x), atol=1e-6)


def test_units_beyond_the_discriminant_are_hinges_through_the_data_with_no_say():
    # two clusters far from the origin of the coordinates: PyTorch's default hinges pass
    # near the origin, those of the start through the clusters
    means = np.array([[100.0, 100.0], [-100.0, 100.0]])
    covs = np.stack([np.diag([4.0, 1.0]), np.diag([1.0, 9.0])])
    args = torch.from_numpy(means), torch.from_numpy(covs), torch.from_numpy(np.log([0.3, 0.7]))
    net = ClusterNet(2, 50, 2, torch.Generator().manual_seed(0)).double()
    assert discriminant_start(net, *args, torch.Generator().manual_seed(1)) == 1
    w, b = net.hidden.weight.detach()[2:], net.hidden.bias.detach()[2:]
    assert not net.out.weight[:, 2:].any()  # no say in the output
    pooled = (0.3 * covs[0] + 0.7 * covs[1])
    slopes = np.einsum("ud,de,ue->u", w.numpy(), pooled, w.numpy())  # per step of S along w
    np.testing.assert_allclose(slopes, HINGE_SLOPE**2)
    # each hinge w·x + b = 0 passes within 5 standard deviations (along w) of a cluster's mean
    sd = np.sqrt(np.einsum("ud,kde,ue->uk", w.numpy(), covs, w.numpy()))
    assert (np.abs(w.numpy() @ means.T + b.numpy()[:, None]) / sd).min(1).max() < 5
    again = ClusterNet(2, 50, 2, torch.Generator().manual_seed(0)).double()
    discriminant_start(again, *args, torch.Generator().manual_seed(1))  # every rank draws alike
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), again.parameters(), strict=True))


def test_a_widened_net_computes_the_same_and_keeps_its_adam_moments():
    net = ClusterNet(3, 4, 5, torch.Generator().manual_seed(0))
    opt = Adam(list(net.parameters()), 0.01)
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(1))
    net(x).square().sum().backward()
    opt.step()
    before = net(x).detach()
    moments = {name: opt.state[p]["exp_avg"].clone() for name, p in net.named_parameters()}
    assert widen_hidden(net, 9, opt, torch.Generator().manual_seed(2))
    assert net.hidden.weight.shape == (9, 3) and net.out.weight.shape == (5, 9)
    torch.testing.assert_close(net(x), before, rtol=0, atol=1e-6)
    assert not net.out.weight[:, 4:].any() and net.hidden.weight[4:].abs().min() > 0
    params = dict(net.named_parameters())
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in params.values()}
    moved = {name: opt.state[p]["exp_avg"] for name, p in params.items()}
    assert torch.equal(moved["hidden.weight"][:4], moments["hidden.weight"]) and not moved["hidden.weight"][4:].any()
    assert torch.equal(moved["out.weight"][:, :4], moments["out.weight"]) and not moved["out.weight"][:, 4:].any()
    assert torch.equal(moved["out.bias"], moments["out.bias"])
    assert not widen_hidden(net, 6, opt, torch.Generator())  # never narrower
    assert net.hidden.weight.shape == (9, 3)


def test_a_net_widened_to_two_units_a_direction_holds_the_full_discriminant():
    # 30 means spanning 29 directions of 40 features: the paper's 50 units hold 25 of them
    means, covs, weights, x = _shared_covariance_mixture(30, 40, 30)
    args = torch.from_numpy(means), torch.from_numpy(covs), torch.from_numpy(np.log(weights))
    exact = _exact_log_posterior(means, covs, weights, x)
    net = ClusterNet(40, 50, 30, torch.Generator().manual_seed(0)).double()
    assert discriminant_start(net, *args, torch.Generator().manual_seed(1)) == 25
    with torch.no_grad():
        assert np.abs(torch.log_softmax(net(torch.from_numpy(x)), dim=1).numpy() - exact).max() > 1e-3
    widen_hidden(net, 58, Adam(list(net.parameters()), 0.01), torch.Generator().manual_seed(0))
    assert discriminant_start(net, *args, torch.Generator().manual_seed(1)) == 29
    with torch.no_grad():
        log_r = torch.log_softmax(net(torch.from_numpy(x)), dim=1).numpy()
    np.testing.assert_allclose(log_r, exact, atol=1e-6)
