"""Sufficient statistics: brute force, additivity, flat round trip."""

import numpy as np
import torch

from deepdpm_core.bayes import SuffStats, sparse_stats


def _brute(x, w):
    return (w.sum(0), w.T @ x, np.einsum("bk,bd,be->kde", w, x, x))


def test_sparse_stats_match_brute_force():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(97, 4))
    w = rng.dirichlet(np.ones(5), size=97)
    n, s1, s2 = _brute(x, w)
    idx = torch.arange(5).expand(97, 5)
    s = sparse_stats(torch.tensor(x), idx, torch.tensor(w), 5)
    np.testing.assert_allclose(s.n.numpy(), n, rtol=1e-12)
    np.testing.assert_allclose(s.s1.numpy(), s1, rtol=1e-12)
    np.testing.assert_allclose(s.s2.numpy(), s2, rtol=1e-12, atol=1e-12)


def test_union_is_sum_and_flat_round_trip():
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.normal(size=(120, 3)))
    z = torch.tensor(rng.integers(0, 4, 120))
    ones = torch.ones(120, dtype=torch.float64)
    full = sparse_stats(x, z, ones, 4)
    parts = sparse_stats(x[:50], z[:50], ones[:50], 4) + sparse_stats(x[50:], z[50:], ones[50:], 4)
    torch.testing.assert_close(full.flat(), parts.flat(), rtol=1e-12, atol=1e-12)
    back = SuffStats.from_flat(full.flat(), 4, 3)
    torch.testing.assert_close(back.s2, full.s2)
    assert full.flat().numel() == SuffStats.numel(4, 3)
    pairs = full.pair_sums()
    torch.testing.assert_close(pairs.n, full.n.view(2, 2).sum(1))
