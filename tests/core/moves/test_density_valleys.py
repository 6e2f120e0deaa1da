"""Density valleys along split and merge axes: the histograms against per-point sums, the
valley ratio against a kernel density written out, and what the moves do with them."""

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from deepdpm_core import DeepDPM
from deepdpm_core.bayes import NIWPrior, SuffStats, grouped_stats
from deepdpm_core.data import clustering_scores, make_mixture
from deepdpm_core.estep import MixtureState
from deepdpm_core.moves import density_valleys
from deepdpm_core.moves.density_valleys import (
    APART_POINTS_PER_FEATURE,
    BINS,
    MEANS_WITHIN,
    MERGE_VALLEY,
    PAIR_SIDE_SHARE,
    SPAN,
    SPLIT_VALLEY,
    VALLEY_BANDWIDTH,
    VALLEY_MIN_POINTS,
    pair_axes,
    pair_histograms,
    projection_histograms,
    split_axes,
    valley_ratios,
)
from deepdpm_core.moves.proposals import EXACT_VALLEY, propose_merges, propose_splits

BANDWIDTH, MIN_POINTS = VALLEY_BANDWIDTH, VALLEY_MIN_POINTS


def _state(rng: np.random.Generator, k: int, d: int) -> MixtureState:
    means = torch.as_tensor(rng.normal(size=(k, d)) * 3)
    a = rng.normal(size=(k, d, d))
    covs = torch.as_tensor(a @ a.transpose(0, 2, 1) / d + 0.5 * np.eye(d))
    state = MixtureState.without_subclusters(means, covs, torch.log(torch.full((k,), 1.0 / k, dtype=torch.float64)))
    state.sub_means = means[:, None, :] + torch.as_tensor(rng.normal(size=(k, 2, d)))
    b = rng.normal(size=(k, 2, d, d))
    state.sub_covariances = torch.as_tensor(b @ b.transpose(0, 1, 3, 2) / d + 0.2 * np.eye(d))
    state.sub_log_weights = torch.log_softmax(torch.as_tensor(rng.normal(size=(k, 2))), 1)
    return state


def _counts(t: np.ndarray) -> np.ndarray:
    """Histogram of standardised positions t over [−SPAN, SPAN] into BINS bins, by hand."""
    out = np.zeros(BINS)
    for v in t:
        if abs(v) < SPAN:
            out[min(int((v + SPAN) / (2 * SPAN) * BINS), BINS - 1)] += 1
    return out


def test_the_split_axis_is_fishers_discriminant_of_the_subclusters():
    """Two long clusters side by side: the line between their means runs along their
    length, the discriminant across the gap; the projections agree with numpy's."""
    rng = np.random.default_rng(7)
    state = _state(rng, 1, 2)
    state.sub_means = torch.tensor([[[0.0, 0.0], [1.0, 3.0]]], dtype=torch.float64)
    long = torch.tensor([[0.1, 0.0], [0.0, 9.0]], dtype=torch.float64)
    state.sub_covariances = torch.stack([long, long])[None]
    state.sub_log_weights = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    _, unit, _ = split_axes(state)
    want = np.linalg.solve(long.numpy() + 1e-6 * state.covariances[0].numpy(), np.array([-1.0, -3.0]))
    np.testing.assert_allclose(unit[0].numpy(), want / np.linalg.norm(want), rtol=1e-9)
    assert abs(float(unit[0, 0])) > 0.99  # across the gap, not along the clusters


def _fisher(diff: np.ndarray, within: np.ndarray) -> np.ndarray:
    v = np.linalg.solve(within, diff)
    return v / np.linalg.norm(v)


def _labelled_rows(seed: int, k: int, d: int, n: int) -> tuple[MixtureState, Tensor, Tensor]:
    """A random state of k clusters, n rows and each row's cluster (−1: none)."""
    rng = np.random.default_rng(seed)
    state = _state(rng, k, d)
    x = torch.as_tensor(rng.normal(size=(n, d)) * 3, dtype=torch.float32)
    return state, x, torch.as_tensor(rng.integers(-1, k, size=n))


def test_the_split_histograms_count_each_point_on_its_cluster_axis():
    k = 4
    state, x, labels = _labelled_rows(0, k, 5, 600)
    got = projection_histograms(x, labels, state, chunk=97).numpy()
    xs, lab = x.double().numpy(), labels.numpy()
    for c in range(k):
        sub = state.sub_means[c].numpy()
        w = np.exp(state.sub_log_weights[c].numpy())
        within = np.einsum("j,jab->ab", w, state.sub_covariances[c].numpy()) + 1e-6 * state.covariances[c].numpy()
        u = _fisher(sub[0] - sub[1], within)
        sd = math.sqrt(u @ state.covariances[c].numpy() @ u)
        t = (xs[lab == c] - sub.mean(0)) @ u / sd
        np.testing.assert_array_equal(got[c], _counts(t))


def test_the_pair_axis_scale_is_the_pooled_spread_of_the_two_clusters():
    """Within plus between variance along the axis, weights as the mixture's: checked on
    points drawn from the two Gaussians in proportion."""
    rng = np.random.default_rng(1)
    state = _state(rng, 3, 4)
    state.log_weights = torch.log(torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64))
    mid, unit, scale = pair_axes(state, [(0, 2)])
    pooled = (0.6 * state.covariances[0] + 0.1 * state.covariances[2]).numpy() / 0.7
    np.testing.assert_allclose(unit[0].numpy(), _fisher((state.means[0] - state.means[2]).numpy(), pooled),
                               rtol=1e-9)
    draws = [rng.multivariate_normal(state.means[c].numpy(), state.covariances[c].numpy(), size=m)
             for c, m in ((0, 600_000), (2, 100_000))]
    t = np.concatenate(draws) @ unit[0].numpy()
    assert float(scale[0]) == pytest.approx(t.std(), rel=5e-3)
    np.testing.assert_allclose(mid[0].numpy(), (state.means[0] + state.means[2]).numpy() / 2)


def test_the_pair_histograms_count_the_two_clusters_points_on_their_axis():
    k, d = 5, 3
    state, x, labels = _labelled_rows(2, k, d, 800)
    pairs = [(0, 1), (1, 4), (2, 3)]
    got = pair_histograms(x, labels, state, pairs).numpy()
    mid, unit, scale = pair_axes(state, pairs)
    for p, (a, b) in enumerate(pairs):
        rows = np.isin(labels.numpy(), [a, b])
        t = (x.double().numpy()[rows] - mid[p].numpy()) @ unit[p].numpy() / float(scale[p])
        np.testing.assert_array_equal(got[p], _counts(t))
    assert split_axes(state)[0].shape == (k, d)


def test_the_axes_computed_a_few_at_a_time_are_those_computed_at_once(monkeypatch):
    """:func:`split_axes` and :func:`pair_axes` take :data:`AXES_PER_PASS` clusters or pairs
    at a time: the same values as all in one pass, the last pass short."""
    state, _, _ = _labelled_rows(3, 7, 4, 10)
    pairs = [(0, 1), (1, 4), (2, 3), (5, 6), (6, 0)]
    at_once = split_axes(state), pair_axes(state, pairs)
    monkeypatch.setattr(density_valleys, "AXES_PER_PASS", 2)
    for got, want in zip((split_axes(state), pair_axes(state, pairs)), at_once, strict=True):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)


def _ratio_by_hand(counts: np.ndarray, min_side: float) -> float:
    """The deepest valley of a Gaussian kernel density of the bin centres, written out."""
    n = counts.sum()
    width = 2 * SPAN / BINS
    h = BANDWIDTH * n ** -0.2
    taps = np.arange(-math.ceil(4 * h / width), math.ceil(4 * h / width) + 1) * width
    kernel = np.exp(-0.5 * (taps / h) ** 2)
    kernel /= kernel.sum()
    f = np.array([sum(counts[j] * kernel[i - j + len(taps) // 2] for j in range(BINS)
                      if 0 <= i - j + len(taps) // 2 < len(taps)) for i in range(BINS)])
    best = 1.0
    for i in range(1, BINS - 1):
        left, right = counts[:i].sum(), counts[i + 1 :].sum()
        side = max(min_side, 0.01 * n)
        if left < side or right < side:
            continue
        lower = min(f[:i].max(), f[i + 1 :].max())
        if lower > 0:
            best = min(best, f[i] / lower)
    return best


@pytest.mark.parametrize("gap", [0.0, 2.0, 3.0, 4.0, 6.0])
def test_the_valley_ratio_is_the_floor_over_the_lower_side_peak(gap):
    rng = np.random.default_rng(3)
    v = np.concatenate([rng.normal(-gap / 2, 1, 3000), rng.normal(gap / 2, 1, 2000)])
    t = (v - v.mean()) / v.std()
    counts = _counts(t)
    got = valley_ratios(counts[None], 5.0, BANDWIDTH)[0]
    assert got == pytest.approx(_ratio_by_hand(counts, 5.0), rel=1e-9, abs=1e-12)


def test_a_small_cluster_far_from_a_large_one_shows_its_valley():
    """A cluster of 60 points 12 standard deviations from one of 8,000 (0.7 % of the
    pair): the pooled spread is about the large cluster's own, yet both means lie inside
    the pair's histogram, and the valley between them counts (a side need not hold 1 % of
    the pair, only half the smaller cluster), so the merge rule does not take the pair for
    one mode."""
    rng = np.random.default_rng(3)
    d, sizes = 4, (8000, 60)
    means = torch.zeros(2, d, dtype=torch.float64)
    means[1, 0] = 12.0
    covs = torch.eye(d, dtype=torch.float64).repeat(2, 1, 1)
    weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    state = MixtureState.without_subclusters(means, covs, weights.log())
    x = torch.as_tensor(np.concatenate([rng.normal(size=(n, d)) + means[c].numpy()
                                        for c, n in enumerate(sizes)]), dtype=torch.float32)
    labels = torch.repeat_interleave(torch.arange(2), torch.tensor(sizes))
    _, _, scale = pair_axes(state, [(0, 1)])
    assert 6.0 / float(scale[0]) == pytest.approx(MEANS_WITHIN * SPAN)  # half the gap, at half the span
    hist = pair_histograms(x, labels, state, [(0, 1)]).numpy()
    assert hist.sum() == sum(sizes)  # every point of both clusters inside
    assert valley_ratios(hist, 5.0, BANDWIDTH, share_cap=np.array([PAIR_SIDE_SHARE * 60]))[0] < 0.05
    assert valley_ratios(hist, 5.0, BANDWIDTH)[0] == 1.0


@pytest.mark.slow
def test_the_smallest_cluster_of_an_unequal_mixture_in_128_d_is_kept():
    """10 Gaussians in 128-D with Dirichlet(0.5) weights (20,000 rows; the smallest of 108
    rows, 0.9 % of the largest's pair): found exactly. The merge rule took the smallest
    and the largest cluster for one mode when their pair's histogram left the smaller
    one out (K = 9, the 10 classes scoring 30,967 nats higher under the fit's own prior)."""
    x, y = make_mixture(20_000, 128, 10, imbalance=0.5, min_weight=0.005, random_state=2)
    assert np.bincount(y).min() == 108
    fit = DeepDPM(random_state=2).fit(x)
    assert fit.n_clusters_ == 10
    assert clustering_scores(y, fit.labels_)["nmi"] > 0.999


def test_one_mode_has_no_valley_and_two_apart_have_a_deep_one():
    """From a few thousand points on: a Gaussian, a Student-t (3 dof) and a skewed (gamma)
    sample show no valley as deep as :data:`SPLIT_VALLEY` (0.75), and two
    Gaussians 3.5 standard deviations apart (the nearest equal pair the DP prior splits)
    always do, ten draws each."""
    rng = np.random.default_rng(4)

    def ratio(v):
        t = (v - v.mean()) / v.std()
        return valley_ratios(_counts(t)[None] if len(t) < 5000 else
                             np.histogram(t, BINS, range=(-SPAN, SPAN))[0][None].astype(float), 5.0, BANDWIDTH)[0]

    for n in (3000, 100_000):
        for _ in range(10):
            assert ratio(rng.normal(size=n)) > SPLIT_VALLEY
            assert ratio(rng.standard_t(3, size=n)) > SPLIT_VALLEY
            assert ratio(rng.gamma(2.0, size=n)) > SPLIT_VALLEY
    for n in (1000, 100_000):
        for _ in range(10):
            assert ratio(np.concatenate([rng.normal(0, 1, n // 2), rng.normal(3.5, 1, n // 2)])) < SPLIT_VALLEY
    # a few stray points in a tail are no second mode
    assert ratio(np.concatenate([rng.normal(size=5000), rng.normal(6, 0.1, 20)])) > MERGE_VALLEY


def _prior(d: int) -> NIWPrior:
    return NIWPrior.from_shape(torch.zeros(d), torch.ones(d), 0.05, None, 0.3)


def test_a_split_without_a_valley_is_not_proposed():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(0, 1, (200, 2)), rng.normal(8, 1, (200, 2))])
    half = (x[:, 0] > 4).astype(int)
    stats = grouped_stats(torch.as_tensor(x), torch.arange(400), torch.as_tensor(half),
                          torch.ones(400, dtype=torch.float64), 2)
    on, log_h = propose_splits(_prior(2), 10.0, stats, np.random.default_rng(0), 5, None, np.array([0.1]), 0.75)
    off, log_h_off = propose_splits(_prior(2), 10.0, stats, np.random.default_rng(0), 5, None,
                                    np.array([0.9]), 0.75)
    assert on == [0] and log_h[0] > 10
    assert off == [] and log_h_off[0] == -np.inf
    # halves of fewer than MIN_POINTS: the kernel may fill any valley, the ratio decides
    few = stats.scaled(torch.full((2,), (MIN_POINTS - 1) / 200, dtype=torch.float64))
    kept, _ = propose_splits(_prior(2), 10.0, few, np.random.default_rng(0), 5, None, np.array([0.9]), 0.75,
                             MIN_POINTS)
    assert kept == [0]


def test_a_pair_without_a_valley_is_merged_whatever_its_ratio():
    """Two far-apart clusters the Hastings ratio keeps apart are merged only when their
    pair has no valley (as a split of their union would not be proposed)."""
    rng = np.random.default_rng(6)
    x = np.concatenate([rng.normal(0, 1, (200, 2)), rng.normal(8, 1, (200, 2))])
    z = torch.as_tensor((x[:, 0] > 4).astype(int))
    stats = grouped_stats(torch.as_tensor(x), torch.arange(400), z, torch.ones(400, dtype=torch.float64), 2)
    means = torch.as_tensor(np.stack([x[z.numpy() == c].mean(0) for c in (0, 1)]))
    args = (_prior(2), 10.0, stats, means, np.random.default_rng(0), 3, None)
    assert propose_merges(*args) == []
    assert propose_merges(*args, {(0, 1): 0.8}, 0.9, MIN_POINTS) == []
    assert propose_merges(*args, {(0, 1): 0.95}, 0.9, MIN_POINTS) == [(0, 1)]
    # clusters of fewer than MIN_POINTS: the ratio decides
    few = (_prior(2), 10.0, stats.scaled(torch.full((2,), (MIN_POINTS - 1) / 200, dtype=torch.float64)), means,
           np.random.default_rng(0), 3, None)
    assert propose_merges(*few, {(0, 1): 0.95}, 0.9, MIN_POINTS) == []


def test_a_pair_across_a_deep_valley_is_not_merged_where_each_side_has_points_to_judge_it():
    """A prior as wide as the pair (fitted while clusters still held several blobs) merges
    two whole blobs by the Hastings ratio; a valley at most EXACT_VALLEY deep between them
    keeps them apart where each holds APART_POINTS_PER_FEATURE points a feature, and below
    that (Fisher's axis fitted to few points shows such valleys in one Gaussian) leaves
    the pair to its ratio."""
    d = 8
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.normal(0, 1, (100, d)), rng.normal(0, 1, (100, d)) + 4.0 / np.sqrt(d)])
    z = torch.as_tensor(np.repeat([0, 1], 100))
    stats = grouped_stats(torch.as_tensor(x), torch.arange(200), z, torch.ones(200, dtype=torch.float64), 2)
    means = torch.as_tensor(np.stack([x[z.numpy() == c].mean(0) for c in (0, 1)]))
    wide = NIWPrior.from_shape(torch.zeros(d), torch.ones(d), 0.05, d + 40.0, 9.0)
    assert 100 >= APART_POINTS_PER_FEATURE * d > 50 >= MIN_POINTS

    def merged(s: SuffStats, valley: float) -> list[tuple[int, int]]:
        return propose_merges(wide, 10.0, s, means, np.random.default_rng(0), 3, None, {(0, 1): valley}, 0.85,
                              MIN_POINTS, EXACT_VALLEY)

    assert merged(stats, 0.5) == [(0, 1)]  # the ratio merges them
    assert merged(stats, EXACT_VALLEY) == []
    half = stats.scaled(torch.full((2,), 0.5, dtype=torch.float64))  # 50 a side: 6 a feature
    assert merged(half, 0.5) == [(0, 1)] and merged(half, EXACT_VALLEY) == [(0, 1)]


def _worms(n: int, seed: int, k: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """``k`` curved worms in 2-D, 16 apart on a 4 x 3 grid: quadratic Bezier arcs of chord 10
    bent by up to 5, points uniform in the curve's parameter, 0.3 thick."""
    rng = np.random.default_rng(seed)
    centres = 16.0 * np.stack(np.meshgrid(np.arange(4), np.arange(3)), -1).reshape(-1, 2)[:k]
    y = rng.permutation(np.arange(n) % k)
    angle = rng.uniform(0, 2 * np.pi, k)
    along = np.stack([np.cos(angle), np.sin(angle)], 1)
    across = np.stack([-np.sin(angle), np.cos(angle)], 1)
    bend = rng.uniform(-5, 5, k)[:, None]
    t = rng.uniform(size=n)[:, None]
    curve = (1 - t) ** 2 * -5 * along[y] + 2 * (1 - t) * t * bend[y] * across[y] + t**2 * 5 * along[y]
    return (centres[y] + curve + rng.normal(0, 0.3, (n, 2))).astype(np.float32), y


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_curved_clusters_cut_by_the_start_are_joined_again(seed):
    """From 3 x K k-means clusters the pieces of a worm, whose shallow dips along it are no
    valley a split could have cut, are merged back: K 12 or 13 from 36 clusters, as 12 from
    10 (with a merge threshold of 0.9: 14 and 15 from 36)."""
    x, y = _worms(6000, seed)
    fit = DeepDPM(random_state=0, init__n_clusters=36).fit(x)
    assert 11 <= fit.n_clusters_ <= 13
    assert clustering_scores(y, fit.labels_)["nmi"] > 0.98


def _bananas(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Four curved clusters in 6-D (a Gaussian bent along a random plane) 9 apart."""
    rng = np.random.default_rng(seed)
    centres = np.eye(6)[:4] * 9.0
    y = rng.integers(4, size=n)
    rot = np.linalg.qr(rng.normal(size=(4, 6, 6)))[0]
    u = rng.normal(size=(n, 6)) * np.r_[1.6, np.full(5, 0.4)]
    u[:, 1] += 0.6 * (u[:, 0] ** 2 - 1.6**2)
    return (centres[y] + np.einsum("nij,nj->ni", rot[y], u)).astype(np.float32), y


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_curved_clusters_keep_their_number_as_n_grows(seed):
    """With the valley rules K is 4 at 24k rows and at most 6 at 2k (500 points a banana;
    both by exact EM); without them the Gaussian model cuts the bananas into 16
    pieces at 2k rows (20-24 at 24k)."""
    for n, most in ((24000, 4), (2000, 6)):
        x, y = _bananas(n, seed)
        fit = DeepDPM(random_state=seed).fit(x)
        assert 4 <= fit.n_clusters_ <= most, (n, fit.n_clusters_)
        assert clustering_scores(y, fit.labels_)["nmi"] > 0.9
