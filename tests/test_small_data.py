"""Small data: exact EM epochs against brute force, the net fitted to the result, and the
switch between the two searches."""

import numpy as np
import pytest
import torch
from sklearn.datasets import make_blobs

from deepdpm_core.communicator import LocalCommunicator
from deepdpm_core.config import Config
from deepdpm_core.gmm import GaussianMixture
from deepdpm_core.mixture_state import MixtureState
from deepdpm_core.nets import ClusterNet
from deepdpm_core.niw import NIWPrior, log_split_hastings
from deepdpm_core.small_data import best_cuts, distil, exact_statistics, principal_axes
from deepdpm_core.stats import grouped_stats
from deepdpm_core.trainer import Trainer


def _state(rng, k, d):
    means = torch.tensor(rng.normal(0, 3, (k, d)))
    a = torch.tensor(rng.normal(size=(k, d, d)))
    covs = a @ a.transpose(1, 2) + torch.eye(d)
    logw = torch.log_softmax(torch.tensor(rng.normal(size=k)), 0)
    sub_means = means[:, None, :] + torch.tensor(rng.normal(0, 1, (k, 2, d)))
    return MixtureState(means, covs, logw, sub_means, covs[:, None].repeat(1, 2, 1, 1),
                        torch.full((k, 2), -np.log(2.0), dtype=torch.float64))


def test_exact_statistics_match_brute_force():
    rng = np.random.default_rng(0)
    k, d, n = 4, 3, 300
    state = _state(rng, k, d)
    x = torch.tensor(rng.normal(0, 4, (n, d)), dtype=torch.float32)
    # the dense E-step: every cluster on every row's support
    log_p = GaussianMixture(state.means, state.covariances, state.log_weights).weighted_log_prob(x).double()
    resp = torch.softmax(log_p, 1)
    candidates = torch.arange(k).expand(n, k)
    z = resp.argmax(1)
    soft, sub, cut, sum_sub = exact_statistics(x, state, candidates, resp.float(), z)
    xd, r = x.double().numpy(), resp.numpy()
    r = np.where(r >= np.finfo(np.float32).eps, r, 0.0)  # what the statistics leave out
    np.testing.assert_allclose(soft.n.numpy(), r.sum(0), rtol=1e-6)
    np.testing.assert_allclose(soft.s1.numpy(), r.T @ xd, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(soft.s2.numpy(), np.einsum("nk,nd,ne->kde", r, xd, xd), rtol=1e-5, atol=1e-3)
    # subclusters: the nearer of the row's cluster's two subcluster means (Eq. 7's minimiser)
    sm = state.sub_means.numpy()
    dist = ((xd[:, None, :] - sm[z.numpy()]) ** 2).sum(-1)
    rows = 2 * z.numpy() + dist.argmin(1)
    np.testing.assert_array_equal(sub.n.numpy(), np.bincount(rows, minlength=2 * k))
    for row in range(2 * k):
        np.testing.assert_allclose(sub.s1[row].numpy(), xd[rows == row].sum(0), rtol=1e-5, atol=1e-4)
    assert float(sum_sub) == pytest.approx(dist.min(1).sum(), rel=1e-5)
    # the principal-axis cut: the side of the hyperplane through the cluster's mean normal
    # to its covariance's leading eigenvector (eigh, up to the vector's sign)
    axes = np.linalg.eigh(state.covariances.numpy())[1][..., -1]
    side = ((xd - state.means.numpy()[z.numpy()]) * axes[z.numpy()]).sum(1) > 0
    cut_n = cut.n.numpy().reshape(k, 2)
    by_hand = np.stack([np.bincount(z.numpy()[side == s], minlength=k) for s in (False, True)], 1)
    assert all(sorted(cut_n[c]) == sorted(by_hand[c]) for c in range(k))


def test_principal_axes_are_the_leading_eigenvectors():
    rng = np.random.default_rng(1)
    a = torch.tensor(rng.normal(size=(6, 20, 20)))
    covs = a @ a.transpose(1, 2) + 0.1 * torch.eye(20)
    expected = torch.linalg.eigh(covs).eigenvectors[..., -1]
    got = principal_axes(covs, iterations=200)
    np.testing.assert_allclose((got * expected).sum(1).abs().numpy(), 1.0, atol=1e-6)


def test_the_better_cut_becomes_the_subclusters():
    """Two blobs 8 apart along x: the cut across them (by the sign of y) gains nothing,
    the cut between them (by x) gains hundreds of nats; each cluster keeps the better of
    its 2-means subclusters and its principal-axis cut."""
    rng = np.random.default_rng(2)
    x = torch.tensor(np.concatenate([rng.normal(size=(200, 2)), rng.normal(size=(200, 2)) + [8.0, 0.0]]))
    across, between = (x[:, 1] > 0).long(), (x[:, 0] > 4).long()
    points, ones = torch.arange(400).repeat(2), torch.ones(800, dtype=torch.float64)
    # cluster 0 (rows 0, 1): 2-means across, principal between; cluster 1 (the same points,
    # rows 2, 3): the reverse
    sub = grouped_stats(x, points, torch.cat([across, 2 + between]), ones, 4)
    cut = grouped_stats(x, points, torch.cat([between, 2 + across]), ones, 4)
    prior = NIWPrior.from_shape(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64),
                                0.05, None, 1.0)
    best, took_cut = best_cuts(prior, 10.0, 500.0, sub, cut)
    assert took_cut.tolist() == [True, False]
    clean = grouped_stats(x, torch.arange(400), between, ones[:400], 2)
    for c in (0, 1):
        np.testing.assert_allclose(best.rows([2 * c, 2 * c + 1]).n.numpy(), clean.n.numpy())
    log_h = log_split_hastings(prior, 10.0, best)
    assert float(log_h.min()) > 100


def test_distil_fits_the_net_to_the_targets_and_stops_when_it_does():
    x, y = make_blobs(400, centers=5, n_features=3, cluster_std=0.5, random_state=0)
    x = torch.tensor((x - x.mean(0)) / x.std(), dtype=torch.float32)
    resp = torch.nn.functional.one_hot(torch.tensor(y), 5).float()
    candidates = torch.arange(5).expand(400, 5)
    net = ClusterNet(3, 50, 5, torch.Generator().manual_seed(0))
    steps, agreement = distil(net, x, candidates, resp, 400, LocalCommunicator(), 0.02, 0.99, 1000)
    assert agreement >= 0.99 and steps < 1000
    assert (net(x).argmax(1) == torch.tensor(y)).float().mean() >= 0.99
    # an agreement it cannot reach (random targets): stops once the checks bring no gain
    noise = torch.nn.functional.one_hot(torch.randint(5, (400,), generator=torch.Generator().manual_seed(1)), 5)
    steps, agreement = distil(net, x, candidates, noise.float(), 400, LocalCommunicator(), 0.02, 1.0, 5000)
    assert agreement < 1.0 and steps < 5000


@pytest.mark.parametrize("max_rows, small", [(10_000, True), (0, False)])
def test_the_search_is_exact_em_up_to_max_rows(max_rows, small):
    x, _ = make_blobs(600, centers=4, n_features=2, cluster_std=0.4, random_state=2)
    config = Config().with_overrides({"small_data.max_rows": max_rows, "schedule.max_epochs": 60})
    trainer = Trainer(config, torch.tensor(x, dtype=torch.float32))
    assert trainer.small is small
    assert trainer.schedule.schedule.move_every == (2 if small else 4)
    trainer.fit()
    assert trainer.n_clusters == 4
    last = trainer.history[-1]
    assert ("distil_steps" in last) is small
    if small:  # the net learned the clusters the search found
        assert last["distil_agreement"] >= 0.99


def test_an_em_epoch_is_an_m_step_of_em():
    """From a mixture, one EM epoch's statistics give the MAP M-step of the exact
    responsibilities: the means move to the responsibility-weighted means (up to the prior)."""
    x, _ = make_blobs(900, centers=3, n_features=2, cluster_std=0.5, random_state=3)
    config = Config().with_overrides({"init.n_clusters": 3})
    trainer = Trainer(config, torch.tensor(x, dtype=torch.float32))
    trainer.initialize()
    soft, _, losses = trainer.em_epoch(train=False)
    log_p = trainer.mixture.weighted_log_prob(trainer.x).double()
    resp = torch.softmax(log_p, 1)
    np.testing.assert_allclose(soft.n.numpy(), resp.sum(0).numpy(), rtol=1e-5)
    np.testing.assert_allclose((soft.s1 / soft.n[:, None]).numpy(),
                               ((resp.T @ trainer.x.double()) / resp.sum(0)[:, None]).numpy(), atol=1e-5)
    assert losses["loss_subcluster"] > 0
