"""One exact EM epoch of a small-data fit (docs/design.md, "Small data"): the soft
statistics from the E-step responsibilities r^E themselves, hard 2-way subclusters, and one
full-batch step of the clustering net."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepdpm_core.bayes import SuffStats
from deepdpm_core.nets import slot_kl
from deepdpm_core.runtime import device_clock, net_precision
from deepdpm_core.training.small_data import exact_statistics

if TYPE_CHECKING:
    from deepdpm_core.training.trainer import Trainer


def em_epoch(trainer: Trainer, train: bool = True, seconds: dict[str, float] | None = None
             ) -> tuple[SuffStats, SuffStats, dict[str, float]]:
    """One exact EM epoch (:func:`~deepdpm_core.training.small_data.exact_statistics`;
    collective); returns what :meth:`~deepdpm_core.training.trainer.Trainer.run_epoch` does.
    With ``train`` the clustering net takes one full-batch step on KL(r^E ‖ r), so it follows
    the clusters through the moves; it is fitted for good once K has settled
    (:meth:`~deepdpm_core.training.trainer.Trainer.distil`).
    """
    t_start = device_clock(trainer.device)
    k, n_local = trainer.n_clusters, trainer.x.shape[0]
    candidates, resp = trainer.estep_targets()
    t_estep = device_clock(trainer.device)
    trainer.cluster_model.train(train)
    with torch.set_grad_enabled(train), net_precision(trainer.precision, trainer.device):
        sum_cl, _, _ = slot_kl(trainer.cluster_model(trainer.x), candidates, resp)
    if train:
        trainer.nets.opt_cluster.zero_grad(set_to_none=True)
        with net_precision(trainer.precision, trainer.device, backward=True):
            (sum_cl / (max(trainer.n_total, 1) / trainer.comm.world_size)).backward()
        trainer.nets.opt_cluster.step()
    t_train = device_clock(trainer.device)
    soft, sub, sum_sub = exact_statistics(trainer.x, trainer.state, candidates, resp, trainer.anchors)
    sums = torch.stack([sum_cl.detach().double(), sum_sub,
                        torch.tensor(float(n_local), dtype=torch.float64, device=trainer.device)])
    flat = trainer.comm.all_reduce(torch.cat([soft.flat(), sub.flat(), sums]))
    a, b = SuffStats.numel(k, trainer.dim), SuffStats.numel(3 * k, trainer.dim)
    soft, sub = SuffStats.from_flat(flat[:a], k, trainer.dim), SuffStats.from_flat(flat[a:b], 2 * k, trainer.dim)
    n = float(flat[-1].clamp_min(1))
    if seconds is not None:
        seconds.update(estep=t_estep - t_start, train=t_train - t_estep)
    return soft, sub, {"loss_cluster": float(flat[-3]) / n, "loss_subcluster": float(flat[-2]) / n}
