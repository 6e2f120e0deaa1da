"""One epoch of the nets' minibatch steps (paper §3; docs/design.md, "One epoch"): r =
softmax(f_cl(x)) against the E-step targets r^E of the mixture frozen at the last M-step
(Eq. 5), the cluster loss KL(r^E ‖ r) (Eq. 6) and the subcluster loss (Eq. 7), with the soft
cluster and hard subcluster statistics of one pass accumulated on the way."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepdpm_core.bayes import SuffStats
from deepdpm_core.estep import EpochStats, slot_targets
from deepdpm_core.nets import slot_kl
from deepdpm_core.runtime import device_clock, net_precision
from deepdpm_core.training.batching import global_batch

if TYPE_CHECKING:
    from deepdpm_core.training.trainer import Trainer


def minibatch_epoch(trainer: Trainer, train: bool = True, seconds: dict[str, float] | None = None
                    ) -> tuple[SuffStats, SuffStats, dict[str, float]]:
    """One pass over ``trainer``'s local rows (collective): what
    :meth:`~deepdpm_core.training.trainer.Trainer.run_epoch` returns for data above
    ``small_data.max_rows``."""
    t_start = device_clock(trainer.device)
    k, bsz = trainer.n_clusters, trainer.batch_size
    n_local = trainer.x.shape[0]
    gen = torch.Generator().manual_seed(trainer.config.seed * 1_000_003 + trainer.epoch * 7919 + trainer.comm.rank)
    one_pass, n_steps = trainer.n_steps()
    perm = torch.randperm(n_local, generator=gen).to(trainer.device)
    if n_steps > one_pass and n_local:  # extra training-only batches, re-drawn at random
        extra = torch.randint(n_local, ((n_steps - one_pass) * bsz,), generator=gen).to(trainer.device)
        perm = torch.cat([perm, extra])
    m = trainer.estep.support(k)
    candidates, resp = trainer.estep_targets()
    t_estep = device_clock(trainer.device)
    trainer.cluster_model.train(train)
    trainer.sub_model.train(train)
    pass_rows = min(n_local, one_pass * bsz)
    stats = EpochStats(k, trainer.dim, pass_rows, m, trainer.device)
    for step in range(n_steps if train else one_pass):
        if step < one_pass:
            idx = perm[step * bsz : min((step + 1) * bsz, pass_rows)]
        else:
            start = n_local + (step - one_pass) * bsz
            idx = perm[start : start + bsz] if n_local else perm[:0]
        x = trainer.x.index_select(0, idx)
        slots, target = slot_targets(candidates, resp, idx)
        with torch.set_grad_enabled(train), net_precision(trainer.precision, trainer.device):
            # KL(r^E || r) also yields the hard clusters z and ln r on the slots
            logits = trainer.cluster_model(x)
            sum_cl, z, log_r_slots = slot_kl(logits, slots, target)
            sub_logits = trainer.sub_model(x, z)
            sub_r = torch.softmax(sub_logits, dim=1)
            dist2 = (x[:, None, :] - trainer.sub_means32.index_select(0, z)).square().sum(-1)
            # both losses summed over the local batch, divided by G/W (G the step's points
            # over all ranks): after DDP's averaging, the per-point mean over the global
            # batch; a rank out of rows runs an empty batch, so every rank takes the same
            # steps (docs/design.md, "One epoch")
            sum_sub = (sub_r * dist2).sum()
            per_rank = max(global_batch(step, one_pass, bsz, trainer.rank_rows), 1) / trainer.comm.world_size
            loss_cl, loss_sub = sum_cl / per_rank, sum_sub / per_rank
        if train:
            trainer.nets.opt_cluster.zero_grad(set_to_none=True)
            trainer.nets.opt_sub.zero_grad(set_to_none=True)
            with net_precision(trainer.precision, trainer.device, backward=True):
                (loss_cl + loss_sub).backward()
            trainer.nets.opt_cluster.step()
            trainer.nets.opt_sub.step()
        if step < one_pass:
            stats.add(x, idx, logits, slots, target, log_r_slots,
                      2 * z + sub_logits.detach().argmax(1), sum_cl, sum_sub)
    t_train = device_clock(trainer.device)
    soft, sub, losses = stats.reduce(trainer.x, trainer.comm)
    if seconds is not None:
        seconds.update(estep=t_estep - t_start, train=t_train - t_estep)
    return soft, sub, losses
