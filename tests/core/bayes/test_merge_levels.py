"""The greedy merge hierarchy against a brute-force one, its scores against ln p(X, z)
computed from scratch, and the elbow on curves whose elbow is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepdpm_core.bayes import (
    NIWPrior,
    SuffStats,
    elbow_level,
    grouped_stats,
    log_crp,
    log_marginal_likelihood,
    merge_levels,
)

ALPHA = 10.0


def _components(n_blobs: int, n_components: int, dim: int, seed: int) -> tuple[SuffStats, NIWPrior]:
    """``n_components`` groups of points drawn around ``n_blobs`` centres at least 8 SD
    apart (on a line through a random direction)."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=dim)
    centres = 8.0 * np.arange(n_blobs)[:, None] * direction / np.linalg.norm(direction)
    x = centres[rng.integers(n_blobs, size=60 * n_components)] + rng.normal(size=(60 * n_components, dim))
    seeds = x[rng.choice(len(x), n_components, replace=False)]
    label = ((x[:, None, :] - seeds[None]) ** 2).sum(-1).argmin(1)
    xt = torch.as_tensor(x, dtype=torch.float64)
    stats = grouped_stats(xt, torch.arange(len(x)), torch.as_tensor(label), torch.ones(len(x), dtype=torch.float64),
                          n_components)
    stats = stats.rows(torch.nonzero(stats.n > 0).squeeze(1))
    prior = NIWPrior(torch.zeros(dim, dtype=torch.float64), 0.01, dim + 2.0, torch.eye(dim, dtype=torch.float64))
    return stats, prior


def _brute_force(stats: SuffStats, prior: NIWPrior, neighbours: int) -> list[tuple[int, int]]:
    """Every step, every group's nearest means and every candidate pair scored afresh."""
    groups = {g: SuffStats(stats.n[g : g + 1], stats.s1[g : g + 1], stats.s2[g : g + 1])
              for g in range(stats.n_rows)}
    merges = []
    while len(groups) > 1:
        alive = sorted(groups)
        means = torch.cat([groups[g].s1 / groups[g].n[:, None] for g in alive])
        dist = torch.cdist(means, means).fill_diagonal_(math.inf)
        near = dist.topk(min(neighbours, len(alive) - 1), largest=False).indices
        pairs = sorted({(alive[min(i, j)], alive[max(i, j)]) for i in range(len(alive)) for j in near[i].tolist()})

        def gain(a: int, b: int) -> float:
            ga, gb = groups[a], groups[b]
            joined = log_marginal_likelihood(prior, ga + gb)
            return float(joined - log_marginal_likelihood(prior, ga) - log_marginal_likelihood(prior, gb)
                         - math.log(ALPHA) + torch.lgamma(ga.n + gb.n) - torch.lgamma(ga.n) - torch.lgamma(gb.n))

        a, b = max(pairs, key=lambda p: gain(*p))
        groups[a] = groups[a] + groups.pop(b)
        merges.append((a, b))
    return merges


@pytest.mark.parametrize(("n_blobs", "n_components", "dim", "neighbours", "seed"),
                         [(4, 30, 3, 8, 0), (7, 45, 2, 3, 0), (2, 12, 5, 20, 0),
                          # a merged mean that comes nearer than a group's farthest candidate
                          (1, 25, 2, 1, 4), (1, 25, 2, 1, 9),
                          # groups whose candidates held the group merged away
                          (2, 30, 3, 2, 0), (3, 30, 2, 3, 1)])
def test_the_hierarchy_is_the_brute_force_one(n_blobs, n_components, dim, neighbours, seed):
    stats, prior = _components(n_blobs, n_components, dim, seed)
    levels = merge_levels(stats, prior, ALPHA, neighbours)
    assert [tuple(p) for p in levels.merges.tolist()] == _brute_force(stats, prior, neighbours)


def test_each_level_scores_its_joint():
    stats, prior = _components(4, 30, 3, seed=1)
    levels = merge_levels(stats, prior, ALPHA)
    assert list(levels.n_groups) == list(range(stats.n_rows, 0, -1))
    for k, score in zip(levels.n_groups, levels.log_joint, strict=True):
        label = torch.as_tensor(levels.labels(int(k)))
        assert int(label.max()) + 1 == k
        grouped = stats.regrouped(label, int(k))
        direct = log_crp(grouped.n.numpy(), ALPHA) + float(log_marginal_likelihood(prior, grouped).sum())
        assert score == pytest.approx(direct, rel=1e-10, abs=1e-6)


def test_separated_blobs_are_the_elbow():
    for n_blobs in (3, 6):
        stats, prior = _components(n_blobs, 40, 2, seed=n_blobs)
        levels = merge_levels(stats, prior, ALPHA)
        assert elbow_level(levels.n_groups, levels.log_joint) == n_blobs


def test_elbow_of_known_curves():
    k = np.arange(1, 31)
    # gain 100 a group up to 6 groups, 10 a group up to 20, then a loss of 1 a group
    score = np.where(k <= 6, 100.0 * k, np.where(k <= 20, 600 + 10.0 * (k - 6), 740 - (k - 20.0)))
    assert elbow_level(k, score) == 6
    # the same up to 20, then gains that fall to nothing before the exact optimum at 25: a
    # ratio against them would choose 24, the floor keeps the elbow at 6
    tail = 740 + np.cumsum(np.r_[np.zeros(20), [4.0, 2.0, 1.0, 0.5, 0.01, -5, -5, -5, -5, -5]])[20:]
    score = np.r_[score[:20], tail]
    assert int(k[np.argmax(score)]) == 25
    assert elbow_level(k, score) == 6
    # no inner vertex: the exact joint's level
    assert elbow_level(np.array([1, 2]), np.array([0.0, 5.0])) == 2
