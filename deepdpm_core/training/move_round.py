"""One split or merge round of a fit (paper §3.2): rank 0 decides the moves from the reduced
statistics and the density valleys, every rank applies the plan, and in a small-data split
round the clusters whose split was not taken are offered births."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from deepdpm_core.bayes import SuffStats
from deepdpm_core.errors import DataError
from deepdpm_core.moves import (
    PAIR_SIDE_SHARE,
    MovePlan,
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

if TYPE_CHECKING:
    from deepdpm_core.training.trainer import Trainer


def move_round(trainer: Trainer, move: str, soft: SuffStats, sub: SuffStats) -> tuple[int, int]:
    """Run a ``move`` ("split" or "merge") round on ``trainer`` (collective); returns the
    splits (births included) and the merges accepted."""
    plan = _decide(trainer, move, sub)
    unsplit = [k for k in range(trainer.n_clusters) if k not in plan.splits and k not in plan.prunes]
    new_row = trainer.apply_plan(plan, soft)
    splits, merges = len(plan.splits), len(plan.merges)
    if move == "split" and trainer.small and trainer.config.moves.birth_parts:
        splits += _births(trainer, [int(new_row[k]) for k in unsplit])
    return splits, merges


def prune_unowned(trainer: Trainer, batch_size: int = 65536) -> None:
    """Drop the clusters that own no point under the clustering net's argmax, counted over
    all ranks (collective): at the last epoch K becomes the clusters that own points."""
    counts = torch.zeros(trainer.n_clusters, dtype=torch.float64, device=trainer.device)
    with torch.no_grad():
        for s in range(0, trainer.x.shape[0], batch_size):
            with net_precision(trainer.precision, trainer.device):
                z = trainer.nets.cluster(trainer.x[s : s + batch_size]).argmax(1)
            counts += torch.bincount(z, minlength=trainer.n_clusters).to(counts)
    empty = [int(k) for k in torch.nonzero(trainer.comm.all_reduce(counts) <= 0).squeeze(1).tolist()]
    if empty and len(empty) < trainer.n_clusters:
        trainer.apply_plan(MovePlan(prunes=empty),
                           SuffStats.zeros(trainer.n_clusters, trainer.dim, device=trainer.device))


def _decide(trainer: Trainer, kind: str, sub: SuffStats) -> MovePlan:
    """Rank 0 decides the moves and broadcasts the plan, or the DataError it ran into,
    so that every rank raises it rather than wait for a plan."""
    plan: MovePlan | DataError | None = None
    valleys = _valleys(trainer, kind, sub)
    if trainer.comm.rank == 0:
        try:
            plan = plan_moves(kind, sub, trainer.state.means, trainer.prior_fit.prior, trainer.config.moves,
                              trainer.config.prior.alpha, trainer.rng, _coarsening(trainer), valleys)
        except torch.linalg.LinAlgError:
            plan = trainer.prior_fit.numerical_failure(trainer.epoch)
    plan = trainer.comm.broadcast_object(plan, src=0)
    if isinstance(plan, DataError):
        raise plan
    return plan


def _coarsening(trainer: Trainer) -> float | None:
    """c of the coarsened move ratios (:func:`~deepdpm_core.moves.coarsening_constant`)."""
    p, prior = trainer.config.prior, trainer.prior_fit.prior
    return coarsening_constant(p.coarsening, p.coarsening_per_parameter, prior.dim, prior.diagonal)


def _valleys(trainer: Trainer, kind: str, sub: SuffStats
             ) -> np.ndarray | dict[tuple[int, int], float] | None:
    """The density valleys a move round judges (:mod:`deepdpm_core.moves.density_valleys`;
    collective), along each cluster's split axis or each candidate pair's merge axis, each
    row counted in its E-step anchor; a pair's sides are sized by its clusters' points in
    ``sub``. None when the round's rule (``moves.split_valley`` or ``merge_valley``) is off."""
    mc = trainer.config.moves
    if (mc.split_valley if kind == "split" else mc.merge_valley) is None:
        return None
    if kind == "split":
        hist = trainer.comm.all_reduce(projection_histograms(trainer.x, trainer.anchors, trainer.state))
        return valley_ratios(hist.cpu().numpy(), mc.min_subcluster_size, mc.valley_bandwidth)
    pairs = merge_candidates(trainer.state.means, mc.merge_neighbours)
    hist = trainer.comm.all_reduce(pair_histograms(trainer.x, trainer.anchors, trainer.state, pairs))
    sizes = sub.n.view(-1, 2).sum(1).cpu().numpy()
    smaller = np.array([min(sizes[a], sizes[b]) for a, b in pairs], dtype=np.float64)
    ratios = valley_ratios(hist.cpu().numpy(), mc.min_subcluster_size, mc.valley_bandwidth,
                           share_cap=PAIR_SIDE_SHARE * smaller)
    return dict(zip(pairs, ratios.tolist(), strict=True))


def _births(trainer: Trainer, candidates: list[int]) -> int:
    """Offer ``candidates`` (clusters whose split this round did not take) the cuts into
    3 .. ``moves.birth_parts`` parts (:mod:`deepdpm_core.moves.births`; collective), if they
    hold :func:`~deepdpm_core.moves.births.birth_min_points` points. Rank 0 chooses, every
    rank cuts; returns the births made."""
    mc = trainer.config.moves
    counts = trainer.comm.all_reduce(
        torch.bincount(trainer.anchors[trainer.anchors >= 0], minlength=trainer.n_clusters).to(torch.float64))
    rows = [k for k in candidates if counts[k] >= birth_min_points(mc, trainer.dim)]
    if not rows:
        return 0
    prior = trainer.prior_fit.prior
    proposals = birth_proposals(trainer.x, trainer.anchors, trainer.state, rows, prior, trainer.config.prior.alpha,
                                mc, _coarsening(trainer), trainer.comm)
    chosen = trainer.comm.broadcast_object(choose_births(proposals) if trainer.comm.rank == 0 else None, src=0)
    for i, prop in enumerate(proposals):
        born = [b for b, j in chosen.items() if j == i]
        if not born:
            continue
        keep = torch.tensor([b * prop.parts + j for b in born for j in range(prop.parts)], dtype=torch.long)
        trainer.state, part_rows = apply_births(trainer.state, trainer.nets, [rows[b] for b in born],
                                                prop.stats.rows(keep), prior, trainer.torch_gen)
        # the rows of a cut cluster move to their part's row
        to_row = torch.full((len(rows) * prop.parts,), -1, dtype=torch.long, device=trainer.device)
        to_row[keep.to(trainer.device)] = part_rows.to(trainer.device)
        new_anchor = to_row[prop.part.clamp_min(0)]
        trainer.anchors = torch.where((prop.part >= 0) & (new_anchor >= 0), new_anchor, trainer.anchors)
    if chosen:
        trainer.reshaped()
    return len(chosen)
