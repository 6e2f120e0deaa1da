"""Components, then clusters: a greedy merge hierarchy scored by the model's own joint, and
the level where its gain per added group falls most.

From M groups (k-means components, say) with statistics ``stats`` and a prior held fixed,
each step merges the pair (each group with its ``neighbours`` nearest means) whose merge
raises ln p(X, z) most (the inverse of the paper's split ratio, Eq. 2, at ζ = 1), down to one
group. Only the pairs that touch the merged groups, or the groups whose nearest means they
change, are scored again, so the hierarchy costs O(M² D) for the distances and O(M)
marginal likelihoods a step, not O(M · neighbours) a step.

:func:`elbow_level` reads the level off the scores (Miller & Dunson's calibration of the
coarsening, JASA 2019, section 4: the elbow of fit against complexity), as
``bench/k_levels.py`` measures it against the truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from deepdpm_core.bayes.niw import NIWPrior, log_marginal_likelihood
from deepdpm_core.bayes.partition_evidence import log_crp
from deepdpm_core.bayes.stats import SuffStats

#: merge candidates of a group: its nearest means
NEIGHBOURS = 8
#: the elbow's floor on a gain per group, as a fraction of the mean gain per group from one
#: group to the exact joint's level: next to that level the gains fall to zero by
#: construction, so a ratio against them measures nearness to it, not an elbow
ELBOW_FLOOR = 0.1


@dataclass(frozen=True)
class MergeLevels:
    """The greedy hierarchy of M groups.

    Attributes
    ----------
    merges : ndarray of shape (M - 1, 2), int64
        Step t joins group ``merges[t, 1]`` into ``merges[t, 0]`` (the lower index survives).
    log_joint : ndarray of shape (M,), float64
        ln p(X, z) of the level of M - t groups, t = 0 .. M - 1.
    """

    merges: np.ndarray
    log_joint: np.ndarray

    @property
    def n_groups(self) -> np.ndarray:
        """K of each level, (M,): M, M - 1, ..., 1."""
        m = len(self.log_joint)
        return np.arange(m, 0, -1)

    def labels(self, n_groups: int) -> np.ndarray:
        """Each of the M groups' cluster at the level of ``n_groups`` clusters, numbered
        0 .. n_groups - 1 in the order of their lowest group, (M,)."""
        m = len(self.log_joint)
        parent = np.arange(m)
        for a, b in self.merges[: m - n_groups]:
            parent[b] = a

        def root(g: int) -> int:
            while parent[g] != g:
                g = parent[g]
            return g

        roots = np.array([root(g) for g in range(m)])
        return np.unique(roots, return_inverse=True)[1]


def _gains(prior: NIWPrior, alpha: float, stats: SuffStats, marginal: torch.Tensor, a: torch.Tensor,
           b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The change of ln p(X, z) when each pair (a, b) merges, and the union's ln f."""
    n = stats.n
    union = SuffStats(n[a] + n[b], stats.s1[a] + stats.s1[b], stats.s2[a] + stats.s2[b])
    joined = log_marginal_likelihood(prior, union)
    gain = (joined - marginal[a] - marginal[b] - math.log(alpha)
            + torch.lgamma(n[a] + n[b]) - torch.lgamma(n[a]) - torch.lgamma(n[b]))
    return gain, joined


def merge_levels(stats: SuffStats, prior: NIWPrior, alpha: float, neighbours: int = NEIGHBOURS) -> MergeLevels:
    """The greedy hierarchy of the groups ``stats`` (M rows, none empty; module docstring).

    Parameters
    ----------
    stats : SuffStats with M rows
        The groups' statistics, float64.
    prior : NIWPrior
        Held fixed over the levels.
    alpha : float
        DP concentration.
    neighbours : int
        Each group's merge candidates: its nearest means.

    Returns
    -------
    MergeLevels
    """
    m = stats.n_rows
    n, s1, s2 = stats.n.clone(), stats.s1.clone(), stats.s2.clone()
    current = SuffStats(n, s1, s2)
    marginal = log_marginal_likelihood(prior, current).clone()
    joint = log_crp(n.cpu().numpy(), alpha) + float(marginal.sum())
    dist = torch.cdist(s1 / n[:, None], s1 / n[:, None]).fill_diagonal_(math.inf)
    alive = torch.ones(m, dtype=torch.bool)
    merges = np.zeros((max(m - 1, 0), 2), dtype=np.int64)
    log_joint = np.empty(m, dtype=np.float64)
    log_joint[0] = joint
    best = torch.full((m,), -math.inf, dtype=torch.float64)
    partner = torch.zeros(m, dtype=torch.long)
    # gains of pairs scored before, valid while neither group has merged since; each
    # group's pairs, to drop them when it merges
    cache: dict[tuple[int, int], tuple[float, float]] = {}
    pairs_of: list[set[tuple[int, int]]] = [set() for _ in range(m)]
    q = min(neighbours, m - 1)
    near = dist.topk(q, largest=False).indices if q > 0 else torch.zeros(m, 0, dtype=torch.long)
    refresh = torch.arange(m)
    for step in range(m - 1):
        if q > 0:
            _score_rows(prior, alpha, current, marginal, near, refresh, cache, pairs_of, best, partner)
        row = int(best.argmax())
        a, b = sorted((row, int(partner[row])))
        gain, joined = cache[(a, b)]
        joint += gain
        merges[step] = (a, b)
        log_joint[step + 1] = joint
        n[a], s1[a], s2[a], marginal[a] = n[a] + n[b], s1[a] + s1[b], s2[a] + s2[b], joined
        alive[b] = False
        best[b] = -math.inf
        for key in pairs_of[a] | pairs_of[b]:
            cache.pop(key, None)
        pairs_of[a].clear()
        pairs_of[b].clear()
        dist[b, :] = math.inf
        dist[:, b] = math.inf
        column = torch.cdist(s1[a : a + 1] / n[a], s1 / n[:, None])[0]
        column[~alive] = math.inf
        column[a] = math.inf
        dist[a, :] = column
        dist[:, a] = column
        k_left = m - step - 1
        if k_left - 1 < q:  # fewer groups than candidates: every group's list shrinks
            q = k_left - 1
            refresh = torch.nonzero(alive).squeeze(1)
            near = dist.topk(q, largest=False).indices if q > 0 else near[:, :0]
            continue
        # a group's list changes if it held a or b, or if a's new mean is nearer than its
        # farthest candidate
        kth = dist.gather(1, near[:, -1:]).squeeze(1)
        touched = (near == a).any(1) | (near == b).any(1) | (dist[:, a] < kth)
        touched[a] = True
        refresh = torch.nonzero(touched & alive).squeeze(1)
        near[refresh] = dist[refresh].topk(q, largest=False).indices
    return MergeLevels(merges, log_joint)


def _score_rows(prior: NIWPrior, alpha: float, stats: SuffStats, marginal: torch.Tensor, near: torch.Tensor,
                rows: torch.Tensor, cache: dict[tuple[int, int], tuple[float, float]],
                pairs_of: list[set[tuple[int, int]]], best: torch.Tensor, partner: torch.Tensor) -> None:
    """Each of ``rows``' best merge among its nearest means, into ``best`` and ``partner``
    (in place), the pairs not in ``cache`` scored in one batch."""
    pairs = [(min(r, j), max(r, j)) for r in rows.tolist() for j in near[r].tolist()]
    new = sorted({p for p in pairs if p not in cache})
    if new:
        idx = torch.tensor(new, dtype=torch.long)
        gain, joined = _gains(prior, alpha, stats, marginal, idx[:, 0], idx[:, 1])
        cache.update(zip(new, zip(gain.tolist(), joined.tolist(), strict=True), strict=True))
        for pair in new:
            pairs_of[pair[0]].add(pair)
            pairs_of[pair[1]].add(pair)
    q = near.shape[1]
    for i, r in enumerate(rows.tolist()):
        own = pairs[i * q : (i + 1) * q]
        gains = [cache[p][0] for p in own]
        j = int(np.argmax(gains))
        best[r] = gains[j]
        partner[r] = own[j][0] + own[j][1] - r


def elbow_level(n_groups: np.ndarray, log_joint: np.ndarray, floor: float = ELBOW_FLOOR) -> int:
    """The level where the gain per added group falls most.

    On the upper concave hull of (K, ln p(X, z)), the vertex at or below the exact joint's
    level whose incoming slope over its outgoing one (in magnitude, floored at ``floor`` ×
    the mean slope from the fewest groups up to that level) is largest; the exact joint's
    level when the hull has no inner vertex there.

    Parameters
    ----------
    n_groups : ndarray of shape (L,)
        K of each level.
    log_joint : ndarray of shape (L,)
        ln p(X, z) of each level.
    floor : float

    Returns
    -------
    int
        K of the level.
    """
    order = np.argsort(n_groups, kind="stable")
    k = np.asarray(n_groups, dtype=np.float64)[order]
    s = np.asarray(log_joint, dtype=np.float64)[order]
    top = int(np.argmax(s))
    hull: list[int] = []
    for i in range(len(k)):
        while len(hull) >= 2 and ((s[hull[-1]] - s[hull[-2]]) * (k[i] - k[hull[-2]])
                                  <= (s[i] - s[hull[-2]]) * (k[hull[-1]] - k[hull[-2]])):
            hull.pop()
        hull.append(i)
    slope = np.diff(s[hull]) / np.diff(k[hull])
    least = floor * (s[top] - s[0]) / max(k[top] - k[0], 1.0)
    ratios = [(slope[j - 1] / max(abs(slope[j]), least), hull[j]) for j in range(1, len(hull) - 1)
              if k[hull[j]] <= k[top]]
    return int(k[max(ratios)[1]]) if ratios else int(k[top])
