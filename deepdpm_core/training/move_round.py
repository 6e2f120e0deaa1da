"""One split or merge round of a fit (paper §3.2): rank 0 decides the moves from the reduced
statistics and the density valleys (every rank then applies the plan), the clusters that own
no point at the end of a fit, and the births offered in a small-data split round to the
clusters whose split was not taken."""

from __future__ import annotations

import numpy as np
import torch

from deepdpm_core.bayes import PriorFit, SuffStats
from deepdpm_core.config import Config
from deepdpm_core.errors import DataError
from deepdpm_core.estep import MixtureState
from deepdpm_core.moves import (
    MERGE_NEIGHBOURS,
    MIN_SUBCLUSTER_SIZE,
    PAIR_SIDE_SHARE,
    VALLEY_BANDWIDTH,
    MovePlan,
    Nets,
    apply_births,
    birth_min_points,
    birth_proposals,
    choose_births,
    coarsening_constant,
    merge_candidates,
    pair_histograms,
    plan_moves,
    projection_histograms,
    valley_ratios,
)
from deepdpm_core.runtime import net_precision
from deepdpm_core.training.fit_context import FitContext

Tensor = torch.Tensor


def decide_moves(ctx: FitContext, config: Config, kind: str, sub: SuffStats, state: MixtureState,
                 anchors: Tensor | None, prior_fit: PriorFit, rng: np.random.Generator, epoch: int) -> MovePlan:
    """The plan of a ``kind`` ("split" or "merge") round (collective): rank 0 decides it
    from the subcluster statistics ``sub`` and the density valleys around the rows'
    ``anchors`` and broadcasts it, or the DataError it ran into (naming ``epoch``), so that
    every rank raises it rather than wait for a plan."""
    plan: MovePlan | DataError | None = None
    valleys = _valleys(ctx, kind, sub, state, anchors)
    if ctx.comm.rank == 0:
        try:
            plan = plan_moves(kind, sub, state.means, prior_fit.prior, config.prior.alpha, rng,
                              _coarsening(config, prior_fit), valleys)
        except torch.linalg.LinAlgError:
            plan = prior_fit.numerical_failure(epoch)
    plan = ctx.comm.broadcast_object(plan, src=0)
    if isinstance(plan, DataError):
        raise plan
    return plan


def unowned_clusters(ctx: FitContext, cluster_net: torch.nn.Module, k: int, batch_size: int = 65536) -> list[int]:
    """The clusters (of K = ``k``) that own no point under the clustering net's argmax,
    counted over all ranks (collective): at the last epoch K becomes the clusters that own
    points."""
    counts = torch.zeros(k, dtype=torch.float64, device=ctx.device)
    with torch.no_grad():
        for s in range(0, ctx.x.shape[0], batch_size):
            with net_precision(ctx.precision, ctx.device):
                z = cluster_net(ctx.x[s : s + batch_size]).argmax(1)
            counts += torch.bincount(z, minlength=k).to(counts)
    return [int(c) for c in torch.nonzero(ctx.comm.all_reduce(counts) <= 0).squeeze(1).tolist()]


def _coarsening(config: Config, prior_fit: PriorFit) -> float | None:
    """c of the coarsened move ratios (:func:`~deepdpm_core.moves.coarsening_constant`)."""
    prior = prior_fit.prior
    return coarsening_constant(config.prior.coarsening, prior.dim, prior.diagonal)


def _valleys(ctx: FitContext, kind: str, sub: SuffStats, state: MixtureState,
             anchors: Tensor | None) -> np.ndarray | dict[tuple[int, int], float]:
    """The density valleys a move round judges (:mod:`deepdpm_core.moves.density_valleys`;
    collective), along each cluster's split axis or each candidate pair's merge axis, each
    row counted in its E-step anchor; a pair's sides are sized by its clusters' points in
    ``sub``."""
    if kind == "split":
        hist = ctx.comm.all_reduce(projection_histograms(ctx.x, anchors, state))
        return valley_ratios(hist.cpu().numpy(), MIN_SUBCLUSTER_SIZE, VALLEY_BANDWIDTH)
    pairs, ratios, _ = merge_valleys(ctx, state, anchors, sub.n.view(-1, 2).sum(1).cpu().numpy())
    return dict(zip(pairs, ratios.tolist(), strict=True))


def merge_valleys(ctx: FitContext, state: MixtureState, labels: Tensor, sizes: np.ndarray
                  ) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
    """Each cluster paired with its nearest means, and the deepest density valley between
    each pair along its merge axis, the rows counted in ``labels`` (collective).

    Returns
    -------
    pairs : list of (a, b)
    ratios : ndarray of shape (len(pairs),)
        :func:`~deepdpm_core.moves.valley_ratios`, a pair's sides sized by ``sizes`` (K,).
    smaller : ndarray of shape (len(pairs),)
        The points of each pair's smaller cluster.
    """
    pairs = merge_candidates(state.means, MERGE_NEIGHBOURS)
    hist = ctx.comm.all_reduce(pair_histograms(ctx.x, labels, state, pairs))
    smaller = np.array([min(sizes[a], sizes[b]) for a, b in pairs], dtype=np.float64)
    ratios = valley_ratios(hist.cpu().numpy(), MIN_SUBCLUSTER_SIZE, VALLEY_BANDWIDTH,
                           share_cap=PAIR_SIDE_SHARE * smaller)
    return pairs, ratios, smaller


def births(ctx: FitContext, config: Config, state: MixtureState, nets: Nets, anchors: Tensor,
           candidates: list[int], prior_fit: PriorFit, torch_gen: torch.Generator
           ) -> tuple[MixtureState, Tensor, int]:
    """Offer ``candidates`` (clusters whose split this round did not take) the cuts into
    3 .. :data:`~deepdpm_core.moves.births.BIRTH_PARTS` parts (:mod:`deepdpm_core.moves.births`; collective), if they
    hold :func:`~deepdpm_core.moves.births.birth_min_points` points. Rank 0 chooses, every
    rank cuts (``nets`` in place); returns the mixture, the anchors and the births made."""
    counts = ctx.comm.all_reduce(
        torch.bincount(anchors[anchors >= 0], minlength=state.n_clusters).to(torch.float64))
    rows = [k for k in candidates if counts[k] >= birth_min_points(ctx.dim)]
    if not rows:
        return state, anchors, 0
    prior = prior_fit.prior
    proposals = birth_proposals(ctx.x, anchors, state, rows, prior, config.prior.alpha,
                                _coarsening(config, prior_fit), ctx.comm)
    chosen = ctx.comm.broadcast_object(choose_births(proposals) if ctx.comm.rank == 0 else None, src=0)
    for i, prop in enumerate(proposals):
        born = [b for b, j in chosen.items() if j == i]
        if not born:
            continue
        keep = torch.tensor([b * prop.parts + j for b in born for j in range(prop.parts)], dtype=torch.long)
        state, part_rows = apply_births(state, nets, [rows[b] for b in born], prop.stats.rows(keep), prior,
                                        torch_gen)
        # the rows of a cut cluster move to their part's row
        to_row = torch.full((len(rows) * prop.parts,), -1, dtype=torch.long, device=ctx.device)
        to_row[keep.to(ctx.device)] = part_rows.to(ctx.device)
        new_anchor = to_row[prop.part.clamp_min(0)]
        anchors = torch.where((prop.part >= 0) & (new_anchor >= 0), new_anchor, anchors)
    return state, anchors, len(chosen)
