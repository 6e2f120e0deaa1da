"""Growth: a settled small-data search against k-means partitions of 2K, 4K, ... clusters,
each scored by the coarsened ln p(X, z) with the prior fitted to it."""

import math

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from deepdpm_core import DeepDPM
from deepdpm_core.bayes import (
    PriorFit,
    fitted_log_joint,
    grouped_stats,
    log_crp,
    log_marginal_likelihood,
)
from deepdpm_core.config import Config
from deepdpm_core.data import clustering_scores
from deepdpm_core.moves import MoveSchedule, coarsening_constant
from deepdpm_core.moves import initial as settling_kmeans
from deepdpm_core.training import Search, start_fit
from deepdpm_core.training.fit_context import partition_stats
from deepdpm_core.training.settling import (
    EXACT_FALLS,
    EXACT_GAIN,
    HIDDEN_GROUPS,
    _best_size,
    _hides_groups,
    coarsened_score,
    grow,
    most_clusters,
    partition_score,
    valley_groups,
)
from tests.support.blobs import many_blobs


def _trainer_at(x: np.ndarray, labels: np.ndarray, **overrides) -> Search:
    search = start_fit(Config().with_overrides({"seed": 0, **overrides}), torch.as_tensor(x))
    search.initialize(torch.as_tensor(labels))
    search.estep_targets()  # the anchors of a settled fit: each row's best cluster
    return search


def _grow(search: Search) -> bool:
    """:func:`grow` of the search's settled partition; the search restarts from the
    grown one if there is one."""
    grown = grow(search.ctx, search.config, search.prior_fit, search.anchors, search.n_clusters,
                 search.schedule.growths, search.rng)
    if grown is not None:
        search.initialize(grown)
    return grown is not None


def test_without_coarsening_the_score_is_the_partitions_evidence():
    x, y = many_blobs()
    search = _trainer_at(x, y % 8, **{"prior.coarsening": None})
    # the same fixed point of the prior's fit, to the tolerances its two callers refit it to
    assert coarsened_score(search.ctx, search.config, search.prior_fit, torch.as_tensor(y), 40) == pytest.approx(
        partition_score(search.ctx, search.config, search.prior_fit, torch.as_tensor(y), 40), rel=1e-5)


def test_the_coarsened_score_tempers_every_row_by_zeta():
    """Against the same joint computed from statistics whose rows weigh ζ = c/(c + N)."""
    x, y = many_blobs()
    search = _trainer_at(x, y % 8)
    labels = torch.as_tensor(y)
    stats, _ = partition_stats(search.ctx, labels, 40)
    prior_fit = PriorFit(search.config.prior, search.coords, search.device)
    prior_fit.restore(search.prior_fit.state_dict())
    fitted_log_joint(stats, prior_fit, search.config.prior.alpha, rtol=1e-2)
    p = search.config.prior
    c = coarsening_constant(p.coarsening, x.shape[1], False)
    zeta = c / (c + len(x))
    weighted = grouped_stats(search.x.double(), torch.arange(len(y)), labels,
                             torch.full((len(y),), zeta, dtype=torch.float64), 40)
    expected = log_crp(np.bincount(y) * zeta, p.alpha) + float(log_marginal_likelihood(prior_fit.prior, weighted).sum())
    assert coarsened_score(search.ctx, search.config, search.prior_fit, labels, 40) == pytest.approx(expected, rel=1e-6)


def test_a_partition_of_wide_clusters_grows_to_many_more():
    """Ten clusters of about 4 blobs each: 20 and 40 k-means clusters score far higher."""
    x, y = many_blobs()
    search = _trainer_at(x, y % 10)
    assert _grow(search)
    assert search.n_clusters in (20, 40)


def test_the_true_partition_does_not_grow():
    x, y = many_blobs()
    search = _trainer_at(x, y)
    assert not _grow(search)
    assert search.n_clusters == 40


def test_a_restarted_schedule_searches_again_and_counts_its_growths():
    config = Config().with_overrides({"small_data.max_rows": 10})
    schedule = MoveSchedule(config.schedule, config.moves)
    for epoch in range(1, 40):
        if schedule.move_at(epoch):
            schedule.moved(epoch, 0, 5)
        if schedule.finished(epoch):
            break
    schedule.restart(epoch)
    assert not schedule.finished(epoch) and schedule.frozen(epoch + 1)
    assert schedule.counters()["growths"] == 1 and schedule.round_k == []
    again = MoveSchedule(config.schedule, config.moves)
    again.restore(schedule.counters())
    assert again.counters() == schedule.counters()
    older = {k: v for k, v in schedule.counters().items() if k != "growths"}  # a checkpoint from before growth
    again.restore(older)
    assert again.growths == 0 and again.round_k == schedule.round_k


@pytest.mark.slow
def test_forty_blobs_in_64_dimensions_are_found_from_the_default_start():
    x, y = many_blobs()
    fit = DeepDPM(random_state=0).fit(x)
    assert fit.n_clusters_ == 40
    assert clustering_scores(y, fit.labels_)["nmi"] == pytest.approx(1.0)
    assert [r["grown"] for r in fit.history_ if "grown" in r]


def _grid_blobs(side: int, per_blob: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """side x side unit Gaussians 4.2 apart in 2-D, ``per_blob`` rows each."""
    rng = np.random.default_rng(seed)
    centres = 4.2 * np.stack(np.meshgrid(np.arange(side), np.arange(side)), -1).reshape(-1, 2)
    y = np.repeat(np.arange(side * side), per_blob)
    return centres[y] + rng.standard_normal((len(y), 2)), y


def test_a_collapsed_search_is_judged_by_the_exact_joint():
    """One cluster: the prior fitted to it is that cluster's own shape (ν0 at its ceiling),
    so the coarsened joint prefers it to every k-means partition of a grid of blobs; the
    exact joint prefers many more clusters."""
    x, y = _grid_blobs(6, 150)
    search = _trainer_at(x, np.zeros(len(y), dtype=np.int64))
    assert _grow(search)
    assert search.n_clusters >= 16


@pytest.mark.slow
def test_a_grid_of_blobs_started_from_three_clusters_is_found():
    """From 3 wide clusters the fitted prior refuses every cut and merges take the 36 blobs
    down to one cluster; growth by the exact joint searches again from many more."""
    x, y = _grid_blobs(6, 150)
    fit = DeepDPM(random_state=0, init__n_clusters=3).fit(x)
    assert abs(fit.n_clusters_ - 36) <= 3
    assert clustering_scores(y, fit.labels_)["nmi"] >= 0.85
    assert [r["grown"] for r in fit.history_ if "grown" in r]


def _curve_blobs(k: int, per_blob: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """k unit Gaussians 6 apart along the arc of y = 30 sin(2 pi x / 200), ``per_blob`` rows each."""
    rng = np.random.default_rng(seed)
    s = 6.0 * np.arange(k)
    y = np.repeat(np.arange(k), per_blob)
    return np.column_stack([s, 30.0 * np.sin(2 * np.pi * s / 200.0)])[y] + rng.standard_normal((len(y), 2)), y


def test_no_probe_for_hidden_groups_where_the_cap_allows_too_few_clusters():
    """40 blobs of 75 rows in 64-D: growth's partitions hold at most 88 clusters, fewer than
    the HIDDEN_GROUPS x 40 groups the probe would have to find, so its k-means is not run
    (it would draw its seeds from the fit's generator)."""
    x, y = many_blobs()
    search = _trainer_at(x, y)
    assert most_clusters(len(x), x.shape[1], False) < HIDDEN_GROUPS * search.n_clusters
    before = search.rng.bit_generator.state
    assert not _hides_groups(search.ctx, search.config, search.prior_fit, search.n_clusters, search.rng, {})
    assert search.rng.bit_generator.state == before


def test_valley_groups_count_what_density_valleys_part():
    """36 grid blobs stay 36 groups; 16 k-means pieces of one Gaussian join into one."""
    x, y = _grid_blobs(6, 150)
    search = _trainer_at(x, y)
    assert valley_groups(search.ctx, search.prior_fit, torch.as_tensor(y), 36) == 36
    one = np.random.default_rng(1).standard_normal((3000, 2))
    pieces = KMeans(16, n_init=1, random_state=0).fit_predict(one)
    search = _trainer_at(one, pieces)
    assert valley_groups(search.ctx, search.prior_fit, torch.as_tensor(pieces), 16) == 1


def test_growth_makes_one_k_means_partition_a_size(monkeypatch):
    """The coarsened joint's sizes (2K, 4K, 8K) and the probe for hidden groups (8K) read
    the same k-means partitions: each size is clustered once."""
    x, y = _curve_blobs(60, 150)
    search = _trainer_at(x, y)
    sizes = []

    def counted(x, init, *args):
        sizes.append(init.n_clusters)
        return settling_kmeans.initial_clusters(x, init, *args)

    monkeypatch.setattr("deepdpm_core.training.settling.initial_clusters", counted)
    _grow(search)
    assert sizes[:3] == [120, 240, 480]  # the coarsened joint's sizes, then the probe's 480 read again
    assert len(sizes) == len(set(sizes))


@pytest.mark.slow
def test_a_curve_of_blobs_started_from_three_clusters_is_found():
    """From 3 wide clusters of 60 blobs along a curve the fitted prior refuses every cut
    (K 3 before); 96 k-means clusters leave 60 groups apart by valleys, and the exact joint
    prefers them."""
    x, y = _curve_blobs(60, 150)
    fit = DeepDPM(random_state=0, init__n_clusters=3).fit(x)
    assert abs(fit.n_clusters_ - 60) <= 6
    assert clustering_scores(y, fit.labels_)["nmi"] >= 0.9
    assert [r["grown"] for r in fit.history_ if "grown" in r]


def test_growth_tries_no_partition_of_fewer_rows_a_cluster_than_its_parameters_per_feature():
    """40 blobs of 75 points in 64-D collapsed to one cluster: the exact joint rises up to
    the 40 blobs, and doubling goes on past 8 clusters until it falls, but never to
    clusters of fewer rows than a full covariance's parameters per feature, ⌈(D + 3)/2⌉ =
    34 (N/10 = 300 let it try 128 and 256 clusters of 23 and 12 rows)."""
    x, y = many_blobs()
    search = _trainer_at(x, np.zeros(len(y), dtype=np.int64))
    tried = {}
    _best_size(search.ctx, search.config, search.prior_fit, search.anchors, 1, partition_score, EXACT_GAIN,
               EXACT_FALLS, search.rng, tried)
    assert 32 in tried
    assert max(tried) * math.ceil((x.shape[1] + 3) / 2) <= len(x)


@pytest.mark.parametrize("climb_out", [False, True])
def test_after_a_collapse_doubling_climbs_out_of_a_dip_before_the_falls_count(climb_out):
    """A score that dips below the one cluster from 2 to 16 clusters and rises above it at 32
    (the shape of 1,000 classes on a sphere, where the dip lasts to 16 and the peak is at
    1,024): past 8 clusters two falls in a row stop an ordinary doubling at 8, before the
    rise; after a collapse (``climb_out``) the falls count only once a size has beaten it."""
    x, _ = many_blobs()
    search = _trainer_at(x, np.zeros(len(x), dtype=np.int64))
    dip = {1: 0.0, 2: -1.0, 4: -2.0, 8: -3.0, 16: -2.5, 32: 1.0, 64: 0.5}

    def score(ctx, config, prior_fit, labels, n_groups):  # nats a row of each size's partition
        return dip[n_groups] * ctx.n_total

    tried = {}
    best = _best_size(search.ctx, search.config, search.prior_fit, search.anchors, 1, score, EXACT_GAIN,
                      EXACT_FALLS, search.rng, tried, climb_out=climb_out)
    assert best == (32 if climb_out else None)
    # 64: the most clusters of ⌈(D + 3)/2⌉ = 34 rows in these 3,000 rows (most_clusters)
    assert max(tried) == (64 if climb_out else 8)
