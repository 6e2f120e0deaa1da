"""Split/merge surgery on (mixture state, nets, optimisers) alone: no search, no data pass."""

from __future__ import annotations

import math

import numpy as np
import torch

from deepdpm_core.bayes import NIWPrior, grouped_stats, map_estimate
from deepdpm_core.estep import MixtureState, log_weights_from_counts
from deepdpm_core.moves import MovePlan, Nets, apply_plan, reset_subclusters
from deepdpm_core.moves.initial import principal_split
from deepdpm_core.nets import ClusterNet, SubclusterNets
from deepdpm_core.training.batching import adam

D, H, SUB_H = 2, 16, 8
CENTRES = torch.tensor([[0.0, 0.0], [6.0, 0.0], [0.0, 6.0], [6.0, 6.0]], dtype=torch.float64)


def _setup(seed: int = 0):
    """Four clusters of 50 points; state, nets with one Adam step taken, soft statistics, prior."""
    gen = torch.Generator().manual_seed(seed)
    x = (CENTRES.repeat_interleave(50, 0) + 0.5 * torch.randn(200, D, generator=gen, dtype=torch.float64))
    z = torch.arange(4).repeat_interleave(50)
    soft = grouped_stats(x, torch.arange(200), z, torch.ones(200, dtype=torch.float64), 4, dtype=torch.float64)
    prior = NIWPrior.from_shape(torch.zeros(D, dtype=torch.float64), torch.ones(D, dtype=torch.float64),
                                0.1, None, 0.1)
    means, covs = map_estimate(prior, soft)
    state = MixtureState.without_subclusters(means, covs, log_weights_from_counts(soft.n, 1.0))
    cluster, sub = ClusterNet(D, H, 4, gen), SubclusterNets(D, SUB_H, 4, gen)
    nets = Nets(cluster, sub, adam(cluster.parameters(), 1e-3), adam(sub.parameters(), 1e-3))
    reset_subclusters(state, nets, torch.arange(4), gen)
    # one optimiser step, so that every parameter has Adam moments to move
    xf = x.float()
    loss = cluster(xf).logsumexp(1).sum() + sub(xf, z, xf[:, :2].square())[0]
    loss.backward()
    nets.opt_cluster.step()
    nets.opt_sub.step()
    return state, nets, soft, prior, gen


def test_a_split_gives_the_halves_their_subclusters_and_moves_the_adam_state():
    state, nets, soft, prior, gen = _setup()
    w = nets.cluster.out.weight
    kept_w, kept_moment = w.detach()[[0, 2, 3]].clone(), nets.opt_cluster.state[w]["exp_avg"][[0, 2, 3]].clone()
    new, new_row = apply_plan(MovePlan(splits=[1]), state, nets, soft, prior, gen)
    assert new.n_clusters == 5 and nets.cluster.n_clusters == 5 and nets.sub.n_clusters == 5
    # paper Eq. 8: cluster 1's halves (rows 1 and 4) take its subclusters' parameters
    torch.testing.assert_close(new.means[[1, 4]], state.sub_means[1])
    torch.testing.assert_close(new.covariances[[1, 4]], state.sub_covariances[1])
    torch.testing.assert_close(new.log_weights[[1, 4]].exp().sum(), state.log_weights[1].exp())
    torch.testing.assert_close(new.log_weights.exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    # kept clusters keep their parameters, output units and Adam moments
    torch.testing.assert_close(new.means[[0, 2, 3]], state.means[[0, 2, 3]])
    w = nets.cluster.out.weight
    torch.testing.assert_close(w.detach()[[0, 2, 3]], kept_w)
    torch.testing.assert_close(nets.opt_cluster.state[w]["exp_avg"][[0, 2, 3]], kept_moment)
    assert any(p is w for p in nets.opt_cluster.param_groups[0]["params"])
    # the new clusters' subclusters are their principal halves; their subnets start with zero moments
    sm, _, _, _ = principal_split(new.means[[1, 4]], new.covariances[[1, 4]])
    torch.testing.assert_close(new.sub_means[[1, 4]], sm)
    assert bool((nets.opt_sub.state[nets.sub.w1]["exp_avg"][[1, 4]] == 0).all())
    assert bool((nets.opt_sub.state[nets.sub.w1]["exp_avg"][[0, 2, 3]] != 0).any())
    assert new_row.tolist() == [0, 1, 2, 3]
    # each half wins its own subcluster's mean
    with torch.no_grad():
        logits = nets.cluster(new.means[[1, 4]].float())
    assert logits[0, 1] > logits[0, 4] and logits[1, 4] > logits[1, 1]


def test_a_merge_pools_the_statistics_and_keeps_the_larger_unit():
    state, nets, soft, prior, gen = _setup()
    soft.n[2] += 10  # cluster 2 is the larger part: its output unit survives
    w_big, b_big = nets.cluster.out.weight.detach()[2].clone(), float(nets.cluster.out.bias.detach()[2])
    new, new_row = apply_plan(MovePlan(merges=[(0, 2)], prunes=[3]), state, nets, soft, prior, gen)
    assert new.n_clusters == 2 and new_row.tolist() == [0, 1, 0, -1]
    mean, cov = map_estimate(prior, soft.rows([0]) + soft.rows([2]))
    torch.testing.assert_close(new.means[0], mean[0])
    torch.testing.assert_close(new.covariances[0], cov[0])
    # the two old clusters become the merged one's subclusters
    torch.testing.assert_close(new.sub_means[0], state.means[[0, 2]])
    torch.testing.assert_close(new.sub_log_weights[0].exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(nets.cluster.out.weight.detach()[0], w_big)
    n_a, n_b = float(soft.n[0]), float(soft.n[2])
    # its bias raised by ln(1 + n_small / n_large) for the added mass
    assert math.isclose(float(nets.cluster.out.bias.detach()[0]) - b_big, math.log1p(n_a / n_b), rel_tol=1e-5)
    torch.testing.assert_close(new.log_weights.exp().sum(), torch.tensor(1.0, dtype=torch.float64))


def test_surgery_is_a_function_of_its_inputs():
    """Two ranks with the same state, nets and generator state end identical."""
    runs = []
    for _ in range(2):
        state, nets, soft, prior, gen = _setup(seed=3)
        new, _ = apply_plan(MovePlan(splits=[0, 3], merges=[(1, 2)]), state, nets, soft, prior, gen)
        runs.append([t.detach().clone() for t in (*new.tensors(), *nets.cluster.parameters(),
                                                  *nets.sub.parameters())])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_the_input_state_is_left_as_it_was():
    state, nets, soft, prior, gen = _setup()
    before = [t.clone() for t in state.tensors()]
    apply_plan(MovePlan(splits=[2], merges=[(0, 1)]), state, nets, soft, prior, gen)
    for a, b in zip(before, state.tensors(), strict=True):
        assert torch.equal(a, b)


def test_mixture_state_round_trips_and_reindexes():
    state, *_ = _setup()
    again = MixtureState.from_state({**state.state_dict(), "other": 1})
    for a, b in zip(state.tensors(), again.tensors(), strict=True):
        assert torch.equal(a, b)
    picked = state.rows(torch.tensor([3, 3, 0]))
    assert picked.n_clusters == 3 and picked.dim == D
    np.testing.assert_array_equal(picked.sub_covariances[1].numpy(), state.sub_covariances[3].numpy())
