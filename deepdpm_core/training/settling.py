"""Where a small-data search settles: polish, then growth (docs/design.md, "Polish" and
"Growth").

Polish: the settled partition against k-means partitions of the same size and one cluster
fewer, judged by the model's own evidence. A coarse partition picks a wide prior under which no cut pays. Once K has settled, the
fit's hard partition and k-means partitions with K and K − 1 clusters (those of the
initialisation, :func:`~deepdpm_core.moves.initial_clusters`) are each scored by ln p(X, z)
with the prior fitted to that partition
(:func:`~deepdpm_core.bayes.partition_evidence.fitted_log_joint`); where a k-means partition
scores :data:`MARGIN_NATS` higher, the mixture becomes its MAP parameters and the net learns
them, as after any small-data search. No EM epoch follows (it drifts back to a wide cluster
beside a narrow one), and K never grows here (on clusters that are not Gaussian the
Gaussian evidence prefers more clusters than there are). The scores come from all-reduced
statistics, so every rank makes the same choice.

Growth: a search that settled far below the model's answer starts again from a k-means
partition of several times as many clusters. When each initial cluster holds several true clusters of few points in many dimensions,
the prior fitted to these wide, odd-shaped clusters keeps ν0 at its weakest (D + 2), no cut
pays, and the fit settles far too low. Once K has settled, k-means partitions of 2K, 4K and
8K clusters (at most N/10, and in more than 16 features N/⌈(D + 3)/2⌉: :func:`most_clusters`;
doubled on past 8K while the score still rises) are each scored
by the coarsened joint the moves climb: ln p(X, z) with the likelihood raised to
ζ = c/(c + N) (:func:`~deepdpm_core.moves.proposals.coarsened`, c of the fit's moves) and the prior
fitted to the partition. The best one that scores ``small_data.growth_gain`` (1) nats a row
above the settled partition (3–17 where growth was needed; elsewhere negative, or 0.03)
becomes the mixture, and the search starts again from it, at most :data:`MAX_GROWTHS`
times a fit and only while ν0 is within :data:`WEAK_NU` times its weakest. The coarsening
keeps clusters that are merely not Gaussian whole. The k-means partitions are those of the
initialisation and the scores come from all-reduced statistics, so every rank makes the
same choice.

A search that collapsed to one cluster is judged by the exact joint instead
(:func:`partition_score`, with :data:`EXACT_GAIN` nats a
row), whatever ν0: the prior fitted to one cluster is that cluster's own shape, known
exactly (ν0 at its ceiling), so no cut pays and the coarsened joint prefers the one cluster
to any partition; 100 grid blobs merge down to it from 10 or 20 clusters.

A search that settled far below the groups its rows form, without collapsing, is judged by
the exact joint too: from 5 or 9 clusters of 100 blobs along a curve the prior fitted to
these wide clusters refuses every cut, and the coarsened joint gains less than a nat a row.
Such a search hides groups: a k-means partition of :data:`PROBE_FACTOR`·K clusters leaves
at least :data:`HIDDEN_GROUPS`·K groups once neighbours that no density valley parts are
joined (:func:`valley_groups`), where pieces of curved, heavy-tailed or UMAP clusters join
back into about K. The search then starts again from twice the best size, and merges.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from deepdpm_core.bayes import (
    PriorFit,
    SuffStats,
    fitted_log_joint,
    log_crp,
    log_marginal_likelihood,
)
from deepdpm_core.config import Config
from deepdpm_core.moves import (
    VALLEY_MIN_POINTS,
    coarsening_constant,
    groups_mixture,
    initial_clusters,
)
from deepdpm_core.training.fit_context import FitContext, partition_stats
from deepdpm_core.training.move_round import merge_valleys

#: k-means partitions tried per size (k-means++ seeds from the fit's generator)
RESTARTS = 2
#: how much higher ln p(X, z) a k-means partition must score to replace the fit's: "positive"
#: evidence (Kass & Raftery 1995, 2 ln B > 2); a tie, the same partition found again, keeps
#: the fit's own parameters rather than those of its hard assignments
MARGIN_NATS = 1.0
#: the prior fitted to a partition is refitted until s and ν0 change by less than this
POLISH_PRIOR_RTOL = 1e-3


def fitted_prior(ctx: FitContext, config: Config, prior_fit: PriorFit, labels: Tensor, n_groups: int,
                 rtol: float = POLISH_PRIOR_RTOL) -> tuple[SuffStats, PriorFit, float]:
    """The statistics of the partition ``labels`` (this rank's rows, int64 in [0, n_groups))
    over all ranks, the prior fitted to them (until s and ν0 move by less than ``rtol``)
    and ln p(X, z) under it (collective). The prior's fit starts from the fit's own prior
    ``prior_fit`` (left as it is): fewer rounds to the same fixed point."""
    stats, _ = partition_stats(ctx, labels, n_groups)
    fitted = PriorFit(config.prior, ctx.coords, ctx.device)
    fitted.restore(prior_fit.state_dict())
    log_joint = fitted_log_joint(stats, fitted, config.prior.alpha, rtol=rtol).log_joint
    return stats, fitted, log_joint


def partition_score(ctx: FitContext, config: Config, prior_fit: PriorFit, labels: Tensor, n_groups: int) -> float:
    """ln p(X, z) of the partition ``labels`` with the prior fitted to it (:func:`fitted_prior`)."""
    return fitted_prior(ctx, config, prior_fit, labels, n_groups)[2]


def same_partition(ctx: FitContext, a: tuple[Tensor, int], b: tuple[Tensor, int]) -> bool:
    """Whether two partitions of the rows (labels of this rank's rows and their number of
    groups) group the rows alike, whatever the groups' names (collective): every non-empty
    cell of their contingency table is the only one of its row and of its column."""
    (la, na), (lb, nb) = a, b
    table = ctx.comm.all_reduce(torch.bincount(la * nb + lb, minlength=na * nb).to(torch.float64))
    cells = table.view(na, nb) > 0
    return bool((cells.sum(0) <= 1).all() and (cells.sum(1) <= 1).all())


def polish(ctx: FitContext, config: Config, prior_fit: PriorFit, anchors: Tensor, k: int,
           rng: np.random.Generator) -> Tensor | None:
    """The best-scoring k-means partition of K = ``k`` or K − 1 clusters (this rank's rows'
    labels, int64 (N_local,)) if it scores above the fit's own hard partition ``anchors``
    (each row's best cluster under the settled mixture), else None (collective; the
    k-means seeds come from ``rng``)."""
    best, chosen = partition_score(ctx, config, prior_fit, anchors, k), None
    scored = [(anchors, k)]
    for size in (k - 1, k) if k > 1 else ():
        init = config.init.model_copy(update={"n_clusters": size})
        for _ in range(RESTARTS):
            labels, n_groups = initial_clusters(ctx.x, init, ctx.n_total, ctx.rank_rows, ctx.comm, rng)
            if any(same_partition(ctx, (labels, n_groups), other) for other in scored):
                continue  # k-means found a partition already scored (often the fit's own)
            scored.append((labels, n_groups))
            score = partition_score(ctx, config, prior_fit, labels, n_groups)
            if score > best + (MARGIN_NATS if chosen is None else 0.0):
                best, chosen = score, labels
    return chosen


#: the partition sizes tried: 2K, 4K, ... up to this multiple of the settled K (one k-means
#: run each), then doubled on while the score still rises
GROWTH_FACTORS_TRIED = 8
#: how many times a fit may start again from a grown partition
MAX_GROWTHS = 2
#: the prior fitted to a partition is refitted until s and ν0 change by less than this: the
#: sizes tried differ by thousands of nats where growth matters
GROWTH_PRIOR_RTOL = 1e-2
#: growth is tried only while the fitted ν0 is within this factor of the weakest (D + 2; 3
#: when diagonal): 1.0–1.5 times it where growth was needed, 300 times and more for
#: clusters of one common shape (blobs in 16–512-D, the sphere family), where scoring 2K–8K
#: clusters would cost 10 s in 512-D
WEAK_NU = 10.0
#: a partition tried has at least this many rows a cluster on average, and in more than 16
#: dimensions at least as many numbers (rows × D) as a cluster's free parameters
#: (:func:`most_clusters`)
MIN_ROWS_PER_CLUSTER = 10
#: the gain in nats a row of the exact joint that grows a search that collapsed to one
#: cluster or hides groups: 128 k-means clusters of 100 grid blobs gain 0.27 over one
#: cluster, 80 of 100 blobs along a curve 1.8 over 5; two overlapping Gaussians settled at
#: one cluster, and breast cancer's, gain nothing
EXACT_GAIN = 0.05
#: judged by the exact joint, doubling stops past 8K once this many sizes in a row score no
#: higher than the one before: the grid's 2 to 8 wide pieces dip and score below the one
#: cluster, 16 to 128 climb far above it
EXACT_FALLS = 2
#: a settled search hides groups where a k-means partition of this many times its K ...
PROBE_FACTOR = 8
#: ... leaves at least this many times K groups apart by density valleys
#: (:func:`valley_groups`): 100 blobs along a curve settled at 5 and 9 clusters leave 35
#: and 72 (7 and 8 times K), 100 grid blobs 72 for 9; where the settled K is right they
#: leave at most 3.3 times it in 2-D to 10-D (UMAP layouts 2.2–3.3, worms 2.6, curved and
#: Student-t clusters 1.1–1.3, digits 0.1–1), and in more dimensions up to 8 times (n2d,
#: sphere), where the exact joint's gain then decides (none of them gains)
HIDDEN_GROUPS = 4.0
#: :func:`valley_groups` joins neighbours with no valley this deep between them: the value
#: :data:`HIDDEN_GROUPS` was measured at, above the merge rounds' own
#: :data:`~deepdpm_core.moves.MERGE_VALLEY`: at 0.85 the probe of 100 blobs along a curve
#: settled at 4 clusters finds too few groups, and the fit stays at 4
PROBE_JOIN_VALLEY = 0.9


def most_clusters(n_rows: int, dim: int, diagonal: bool) -> int:
    """The most clusters a partition of ``n_rows`` rows in ``dim`` features that growth
    tries may have: each cluster holds, on average, :data:`MIN_ROWS_PER_CLUSTER` rows and
    at least as many numbers (rows × D) as its free parameters P (D + D(D + 1)/2, or 2D
    when ``diagonal``), i.e. ⌈P/D⌉ = ⌈(D + 3)/2⌉ rows (2 when diagonal).

    Below that a cluster's scatter is of rank under D/2: its score says more about the
    prior than about its rows, and k-means of thousands of clusters in many features costs
    more than the fit. On 1,000 classes of 50 rows in 128-D (``bench/k_vs_n.py``'s
    ``sphere-1000``, 50,000 rows, seed 0) a search settled at 10 clusters, and N/10 let growth
    try 20 to 2,560 k-means clusters, 895 s on one shared thread (k-means of 1,280 clusters
    207 s, of 2,560 244 s) before the first epoch at K 2,560. The coarsened joint the moves climb peaks
    at 200 k-means clusters (250 rows each; −101.97 nats a row, the true classes −103.34)
    and the exact joint at 1,000–1,280 (−170.6 nats a row; 1,600 clusters of 31 rows
    −171.6), so no score needs clusters of fewer rows; here the cap is 757 clusters, with
    ⌈(D + 3)/2⌉ = 66 rows each. At 16 features and fewer the cap stays N/10.
    """
    params = 2 * dim if diagonal else dim + dim * (dim + 1) // 2
    return n_rows // max(MIN_ROWS_PER_CLUSTER, math.ceil(params / dim))


def coarsened_score(ctx: FitContext, config: Config, prior_fit: PriorFit, labels: Tensor, n_groups: int
                    ) -> float:
    """ln p(X, z) of the partition ``labels`` (this rank's rows, int64 in [0, n_groups))
    with every group's statistics (and the labels' counts) scaled by ζ = c/(c + N), and the
    prior fitted to the unscaled statistics, starting from ``prior_fit`` (collective)."""
    stats, fitted, _ = fitted_prior(ctx, config, prior_fit, labels, n_groups, GROWTH_PRIOR_RTOL)
    p, prior = config.prior, fitted.prior
    c = coarsening_constant(p.coarsening, prior.dim, prior.diagonal)
    if c is not None:
        stats = stats.scaled(torch.full_like(stats.n, c / (c + ctx.n_total)))
    return log_crp(stats.n.cpu().numpy(), p.alpha) + float(log_marginal_likelihood(prior, stats).sum())


def grow(ctx: FitContext, config: Config, prior_fit: PriorFit, anchors: Tensor, k: int, growths: int,
         rng: np.random.Generator) -> Tensor | None:
    """A k-means partition of more clusters than the settled K = ``k`` to search again
    from (this rank's rows' labels, int64 (N_local,)), or None (collective; the k-means
    seeds come from ``rng``); None too once the fit has grown ``growths`` =
    :data:`MAX_GROWTHS` times or ``small_data.growth_gain`` is null. A search that collapsed
    to one cluster takes the best of 2, 4, 8, ... clusters by the exact joint
    (:data:`EXACT_GAIN`); any other takes the best of 2K, 4K, 8K, ... by the coarsened joint
    (``growth_gain``, while ν0 is within :data:`WEAK_NU` times its weakest), else, if it
    hides groups (:func:`valley_groups`), twice the best size by the exact joint (module
    docstring). ``anchors``: each row's best cluster under the settled mixture."""
    gain, prior = config.small_data.growth_gain, prior_fit.prior
    weakest = 3.0 if prior.diagonal else prior.dim + 2.0
    if gain is None or growths >= MAX_GROWTHS:
        return None
    tried: dict[int, tuple[Tensor, int]] = {}  # one k-means partition a size, whichever score reads it
    if k == 1:  # the prior fitted to one cluster is its shape: the coarsened joint keeps it
        best = _best_size(ctx, config, prior_fit, anchors, k, partition_score, EXACT_GAIN, EXACT_FALLS, rng, tried,
                          climb_out=True)
        return None if best is None else tried[best][0]
    if prior.nu <= WEAK_NU * weakest:  # above, the clusters agree on one shape: none holds several
        best = _best_size(ctx, config, prior_fit, anchors, k, coarsened_score, gain, 1, rng, tried)
        if best is not None:
            return tried[best][0]
    if not _hides_groups(ctx, config, prior_fit, k, rng, tried):
        return None
    best = _best_size(ctx, config, prior_fit, anchors, k, partition_score, EXACT_GAIN, EXACT_FALLS, rng, tried)
    # twice the best size: k-means at the best size still joins some groups and cuts others,
    # and merges, guided by the valleys, repair a partition of too many clusters
    return None if best is None else tried.get(2 * best, tried[best])[0]


def _best_size(ctx: FitContext, config: Config, prior_fit: PriorFit, anchors: Tensor, k: int,
               score_of: Callable[..., float], gain: float, falls_to_stop: int, rng: np.random.Generator,
               tried: dict[int, tuple[Tensor, int]], climb_out: bool = False) -> int | None:
    """k-means partitions of 2K, 4K, ... clusters (K = ``k``; at most
    :func:`most_clusters`; past :data:`GROWTH_FACTORS_TRIED`·K until
    ``falls_to_stop`` sizes in a row score no higher than the one before), each scored by
    ``score_of``: the size of the best one that scores ``gain`` nats a row above the settled
    partition ``anchors`` (None if none does). ``tried`` holds the partitions by size: those
    already in it are scored again, the others added (:func:`_partition_of_size`).
    With ``climb_out`` (a search that collapsed to one cluster) the falls stop the doubling
    only once a size has scored ``gain`` above the settled partition: on 1,000 classes on a
    sphere (``sphere-1000``, 200,000 rows in 128-D) the exact joint of 2 to 16 k-means
    clusters dips below the one cluster's, by up to 0.28 nats a row, and climbs to 19.6
    above it at 1,024."""
    best, best_size = score_of(ctx, config, prior_fit, anchors, k) + gain * ctx.n_total, None
    size, last, falls = k, -math.inf, 0
    most = most_clusters(ctx.n_total, prior_fit.prior.dim, prior_fit.prior.diagonal)
    while size * 2 <= most:
        size *= 2
        labels, n_groups = _partition_of_size(ctx, config, size, rng, tried)
        score = score_of(ctx, config, prior_fit, labels, n_groups)
        if score > best:
            best, best_size = score, size
        falls = falls + 1 if score <= last else 0
        if size >= GROWTH_FACTORS_TRIED * k and falls >= falls_to_stop and (best_size is not None or not climb_out):
            break  # past the sizes always tried, and no longer rising
        last = score
    return best_size


def _partition_of_size(ctx: FitContext, config: Config, size: int, rng: np.random.Generator,
                       tried: dict[int, tuple[Tensor, int]]) -> tuple[Tensor, int]:
    """The k-means partition of ``size`` clusters in ``tried`` (this rank's rows' labels
    and their number of groups), made and added there if it is not (collective; seeds from
    ``rng``)."""
    if size not in tried:
        init = config.init.model_copy(update={"n_clusters": size})
        tried[size] = initial_clusters(ctx.x, init, ctx.n_total, ctx.rank_rows, ctx.comm, rng)
    return tried[size]


def _hides_groups(ctx: FitContext, config: Config, prior_fit: PriorFit, k: int, rng: np.random.Generator,
                  tried: dict[int, tuple[Tensor, int]]) -> bool:
    """Whether a k-means partition of :data:`PROBE_FACTOR`·K clusters (at most
    :func:`most_clusters`; taken from or added to ``tried``) leaves :data:`HIDDEN_GROUPS`·K
    groups apart by valleys; no k-means is run where the cap allows fewer clusters than
    that (1,000 classes of 50 rows in 128-D at K 843: 25 s for an answer known before it)."""
    probe = min(PROBE_FACTOR * k, most_clusters(ctx.n_total, prior_fit.prior.dim, prior_fit.prior.diagonal))
    if probe < HIDDEN_GROUPS * k:
        return False
    labels, n_groups = _partition_of_size(ctx, config, probe, rng, tried)
    return valley_groups(ctx, prior_fit, labels, n_groups) >= HIDDEN_GROUPS * k


def valley_groups(ctx: FitContext, prior_fit: PriorFit, labels: Tensor, n_groups: int) -> int:
    """How many groups the partition ``labels`` (this rank's rows, int64 in [0, n_groups))
    leaves once neighbours (each group's :data:`~deepdpm_core.moves.MERGE_NEIGHBOURS`
    nearest means) are joined where no density valley as deep as :data:`PROBE_JOIN_VALLEY`
    parts them along their merge axis, or either holds too few points to judge one
    (:mod:`deepdpm_core.moves.density_valleys`; collective)."""
    stats, keep = partition_stats(ctx, labels, n_groups)
    index = torch.full((n_groups,), -1, dtype=torch.long, device=labels.device)
    index[keep.to(labels.device)] = torch.arange(keep.shape[0], device=labels.device)
    state = groups_mixture(prior_fit.prior, stats).to(ctx.x.device)
    pairs, ratios, smaller = merge_valleys(ctx, state, index[labels], stats.n.cpu().numpy())
    root = list(range(stats.n_rows))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for (a, b), ratio, small in zip(pairs, ratios.tolist(), smaller.tolist(), strict=True):
        if ratio > PROBE_JOIN_VALLEY or small < VALLEY_MIN_POINTS:
            root[find(a)] = find(b)
    return len({find(i) for i in range(stats.n_rows)})
