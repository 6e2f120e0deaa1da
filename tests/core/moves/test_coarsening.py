"""The coarsened Hastings ratios: what they equal, what they keep, and what they bound."""

import math

import numpy as np
import pytest
import torch

from deepdpm_core.bayes import (
    NIWPrior,
    SuffStats,
    grouped_stats,
    log_marginal_likelihood,
    log_split_hastings,
)
from deepdpm_core.moves import coarsening_constant
from deepdpm_core.moves.proposals import (
    COARSENING_PER_PARAMETER,
    EXACT_VALLEY,
    coarsened,
    propose_merges,
    propose_splits,
)

ALPHA = 10.0


def _prior(d: int, scale: float = 1.0) -> NIWPrior:
    return NIWPrior.from_shape(torch.zeros(d), torch.ones(d), 0.05, None, 0.3 * scale * scale)


def _pair_stats(x: np.ndarray, half: np.ndarray) -> SuffStats:
    """Hard statistics of the two halves of one cluster, rows (k, 1), (k, 2)."""
    xt = torch.as_tensor(x, dtype=torch.float64)
    return grouped_stats(xt, torch.arange(len(xt)), torch.as_tensor(half, dtype=torch.long),
                         torch.ones(len(xt), dtype=torch.float64), 2)


def _banana(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One curved (non-Gaussian) cluster and its split at the bend's middle."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(n, 3)) * np.array([1.6, 0.4, 0.4])
    u[:, 1] += 0.6 * u[:, 0] ** 2
    return u, (u[:, 0] > 0).astype(int)


def test_the_ratio_is_the_chain_rule_of_points_weighted_by_zeta():
    """ln H on scaled statistics is ln H of the same points each weighted by ζ = c/(c + n):
    ln Γ and ln f of the ζ-weighted groups, written out here."""
    x, half = _banana(400, 0)
    stats = _pair_stats(x, half)
    c, n = 150.0, float(len(x))
    zeta = c / (c + n)
    weighted = grouped_stats(torch.as_tensor(x), torch.arange(len(x)), torch.as_tensor(half),
                             torch.full((len(x),), zeta, dtype=torch.float64), 2)
    prior = _prior(3)
    by_hand = (math.log(ALPHA) + sum(math.lgamma(zeta * float((half == j).sum())) for j in (0, 1))
               - math.lgamma(zeta * n) + float(log_marginal_likelihood(prior, weighted).sum())
               - float(log_marginal_likelihood(prior, weighted.pair_sums())[0]))
    union = stats.n.sum().repeat(2)
    got = float(log_split_hastings(prior, ALPHA, coarsened(stats, union, c))[0])
    assert got == pytest.approx(by_hand, rel=1e-10)
    assert coarsened(stats, union, None) is stats  # null: the exact posterior


def test_the_coarsened_ratio_is_free_of_units():
    x, half = _banana(600, 1)
    union = torch.tensor([600.0, 600.0], dtype=torch.float64)
    ref = log_split_hastings(_prior(3), ALPHA, coarsened(_pair_stats(x, half), union, 150.0))
    # the prior scales with the data, as the fit's own coordinates make it
    big = log_split_hastings(_prior(3, 1e3), ALPHA, coarsened(_pair_stats(1e3 * x, half), union, 150.0))
    # ln f gains the Jacobian −n' D ln(1e3) on both sides of the ratio: it cancels
    assert float(big[0]) == pytest.approx(float(ref[0]), rel=1e-8, abs=1e-6)


def test_the_evidence_for_cutting_a_curved_cluster_is_bounded_in_n():
    """Exact: ln H of cutting one banana grows about linearly with n. Coarsened: it levels
    off, so a bigger sample of the same cluster is not cut where a smaller one was not."""
    prior = _prior(3)
    exact, coarse = [], []
    for n in (2_000, 20_000, 200_000):
        x, half = _banana(n, 2)
        stats = _pair_stats(x, half)
        union = stats.n.sum().repeat(2)
        exact.append(float(log_split_hastings(prior, ALPHA, stats)[0]))
        coarse.append(float(log_split_hastings(prior, ALPHA, coarsened(stats, union, 150.0))[0]))
    assert exact[2] > 50 * max(exact[0], 1.0)  # the exact posterior cuts it ever more surely
    assert abs(coarse[2] - coarse[1]) < 0.05 * abs(coarse[1]) + 1.0  # settled
    assert coarse[2] < exact[2] / 100


def test_two_apart_clusters_are_still_split_and_never_merged():
    rng = np.random.default_rng(3)
    for n in (1_000, 100_000):
        x = np.concatenate([rng.normal(size=(n // 2, 3)), rng.normal(size=(n // 2, 3)) + 6.0])
        half = np.repeat([0, 1], n // 2)
        stats = _pair_stats(x, half)
        accepted, log_h = propose_splits(_prior(3), ALPHA, stats, np.random.default_rng(0), 5, 150.0)
        assert accepted == [0] and log_h[0] > 50
        means = torch.stack([stats.s1[0] / stats.n[0], stats.s1[1] / stats.n[1]])
        assert propose_merges(_prior(3), ALPHA, stats, means, np.random.default_rng(0), 1, 150.0) == []


def test_the_coarsening_constant_grows_with_the_parameters_above_its_floor():
    assert COARSENING_PER_PARAMETER == 7.5
    assert coarsening_constant(None, 30, False) is None  # the exact posterior
    assert coarsening_constant(500.0, 2, False) == 500.0  # P = 5: the floor c
    assert coarsening_constant(500.0, 10, False) == 500.0  # P = 65: 487.5 < c
    assert coarsening_constant(500.0, 30, False) == 7.5 * (30 + 30 * 31 // 2)
    assert coarsening_constant(500.0, 100, True) == 7.5 * 200  # diagonal: P = 2D


def test_clusters_plainly_apart_in_many_features_are_split_at_any_n():
    """Two unit Gaussians 6 apart along one axis of 30-D, 20,000 points: a fixed c = 500
    asks ~3 nats per point of a split in 30-D and rejects it; c_p·P accepts it, and at
    the same c the 10-D case is accepted as it was."""
    rng = np.random.default_rng(0)
    n = 20_000
    for d, fixed_accepts in ((10, True), (30, False)):
        x = rng.normal(size=(n, d))
        x[n // 2:, 0] += 6.0
        stats = _pair_stats(x, np.repeat([0, 1], n // 2))
        union = stats.n.sum().repeat(2)
        fixed = float(log_split_hastings(_prior(d), ALPHA, coarsened(stats, union, 500.0))[0])
        scaled = float(log_split_hastings(
            _prior(d), ALPHA, coarsened(stats, union, coarsening_constant(500.0, d, False)))[0])
        assert (fixed > 0) == fixed_accepts
        assert scaled > 50


def test_a_move_across_a_deep_valley_is_judged_by_the_exact_posterior():
    """Two blobs 8 apart, 20,000 points: with the valley at most ``EXACT_VALLEY`` deep and
    judged, the split's (and the merge's) ratio is the exact one; shallower, or with too
    few points a side to judge, it stays coarsened."""
    rng = np.random.default_rng(3)
    n = 20_000
    x = np.concatenate([rng.normal(0, 1, (n // 2, 2)), rng.normal(8, 1, (n // 2, 2))])
    half = np.repeat([0, 1], n // 2)
    stats = _pair_stats(x, half)
    union = stats.n.sum().repeat(2)
    exact = float(log_split_hastings(_prior(2), ALPHA, stats)[0])
    tempered = float(log_split_hastings(_prior(2), ALPHA, coarsened(stats, union, 500.0))[0])
    assert exact > 10 * tempered > 0

    def split(valley, min_points=25.0, exact_valley=EXACT_VALLEY):
        return propose_splits(_prior(2), ALPHA, stats, np.random.default_rng(0), 5, 500.0, np.array([valley]), 0.75,
                              min_points, exact_valley)[1][0]

    assert split(0.1) == pytest.approx(exact, rel=1e-12)
    assert split(0.5) == pytest.approx(tempered, rel=1e-12)
    assert split(0.1, exact_valley=0.05) == pytest.approx(tempered, rel=1e-12)  # not as deep as asked
    assert split(0.1, min_points=n) == pytest.approx(tempered, rel=1e-12)  # not judged

    means = torch.as_tensor(np.stack([x[half == c].mean(0) for c in (0, 1)]))
    # with an α that makes the split cost 10 nats more than its tempered gain, the
    # coarsened ratio takes the merge (ln H_m = −ln H_s); exactly judged, it is refused
    costly = math.exp(math.log(ALPHA) - tempered - 10.0)

    def merged(valley, exact_valley=EXACT_VALLEY):
        return propose_merges(_prior(2), costly, stats, means, np.random.default_rng(0), 3, 500.0,
                              {(0, 1): valley}, 0.9, 25.0, exact_valley)

    tempered_split = float(log_split_hastings(_prior(2), costly, coarsened(stats, union, 500.0))[0])
    exact_split = float(log_split_hastings(_prior(2), costly, stats)[0])
    assert tempered_split < 0 < exact_split
    assert merged(0.5) == [(0, 1)]
    assert merged(0.1) == []
    assert merged(0.1, exact_valley=0.05) == [(0, 1)]
