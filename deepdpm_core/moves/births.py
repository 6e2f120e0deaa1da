"""Birth moves: a cluster split into several parts at once, where no two-way cut pays
(docs/design.md, "Births").

A cluster that holds several groups side by side (eight blobs in a 2 x 4 block) may have no
two-way cut the Hastings ratio (paper Eq. 2) takes. A birth proposes the cut into
P = :data:`BIRTH_PARTS` parts found by k-means inside the cluster, and the cuts into
P − 1, ..., 3 parts made from it by joining the nearest parts, judged by the paper's split
ratio with P instead of 2,

    ln H_b = (P − 1) ln α + Σ_j [ln Γ(n_j) + ln f(X_j)] − ln Γ(n) − ln f(X),

on statistics coarsened as a split's (:func:`~deepdpm_core.moves.proposals.coarsened`); each part
needs a density valley towards its nearest part (:mod:`deepdpm_core.moves.density_valleys`).
Of the cuts a cluster passes, the one of the largest ratio is made. The k-means seeds are a
function of each cluster's parameters and its sums are all-reduced at each iteration, so
every rank holds the same parts and statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from deepdpm_core.bayes import (
    NIWPrior,
    SuffStats,
    grouped_stats,
    log_marginal_likelihood,
    map_estimate,
)
from deepdpm_core.estep import MixtureState
from deepdpm_core.moves.density_valleys import (
    SPLIT_VALLEY,
    VALLEY_BANDWIDTH,
    VALLEY_MIN_POINTS,
    pair_histograms,
    valley_ratios,
)
from deepdpm_core.moves.proposals import MIN_SUBCLUSTER_SIZE
from deepdpm_core.runtime import Communicator

#: subspace iterations for each cluster's principal plane (the seeds need only a plane of
#: large variance, not converged eigenvectors)
PLANE_ITERS = 30
#: Lloyd iterations of a birth's k-means: started from the seeds on the cluster's principal
#: ellipse, the parts of a cluster of a few thousand rows have settled by then
BIRTH_KMEANS_ITERS = 10
#: P, the most parts a birth cuts a cluster into (then P − 1, ..., 3): 4 finds the blocks of
#: 6 to 11 blobs side by side that two-way splits left in one cluster (50 blobs laid out as
#: the A3 set stopped at K = 39 to 45 without births), at the cost of one k-means a cluster
BIRTH_PARTS = 4


def principal_plane(covariances: Tensor) -> tuple[Tensor, Tensor]:
    """The two leading eigenpairs of each covariance, by subspace iteration from the two
    features of largest variance (O(D²) a step, where a full eigendecomposition of a 512-D
    covariance costs a quarter of a second), then Rayleigh–Ritz in the plane found.

    Parameters
    ----------
    covariances : Tensor of shape (B, D, D), D >= 2

    Returns
    -------
    values : Tensor of shape (B, 2), descending
    vectors : Tensor of shape (B, D, 2), orthonormal columns
    """
    c = covariances.to(torch.float64)
    b, d, _ = c.shape
    top = c.diagonal(dim1=1, dim2=2).topk(2, dim=1).indices
    q = torch.full((b, d, 2), 0.1 / math.sqrt(d), dtype=torch.float64, device=c.device)
    q[torch.arange(b), top[:, 0], 0] += 1.0
    q[torch.arange(b), top[:, 1], 1] -= 1.0
    for _ in range(PLANE_ITERS):
        q = torch.linalg.qr(c @ q).Q
    values, turn = torch.linalg.eigh(q.transpose(1, 2) @ c @ q)
    return values.flip(1), (q @ turn).flip(2)


def birth_min_points(dim: int) -> int:
    """Fewest points of a cluster offered a birth: :data:`BIRTH_PARTS` parts that can each
    hold :data:`~deepdpm_core.moves.density_valleys.VALLEY_MIN_POINTS` points (the valley rule judges them) and more points
    than features (a covariance estimated from its points, not from the prior alone; in
    512-D a birth would also cost a third of a small fit's time)."""
    return BIRTH_PARTS * max(VALLEY_MIN_POINTS, MIN_SUBCLUSTER_SIZE, dim + 1)


def birth_seeds(means: Tensor, covariances: Tensor, parts: int) -> Tensor:
    """Starting centres of each cluster's parts: ``parts`` points on the ellipse of one
    standard deviation in the cluster's principal plane, at angles (2i + 1)π/P (for P = 4
    the centres of the four quadrants).

    Parameters
    ----------
    means : Tensor of shape (B, D)
    covariances : Tensor of shape (B, D, D)
    parts : int

    Returns
    -------
    Tensor of shape (B, P, D), float64
    """
    c = covariances.to(torch.float64)
    if c.shape[1] == 1:  # one feature: the seeds on a line
        values = torch.cat([c[:, 0], torch.zeros_like(c[:, 0])], 1)
        vectors = torch.cat([torch.ones_like(c), torch.zeros_like(c)], 2)
    else:
        values, vectors = principal_plane(c)
    angle = torch.tensor([(2 * i + 1) * math.pi / parts for i in range(parts)], dtype=torch.float64,
                         device=c.device)
    axes = vectors * values.clamp_min(0).sqrt()[:, None, :]  # (B, D, 2)
    offsets = angle.cos()[None, :, None] * axes[:, None, :, 0] + angle.sin()[None, :, None] * axes[:, None, :, 1]
    return means.to(torch.float64)[:, None] + offsets


@torch.no_grad()
def birth_kmeans(x: Tensor, labels: Tensor, n_clusters: int, clusters: Tensor, seeds: Tensor, iters: int,
                 comm: Communicator) -> tuple[Tensor, SuffStats]:
    """k-means inside each of ``clusters`` (collective: sums all-reduced every iteration).

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
        This rank's rows in the fit's coordinates.
    labels : Tensor of shape (N_local,), int64
        Each row's cluster, −1 for a row of none (the E-step anchors).
    n_clusters : int
        K.
    clusters : Tensor of shape (B,), int64
        The clusters to cut.
    seeds : Tensor of shape (B, P, D)
        Starting centres (:func:`birth_seeds`).
    iters : int
        Lloyd iterations.
    comm : Communicator

    Returns
    -------
    part : Tensor of shape (N_local,), int64
        Each row's part b·P + j (−1 outside the clusters).
    stats : SuffStats with B·P rows
        The parts' statistics, summed over ranks.
    """
    b, p, d = seeds.shape
    slot = torch.full((n_clusters,), -1, dtype=torch.long, device=x.device)
    slot[clusters.to(x.device)] = torch.arange(b, device=x.device)
    row_slot = torch.where(labels >= 0, slot[labels.clamp_min(0)], -1)
    rows = torch.nonzero(row_slot >= 0).squeeze(1)
    # the rows gathered once, cluster by cluster: each cluster's rows are one contiguous block
    owner = row_slot.index_select(0, rows)
    rows = rows[torch.argsort(owner, stable=True)]
    xs = x.index_select(0, rows).to(torch.float64)
    ends = torch.cumsum(torch.bincount(owner, minlength=b), 0).tolist()
    blocks = list(zip([0, *ends[:-1]], ends, strict=True))
    centres = seeds.to(x.device, torch.float64).clone()

    def assign() -> Tensor:
        out = torch.empty(xs.shape[0], dtype=torch.long, device=x.device)
        for c, (s, e) in enumerate(blocks):  # ‖x − m‖² up to ‖x‖², one product a cluster
            scores = centres[c].square().sum(1) - 2 * xs[s:e] @ centres[c].T
            out[s:e] = c * p + scores.argmin(1)
        return out

    for _ in range(iters):
        part = assign()
        sums = torch.zeros(b * p, d, dtype=torch.float64, device=x.device).index_add_(0, part, xs)
        sums = comm.all_reduce(torch.cat([sums, torch.bincount(part, minlength=b * p).to(sums)[:, None]], 1))
        n = sums[:, -1:]
        centres = torch.where(n > 0, sums[:, :-1] / n.clamp_min(1.0), centres.view(b * p, d)).view(b, p, d)
    part = assign()
    local = grouped_stats(x, rows, part, torch.ones(rows.shape[0], dtype=torch.float32, device=x.device), b * p)
    stats = SuffStats.from_flat(comm.all_reduce(local.flat()), b * p, d)
    out = torch.full_like(labels, -1)
    out[rows] = part
    return out, stats


def log_birth_hastings(prior: NIWPrior, alpha: float, part_stats: SuffStats, parts: int,
                       coarsening: float | None) -> Tensor:
    """ln H_b of cutting each cluster into its ``parts`` parts (module docstring).

    Parameters
    ----------
    part_stats : SuffStats with B·P rows
        Part j of cluster b at row b·P + j.
    coarsening : float or None
        c of :func:`~deepdpm_core.moves.proposals.coarsened`: every row of a cluster is scaled by
        ζ = c / (c + n), n the cluster's points.

    Returns
    -------
    Tensor of shape (B,); −inf where a part is empty.
    """
    b = part_stats.n_rows // parts
    whole = part_stats.regrouped(torch.arange(b * parts) // parts, b)
    if coarsening is not None:
        zeta = coarsening / (coarsening + whole.n)
        whole, part_stats = whole.scaled(zeta), part_stats.scaled(zeta.repeat_interleave(parts))
    n = part_stats.n.view(b, parts)
    log_h = ((parts - 1) * math.log(alpha)
             + torch.lgamma(n.clamp_min(1e-300)).sum(1)
             + log_marginal_likelihood(prior, part_stats).view(b, parts).sum(1)
             - torch.lgamma(whole.n.clamp_min(1e-300))
             - log_marginal_likelihood(prior, whole))
    return torch.where((n > 0).all(1), log_h, torch.full_like(log_h, -math.inf))


def nearest_part_pairs(means: Tensor, parts: int) -> list[tuple[int, int]]:
    """Each part paired with the nearest other part of its own cluster, (a, b) with a < b,
    unique; rows as in :func:`birth_kmeans`.

    Parameters
    ----------
    means : Tensor of shape (B·P, D)
    """
    b = means.shape[0] // parts
    dist = torch.cdist(means.view(b, parts, -1), means.view(b, parts, -1))
    dist.diagonal(dim1=1, dim2=2).fill_(math.inf)
    nearest = dist.argmin(2)  # (B, P)
    pairs = {(min(c * parts + j, c * parts + int(nearest[c, j])), max(c * parts + j, c * parts + int(nearest[c, j])))
             for c in range(b) for j in range(parts)}
    return sorted(pairs)


@torch.no_grad()
def part_valleys(x: Tensor, part: Tensor, part_stats: SuffStats, parts: int, prior: NIWPrior,
                 min_side: float, bandwidth: float, comm: Communicator) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The density valley between each part and its nearest part (collective), along the
    pair's discriminant as a merge round measures it
    (:func:`~deepdpm_core.moves.density_valleys.pair_histograms`).

    Returns
    -------
    pairs : list of (a, b)
        From :func:`nearest_part_pairs`.
    ratios : ndarray of shape (len(pairs),)
        Each pair's valley ratio (:func:`~deepdpm_core.moves.density_valleys.valley_ratios`).
    """
    state = groups_mixture(prior, part_stats)
    pairs = nearest_part_pairs(state.means, parts)
    hist = comm.all_reduce(pair_histograms(x, part, state.to(x.device), pairs))
    return pairs, valley_ratios(hist.cpu().numpy(), min_side, bandwidth)


def groups_mixture(prior: NIWPrior, stats: SuffStats) -> MixtureState:
    """The MAP mixture of R hard groups with statistics ``stats``, without subclusters:
    what :func:`~deepdpm_core.moves.density_valleys.pair_histograms` reads of a partition
    that is not the fit's."""
    means, covs = map_estimate(prior, stats)
    n = stats.n.clamp_min(1e-300)
    r, d = stats.n_rows, stats.dim
    zero = torch.zeros((), dtype=torch.float64, device=means.device)  # no subclusters: broadcast views
    return MixtureState(means, covs, n.log() - n.sum().log(), zero.expand(r, 2, d), zero.expand(r, 2, d, d),
                        zero.expand(r, 2))


def accepted_births(log_h: Tensor, part_n: Tensor, parts: int, pairs: list[tuple[int, int]],
                    ratios: np.ndarray, max_valley: float, valley_min_points: float) -> list[int]:
    """The births to make: ln H_b > 0 (the model prefers the parts), and every part has a
    valley of at most ``max_valley`` (:data:`SPLIT_VALLEY` in a fit) towards its nearest
    part where both hold at least ``valley_min_points`` points.

    Parameters
    ----------
    log_h : Tensor of shape (B,)
    part_n : Tensor of shape (B·P,)
        The parts' points.

    Returns
    -------
    list of int
        Indices b into the B proposed clusters.
    """
    ok = (log_h > 0).cpu().numpy()
    n = part_n.cpu().numpy()
    for (a, b), ratio in zip(pairs, ratios, strict=True):
        if min(n[a], n[b]) >= valley_min_points and ratio > max_valley:
            ok[a // parts] = False
    return [int(c) for c in np.flatnonzero(ok)]


@dataclass(frozen=True)
class BirthProposal:
    """The cut of B clusters into ``parts`` parts each.

    Attributes
    ----------
    parts : int
    part : Tensor of shape (N_local,), int64
        Each local row's part b·P + j (−1: not in the B clusters).
    stats : SuffStats with B·P rows
        Summed over ranks.
    log_h : Tensor of shape (B,)
        ln H_b (:func:`log_birth_hastings`).
    passed : list of int
        The clusters (indices b) whose cut passes :func:`accepted_births`.
    """

    parts: int
    part: Tensor
    stats: SuffStats
    log_h: Tensor
    passed: list[int]


def coarser(part: Tensor, stats: SuffStats, parts: int) -> tuple[Tensor, SuffStats]:
    """Each cluster's P parts made P − 1 by joining the pair whose union adds the least
    to the within-part sum of squares (Ward: n_a·n_b / (n_a + n_b)·‖μ_a − μ_b‖²).

    Parameters
    ----------
    part : Tensor of shape (N_local,), int64
        Each row's part b·P + j (−1: none).
    stats : SuffStats with B·P rows
    parts : int
        P.

    Returns
    -------
    part : Tensor of shape (N_local,), int64
        Parts b·(P − 1) + j'.
    stats : SuffStats with B·(P − 1) rows
    """
    b = stats.n_rows // parts
    n = stats.n.view(b, parts)
    mean = stats.s1.view(b, parts, -1) / n.clamp_min(1e-300)[..., None]
    cost = n[:, :, None] * n[:, None, :] / (n[:, :, None] + n[:, None, :]).clamp_min(1e-300) \
        * torch.cdist(mean, mean).square()
    upper = torch.triu(torch.ones(parts, parts, dtype=torch.bool, device=cost.device), 1)
    cost = torch.where(upper, cost, torch.full_like(cost, math.inf))
    pick = cost.view(b, -1).argmin(1)
    first, second = (pick // parts).tolist(), (pick % parts).tolist()
    table = []  # old part -> new part
    for c in range(b):
        slot = [j if j < second[c] else j - 1 for j in range(parts)]
        slot[second[c]] = first[c] if first[c] < second[c] else first[c] - 1
        table += [c * (parts - 1) + j for j in slot]
    to_new = torch.tensor(table, dtype=torch.long)
    relabel = to_new.to(part.device)
    return torch.where(part >= 0, relabel[part.clamp_min(0)], part), stats.regrouped(to_new, b * (parts - 1))


def birth_proposals(x: Tensor, labels: Tensor, state: MixtureState, clusters: list[int], prior: NIWPrior,
                    alpha: float, coarsening: float | None, comm: Communicator) -> list[BirthProposal]:
    """Each of ``clusters`` cut into P = :data:`BIRTH_PARTS` parts by k-means, then into
    P − 1, ..., 3 by :func:`coarser`, with the ratios and valley checks of every cut
    (collective; the same on every rank).

    Parameters
    ----------
    x, labels : Tensor
        The local rows and their clusters, as :func:`birth_kmeans` takes them.
    state : MixtureState
    clusters : list of int
        The B clusters offered a birth.
    """
    ks = torch.tensor(clusters, dtype=torch.long, device=state.means.device)
    parts = BIRTH_PARTS
    seeds = birth_seeds(state.means[ks], state.covariances[ks], parts)
    part, stats = birth_kmeans(x, labels, state.n_clusters, ks, seeds, BIRTH_KMEANS_ITERS, comm)
    out = []
    while True:
        pairs, ratios = part_valleys(x, part, stats, parts, prior, MIN_SUBCLUSTER_SIZE, VALLEY_BANDWIDTH, comm)
        log_h = log_birth_hastings(prior, alpha, stats, parts, coarsening)
        passed = accepted_births(log_h, stats.n, parts, pairs, ratios, SPLIT_VALLEY, VALLEY_MIN_POINTS)
        out.append(BirthProposal(parts, part, stats, log_h, passed))
        if parts <= 3:
            return out
        part, stats = coarser(part, stats, parts)
        parts -= 1


def choose_births(proposals: list[BirthProposal]) -> dict[int, int]:
    """Each cluster b with a passing cut -> the index of its proposal of largest ln H_b."""
    best: dict[int, tuple[float, int]] = {}
    for i, prop in enumerate(proposals):
        for b in prop.passed:
            value = float(prop.log_h[b])
            if b not in best or value > best[b][0]:
                best[b] = (value, i)
    return {b: i for b, (_, i) in sorted(best.items())}
