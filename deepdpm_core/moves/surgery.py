"""Split/merge surgery: a :class:`~deepdpm_core.moves.MovePlan` applied to the mixture
state, the two nets and their optimisers (paper §3.2, Eq. 8; docs/design.md, "Surgery").
Functions of (state, nets, statistics, prior, generator) only, with no data and no
communication, so every rank applies the same plan identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepdpm_core.bayes import NIWPrior, SuffStats, map_estimate
from deepdpm_core.estep import GaussianMixture, MixtureState
from deepdpm_core.moves.initial import principal_split
from deepdpm_core.moves.proposals import MovePlan
from deepdpm_core.nets import (
    Adam,
    ClusterNet,
    SubclusterNets,
    axis_aligned_subnets,
    cluster_row_map,
    new_row_of,
    reindex_rows,
)

Tensor = torch.Tensor


@dataclass(eq=False)
class Nets:
    """The clustering net, the K subclustering nets and their optimisers.

    Surgery replaces parameters inside the modules and moves their optimiser state along,
    so these objects stay the same through every move. ``sub`` and ``opt_sub`` are None in
    a search that trains no subclustering nets (exact EM splits each cluster at the nearer
    subcluster mean); surgery then moves the subcluster parameters alone.
    """

    cluster: ClusterNet
    sub: SubclusterNets | None
    opt_cluster: Adam
    opt_sub: Adam | None

    def parameters(self) -> list[Tensor]:
        """The nets' parameters (clustering net first)."""
        return [*self.cluster.parameters(), *([] if self.sub is None else self.sub.parameters())]


def reset_subclusters(state: MixtureState, nets: Nets, ks: Tensor, generator: torch.Generator) -> None:
    """Principal-axis subclusters of clusters ``ks`` and subnet weights that split the same
    way (in place).

    Parameters
    ----------
    state : MixtureState
    nets : Nets
    ks : Tensor of shape (n,), int64
        Clusters whose subclusters restart.
    generator : torch.Generator
        Draws the subnets' random weights.
    """
    if ks.numel() == 0:
        return
    sm, sc, direction, spread = principal_split(state.means[ks], state.covariances[ks])
    state.sub_means[ks] = sm
    state.set_sub_covariances(ks, sc)
    state.sub_log_weights[ks] = -math.log(2)
    init_subnet_rows(nets, ks, state.means[ks], direction, spread, generator)


def init_subnet_rows(nets: Nets, ks: Tensor, centers: Tensor, directions: Tensor, spreads: Tensor,
                     generator: torch.Generator) -> None:
    """Set subnets ``ks`` to split their clusters at ``centers`` along ``directions``
    (:func:`~deepdpm_core.nets.axis_aligned_subnets`), with zero Adam moments.

    Parameters
    ----------
    nets : Nets
    ks : Tensor of shape (n,), int64
    centers, directions : Tensor of shape (n, D)
    spreads : Tensor of shape (n,)
    generator : torch.Generator
    """
    sub = nets.sub
    if ks.numel() == 0 or sub is None:
        return
    # the draws on the CPU (one generator stream, in row order), then one write per tensor
    fresh = axis_aligned_subnets(sub.dim, sub.hidden_size, centers, directions, spreads, generator)
    rows = ks.to(sub.w1.device)
    with torch.no_grad():
        for p, values in zip((sub.w1, sub.b1, sub.w2, sub.b2), fresh, strict=True):
            p[rows] = values.to(p)
            st = nets.opt_sub.state.get(p)
            for key in ("exp_avg", "exp_avg_sq"):
                if st and key in st:
                    st[key][rows] = 0


def apply_plan(plan: MovePlan, state: MixtureState, nets: Nets, soft: SuffStats, prior: NIWPrior,
               generator: torch.Generator) -> tuple[MixtureState, Tensor]:
    """Apply a move plan: the new mixture state, and the nets reshaped in place.

    Parameters
    ----------
    plan : MovePlan
        Splits, merges and prunes over the current K clusters.
    state : MixtureState
        The current state (not modified).
    nets : Nets
        Reshaped in place; their optimisers' moments follow the kept units.
    soft : SuffStats
        The epoch's soft cluster statistics (K rows): merged clusters get the MAP
        parameters of their pooled statistics, and their output unit is the larger part's.
    prior : NIWPrior
    generator : torch.Generator
        Draws the fresh subnets.

    Returns
    -------
    state : MixtureState
        K_new = K − |removed| + |splits| clusters: the kept ones in order, then the second
        half of every split.
    new_row : Tensor of shape (K,), int64
        Each old cluster's new row (a split one: its first half; a merged one: the merged
        row; a pruned one: −1).
    """
    k_old = state.n_clusters
    device = state.means.device
    src = cluster_row_map(k_old, plan.splits, plan.removed).to(device)
    k_new, n_split = src.shape[0], len(plan.splits)
    # split cluster k -> rows (first, second); merge (a, b) -> row of a
    halves = {k: (int(torch.nonzero(src == k)[0]), k_new - n_split + i) for i, k in enumerate(plan.splits)}
    merged = [(int(torch.nonzero(src == a)[0]), a, b) for a, b in plan.merges]
    new_row = new_row_of(src[: k_new - n_split], k_old)
    for row, _, b in merged:
        new_row[b] = row
    new = _moved_state(state, src, halves, merged, soft, prior)
    _reshape_cluster_net(nets, new, state, src, halves, merged, soft)
    # subclustering nets: fresh nets for the new and the merged clusters
    split_rows = [row for rows in halves.values() for row in rows]
    fresh_rows = sorted(split_rows + [row for row, _, _ in merged])
    _reindex_subnets(nets, src, fresh_rows, generator)
    reset_subclusters(new, nets, torch.tensor(split_rows, dtype=torch.long, device=device), generator)
    for row, _, _ in merged:  # split the merged cluster along the line between its parts
        axis = new.sub_means[row, 0] - new.sub_means[row, 1]
        half = float(axis.norm()) / 2 or 1.0
        init_subnet_rows(nets, torch.tensor([row]), new.means[row : row + 1],
                         (axis / axis.norm().clamp_min(1e-300))[None], torch.tensor([half]), generator)
    return new, new_row


def apply_births(state: MixtureState, nets: Nets, rows: list[int], part_stats: SuffStats, prior: NIWPrior,
                 generator: torch.Generator) -> tuple[MixtureState, Tensor]:
    """Cut clusters ``rows`` into their parts (:mod:`deepdpm_core.moves.births`).

    Part 0 of a cluster keeps its row, its other parts are appended in order; every part
    takes the MAP parameters of its statistics and a weight in proportion to its points,
    a copy of the cluster's output unit (bias shifted by the part's log share) and a fresh
    subclustering net that halves it along its principal axis.

    Parameters
    ----------
    state : MixtureState
        K clusters (not modified).
    nets : Nets
        Reshaped in place.
    rows : list of int
        The B clusters cut.
    part_stats : SuffStats with B·P rows
        Part j of ``rows[b]`` at row b·P + j; no part empty.
    prior, generator : NIWPrior, torch.Generator
        As for :func:`apply_plan`.

    Returns
    -------
    state : MixtureState
        K + B·(P − 1) clusters.
    part_rows : Tensor of shape (B·P,), int64
        Each part's row in it.
    """
    k, b = state.n_clusters, len(rows)
    parts = part_stats.n_rows // b
    device = state.means.device
    src = torch.tensor(list(range(k)) + [r for r in rows for _ in range(parts - 1)], dtype=torch.long,
                       device=device)
    part_rows = torch.tensor([[r] + [k + i * (parts - 1) + j for j in range(parts - 1)] for i, r in enumerate(rows)],
                             dtype=torch.long, device=device).view(-1)
    new = state.rows(src)
    means, covs = map_estimate(prior, part_stats)
    n = part_stats.n.view(b, parts)
    share = (n / n.sum(1, keepdim=True)).log().view(-1)
    owner = torch.tensor(rows, dtype=torch.long, device=device).repeat_interleave(parts)
    new.means[part_rows], new.covariances[part_rows] = means.to(new.means), covs.to(new.covariances)
    new.log_weights[part_rows] = state.log_weights[owner] + share.to(new.log_weights)
    new.log_weights = new.log_weights - torch.logsumexp(new.log_weights, 0)
    out = nets.cluster.out
    old_bias = out.bias.detach().clone()
    reindex_rows(out, "weight", src, None, nets.opt_cluster)
    reindex_rows(out, "bias", src, None, nets.opt_cluster)
    with torch.no_grad():
        out.bias[part_rows.to(out.bias.device)] = (old_bias[owner.to(old_bias.device)]
                                                   + share.to(old_bias))
    _reindex_subnets(nets, src, part_rows, generator)
    reset_subclusters(new, nets, part_rows, generator)
    return new, part_rows


def _reindex_subnets(nets: Nets, src: Tensor, fresh_rows: list[int] | Tensor, generator: torch.Generator) -> None:
    """The subclustering nets (if any) follow the row map ``src``, with fresh default nets
    (drawn from ``generator``) at ``fresh_rows``, their Adam moments zero."""
    if nets.sub is None:
        return
    sub_src = src.clone()
    sub_src[fresh_rows] = -1
    fresh = nets.sub.fresh(len(fresh_rows), generator)
    for name, values in zip(("w1", "b1", "w2", "b2"), fresh, strict=True):
        reindex_rows(nets.sub, name, sub_src, values.to(src.device), nets.opt_sub)


def _moved_state(state: MixtureState, src: Tensor, halves: dict[int, tuple[int, int]],
                 merged: list[tuple[int, int, int]], soft: SuffStats, prior: NIWPrior) -> MixtureState:
    """The mixture state after the move (paper Eq. 8 for splits; pooled MAP for merges)."""
    new = state.rows(src)
    split = list(halves)
    sub_covs = state.sub_covariance_rows(torch.tensor(split, dtype=torch.long, device=src.device))
    for i, (k, rows) in enumerate(halves.items()):  # new clusters take their subclusters' parameters
        for j, row in enumerate(rows):
            new.means[row], new.covariances[row] = state.sub_means[k, j], sub_covs[i, j]
            new.log_weights[row] = state.log_weights[k] + state.sub_log_weights[k, j]
    for row, a, b in merged:
        m, c = map_estimate(prior, soft.rows([a]) + soft.rows([b]))
        new.means[row], new.covariances[row] = m[0], c[0]
        new.log_weights[row] = torch.logaddexp(state.log_weights[a], state.log_weights[b])
        # the two old clusters become the subclusters of the merged one
        new.sub_means[row] = torch.stack([state.means[a], state.means[b]])
        new.set_sub_covariances(torch.tensor([row]), torch.stack([state.covariances[a], state.covariances[b]])[None])
        pair = torch.stack([state.log_weights[a], state.log_weights[b]])
        new.sub_log_weights[row] = pair - torch.logsumexp(pair, 0)
    new.log_weights = new.log_weights - torch.logsumexp(new.log_weights, 0)
    return new


def _reshape_cluster_net(nets: Nets, new: MixtureState, old: MixtureState, src: Tensor,
                         halves: dict[int, tuple[int, int]], merged: list[tuple[int, int, int]],
                         soft: SuffStats) -> None:
    """Clustering net: duplicate the split unit, drop removed ones (paper §3.2).

    The halves' biases share the old unit's mass in proportion to the subclusters, then
    are tilted apart (:func:`separate_halves`). A merged cluster keeps the output unit
    (weights and Adam state) of its larger part, its bias raised by ln(1 + n_small /
    n_large) <= ln 2. (Not the two biases added in log space: a bias means something only
    with its own weights, and a large bias offset by its weights won every point.)
    """
    out = nets.cluster.out
    old_bias = out.bias.detach().clone()
    out_src = src.clone()
    mass_gain = {}
    for row, a, b in merged:
        n_a, n_b = float(soft.n[a]), float(soft.n[b])
        if n_b > n_a:
            out_src[row], mass_gain[row] = b, math.log1p(n_a / n_b)
        else:
            out_src[row], mass_gain[row] = a, math.log1p(n_b / n_a) if n_a > 0 else 0.0
    reindex_rows(out, "weight", out_src, None, nets.opt_cluster)
    reindex_rows(out, "bias", out_src, None, nets.opt_cluster)
    with torch.no_grad():
        for k, rows in halves.items():
            for j, row in enumerate(rows):
                out.bias[row] = old_bias[k] + old.sub_log_weights[k, j].float()
            separate_halves(nets.cluster, new, rows, float(old_bias[k]))
        for row, gain in mass_gain.items():
            out.bias[row] += gain


def separate_halves(net: ClusterNet, state: MixtureState, rows: tuple[int, int], unit_bias: float,
                    max_gap: float = 2.0, margin: float = 1.0) -> None:
    """Tilt the two duplicated output units of a split apart along the hidden-feature
    difference of the subcluster means, so each half wins its own subcluster.

    Duplicated units cannot tell the halves apart, and a small half that wins no point
    before the next move round is pruned and proposed again. The halves' logit gap
    g(x) = a·δ·h(x) + c (δ = h(μ₁) − h(μ₂), h the hidden layer) is set to the subclusters'
    own log-odds at their two means, clipped to ±``max_gap`` (odds e² ≈ 7 suffice), with
    the mean of the two units unchanged. Far from the split cluster the tilt lifts the
    better half by |g(x)|/2 and can outbid other clusters' units (a split in a barely
    trained 4-cluster net took up to 1200 of 1500 points), so it is scaled back,
    g_t = (1 − t)·Δb + t·g with Δb the untilted bias gap, by the largest t ∈ [0, 1] for
    which, at every other cluster's mean, the better half is no higher than the split
    unit was (bias ``unit_bias``) or stays ``margin`` below the best other unit.

    Parameters
    ----------
    net : ClusterNet
        Its output rows ``rows`` hold the split unit twice; changed in place.
    state : MixtureState
        The state after the split (the halves hold their subclusters' parameters).
    rows : (int, int)
        The halves' rows.
    unit_bias : float
        The split unit's bias before the split.
    """
    out = net.out
    with torch.no_grad():
        h_all = torch.relu(net.hidden(state.means.float())).double()  # (K, H)
        logits = out(h_all.float()).double()  # (K means, K units)
    h = h_all[list(rows)]  # the halves took their subclusters' parameters (Eq. 8)
    delta = h[0] - h[1]
    norm2 = float(delta.square().sum())
    if norm2 < 1e-12:
        return
    mu = state.means[list(rows)]
    pair = GaussianMixture(mu, state.covariances[list(rows)], state.log_weights[list(rows)])
    lp = pair.weighted_log_prob(mu)  # (2 points, 2 halves)
    odds = (lp[:, 0] - lp[:, 1]).clamp(-max_gap, max_gap)  # wanted g at μ₁ and at μ₂
    a = float(odds[0] - odds[1]) / norm2
    if a <= 0:
        return
    c = float(odds[0]) - a * float(delta @ h[0])
    w = out.weight[rows[0]].double()  # both rows hold the duplicated weights
    b1, b2 = float(out.bias[rows[0]]), float(out.bias[rows[1]])
    mean_bias, gap0 = 0.5 * (b1 + b2), b1 - b2
    t = tilt_scale(rows, h_all, logits, w, mean_bias, unit_bias - mean_bias, gap0,
                   a * (h_all @ delta) + c, margin)
    step = 0.5 * t * a * delta
    out.weight[rows[0]] = (w + step).float()
    out.weight[rows[1]] = (w - step).float()
    gap = (1.0 - t) * gap0 + t * c
    out.bias[rows[0]] = mean_bias + 0.5 * gap
    out.bias[rows[1]] = mean_bias - 0.5 * gap


def tilt_scale(rows: tuple[int, int], h_all: Tensor, logits: Tensor, w: Tensor, mean_bias: float,
               lift: float, gap0: float, g: Tensor, margin: float) -> float:
    """Largest t in [0, 1] such that |(1 − t)·gap0 + t·g_j| ≤ R_j at every other mean j.

    Parameters
    ----------
    rows : (int, int)
        The halves' rows.
    h_all : Tensor of shape (K, H)
        Hidden features at every cluster mean.
    logits : Tensor of shape (K, K)
        Untilted logits at every cluster mean (both halves still duplicated).
    w : Tensor of shape (H,)
        The duplicated output weights.
    mean_bias : float
        Mean of the halves' biases.
    lift : float
        Split unit's bias minus ``mean_bias`` (≥ |gap0|/2: the halves' biases are the
        unit's plus their subclusters' log weights).
    gap0 : float
        The halves' untilted bias gap.
    g : Tensor of shape (K,)
        Full tilt gap a·δ·h(μ_j) + c at every mean.
    margin : float

    Notes
    -----
    The pair's larger logit at x is base(x) + |gap(x)|/2 with base = w·h(x) + mean_bias.
    R_j = max(2·(L_j − margin − base_j), 2·lift), L_j the best other unit at μ_j: the
    pair may reach the split unit's own logit there, or ``margin`` below the best other
    unit. The gap is linear in t, so each j bounds t from above.
    """
    other = torch.ones(logits.shape[0], dtype=torch.bool)  # means and units not of the pair
    other[list(rows)] = False
    if not other.any():
        return 1.0
    best_other = logits[other][:, other].max(1).values  # (K - 2,)
    base = h_all[other] @ w + mean_bias
    bound = (2.0 * (best_other - margin - base)).clamp_min(max(2.0 * lift, abs(gap0)))
    slope = g[other] - gap0  # d gap / dt
    # gap0 + t·slope ≤ R (slope > 0) and gap0 + t·slope ≥ −R (slope < 0)
    limit = torch.where(slope > 0, (bound - gap0) / slope.clamp_min(1e-300),
                        (bound + gap0) / (-slope).clamp_min(1e-300))
    return float(limit.min().clamp(0.0, 1.0))
