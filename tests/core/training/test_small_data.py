"""Small data: exact EM epochs against brute force, the net fitted to the result, and the
switch between the two searches."""

import numpy as np
import pytest
import torch
from sklearn.datasets import make_blobs

from deepdpm_core.bayes import linalg
from deepdpm_core.config import Config
from deepdpm_core.estep import GaussianMixture, MixtureState
from deepdpm_core.nets import ClusterNet, slot_kl
from deepdpm_core.runtime import LocalCommunicator
from deepdpm_core.training import exact_em, start_fit
from deepdpm_core.training.exact_em import (
    CHECK_EVERY,
    ExactEM,
    distil,
    distil_max_steps,
    distil_sample,
    exact_statistics,
    nearer_subcluster,
    net_check,
)
from deepdpm_core.training.fit_context import build_nets, model_state

Tensor = torch.Tensor


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
    soft, sub, sum_sub = exact_statistics(x, state, candidates, resp.float(), z)
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


def test_the_nearer_subcluster_in_blocks_of_rows_is_the_whole_arrays(monkeypatch):
    """On a CPU :func:`nearer_subcluster` takes a block of rows at a time: the same
    distances and choices as the (N, 2, D) differences at once."""
    rng = np.random.default_rng(1)
    state, z = _state(rng, 4, 3), torch.tensor(rng.integers(0, 4, 301))
    x = torch.tensor(rng.normal(0, 4, (301, 3)), dtype=torch.float32)
    sub_means = state.sub_means.float()
    whole = (x[:, None, :] - sub_means[z]).square().sum(-1).min(1)
    monkeypatch.setattr(linalg, "CACHE_FLOATS", 2 * 3 * 16)  # blocks of 16 rows, the last one short
    nearest, which = nearer_subcluster(x, sub_means, z)
    assert torch.equal(nearest, whole.values) and torch.equal(which, whole.indices)


def _blob_targets(unsure: int = 0) -> tuple[Tensor, Tensor, Tensor, np.ndarray]:
    """400 rows of 5 blobs in 3-D, standardised, with one-hot targets but for the ``unsure``
    rows of blob 0 nearest blob 1, which r^E shares 0.6 / 0.4 between them."""
    x, y = make_blobs(400, centers=5, n_features=3, cluster_std=0.5, random_state=0)
    resp = np.eye(5)[y]
    near = np.flatnonzero(y == 0)[np.argsort(((x[y == 0] - x[y == 1].mean(0)) ** 2).sum(1))[:unsure]]
    resp[near, 0], resp[near, 1] = 0.6, 0.4
    x = torch.tensor((x - x.mean(0)) / x.std(), dtype=torch.float32)
    return x, torch.arange(5).expand(400, 5), torch.tensor(resp, dtype=torch.float32), y


def test_distil_fits_the_net_to_the_targets_and_stops_when_it_does():
    x, candidates, resp, y = _blob_targets(unsure=3)
    net = ClusterNet(3, 50, 5, torch.Generator().manual_seed(0))
    steps, agreement = distil(net, x, candidates, resp, 400, LocalCommunicator(), 0.02, 0.99, 1000)
    assert agreement >= 0.99 and 0 < steps < 1000
    # the agreement it reports is the returned net's, not the net's before a last step
    assert (net(x).argmax(1) == torch.tensor(y)).float().mean() == agreement
    # a net that already agrees takes no step
    assert distil(net, x, candidates, resp, 400, LocalCommunicator(), 0.02, 0.99, 1000) == (0, agreement)
    # an agreement it cannot reach (random targets): stops once the checks bring no gain
    noise = torch.nn.functional.one_hot(torch.randint(5, (400,), generator=torch.Generator().manual_seed(1)), 5)
    steps, agreement = distil(net, x, candidates, noise.float(), 400, LocalCommunicator(), 0.02, 1.0, 5000)
    assert agreement < 1.0 and steps < 5000
    assert (net(x).argmax(1) == noise.argmax(1)).float().mean() == agreement
    assert distil(net, x, candidates, noise.float(), 400, LocalCommunicator(), 0.02, 1.0, 3)[0] == 3  # at most


def _distilled(x, candidates, resp, max_steps, mark=0.99):
    net = ClusterNet(3, 50, resp.shape[1], torch.Generator().manual_seed(0))
    steps, agreement = distil(net, x, candidates, resp, 400, LocalCommunicator(), 0.02, mark, max_steps)
    with torch.no_grad():
        return steps, agreement, net(x).argmax(1)


def test_the_nets_check_in_blocks_of_rows_gives_the_whole_forwards_values(monkeypatch):
    """:func:`net_check` takes the logits a block of rows at a time on a CPU: the same K,
    argmax and ln r on the slots as one forward over every row, and the same distillation."""
    x, candidates, resp, y = _blob_targets(unsure=3)
    net = ClusterNet(3, 50, 5, torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, z, log_r = slot_kl(net(x), candidates, resp)
    monkeypatch.setattr(linalg, "CACHE_FLOATS", 7 * 5)  # blocks of 7 rows, the last one short
    k, z_blocks, log_r_blocks = net_check(net, x, candidates, resp)
    assert k == 5 and torch.equal(z_blocks, z) and torch.allclose(log_r_blocks, log_r, rtol=0, atol=1e-6)
    assert _distilled(x, candidates, resp, 1000)[:2] == _distilled_unblocked(monkeypatch, x, candidates, resp)[:2]


def _distilled_unblocked(monkeypatch, x, candidates, resp):
    monkeypatch.setattr(linalg, "CACHE_FLOATS", x.shape[0] * resp.shape[1])
    return _distilled(x, candidates, resp, 1000)


def test_distil_stops_at_the_mark_only_once_it_misses_no_clear_row():
    """The rows the net may leave to the mark's 1 % are those r^E itself is unsure of; a
    row it assigns with 0.99 of its mass placed elsewhere is a wrong label."""
    x, candidates, resp, y = _blob_targets(unsure=3)
    clear = resp.max(1).values >= 0.99
    steps, agreement, z = _distilled(x, candidates, resp, 1000)
    assert agreement >= 0.99 and (z == torch.tensor(y))[clear].all()
    before = _distilled(x, candidates, resp, steps - 1)
    assert before[1] < 0.99 or not (before[2] == torch.tensor(y))[clear].all()


def test_distil_waits_for_a_clear_row_it_misses_only_so_long():
    """A clear row the net cannot place (one target inside another blob) holds it
    :data:`CHECK_EVERY` steps past the first step that reaches the mark, not to patience."""
    x, candidates, resp, y = _blob_targets()
    odd = int(np.flatnonzero(y == 2)[0])
    resp[odd] = torch.nn.functional.one_hot(torch.tensor(3), 5).float()  # blob 2's row, said to be blob 3's
    steps, agreement, z = _distilled(x, candidates, resp, 1000)
    assert agreement >= 0.99 and z[odd] != 3
    marked = steps - CHECK_EVERY  # the first step at the mark
    assert _distilled(x, candidates, resp, marked)[1] >= 0.99
    assert _distilled(x, candidates, resp, marked - 1)[1] < 0.99


def test_distil_does_not_stop_before_the_net_owns_every_cluster_the_targets_do():
    """K is the mixture's, not a count that depends on how long the net trained: a cluster
    of 3 rows (less than the 1 % the mark leaves) keeps the net training until it owns one."""
    x, y = make_blobs(400, centers=5, n_features=3, cluster_std=0.5, random_state=0)
    near = np.flatnonzero(y == 0)[np.argsort(((x[y == 0] - x[y == 1].mean(0)) ** 2).sum(1))[:3]]
    y[near] = 5  # the 3 rows of blob 0 nearest blob 1
    x = torch.tensor((x - x.mean(0)) / x.std(), dtype=torch.float32)
    resp, candidates = torch.nn.functional.one_hot(torch.tensor(y), 6).float(), torch.arange(6).expand(400, 6)
    steps, agreement, z = _distilled(x, candidates, resp, 10)  # past the mark already, without the small cluster
    assert steps == 10 and agreement >= 0.99 and 5 not in set(z.tolist())
    steps, agreement, z = _distilled(x, candidates, resp, 1000)
    assert 10 < steps < 1000 and agreement >= 0.99 and set(z.tolist()) == set(range(6))


@pytest.mark.parametrize("max_rows, small", [(10_000, True), (0, False)])
def test_the_search_is_exact_em_up_to_max_rows(max_rows, small):
    x, _ = make_blobs(600, centers=4, n_features=2, cluster_std=0.4, random_state=2)
    config = Config().with_overrides({"small_data.max_rows": max_rows, "schedule.max_epochs": 60})
    search = start_fit(config, torch.tensor(x, dtype=torch.float32))
    assert isinstance(search, ExactEM) is small
    assert search.schedule.schedule.move_every == (2 if small else 4)
    search.fit()
    assert search.n_clusters == 4
    last = search.history[-1]
    assert ("distil_steps" in last) is small
    if small:  # the net learned the clusters the search found
        assert last["distil_agreement"] >= 0.99


def test_an_em_epoch_is_an_m_step_of_em():
    """From a mixture, one EM epoch's statistics give the MAP M-step of the exact
    responsibilities: the means move to the responsibility-weighted means (up to the prior)."""
    x, _ = make_blobs(900, centers=3, n_features=2, cluster_std=0.5, random_state=3)
    config = Config().with_overrides({"init.n_clusters": 3})
    search = start_fit(config, torch.tensor(x, dtype=torch.float32))
    search.initialize()
    assert isinstance(search, ExactEM)
    soft, _, losses = search.run_epoch()  # the net's step leaves the statistics of the targets as they are
    log_p = search.mixture.weighted_log_prob(search.x).double()
    resp = torch.softmax(log_p, 1)
    np.testing.assert_allclose(soft.n.numpy(), resp.sum(0).numpy(), rtol=1e-5)
    np.testing.assert_allclose((soft.s1 / soft.n[:, None]).numpy(),
                               ((resp.T @ search.x.double()) / resp.sum(0)[:, None]).numpy(), atol=1e-5)
    assert losses["loss_subcluster"] > 0


def test_exact_em_builds_saves_and_resumes_without_subclustering_nets():
    x, _ = make_blobs(400, centers=3, n_features=2, cluster_std=0.4, random_state=1)
    x = torch.tensor(x, dtype=torch.float32)
    config = Config().with_overrides({"schedule.max_epochs": 8})
    search = start_fit(config, x)
    search.initialize()
    for _ in range(4):
        search.step_epoch()
    assert search.nets.sub is None and search.sub_model is None
    state = search.state_dict()
    assert not {"sub_nets", "opt_sub"} & set(state)
    # a state that carries them (as exact EM once wrote) resumes; they are left out
    old = {**state, **model_state(search.state, build_nets(search.ctx, config, search.n_clusters,
                                                           torch.Generator().manual_seed(0), True),
                                  search.rng, search.torch_gen)}
    old.update({key: state[key] for key in ("rng", "torch_gen")})
    resumed = start_fit(config, x)
    resumed.resume(old)
    assert resumed.nets.sub is None
    search.fit()
    resumed.fit()
    assert [r["n_clusters"] for r in resumed.history] == [r["n_clusters"] for r in search.history]
    torch.testing.assert_close(resumed.state.means, search.state.means)


def test_the_net_is_distilled_on_a_sample_of_the_rows_sized_by_k():
    """Above max(DISTIL_ROWS, DISTIL_ROWS_PER_CLUSTER·K) rows the net is fitted to a uniform
    sample, each rank its share; below it to every row, drawing nothing."""
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert distil_sample([15_000, 5_000], 0, 10, gen) == (slice(None), 20_000)
    assert torch.equal(gen.get_state(), state)
    rows, n_rows = distil_sample([60_000, 40_000], 1, 50, gen)
    assert n_rows == 20_000 and rows.shape == (8_000,) and rows.unique().shape == (8_000,)
    assert int(rows.max()) < 40_000 and bool((rows[1:] > rows[:-1]).all())
    assert distil_sample([60_000, 40_000], 0, 400, gen)[1] == 80_000  # 200 rows a cluster


def test_the_distillation_steps_are_bounded_by_rows_times_steps():
    # up to 20,000 rows (K <= 100) the step bound; above it the rows times the steps
    assert [distil_max_steps(n) for n in (400, 20_000, 40_000, 200_000, 10**9)] == [1000, 1000, 500, 100, 1]


def test_a_net_distilled_on_a_sample_places_every_row(monkeypatch):
    x, _ = make_blobs(3000, centers=4, n_features=2, cluster_std=0.4, random_state=2)
    monkeypatch.setattr(exact_em, "DISTIL_ROWS", 400)
    monkeypatch.setattr(exact_em, "DISTIL_ROWS_PER_CLUSTER", 50)
    search = start_fit(Config().with_overrides({"schedule.max_epochs": 60}), torch.tensor(x, dtype=torch.float32))
    search.fit()
    last = search.history[-1]
    assert search.n_clusters == 4 and last["distil_agreement"] >= 0.99


def test_the_net_of_many_clusters_gives_the_mixtures_own_labels():
    # 40 blobs along a curve: the net that followed the search stalled at 99.1 % agreement
    # (300 steps); distilled from the mixture's linear discriminant it places every row but
    # one in a thousand where the mixture does
    rng = np.random.default_rng(0)
    t = np.linspace(0, 3 * np.pi, 40)
    centres = np.stack([t, 3 * np.sin(t)], 1) * 8.0
    x = torch.tensor(centres[rng.integers(40, size=4000)] + rng.normal(scale=0.5, size=(4000, 2)),
                     dtype=torch.float32)
    search = start_fit(Config().with_overrides({"seed": 0, "init.n_clusters": 40}), x)
    search.fit()
    mixture = search.mixture
    own = mixture.weighted_log_prob(search.x.to(mixture.means.dtype)).argmax(1)
    with torch.no_grad():
        net = search.nets.cluster(search.x).argmax(1)
    assert search.n_clusters == 40
    assert (net == own).double().mean() >= 0.999
    assert search.history[-1]["distil_steps"] <= 100


def test_the_net_of_many_clusters_in_many_features_is_widened_to_their_discriminant_and_resumes():
    # 30 blobs in 40 features: 29 discriminant directions, 58 units (the paper's 50 hold 25);
    # from the discriminant the net places every row where the mixture does
    x = torch.tensor(make_blobs(3000, centers=30, n_features=40, cluster_std=1.0, random_state=0)[0],
                     dtype=torch.float32)
    search = start_fit(config := Config().with_overrides({"seed": 0}), x)
    search.fit()
    last = search.history[-1]
    assert search.n_clusters == 30 and search.nets.cluster.hidden.weight.shape == (58, 40)
    # the discriminant start already agrees: not a step is taken
    assert last["distil_steps"] == 0 and last["distil_agreement"] == 1.0
    resumed = start_fit(config, x)
    resumed.resume(search.state_dict())  # the widened net loads at its width
    with torch.no_grad():
        assert torch.equal(resumed.nets.cluster(resumed.x), search.nets.cluster(search.x))
