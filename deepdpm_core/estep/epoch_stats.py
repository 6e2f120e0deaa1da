"""What one pass of an epoch accumulates: soft cluster statistics, hard subcluster
statistics and the loss sums, in one flat float64 buffer that is all-reduced once
(docs/design.md, "One epoch").

Below K slots a batch adds all its (point, slot) triples, the weight 0 where a slot is left
out, and the kept ones are picked once per epoch (:meth:`EpochStats.reduce`): the same
triples in the same order as picking them per batch, without a host synchronisation per
step (``nonzero`` waits for the device to learn its output's size)."""

from __future__ import annotations

import torch

from deepdpm_core.bayes import SuffStats, TripleBuffer, grouped_stats
from deepdpm_core.runtime import Communicator

Tensor = torch.Tensor
#: responsibilities below float32's resolution of 1 (a point's total mass) are left out
#: of the sparse soft statistics: they are below the rounding of the kept ones
R_FLOOR = float(torch.finfo(torch.float32).eps)


class EpochStats:
    """Accumulates an epoch's statistics batch by batch, then reduces them over the ranks.

    Parameters
    ----------
    n_clusters : int
        K.
    dim : int
        D.
    pass_rows : int
        Local rows of the one statistics pass.
    m : int
        Slots per point (the most clusters in a point's E-step support).
    device : torch.device
    """

    def __init__(self, n_clusters: int, dim: int, pass_rows: int, m: int, device: torch.device) -> None:
        k, d = n_clusters, dim
        self.k, self.d = k, d
        self.sizes = [SuffStats.numel(k, d), SuffStats.numel(2 * k, d), 3]
        # soft cluster and hard subcluster statistics and the loss sums: views of one buffer
        self.flat = torch.zeros(sum(self.sizes), dtype=torch.float64, device=device)
        self.soft = SuffStats.from_flat(self.flat[: self.sizes[0]], k, d)
        self.sub = SuffStats.from_flat(self.flat[self.sizes[0] : -3], 2 * k, d)
        # below K slots (K > estep.dense_max_k) the triples wait for one reduction per epoch;
        # with all K (K small) each batch is reduced at once, with no O(N·K) buffer
        self.soft_buf = TripleBuffer(pass_rows * m, device) if m < k else None
        self.sub_buf = TripleBuffer(pass_rows, device)
        self.rows = 0  # the pass's local rows so far (a Python count: no device tensor per step)

    @torch.no_grad()
    def add(self, x: Tensor, idx: Tensor, logits: Tensor, slots: Tensor, target: Tensor,
            log_r_slots: Tensor, sub_rows: Tensor, sum_cl: Tensor, sum_sub: Tensor) -> None:
        """One batch.

        Parameters
        ----------
        x : Tensor of shape (B, D)
            The batch's rows; ``idx`` (B,) their local row numbers.
        logits : Tensor of shape (B, K)
            The clustering net's output.
        slots, target, log_r_slots : Tensor of shape (B, m)
            The slots' clusters, their E-step targets r^E and the net's ln r on them.
        sub_rows : Tensor of shape (B,), int64
            Each point's hard subcluster row, 2·z + j.
        sum_cl, sum_sub : Tensor
            The batch's summed cluster and subcluster losses.
        """
        # the net's r less those below R_FLOOR: a trained net puts one or two clusters above it
        if self.soft_buf is not None:  # on r^E's support, where the KL puts the net's mass
            # (not renormalised), reduced once per epoch; weight 0: left out (picked at reduce)
            r = log_r_slots.exp()
            kept = torch.where((r >= R_FLOOR) & (target > 0), r, torch.zeros_like(r))
            self.soft_buf.add(idx[:, None].expand_as(slots).reshape(-1), slots.reshape(-1), kept.reshape(-1))
        else:  # on all K clusters (K ≤ estep.dense_max_k): one small GEMM per cluster
            r = torch.softmax(logits.detach().float(), dim=1)
            point, j = (r >= R_FLOOR).nonzero(as_tuple=True)
            grouped_stats(x, point, j, r[point, j], self.k, out=self.soft)
        self.sub_buf.add(idx, sub_rows, torch.ones_like(sub_rows, dtype=torch.float32))
        self.flat[-3:-1] += torch.stack([sum_cl.detach().double(), sum_sub.detach().double()])
        self.rows += x.shape[0]

    def reduce(self, x_local: Tensor, comm: Communicator) -> tuple[SuffStats, SuffStats, dict[str, float]]:
        """The statistics over all ranks: soft cluster (K rows), hard subcluster (2K rows) and
        the mean losses. ``x_local`` (N_local, D) are the rows the buffers index."""
        if self.soft_buf is not None:
            self.soft_buf.positive().stats(x_local, self.k, out=self.soft)
        self.sub_buf.stats(x_local, 2 * self.k, out=self.sub)
        self.flat[-1] = self.rows
        flat = comm.all_reduce(self.flat)
        soft = SuffStats.from_flat(flat[: self.sizes[0]], self.k, self.d)
        sub = SuffStats.from_flat(flat[self.sizes[0] : -3], 2 * self.k, self.d)
        tot = flat[-3:]
        losses = {
            "loss_cluster": float(tot[0] / tot[2].clamp_min(1)),
            "loss_subcluster": float(tot[1] / tot[2].clamp_min(1)),
        }
        return soft, sub, losses
