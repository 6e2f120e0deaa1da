"""Exact EM on small data (docs/design.md, "Small data"): each epoch the soft statistics
from the E-step responsibilities r^E themselves, hard 2-way subclusters and one full-batch
step of the clustering net; births in split rounds; and where the search settles, polish,
growth and the clustering net fitted to the final responsibilities."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from deepdpm_core.bayes import PriorFit, SuffStats
from deepdpm_core.config import Config, ScheduleConfig
from deepdpm_core.estep import EStep
from deepdpm_core.nets import slot_kl
from deepdpm_core.runtime import device_clock, net_precision
from deepdpm_core.training.epoch_body import EpochBody, EpochStatistics, Settled
from deepdpm_core.training.fit_context import FitContext
from deepdpm_core.training.growth import grow
from deepdpm_core.training.move_round import births
from deepdpm_core.training.polish import polish
from deepdpm_core.training.search_model import SearchModel, estep_targets, start_model, wrapped
from deepdpm_core.training.small_data import (
    DISTIL_AGREEMENT,
    DISTIL_LR,
    DISTIL_MAX_STEPS,
    distil,
    exact_statistics,
)

Tensor = torch.Tensor

#: without nets to wait for, exact EM needs one warm-up epoch before its first move round ...
EM_WARMUP_EPOCHS = 1
#: ... and a move round every this many epochs (a split round, then a merge round)
EM_MOVE_EVERY = 2


class ExactEM(EpochBody):
    """The epoch body of data up to ``small_data.max_rows`` rows.

    Parameters
    ----------
    ctx : FitContext
    config : Config
    estep : EStep
        The fit's E-step (the settled mixture's targets).
    """

    def __init__(self, ctx: FitContext, config: Config, estep: EStep) -> None:
        super().__init__(ctx, config)
        self.estep = estep

    #: no nets to wait for: an accepted move freezes nothing
    freeze_epochs = 0

    def schedule(self, config: ScheduleConfig) -> ScheduleConfig:
        """No nets to wait for: moves more often (:data:`EM_WARMUP_EPOCHS`,
        :data:`EM_MOVE_EVERY`)."""
        return config.model_copy(update={"warmup_epochs": EM_WARMUP_EPOCHS, "move_every": EM_MOVE_EVERY})

    def statistics(self, model: SearchModel, candidates: Tensor, resp: Tensor, epoch: int) -> EpochStatistics:
        """One exact EM epoch (:func:`~deepdpm_core.training.small_data.exact_statistics`;
        collective). The clustering net takes one full-batch step on KL(r^E ‖ r), so it
        follows the clusters through the moves; it is fitted for good once K has settled
        (:meth:`settle`)."""
        ctx, nets = self.ctx, model.nets
        t_start = device_clock(ctx.device)
        k, n_local = model.state.n_clusters, ctx.x.shape[0]
        model.cluster_model.train()
        with torch.enable_grad(), net_precision(ctx.precision, ctx.device):  # whatever the caller's mode
            sum_cl, _, _ = slot_kl(model.cluster_model(ctx.x), candidates, resp)
        nets.opt_cluster.zero_grad(set_to_none=True)
        with net_precision(ctx.precision, ctx.device, backward=True):
            (sum_cl / (max(ctx.n_total, 1) / ctx.comm.world_size)).backward()
        nets.opt_cluster.step()
        t_train = device_clock(ctx.device)
        soft, sub, sum_sub = exact_statistics(ctx.x, model.state, candidates, resp, model.anchors)
        sums = torch.stack([sum_cl.detach().double(), sum_sub,
                            torch.tensor(float(n_local), dtype=torch.float64, device=ctx.device)])
        flat = ctx.comm.all_reduce(torch.cat([soft.flat(), sub.flat(), sums]))
        a, b = SuffStats.numel(k, ctx.dim), SuffStats.numel(3 * k, ctx.dim)
        soft, sub = SuffStats.from_flat(flat[:a], k, ctx.dim), SuffStats.from_flat(flat[a:b], 2 * k, ctx.dim)
        n = float(flat[-1].clamp_min(1))
        return EpochStatistics(soft, sub, {"loss_cluster": float(flat[-3]) / n,
                                           "loss_subcluster": float(flat[-2]) / n}, t_train - t_start)

    def after_split(self, model: SearchModel, unsplit: list[int], prior_fit: PriorFit,
                    torch_gen: torch.Generator) -> tuple[SearchModel, int]:
        """Births (:func:`~deepdpm_core.training.move_round.births`) offered to ``unsplit``."""
        state, anchors, born = births(self.ctx, self.config, model.state, model.nets, model.anchors, unsplit,
                                      prior_fit, torch_gen)
        return (wrapped(self.ctx, state, model.nets, anchors) if born else model), born

    def settle(self, model: SearchModel, prior_fit: PriorFit, rng: np.random.Generator,
               torch_gen: torch.Generator, may_grow: bool, growths: int) -> Settled:
        """The model's best partition of K or K − 1 (:func:`~deepdpm_core.training.polish.polish`),
        then either a search again from a grown partition
        (:func:`~deepdpm_core.training.growth.grow`; only if ``may_grow``) or the clustering
        net fitted to the result (:meth:`distil`). Either way the anchors end as each row's
        best cluster under the final mixture."""
        ctx, config = self.ctx, self.config
        model = self._targets(model)[2]
        chosen = polish(ctx, config, prior_fit, model.anchors, model.state.n_clusters, rng)
        record = {"polished": int(chosen is not None)}
        if chosen is not None:
            model = self._targets(start_model(ctx, config, prior_fit, rng, torch_gen, chosen))[2]
        if may_grow:
            grown = grow(ctx, config, prior_fit, model.anchors, model.state.n_clusters, growths, rng)
            if grown is not None:  # settled far below the model's answer: search again
                model = start_model(ctx, config, prior_fit, rng, torch_gen, grown)
                return Settled({**record, "grown": model.state.n_clusters}, model, grown=True)
        candidates, resp, model = self._targets(model)
        with net_precision(ctx.precision, ctx.device):
            steps, agreement = distil(model.cluster_model, ctx.x, candidates, resp, ctx.n_total, ctx.comm,
                                      DISTIL_LR, DISTIL_AGREEMENT, DISTIL_MAX_STEPS)
        return Settled({**record, "distil_steps": steps, "distil_agreement": agreement}, model)

    def _targets(self, model: SearchModel) -> tuple[Tensor, Tensor, SearchModel]:
        """The E-step targets under ``model``'s mixture, and the model with the anchors
        they move to."""
        candidates, resp, anchors = estep_targets(self.estep, model.mixture, self.ctx.x, model.anchors)
        return candidates, resp, replace(model, anchors=anchors)
