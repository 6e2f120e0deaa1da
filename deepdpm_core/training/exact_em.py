"""Exact EM, the search of every fit unless ``small_data.max_rows`` is set (docs/design.md,
"Exact EM").

The search runs on the exact quantities the nets
approximate: the soft cluster statistics take the E-step responsibilities r^E (paper
Eq. 5), the target of the clustering net's KL loss (Eq. 6); each point's subcluster is the
nearer of its cluster's two subcluster means, the minimiser of the subclustering nets' loss
(Eq. 7) for the current means. The M-step, the prior and the stop rule are unchanged; the
moves come more often (no nets to wait for), a split round offers births to the clusters
it did not split, and where the search settles come polish and growth
(:mod:`~deepdpm_core.training.settling`). No net is trained during the search: once K has
settled, :func:`distil` fits the clustering net to the final responsibilities, so
``predict`` works as after any fit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepdpm_core.bayes import SuffStats, cache_blocks, grouped_stats
from deepdpm_core.estep import R_FLOOR, MixtureState
from deepdpm_core.nets import (
    Adam,
    discriminant_start,
    first_slots,
    slot_kl,
    slot_misfit,
    widen_hidden,
)
from deepdpm_core.runtime import Communicator, net_precision
from deepdpm_core.training.move_round import births
from deepdpm_core.training.search import Search
from deepdpm_core.training.settling import grow, polish

Tensor = torch.Tensor
#: steps of :func:`distil` between two looks for a gain, and looks without one before it
#: stops (its mark is looked for before every step, and once it is reached the clear rows
#: the net still misses for at most this many steps)
CHECK_EVERY, PATIENCE = 25, 4
#: Adam's learning rate in :func:`distil`: full-batch steps (no minibatch noise) on a net
#: that starts at the mixture's linear discriminant, near the answer
DISTIL_LR = 0.02
#: :func:`distil` stops once the net's argmax agrees with the E-step's on this share of the
#: rows: the rest lie on boundaries between overlapping clusters. The rows a net places
#: elsewhere are those a partition is least sure of, so each one costs NMI against the
#: classes: at 99 % the net's labels of a 70,000-row UMAP layout score 0.940, the mixture's
#: own 0.949; at 99.9 % the net's 0.947 (425 steps, 3 s more)
DISTIL_AGREEMENT = 0.999
#: ... or after this many steps: a bound on the time of a net that keeps gaining slowly
DISTIL_MAX_STEPS = 1000
#: ... and at most this many rows times steps (:func:`distil_max_steps`): a step costs rows
#: times K, and on 1,000 clusters of 200 rows in 128-D (``sphere-1000`` at 200,000 rows,
#: steps of 1.5-4 s on a CPU thread) the agreement was still short of its mark after 25
#: minutes; there 100 steps. Every sample of at most 20,000 rows (K ≤ 100) keeps its 1,000
DISTIL_ROW_STEPS = 20_000_000
#: a step of :func:`distil` takes its gradient from the rows whose net probabilities lie
#: further than this (L1, :func:`~deepdpm_core.nets.losses.slot_misfit`) from their targets:
#: the others' gradients are below it in every logit. From the mixture's discriminant they
#: are most rows (1,000 clusters in 128-D, 200,000 rows: all but 2–4 %), so a step costs a
#: forward over the rows and a backward over a few per cent of them (4 steps 40.4 -> 15.5 s)
DISTIL_ROW_MISFIT = 1e-5
#: :func:`distil` fits the net to a uniform sample of at most this many rows ...
DISTIL_ROWS = 20_000
#: ... or this many a cluster where that is more: full-batch steps over all 100,000 rows of
#: 100 grid blobs took 469 s of a 604 s fit (625 steps), and a net of a few thousand weights
#: (one hidden layer of 50) placed on 200 rows a cluster places the rest as well
DISTIL_ROWS_PER_CLUSTER = 200


class ExactEM(Search):
    """The search of every fit, or of those up to ``small_data.max_rows`` rows (module
    docstring)."""

    name = "exact_em"
    #: without nets to wait for, one warm-up epoch before the first move round, and a move
    #: round (a split round, then a merge round) every 2 epochs
    schedule_rules = {"warmup_epochs": 1, "move_every": 2}
    #: no nets to wait for: an accepted move freezes nothing
    freeze_epochs = 0
    #: the subclusters are the nearer-mean halves (:func:`exact_statistics`): no
    #: subclustering nets to build, reshape or save
    subnets = False

    def statistics(self, candidates: Tensor, resp: Tensor) -> tuple[SuffStats, SuffStats, dict[str, float | None], float]:
        """One exact EM epoch (:func:`exact_statistics`; collective). No net is trained:
        the clustering net is fitted once K has settled (:meth:`settle`), so the epoch
        has no cluster loss (``None``) and no seconds of net steps."""
        ctx, k = self.ctx, self.n_clusters
        soft, sub, sum_sub = exact_statistics(ctx.x, self.state, candidates, resp, self.anchors)
        sums = torch.stack([sum_sub, torch.tensor(float(ctx.x.shape[0]), dtype=torch.float64, device=ctx.device)])
        flat = ctx.comm.all_reduce(torch.cat([soft.flat(), sub.flat(), sums]))
        a, b = SuffStats.numel(k, ctx.dim), SuffStats.numel(3 * k, ctx.dim)
        soft, sub = SuffStats.from_flat(flat[:a], k, ctx.dim), SuffStats.from_flat(flat[a:b], 2 * k, ctx.dim)
        return soft, sub, {"loss_cluster": None, "loss_subcluster": float(flat[-2]) / float(flat[-1].clamp_min(1))}, 0.0

    def births(self, unsplit: list[int]) -> int:
        """Births (:func:`~deepdpm_core.training.move_round.births`) offered to ``unsplit``."""
        state, anchors, born = births(self.ctx, self.config, self.state, self.nets, self.anchors, unsplit,
                                      self.prior_fit, self.torch_gen)
        if born:
            self._take(state, self.nets, anchors)
        return born

    def settle(self, epoch: int) -> dict[str, Any]:
        """The model's best partition of K or K − 1 (:func:`~deepdpm_core.training.settling.polish`),
        then either a search again from a grown partition
        (:func:`~deepdpm_core.training.settling.grow`; only before ``max_epochs``) or the
        clustering net fitted to the result (:func:`distil`, from the mixture's linear
        discriminant, :func:`~deepdpm_core.nets.discriminant_start`) and the clusters that own no
        point dropped (:meth:`Search.settle`). Either way the anchors end as each row's
        best cluster under the final mixture."""
        ctx, config = self.ctx, self.config
        targets = self.estep_targets()
        chosen = polish(ctx, config, self.prior_fit, self.anchors, self.n_clusters, self.rng)
        record: dict[str, Any] = {"polished": int(chosen is not None)}
        if chosen is not None:
            self.initialize(chosen)
            targets = self.estep_targets()
        if epoch < self.schedule.schedule.max_epochs:
            grown = grow(ctx, config, self.prior_fit, self.anchors, self.n_clusters, self.schedule.growths, self.rng)
            if grown is not None:  # settled far below the model's answer: search again
                self.initialize(grown)
                self.schedule.restart(epoch)
                return {**record, "grown": self.n_clusters}
        candidates, resp = targets  # the final mixture's: neither polish nor growth changed it since
        rows, n_rows = distil_sample(ctx.rank_rows, ctx.comm.rank, self.n_clusters, self.torch_gen)
        with net_precision(ctx.precision, ctx.device):
            self._start_distillation()
            steps, agreement = distil(self.cluster_model, ctx.x[rows], candidates[rows], resp[rows], n_rows, ctx.comm,
                                      DISTIL_LR, DISTIL_AGREEMENT, distil_max_steps(n_rows))
            if n_rows < ctx.n_total:  # the agreement over every row, not the sample's
                agreement = net_agreement(self.cluster_model, ctx.x, self.anchors, ctx.n_total, ctx.comm)
        return {**record, "distil_steps": steps, "distil_agreement": agreement, **super().settle(epoch)}

    def _start_distillation(self) -> None:
        """Set the clustering net to the mixture's linear discriminant
        (:func:`~deepdpm_core.nets.discriminant_start`), first widened to
        :func:`discriminant_width` hidden units so that it holds every discriminant
        direction: with the paper's 50 units it holds 25, and on 1,000 clusters in 128
        dimensions (``sphere-1000``, 200,000 rows, the true classes' mixture) the start
        agreed with the mixture on 0.56 of the rows, 100 full-batch steps (350 s on a CPU
        thread) left it short of its mark and its NMI 0.92; with 256 units it agrees on
        0.9987 before any step."""
        net, state = self.nets.cluster, self.state
        if widen_hidden(net, discriminant_width(self.dim, self.n_clusters), self.nets.opt_cluster, self.torch_gen):
            self._take(state, self.nets, self.anchors)  # the new parameters, wrapped anew
        discriminant_start(net, state.means, state.covariances, state.log_weights, self.torch_gen)


def discriminant_width(dim: int, n_clusters: int) -> int:
    """Hidden units that hold the linear discriminant of ``n_clusters`` Gaussians in
    ``dim`` coordinates: a pair of units a direction, min(D, K − 1) directions."""
    return 2 * min(dim, n_clusters - 1)


def exact_statistics(x: Tensor, state: MixtureState, candidates: Tensor, resp: Tensor,
                     z: Tensor) -> tuple[SuffStats, SuffStats, Tensor]:
    """This rank's soft cluster and hard subcluster statistics of one EM epoch.

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
    state : MixtureState
        K clusters and their subclusters, frozen at the last M-step.
    candidates, resp : Tensor of shape (N_local, m)
        Each row's E-step support and r^E on it
        (:meth:`~deepdpm_core.estep.EStep.targets`).
    z : Tensor of shape (N_local,), int64
        Each row's most responsible cluster.

    Returns
    -------
    soft : SuffStats
        K rows, weights r^E.
    sub : SuffStats
        2K rows (cluster k's subclusters at 2k, 2k + 1), hard counts.
    sum_sub : Tensor
        Σ_i ‖x_i − μ̃_{z_i j_i}‖², the subcluster loss (Eq. 7) of the hard assignment.
    """
    k = state.n_clusters
    point, slot = (resp >= R_FLOOR).nonzero(as_tuple=True)
    soft = grouped_stats(x, point, candidates[point, slot], resp[point, slot], k)
    nearest, j = nearer_subcluster(x, state.sub_means.to(x.dtype), z)
    sub_rows = 2 * z + j
    rows = torch.arange(x.shape[0], device=x.device)
    sub = grouped_stats(x, rows, sub_rows, torch.ones_like(z, dtype=torch.float32), 2 * k)
    return soft, sub, nearest.sum().double()


def nearer_subcluster(x: Tensor, sub_means: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's squared distance to the nearer of its cluster's two subcluster means and
    which one (0 or 1), both (N_local,): the minimiser of Eq. 7 for fixed means. On a CPU a
    block of rows at a time (:func:`~deepdpm_core.bayes.cache_blocks`), so the (rows, 2, D)
    differences stay in the cache: the same values row by row (200,000 rows in 128-D, one
    thread: 0.29 s at once, 0.02 s in blocks).

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
    sub_means : Tensor of shape (K, 2, D)
        Each cluster's two subcluster means, in ``x``'s dtype.
    z : Tensor of shape (N_local,), int64
        Each row's cluster.
    """
    nearest, which = [], []
    for start, stop in cache_blocks(x.shape[0], 2 * x.shape[1], x.device):
        dist, j = (x[start:stop, None, :] - sub_means.index_select(0, z[start:stop])).square().sum(-1).min(1)
        nearest.append(dist)
        which.append(j)
    return torch.cat(nearest), torch.cat(which)


def distil_sample(rank_rows: list[int], rank: int, n_clusters: int, generator: torch.Generator
                  ) -> tuple[Tensor | slice, int]:
    """The rows :func:`distil` fits the net to: a uniform sample of at most
    max(:data:`DISTIL_ROWS`, :data:`DISTIL_ROWS_PER_CLUSTER`·K) of the fit's rows, each rank
    its share.

    Parameters
    ----------
    rank_rows : list of int
        Rows held by each rank, in rank order.
    rank : int
        This rank.
    n_clusters : int
        K.
    generator : torch.Generator
        A CPU generator, drawn from only where the rows are sampled.

    Returns
    -------
    rows : Tensor of shape (n_local,), int64, or slice
        This rank's rows in the sample, in order (every row: ``slice(None)``).
    n_rows : int
        The sample's rows over all ranks.
    """
    n_total = sum(rank_rows)
    cap = max(DISTIL_ROWS, DISTIL_ROWS_PER_CLUSTER * n_clusters)
    if n_total <= cap:
        return slice(None), n_total
    shares = [r * cap // n_total for r in rank_rows]
    rows = torch.randperm(rank_rows[rank], generator=generator)[:shares[rank]].sort().values
    return rows, sum(shares)


def distil_max_steps(n_rows: int) -> int:
    """The most steps :func:`distil` takes on a sample of ``n_rows`` rows (all ranks):
    :data:`DISTIL_MAX_STEPS`, fewer where the rows times the steps would pass
    :data:`DISTIL_ROW_STEPS`."""
    return max(1, min(DISTIL_MAX_STEPS, DISTIL_ROW_STEPS // max(n_rows, 1)))


def net_agreement(model: nn.Module, x: Tensor, best: Tensor, n_total: int, comm: Communicator,
                  batch_size: int = 65536) -> float:
    """The fraction of rows (all ranks) whose net argmax is ``best``, their most responsible
    cluster (the anchors after the E-step, int64 (N_local,)); collective."""
    hits = torch.zeros(1, dtype=torch.float64, device=x.device)
    with torch.no_grad():
        for start in range(0, x.shape[0], batch_size):
            z = model(x[start:start + batch_size]).argmax(1)
            hits += (z == best[start:start + batch_size]).sum()
    return float(comm.all_reduce(hits)[0]) / max(n_total, 1)


def net_check(model: nn.Module, x: Tensor, candidates: Tensor, resp: Tensor) -> tuple[int, Tensor, Tensor]:
    """The net's K, argmax z (N_local,) and ln r on the slots (N_local, m), without a
    graph: :func:`~deepdpm_core.nets.slot_kl` of the net's logits, on a CPU a block of
    rows at a time (:func:`~deepdpm_core.bayes.cache_blocks`), the same values row by row."""
    with torch.no_grad():
        k = model(x[:1]).shape[1]
        zs, log_rs = [], []
        for start, stop in cache_blocks(x.shape[0], k, x.device):
            block = slice(start, stop)
            _, z, log_r = slot_kl(model(x[block]), candidates[block], resp[block])
            zs.append(z)
            log_rs.append(log_r)
    return k, torch.cat(zs), torch.cat(log_rs)


def distil(model: nn.Module, x: Tensor, candidates: Tensor, resp: Tensor, n_total: int,
           comm: Communicator, lr: float, agreement: float, max_steps: int) -> tuple[int, float]:
    """Fit the clustering net to the final E-step targets: full-batch Adam on KL(r^E ‖ r).

    Each step learns from the rows whose gradient is not negligible
    (:data:`DISTIL_ROW_MISFIT`). Stops at the first step (checked before every step, from a
    forward over every row: zero steps where the start already does) where the net's
    argmax agrees with r^E's on ``agreement`` of the rows (over all ranks), gives a row to every cluster that
    r^E's argmax gives one, and misses none of the rows r^E assigns with at least
    ``agreement`` of their mass (the rows the net may miss lie on boundaries between
    overlapping clusters: a clear row placed elsewhere is a wrong label, not a doubt); the
    last only for :data:`CHECK_EVERY` steps once the first two hold (on 20,000 rows of ten
    clusters in 10-D one clear row was missed at the mark and none 5 steps later). It also
    stops when :data:`PATIENCE` checks in a row (every :data:`CHECK_EVERY` steps) bring no
    gain (rows near a boundary, which a 1-hidden-layer net may never place exactly), or
    after ``max_steps``. Every rank takes the same steps. The clusters the net owns no row
    of are dropped after it (:meth:`Search.settle`): requiring the mixture's clusters keeps
    K the mixture's, not a count that depends on how long the net trained.

    Parameters
    ----------
    model : nn.Module
        The clustering net (maybe DDP-wrapped): (N_local, D) -> logits (N_local, K).
    x : Tensor of shape (N_local, D)
    candidates, resp : Tensor of shape (N_local, m)
        The final E-step support and targets.
    n_total : int
        Rows over all ranks (the loss is the mean KL over them).
    comm : Communicator
    lr, agreement, max_steps
        :data:`DISTIL_LR`, :data:`DISTIL_AGREEMENT`, :data:`DISTIL_MAX_STEPS` in a fit.

    Returns
    -------
    steps : int
    agreement : float
        The fraction of rows whose argmax under the net returned (measured after its last
        step) is their most responsible cluster.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = Adam(params, lr)
    top, slot = resp.max(1)
    target_z, clear = candidates.gather(1, slot[:, None]).squeeze(1), top >= agreement
    first = first_slots(candidates)
    per_rank = max(n_total, 1) / comm.world_size  # DDP averages the ranks' gradients
    model.train(True)
    best, stale, step, owned, marked = -1.0, 0, 0, None, None
    while True:
        k, z, log_r = net_check(model, x, candidates, resp)
        if owned is None:  # the clusters r^E's argmax gives a row (all ranks)
            owned = comm.all_reduce(torch.bincount(target_z, minlength=k).to(torch.float64)) > 0
        # the net as it is returned: its agreement, the clear rows it misses, the rows it gives each cluster
        hit = z == target_z
        counts = torch.cat([hit.sum().reshape(1), (clear & ~hit).sum().reshape(1), torch.bincount(z, minlength=k)])
        counts = comm.all_reduce(counts.to(torch.float64))
        agree = float(counts[0]) / max(n_total, 1)
        mark = agree >= agreement and bool((counts[2:][owned] > 0).all())
        marked = step if mark and marked is None else marked
        if (mark and (counts[1] == 0 or step >= marked + CHECK_EVERY)) or step >= max_steps:
            break
        if step and step % CHECK_EVERY == 0:
            stale = 0 if agree > best + 1e-4 else stale + 1
            best = max(best, agree)
            if stale >= PATIENCE:
                break
        # the step learns from the rows whose gradient is not negligible
        rows = torch.nonzero(slot_misfit(log_r, resp, first) > DISTIL_ROW_MISFIT).squeeze(1)
        del log_r
        opt.zero_grad()
        kl, _, _ = slot_kl(model(x[rows]), candidates[rows], resp[rows])
        (kl / per_rank).backward()
        opt.step()
        step += 1
    model.train(False)
    return step, agree
