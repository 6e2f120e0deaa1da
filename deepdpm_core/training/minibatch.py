"""The paper's search, of data above ``small_data.max_rows`` rows where it is set: each epoch the nets'
minibatch steps (paper §3; docs/design.md, "One epoch"): r =
softmax(f_cl(x)) against the E-step targets r^E of the mixture frozen at the last M-step
(Eq. 5), the cluster loss KL(r^E ‖ r) (Eq. 6) and the subcluster loss (Eq. 7), with the soft
cluster and hard subcluster statistics of one pass accumulated on the way."""

from __future__ import annotations

import torch

from deepdpm_core.bayes import SuffStats
from deepdpm_core.estep import EpochStats, slot_targets
from deepdpm_core.runtime import device_clock, net_precision
from deepdpm_core.training.batching import global_batch
from deepdpm_core.training.search import Search

Tensor = torch.Tensor


class MinibatchSearch(Search):
    """The search of data above ``small_data.max_rows`` rows (where it is set): the nets' minibatch steps,
    the statistics of one pass accumulated on the way."""

    name = "net"

    def statistics(self, candidates: Tensor, resp: Tensor) -> tuple[SuffStats, SuffStats, dict[str, float], float]:
        """One pass over the local rows (collective), the batches drawn from the seed and
        the epoch."""
        ctx = self.ctx
        t_start = device_clock(ctx.device)
        k, bsz, m = self.n_clusters, ctx.batch_size, candidates.shape[1]
        n_local = ctx.x.shape[0]
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.epoch * 7919 + ctx.comm.rank)
        one_pass, n_steps = ctx.n_steps(self.config)
        perm = torch.randperm(n_local, generator=gen).to(ctx.device)
        if n_steps > one_pass and n_local:  # extra training-only batches, re-drawn at random
            extra = torch.randint(n_local, ((n_steps - one_pass) * bsz,), generator=gen).to(ctx.device)
            perm = torch.cat([perm, extra])
        sub_means32 = self.state.sub_means.to(torch.float32)
        nets, cluster_model, sub_model = self.nets, self.cluster_model, self.sub_model
        cluster_model.train()
        sub_model.train()
        pass_rows = min(n_local, one_pass * bsz)
        stats = EpochStats(k, ctx.dim, pass_rows, m, ctx.device)
        scales: dict[float, Tensor] = {}
        for step in range(n_steps):
            if step < one_pass:
                idx = perm[step * bsz : min((step + 1) * bsz, pass_rows)]
            else:
                start = n_local + (step - one_pass) * bsz
                idx = perm[start : start + bsz] if n_local else perm[:0]
            x = ctx.x.index_select(0, idx)
            slots, target = slot_targets(candidates, resp, idx)
            with torch.enable_grad(), net_precision(ctx.precision, ctx.device):  # whatever the caller's mode
                # KL(r^E || r) also yields the hard clusters z and ln r on the slots
                sum_cl, z, log_r_slots, logits = cluster_model(x, slots, target)
                # in place on the gathered means (no gradient flows here): m − x squares to
                # the same bits as x − m, 4-5 x faster than the broadcast subtraction and
                # pow; d·d is the bits of pow(d, 2), one operator less
                diff = sub_means32.index_select(0, z).sub_(x.unsqueeze(1))
                dist2 = diff.mul_(diff).sum(-1)
                sum_sub, sub_logits = sub_model(x, z, dist2)
            # both losses summed over the local batch, divided by G/W (G the step's points
            # over all ranks): after DDP's averaging, the per-point mean over the global
            # batch; a rank out of rows runs an empty batch, so every rank takes the same
            # steps (docs/design.md, "One epoch"). The gradient of each sum is 1 / (G/W),
            # made once per batch size as the division's backward makes it
            per_rank = max(global_batch(step, one_pass, bsz, ctx.rank_rows), 1) / ctx.comm.world_size
            if per_rank not in scales:
                scales[per_rank] = torch.ones((), device=ctx.device) / per_rank
            nets.opt_cluster.zero_grad()
            nets.opt_sub.zero_grad()
            with net_precision(ctx.precision, ctx.device, backward=True):
                torch.autograd.backward((sum_cl, sum_sub), (scales[per_rank], scales[per_rank]))
            nets.opt_cluster.step()
            nets.opt_sub.step()
            if step < one_pass:
                stats.add(x, idx, logits, slots, target, log_r_slots,
                          2 * z + sub_logits.detach().argmax(1), sum_cl, sum_sub)
        t_train = device_clock(ctx.device)
        soft, sub, losses = stats.reduce(ctx.x, ctx.comm)
        return soft, sub, losses, t_train - t_start
