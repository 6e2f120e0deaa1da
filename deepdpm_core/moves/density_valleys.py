"""Density valleys along split and merge axes: a split must cut where the cluster's density
dips (docs/design.md, "Density valleys").

A Gaussian fitted to a curved or heavy-tailed cluster gains likelihood from a cut into two
Gaussians although the cluster has one mode, so K grows with N on such clusters. A split is
proposed only if the cluster's points, projected on Fisher's discriminant of its two
subclusters, show a valley whose floor is at most :data:`SPLIT_VALLEY` of the lower of
the peaks on its two sides; two clusters whose points, projected on their own
discriminant, show no valley deeper than :data:`MERGE_VALLEY` are merged whatever their
Hastings ratio. The projections are histograms summed over ranks like the statistics, and
rank 0 reads the valleys from them. Two equal Gaussians the model itself splits (d > 3.46
standard deviations apart) leave a floor of 0.43 of the peaks; a single Gaussian, a banana
or a Student-t cluster projects to one mode.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from deepdpm_core.bayes import cholesky_jittered, row_blocks
from deepdpm_core.estep import MixtureState

#: histogram bins over [−SPAN, SPAN] standard deviations of the cluster along the axis
BINS = 128
SPAN = 4.0
#: split or merge axes (:func:`split_axes`, :func:`pair_axes`) computed at a time: their
#: (n, D, D) gathers, sums and factors stay in the cache (2,357 pairs of 1,000 clusters in
#: 128-D, one thread: 1.68 s all at once, 0.50 s 32 at a time)
AXES_PER_PASS = 32
#: a split's valley counts only if each side holds this share of the cluster's points (and
#: at least :data:`~deepdpm_core.moves.proposals.MIN_SUBCLUSTER_SIZE` points): a few stray
#: points in a tail are no mode
MIN_SIDE_SHARE = 0.01
#: a pair's two means lie within this share of the span from its centre, however unequal
#: the pair (:func:`pair_axes`)
MEANS_WITHIN = 0.5
#: a pair's valley needs on each side at most this share of the smaller cluster's points
#: (rather than :data:`MIN_SIDE_SHARE` of the pair, which a cluster under 1 % of the pair
#: cannot hold: the valley before it would not count, and the pair would merge as one mode)
PAIR_SIDE_SHARE = 0.5
#: the valley rules judge a split or merge only when each side holds this many points: at 25
#: a side one Gaussian shows no valley below 0.9 in 99 draws of 100, and two Gaussians 5
#: standard deviations apart show one below 0.75 in 99 (4 apart: 80, 3.5 apart: 39, pairs
#: whose split the Hastings ratio itself barely takes at that size); below it the kernel
#: fills valleys, and the moves are left to the Hastings ratio
VALLEY_MIN_POINTS = 25
#: the smoothing kernel's width is this times n^(−1/5) standard deviations for n points:
#: Silverman's rule for one Gaussian mode; narrower kernels show valleys in one mode's
#: sampling noise at a few thousand points
VALLEY_BANDWIDTH = 0.9
#: a split is proposed only across a valley whose floor is at most this share of the lower
#: peak: two equal Gaussians the DP model itself splits (d > 3.46 standard deviations apart)
#: leave 0.43, while one Gaussian, a Student-t or a gamma sample of 3,000 points or more
#: projects to above 0.82, so only the cuts the Gaussian likelihood makes inside one mode go
SPLIT_VALLEY = 0.75
#: a pair of clusters with a valley at most :data:`~deepdpm_core.moves.proposals.EXACT_VALLEY`
#: deep between them is not merged where each holds this many points a feature: Fisher's
#: axis is fitted to the same points, and the halves of one Gaussian sample show valleys of
#: 0.01 along it at 1 point a feature in 64-D, none below 0.64 at 10 (40 draws each, 2- to
#: 64-D); fewer points leave the pair to its Hastings ratio. Without it, a prior fitted while
#: clusters still hold several blobs merges whole blobs across valleys of 0.12-0.15
#: (100 blobs along a curve at 100,000 rows ended at K 81)
APART_POINTS_PER_FEATURE = 10
#: a merge candidate with no valley this deep between its clusters is one mode and is merged
#: whatever its Hastings ratio; above :data:`SPLIT_VALLEY`, so that sampling noise in a
#: valley's depth cannot undo a split at the next round (at 0.75 for both, 15 overlapping
#: blobs alternated between split and merge for 200 epochs), but a pair whose valley lies
#: between the two can be neither split from its union nor merged, so the start decides it:
#: 35 worms in 2-D from 105 k-means clusters end at K 43 with 0.9, 38 with 0.85, 35 with
#: 0.78, where 15 overlapping blobs lose 0.045 of NMI (docs/design.md, "Density valleys")
MERGE_VALLEY = 0.85


def split_axes(state: MixtureState) -> tuple[Tensor, Tensor, Tensor]:
    """Each cluster's split axis: Fisher's discriminant of its two subclusters.

    The direction is Σ_w⁻¹ (μ̃_k1 − μ̃_k2), Σ_w the subclusters' covariances pooled with
    their weights (two elongated clusters side by side overlap on the line between their
    means, not on this one).

    Returns
    -------
    mid : Tensor of shape (K, D)
        The midpoint of the subcluster means.
    unit : Tensor of shape (K, D)
        The unit discriminant direction.
    scale : Tensor of shape (K,)
        The cluster's standard deviation along it, sqrt(uᵀ Σ_k u).
    """
    sub = state.sub_means.to(torch.float64)
    w = torch.softmax(state.sub_log_weights.to(torch.float64), 1)
    units, scales = [], []
    for s, e in row_blocks(state.n_clusters, AXES_PER_PASS):  # a few clusters at a time, as pair_axes
        rows = slice(s, e)
        covs = state.covariances[rows].to(torch.float64)
        # (a millionth of the cluster's covariance keeps subclusters not yet drawn, zeros, solvable)
        within = torch.einsum("kj,kjab->kab", w[rows], state.sub_covariances[rows].to(torch.float64)) + 1e-6 * covs
        unit = _discriminant(sub[rows, 0] - sub[rows, 1], within)
        units.append(unit)
        scales.append(torch.einsum("ki,kij,kj->k", unit, covs, unit).clamp_min(1e-300).sqrt())
    return sub.mean(1), torch.cat(units), torch.cat(scales)


def pair_axes(state: MixtureState, pairs: list[tuple[int, int]]) -> tuple[Tensor, Tensor, Tensor]:
    """Each pair's merge axis: Fisher's discriminant of the two clusters.

    Returns
    -------
    mid : Tensor of shape (P, D)
        The midpoint of the two means.
    unit : Tensor of shape (P, D)
        The unit direction Σ_w⁻¹ (μ_a − μ_b), Σ_w the two covariances pooled with the
        clusters' weights.
    scale : Tensor of shape (P,)
        The standard deviation along it of the two clusters pooled with their weights
        (within plus between), widened where a mean would lie beyond :data:`MEANS_WITHIN`
        of the span (the smaller of two unequal clusters would fall outside the histogram).
    """
    device = state.means.device
    means, covs = state.means.to(torch.float64), state.covariances.to(torch.float64)
    log_weights = state.log_weights.to(torch.float64)
    parts = []
    for s, e in row_blocks(len(pairs), AXES_PER_PASS):
        a, b = torch.tensor(pairs[s:e], dtype=torch.long, device=device).T
        w = torch.softmax(torch.stack([log_weights[a], log_weights[b]], 1), 1)
        pooled = w[:, 0, None, None] * covs[a] + w[:, 1, None, None] * covs[b]
        unit = _discriminant(means[a] - means[b], pooled)
        within = torch.stack([torch.einsum("pi,pij,pj->p", unit, covs[c], unit) for c in (a, b)], 1)
        gap = ((means[a] - means[b]) * unit).sum(1)
        var = (w * within).sum(1) + w[:, 0] * w[:, 1] * gap.square()
        scale = torch.maximum(var.clamp_min(1e-300).sqrt(), gap.abs() / (2 * MEANS_WITHIN * SPAN))
        parts.append(((means[a] + means[b]) / 2, unit, scale))
    return tuple(torch.cat(t) for t in zip(*parts, strict=True))


def _discriminant(diff: Tensor, within: Tensor) -> Tensor:
    """Unit vectors along within⁻¹ diff, (n, D) from diff (n, D) and within (n, D, D)."""
    v = torch.cholesky_solve(diff[..., None], cholesky_jittered(within)).squeeze(-1)
    return v / v.norm(dim=1, keepdim=True).clamp_min(1e-300)


def _bin(x: Tensor, mid: Tensor, unit: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """Rows x (n, D) projected on lines (n rows each of mid, unit (n, D), scale (n,)):
    which rows fall inside [−SPAN, SPAN] and their bins."""
    t = ((x - mid) * unit).sum(1).double() / scale
    inside = t.abs() < SPAN
    return inside, ((t[inside] + SPAN) * (BINS / (2 * SPAN))).long().clamp_(0, BINS - 1)


@torch.no_grad()
def projection_histograms(x: Tensor, labels: Tensor, state: MixtureState, chunk: int = 8192) -> Tensor:
    """Counts of each cluster's points along its split axis (:func:`split_axes`), in its
    standard deviations.

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
        The rows in the fit's coordinates.
    labels : Tensor of shape (N_local,), int64
        Each row's cluster (−1: none; not counted).
    state : MixtureState
        K clusters with their subcluster means and covariances.
    chunk : int
        Rows per pass: their gathered (chunk, D) axes stay in the cache (1,000 clusters in
        128-D, 200,000 rows, one thread: 0.42 s in passes of 65,536 rows, 0.23 s of 8,192).

    Returns
    -------
    Tensor of shape (K, BINS), float64
        Local counts over [−SPAN, SPAN]; points beyond are not counted. Sum over ranks.
    """
    k = state.n_clusters
    mid, unit, scale = (t.to(x.device) for t in split_axes(state))
    mid32, unit32 = mid.to(torch.float32), unit.to(torch.float32)
    counts = torch.zeros(k * BINS, dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], chunk):
        z = labels[s : s + chunk]
        keep = z >= 0
        xb, z = x[s : s + chunk][keep], z[keep]
        inside, bins = _bin(xb, mid32.index_select(0, z), unit32.index_select(0, z), scale[z])
        counts += torch.bincount(z[inside] * BINS + bins, minlength=k * BINS).to(counts)
    return counts.view(k, BINS)


@torch.no_grad()
def pair_histograms(x: Tensor, labels: Tensor, state: MixtureState, pairs: list[tuple[int, int]]) -> Tensor:
    """Counts of the points of each pair of clusters along the pair's merge axis
    (:func:`pair_axes`), in the pooled standard deviations.

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
    labels : Tensor of shape (N_local,), int64
        Each row's cluster (−1: none).
    state : MixtureState
    pairs : list of (a, b)
        Merge candidates.

    Returns
    -------
    Tensor of shape (P, BINS), float64
        Local counts; sum over ranks.
    """
    counts = torch.zeros(len(pairs), BINS, dtype=torch.float64, device=x.device)
    if not pairs:
        return counts
    mid, unit, scale = (t.to(x.device) for t in pair_axes(state, pairs))
    mid32, unit32 = mid.to(torch.float32), unit.to(torch.float32)
    order = torch.argsort(labels)
    ends = torch.searchsorted(labels[order], torch.arange(state.n_clusters + 1, device=x.device) - 1, right=True)
    ends = ends.tolist()  # rows of cluster c: order[ends[c] : ends[c + 1]]
    for p, (a, b) in enumerate(pairs):
        rows = torch.cat([order[ends[a] : ends[a + 1]], order[ends[b] : ends[b + 1]]])
        n = rows.shape[0]
        inside, bins = _bin(x.index_select(0, rows), mid32[p].expand(n, -1), unit32[p].expand(n, -1),
                            scale[p].expand(n))
        counts[p] += torch.bincount(bins, minlength=BINS).to(counts)
    return counts


def smoothed(hist: np.ndarray, bandwidth: float) -> np.ndarray:
    """Each row of counts (K, B) smoothed by a Gaussian kernel of Silverman's width,
    ``bandwidth``·n^(−1/5) standard deviations for a row of n points (the axis is in the
    cluster's standard deviations; :data:`VALLEY_BANDWIDTH`); shape (K, B)."""
    out = np.empty_like(hist, dtype=np.float64)
    bin_width = 2 * SPAN / hist.shape[1]
    for k, row in enumerate(hist):
        n = float(row.sum())
        width = bandwidth * max(n, 1.0) ** -0.2 / bin_width
        half = max(1, math.ceil(4 * width))
        taps = np.exp(-0.5 * (np.arange(-half, half + 1) / width) ** 2)
        out[k] = np.convolve(row, taps / taps.sum(), mode="same")
    return out


def valley_ratios(hist: np.ndarray, min_side: float, bandwidth: float,
                  share_cap: np.ndarray | None = None) -> np.ndarray:
    """The deepest valley of each smoothed projection, as floor / lower side peak.

    For a bin i with mass on both sides, the valley ratio is f(i) / min(max f left of i,
    max f right of i); the ratio of a row is its smallest over the bins whose two sides
    each hold at least ``min_side`` points and :data:`MIN_SIDE_SHARE` of the row (or
    ``share_cap`` points, where fewer). A unimodal row has none below 1.

    Parameters
    ----------
    hist : ndarray of shape (K, B)
        Counts along each cluster's split axis, or each pair's merge axis (summed over ranks).
    min_side : float
        Fewest points on either side of a valley
        (:data:`~deepdpm_core.moves.proposals.MIN_SUBCLUSTER_SIZE` in a fit).
    bandwidth : float
        The smoothing kernel's width factor (:func:`smoothed`).
    share_cap : ndarray of shape (K,), optional
        The most points the share rule may ask of a side: for a pair,
        :data:`PAIR_SIDE_SHARE` of its smaller cluster; none for a split.

    Returns
    -------
    ndarray of shape (K,)
        In [0, 1]; 1 where no valley counts.
    """
    f = smoothed(hist, bandwidth)
    counts = np.asarray(hist, dtype=np.float64)
    n = counts.sum(1, keepdims=True)
    left_mass = np.cumsum(counts, 1) - counts
    right_mass = n - np.cumsum(counts, 1)
    left_peak = np.maximum.accumulate(f, 1)
    right_peak = np.maximum.accumulate(f[:, ::-1], 1)[:, ::-1]
    # the peaks strictly beside bin i
    left_peak = np.concatenate([np.zeros((f.shape[0], 1)), left_peak[:, :-1]], 1)
    right_peak = np.concatenate([right_peak[:, 1:], np.zeros((f.shape[0], 1))], 1)
    share = MIN_SIDE_SHARE * n if share_cap is None else np.minimum(MIN_SIDE_SHARE * n, share_cap[:, None])
    side = np.maximum(min_side, share)
    counted = (left_mass >= side) & (right_mass >= side)
    lower = np.minimum(left_peak, right_peak)
    ratio = np.where(counted & (lower > 0), f / np.where(lower > 0, lower, 1.0), 1.0)
    return np.clip(ratio.min(1), 0.0, 1.0)
