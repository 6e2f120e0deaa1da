"""Subcluster covariances computed where they are read (deepdpm_core.estep.mixture_state)."""

import math

import torch

from deepdpm_core.bayes import NIWPrior, SuffStats, map_estimate
from deepdpm_core.estep import MixtureState, SubclusterMAP


def _sub_stats(k: int, d: int) -> tuple[NIWPrior, SuffStats]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40 * k, d, dtype=torch.float64, generator=g)
    rows = torch.randint(0, 2 * k, (40 * k,), generator=g)
    n = torch.bincount(rows, minlength=2 * k).double()
    s1 = torch.zeros(2 * k, d, dtype=torch.float64).index_add_(0, rows, x)
    s2 = torch.zeros(2 * k, d, d, dtype=torch.float64).index_add_(0, rows, x[:, :, None] * x[:, None, :])
    f64 = {"dtype": torch.float64}
    prior = NIWPrior.from_shape(torch.zeros(d, **f64), torch.ones(d, **f64), 1.0, None, 1.0,
                                floor=torch.full((d,), 1e-4, **f64))
    return prior, SuffStats(n, s1, s2)


def test_subcluster_map_rows_are_the_batched_map_to_the_bit():
    k, d = 12, 5
    prior, stats = _sub_stats(k, d)
    full = map_estimate(prior, stats)[1].view(k, 2, d, d)
    lazy = SubclusterMAP(prior, stats)
    assert torch.equal(lazy.rows(), full)
    ks = torch.tensor([3, 7, 7, 11, 0])
    assert torch.equal(lazy.rows(ks), full[ks])
    src = torch.tensor([5, 3, 3, 10, 0, 11])
    picked = lazy.picked(src)
    assert torch.equal(picked.rows(), full[src]) and torch.equal(picked.rows(torch.tensor([2, 5])), full[src][[2, 5]])
    given = torch.ones(1, 2, d, d, dtype=torch.float64)
    expected = full[src].clone()
    expected[1] = given[0]
    changed = picked.with_rows(torch.tensor([1]), given)
    assert torch.equal(changed.rows(), expected)
    assert torch.equal(changed.picked(torch.tensor([1, 1, 0])).rows(), expected[[1, 1, 0]])


def test_a_state_with_deferred_subcluster_covariances_reads_as_the_computed_one():
    k, d = 6, 4
    prior, stats = _sub_stats(k, d)
    full = map_estimate(prior, stats)[1].view(k, 2, d, d)
    f64 = {"dtype": torch.float64}
    parts = (torch.zeros(k, d, **f64), torch.eye(d, **f64).repeat(k, 1, 1), torch.full((k,), -math.log(k), **f64),
             torch.zeros(k, 2, d, **f64))
    lazy = MixtureState(*parts, SubclusterMAP(prior, stats), torch.full((k, 2), -math.log(2), **f64))
    eager = MixtureState(*parts, full.clone(), torch.full((k, 2), -math.log(2), **f64))
    ks = torch.tensor([4, 1])
    assert torch.equal(lazy.sub_covariance_rows(ks), eager.sub_covariance_rows(ks))
    for state in (lazy, eager):
        state.set_sub_covariances(torch.tensor([2]), 3.0 * torch.eye(d, **f64).expand(1, 2, d, d))
    src = torch.tensor([2, 2, 5, 0])
    moved_lazy, moved_eager = lazy.rows(src), eager.rows(src)
    assert torch.equal(moved_lazy.sub_covariances, moved_eager.sub_covariances)
    assert torch.equal(moved_lazy.sub_covariances[0, 1], 3.0 * torch.eye(d, **f64))
    assert all(torch.equal(a, b) for a, b in zip(lazy.tensors(), eager.tensors(), strict=True))
    assert lazy.state_dict().keys() == eager.state_dict().keys()
