"""Split and merge proposals from reduced statistics, decided into a :class:`MovePlan`
(docs/design.md, "Split and merge moves"). Decisions see only sufficient statistics and the
cluster means and draw their Hastings coins from an explicit ``numpy.random.Generator``; in
a distributed fit rank 0 decides and broadcasts the plan (docs/design.md, "Distribution").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import faiss
import numpy as np
import torch

from deepdpm_core.bayes import NIWPrior, SuffStats, log_merge_hastings, log_split_hastings
from deepdpm_core.moves.density_valleys import (
    APART_POINTS_PER_FEATURE,
    MERGE_VALLEY,
    SPLIT_VALLEY,
    VALLEY_MIN_POINTS,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class MovePlan:
    """What changes K this round.

    Attributes
    ----------
    splits : list of int
        Clusters split into their two subclusters.
    merges : list of (int, int)
        Pairs merged; the first index survives, the second is removed.
    prunes : list of int
        Empty clusters removed.
    """

    splits: list[int] = field(default_factory=list)
    merges: list[tuple[int, int]] = field(default_factory=list)
    prunes: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.splits or self.merges or self.prunes)

    @property
    def removed(self) -> list[int]:
        return [b for _, b in self.merges] + list(self.prunes)


#: (rows, D, D) float64 elements per batch of Hastings ratios (4 MiB): the NIW posteriors
#: and Cholesky factors of ~3000 merge pairs at D = 128 would otherwise take GBs at once,
#: and a batch's gathers, sums and factors stay in the cache (2,357 merge pairs of 1,000
#: clusters in 128-D, one thread: 2.25 s in batches of 512 pairs, 1.25 s of 32; the same bits)
_CHUNK_ELEMS = 1 << 19
#: merge candidates: each cluster paired with this many nearest means (the paper's 3)
MERGE_NEIGHBOURS = 3
#: a split whose smaller subcluster holds fewer points is not proposed, and a move round
#: first prunes the clusters that hard-own fewer rows (at least one): no split could have
#: made them, and k-means++ seeds lone outliers that the Gaussian evidence then keeps apart
#: (Student-t clusters at 2,000 rows from 32 k-means clusters kept clusters of 1, 4 and 6 rows)
MIN_SUBCLUSTER_SIZE = 5
#: c_p: the coarsening constant rises to c_p·P for clusters of P free parameters, so that a
#: split needs about the same gain per point in every dimension (:func:`coarsening_constant`);
#: at 7.5 the constant c = 500 holds up to 10 features (65 parameters), as measured there
COARSENING_PER_PARAMETER = 7.5
#: a split or merge across a density valley whose floor is at most this share of the lower
#: peak is judged by the exact posterior, not the coarsened one: a valley that deep parts two
#: modes whatever their shapes (100 blobs on a grid were never split at c = 500), while
#: curved, Student-t and sphere clusters have no cut that deep (:func:`exact_across_deep_valleys`)
EXACT_VALLEY = 0.2


def hastings_chunks(n_rows: int, dim: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most _CHUNK_ELEMS / D² rows covering n_rows rows."""
    step = max(1, _CHUNK_ELEMS // (dim * dim))
    return [(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]


def _accept(log_h: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Metropolis–Hastings coins: accept with probability min(1, H)."""
    u = rng.random(log_h.shape[0])
    with np.errstate(divide="ignore"):
        return np.log(u) < log_h


def coarsened(stats: SuffStats, union_n: Tensor, coarsening: float | None) -> SuffStats:
    """The statistics a move's Hastings ratio sees under the coarsened posterior.

    The likelihood raised to ζ = c / (c + n) (Miller & Dunson, JASA 2019), n the points of
    the cluster the move splits or creates (``union_n``): the whole complete-data
    likelihood is tempered, which for the NIW model is the same formula on statistics
    scaled by ζ (docs/design.md, "Coarsening"). n ≪ c is the exact DP posterior.

    Parameters
    ----------
    stats : SuffStats with R rows
    union_n : Tensor of shape (R,)
        n of the union each row belongs to.
    coarsening : float or None
        c (``prior.coarsening``); None is ζ = 1.
    """
    if coarsening is None:
        return stats
    return stats.scaled(coarsening / (coarsening + union_n))


def coarsening_constant(coarsening: float | None, dim: int, diagonal: bool) -> float | None:
    """c of :func:`coarsened` for clusters in ``dim`` features: max(c, c_p·P), c_p
    :data:`COARSENING_PER_PARAMETER`.

    P is a cluster's free parameters (D + D(D + 1)/2, or 2D when diagonal). A split of
    n ≫ c points must gain about P·ln(c)/(2c) nats per point; c_p·P keeps that demand about
    the same in every dimension, c the low-dimensional end (docs/design.md, "Coarsening in
    many features").

    Parameters
    ----------
    coarsening : float or None
        c (``prior.coarsening``); None is the exact posterior.
    dim : int
        D, the fit's features.
    diagonal : bool
        Whether the clusters' covariances are diagonal.
    """
    if coarsening is None:
        return None
    params = 2 * dim if diagonal else dim + dim * (dim + 1) // 2
    return max(coarsening, COARSENING_PER_PARAMETER * params)


def exact_across_deep_valleys(union_n: Tensor, valleys: np.ndarray, judged: np.ndarray,
                              exact_valley: float) -> Tensor:
    """``union_n`` with 0 (ζ = 1 in :func:`coarsened`: the exact posterior) for the moves
    that cut across a valley whose floor is at most ``exact_valley`` of the lower peak
    (:data:`EXACT_VALLEY` in a fit), where the valley was judged: such a cut separates two modes
    whatever their shapes, which coarsening need not guard (docs/design.md, "Moves across
    deep valleys are not coarsened").

    Parameters
    ----------
    union_n : Tensor of shape (R,)
        n of the union each row belongs to (:func:`coarsened`).
    valleys, judged : ndarray of shape (R,)
        Each row's move's valley ratio, and whether it was judged (both sides held
        :data:`~deepdpm_core.moves.density_valleys.VALLEY_MIN_POINTS`).
    exact_valley : float
    """
    deep = torch.as_tensor(judged & (np.asarray(valleys) <= exact_valley), device=union_n.device)
    return torch.where(deep, torch.zeros_like(union_n), union_n)


def propose_splits(
    prior: NIWPrior,
    alpha: float,
    sub_stats: SuffStats,
    rng: np.random.Generator,
    min_subcluster_size: float,
    coarsening: float | None = None,
    valleys: np.ndarray | None = None,
    max_valley: float | None = None,
    valley_min_points: float = 0.0,
    exact_valley: float = EXACT_VALLEY,
) -> tuple[list[int], np.ndarray]:
    """Propose every cluster's split in parallel (paper §3.2).

    Parameters
    ----------
    sub_stats : SuffStats with 2K rows
        Hard subcluster statistics (row 2k + j is subcluster j of cluster k).
    min_subcluster_size : float
        Splits whose smaller subcluster has fewer points are not proposed.
    coarsening : float, optional
        c of :func:`coarsened`.
    valleys : ndarray of shape (K,), optional
        The deepest density valley along each cluster's split axis, floor / lower peak
        (:func:`~deepdpm_core.moves.density_valleys.valley_ratios`).
    max_valley : float, optional
        Splits whose valley ratio is above it (no valley that deep: one mode) are not
        proposed (:data:`~deepdpm_core.moves.density_valleys.SPLIT_VALLEY` in a fit), where both subclusters hold at least
        ``valley_min_points``; None proposes them all.
    valley_min_points : float
        Fewest points a side for the valley rule to judge (:data:`~deepdpm_core.moves.density_valleys.VALLEY_MIN_POINTS`).
    exact_valley : float, optional
        Splits across a valley at most this deep are judged uncoarsened
        (:func:`exact_across_deep_valleys`).

    Returns
    -------
    accepted : list of int
    log_h : ndarray of shape (K,)
        ln H_s per cluster (−inf where not proposed).
    """
    union_n = sub_stats.n.view(-1, 2).sum(1).repeat_interleave(2)
    smaller = sub_stats.n.view(-1, 2).min(1).values.cpu().numpy()  # each split's smaller side
    judged = smaller >= valley_min_points
    if valleys is not None:
        union_n = exact_across_deep_valleys(union_n, np.repeat(valleys, 2), np.repeat(judged, 2), exact_valley)

    def chunk(s: int, e: int) -> np.ndarray:  # rows [2s, 2e): scaled a chunk at a time (memory)
        rows = torch.arange(2 * s, 2 * e, device=sub_stats.n.device)
        return log_split_hastings(prior, alpha, coarsened(sub_stats.rows(rows), union_n[rows],
                                                          coarsening)).cpu().numpy()

    log_h = np.concatenate([chunk(s, e) for s, e in hastings_chunks(sub_stats.n_rows // 2, sub_stats.dim)])
    log_h[smaller < max(min_subcluster_size, 1.0)] = -np.inf
    if valleys is not None and max_valley is not None:
        log_h[judged & (np.asarray(valleys) > max_valley)] = -np.inf
    coins = _accept(log_h, rng)
    return [int(k) for k in np.flatnonzero(coins)], log_h


def merge_candidates(means: torch.Tensor, n_neighbours: int) -> list[tuple[int, int]]:
    """Each cluster paired with its ``n_neighbours`` nearest means (FAISS, exact L2).

    Returns
    -------
    list of (a, b) with a < b, unique, nearest pairs first.
    """
    k = means.shape[0]
    if k < 2:
        return []
    x = np.ascontiguousarray(means.detach().cpu().numpy(), dtype=np.float32)
    index = faiss.IndexFlatL2(x.shape[1])
    index.add(x)
    dist, nbr = index.search(x, min(n_neighbours + 1, k))
    best: dict[tuple[int, int], float] = {}
    for a in range(k):
        for d, b in zip(dist[a], nbr[a], strict=True):
            if b < 0 or b == a:
                continue
            pair = (min(a, int(b)), max(a, int(b)))
            best[pair] = min(best.get(pair, np.inf), float(d))
    return sorted(best, key=lambda p: (best[p], p))


def propose_merges(
    prior: NIWPrior,
    alpha: float,
    cluster_stats: SuffStats,
    means: torch.Tensor,
    rng: np.random.Generator,
    n_neighbours: int,
    coarsening: float | None = None,
    valleys: dict[tuple[int, int], float] | None = None,
    max_valley: float | None = None,
    valley_min_points: float = 0.0,
    exact_valley: float = EXACT_VALLEY,
) -> list[tuple[int, int]]:
    """Sequential merge proposals over nearest-neighbour pairs (Supmat "Merge Proposals").

    Pairs are considered nearest first; a cluster takes part in at most one accepted
    merge per round, so three clusters are never merged at once.

    Parameters
    ----------
    cluster_stats : SuffStats with K rows
        Hard cluster statistics.
    means : Tensor of shape (K, D)
    coarsening : float, optional
        c of :func:`coarsened`.
    valleys : dict of (a, b) -> float, optional
        The deepest density valley of each candidate pair's points along the pair's merge
        axis (:func:`~deepdpm_core.moves.density_valleys.valley_ratios`).
    max_valley : float, optional
        A pair with no valley this deep (one mode) is merged whatever its Hastings ratio
        (:data:`~deepdpm_core.moves.density_valleys.MERGE_VALLEY` in a fit), where both clusters hold at
        least ``valley_min_points``.
    valley_min_points : float
        Fewest points a side for the valley rule to judge (:data:`~deepdpm_core.moves.density_valleys.VALLEY_MIN_POINTS`).
    exact_valley : float, optional
        Pairs with a valley at most this deep between them are judged uncoarsened
        (:func:`exact_across_deep_valleys`), as their split would be, and are not merged
        where both clusters hold :data:`~deepdpm_core.moves.density_valleys.APART_POINTS_PER_FEATURE`
        points a feature: a valley that deep parts two modes.

    Returns
    -------
    list of (a, b): accepted merges, a survives.
    """
    pairs = [(a, b) for a, b in merge_candidates(means, n_neighbours)
             if cluster_stats.n[a] > 0 and cluster_stats.n[b] > 0]
    if not pairs:
        return []
    a_idx = [a for a, _ in pairs]
    b_idx = [b for _, b in pairs]
    union_n = cluster_stats.n[a_idx] + cluster_stats.n[b_idx]
    n = cluster_stats.n.cpu().numpy()
    smaller = np.minimum(n[a_idx], n[b_idx])
    judged = smaller >= valley_min_points
    if valleys is not None:
        depth = np.array([valleys.get(p, 1.0) for p in pairs])
        union_n = exact_across_deep_valleys(union_n, depth, judged, exact_valley)

    def chunk(s: int, e: int) -> np.ndarray:  # pairs [s, e), scaled a chunk at a time (memory)
        return log_merge_hastings(prior, alpha, coarsened(cluster_stats.rows(a_idx[s:e]), union_n[s:e], coarsening),
                                  coarsened(cluster_stats.rows(b_idx[s:e]), union_n[s:e], coarsening)).cpu().numpy()

    log_h = np.concatenate([chunk(s, e) for s, e in hastings_chunks(len(pairs), cluster_stats.dim)])
    coins = _accept(log_h, rng)
    if valleys is not None and max_valley is not None:
        coins = coins | (judged & np.array([valleys.get(p, 0.0) > max_valley for p in pairs], dtype=bool))
    if valleys is not None:  # two modes stay apart: no merge across a deep valley judged by enough points
        firm = smaller >= max(valley_min_points, APART_POINTS_PER_FEATURE * cluster_stats.dim)
        coins = coins & ~(firm & (depth <= exact_valley))
    used: set[int] = set()
    accepted = []
    for (a, b), ok in zip(pairs, coins, strict=True):
        if ok and a not in used and b not in used:
            accepted.append((a, b))
            used.update((a, b))
    return accepted


def plan_moves(kind: str, sub_stats: SuffStats, means: torch.Tensor, prior: NIWPrior,
               alpha: float, rng: np.random.Generator, coarsening: float | None = None,
               valleys: np.ndarray | dict[tuple[int, int], float] | None = None) -> MovePlan:
    """One move round's plan: prunes of clusters of fewer than :data:`MIN_SUBCLUSTER_SIZE`
    rows, then the accepted splits or merges.

    Parameters
    ----------
    kind : {"split", "merge"}
    sub_stats : SuffStats with 2K rows
        Hard subcluster statistics (rows 2k, 2k + 1: cluster k's pair).
    means : Tensor of shape (K, D)
    prior : NIWPrior
    alpha : float
        DP concentration.
    rng : numpy.random.Generator
        The Hastings coins.
    coarsening : float, optional
        c of :func:`coarsened` (``prior.coarsening``).
    valleys : ndarray of shape (K,) or dict of (a, b) -> float, optional
        In a split round each cluster's valley ratio along its split axis, judged against
        :data:`~deepdpm_core.moves.density_valleys.SPLIT_VALLEY` (:func:`propose_splits`); in a
        merge round each candidate pair's, against
        :data:`~deepdpm_core.moves.density_valleys.MERGE_VALLEY` (:func:`propose_merges`).
    """
    hard = sub_stats.pair_sums()
    k = hard.n.shape[0]
    # a cluster of fewer rows than a split may give a subcluster is pruned: k-means seeds
    # lone outliers (k-means++ draws far rows), which no split could have made
    prunes = [int(i) for i in torch.nonzero(hard.n < MIN_SUBCLUSTER_SIZE).squeeze(1).tolist()] if k > 1 else []
    if len(prunes) == k:
        prunes = prunes[1:]
    splits, merges = [], []
    if kind == "split":
        accepted, _ = propose_splits(prior, alpha, sub_stats, rng, MIN_SUBCLUSTER_SIZE,
                                     coarsening, valleys, SPLIT_VALLEY, VALLEY_MIN_POINTS, EXACT_VALLEY)
        splits = [c for c in accepted if c not in prunes]
    else:
        merges = [(a, b) for a, b in propose_merges(prior, alpha, hard, means, rng, MERGE_NEIGHBOURS,
                                                      coarsening, valleys, MERGE_VALLEY,
                                                      VALLEY_MIN_POINTS, EXACT_VALLEY)
                  if a not in prunes and b not in prunes]
    return MovePlan(splits=splits, merges=merges, prunes=prunes)
