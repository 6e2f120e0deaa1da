"""The DeepDPM epoch loop over a :class:`~deepdpm_core.runtime.communicator.Communicator`.

One epoch (paper §3; docs/design.md, "One epoch"):

1. minibatches: r = softmax(f_cl(x)); target r^E from the mixture frozen at the last
   M-step (Eq. 5); cluster loss KL(r^E ‖ r) (Eq. 6); subcluster loss Σ_j r̃_ij ‖x_i − μ̃_{z_i j}‖²
   (Eq. 7); accumulate soft cluster statistics (weights r) and hard subcluster statistics
   (z_i = argmax r_i, j_i = argmax r̃_i) — never an N × K array;
2. one all-reduce of all statistics as a flat float64 tensor;
3. M-step on every rank (NIW MAP, :mod:`deepdpm_core.bayes.niw`), unless parameters are frozen;
4. when the :class:`~deepdpm_core.moves.schedule.MoveSchedule` says so, splits or merges decided
   on rank 0 from the reduced statistics and broadcast as a
   :class:`~deepdpm_core.moves.MovePlan` that every rank applies identically
   (:mod:`deepdpm_core.moves.surgery`).

Data live on the device as one (N_local, D) float32 tensor in the fit's own coordinates
(:mod:`deepdpm_core.data.coordinates`: centred, so the prior mean is 0 and uncentred float64
sums stay accurate, and scaled to unit mean variance, so nothing depends on the units).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.bayes import PriorFit, SuffStats, grouped_stats, map_estimate
from deepdpm_core.config import Config, from_dict
from deepdpm_core.data import fit_coordinates, stored_coordinates
from deepdpm_core.errors import CheckpointError, DataError
from deepdpm_core.estep import (
    EpochStats,
    MixtureState,
    estep_targets,
    log_weights_from_counts,
    slot_targets,
    top_m,
)
from deepdpm_core.moves import (
    MovePlan,
    MoveSchedule,
    Nets,
    apply_births,
    apply_plan,
    birth_min_points,
    birth_proposals,
    choose_births,
    coarsening_constant,
    initial_clusters,
    merge_candidates,
    pair_histograms,
    plan_moves,
    projection_histograms,
    reset_subclusters,
    valley_ratios,
)
from deepdpm_core.nets import ClusterNet, SubclusterNets, new_row_of, slot_kl
from deepdpm_core.runtime import (
    Communicator,
    LocalCommunicator,
    device_clock,
    flush_denormals,
    net_precision,
    resolve_device,
    resolve_precision,
)
from deepdpm_core.training.batching import (
    adam,
    auto_batch_size,
    epoch_steps,
    global_batch,
    scaled_lr,
)
from deepdpm_core.training.consistency import check_ranks_agree, position_checksum
from deepdpm_core.training.resume import check_same_data, restore_optimisers, trainer_state
from deepdpm_core.training.small_data import distil, exact_statistics

Tensor = torch.Tensor
EpochCallback = Callable[[dict[str, Any]], None]

#: the parts of an epoch's ``seconds`` in its history record (key ``seconds_<phase>``), in order
EPOCH_PHASES: tuple[tuple[str, str], ...] = (
    ("estep", "E-step targets"),
    ("train", "minibatch steps"),
    ("stats", "statistics + all-reduce"),
    ("mstep", "M-step"),
    ("moves", "split / merge round"),
)


class Trainer:
    """Fits DeepDPM to this rank's rows; collective steps go through ``comm``.

    Parameters
    ----------
    config : Config
    x : Tensor of shape (N_local, D)
        This rank's rows (any float dtype; may be empty on some ranks).
    comm : Communicator, optional
        Defaults to single-process.
    wrap : callable, optional
        Applied to each net after it is built or reshaped (e.g. DDP); identity by default.
    callbacks : list of callables, optional
        Called on every rank with each epoch's history record.

    Attributes
    ----------
    state : MixtureState
        The clusters and subclusters (after :meth:`initialize`).
    nets : Nets
        The clustering and subclustering nets and their optimisers.
    schedule : MoveSchedule
        When moves run and when the fit stops.
    prior_fit : PriorFit
        The NIW prior and its refit.
    """

    def __init__(self, config: Config, x: Tensor, comm: Communicator | None = None,
                 wrap: Callable[[nn.Module], nn.Module] | None = None,
                 callbacks: list[EpochCallback] | None = None) -> None:
        self.config = config
        self.comm = comm or LocalCommunicator()
        self.wrap = wrap or (lambda m: m)
        self.callbacks = list(callbacks or [])
        self.device = resolve_device(config.device)
        self.precision = resolve_precision(config.model.precision, self.device)
        self.dim = int(x.shape[1])
        self.rng = np.random.default_rng(config.seed)  # move decisions (rank 0) and init
        self.torch_gen = torch.Generator().manual_seed(config.seed)  # net initialisation
        self.epoch = 0
        self.history: list[dict[str, Any]] = []
        #: each local row's best cluster (its initial cluster, then the last E-step's best),
        #: the sparse E-step's anchors; kept through surgery; None: not known (a resumed fit)
        self.anchors: Tensor | None = None
        self._init_data(x)
        #: the search runs exact EM epochs (:mod:`deepdpm_core.training.small_data`)
        self.small = self.n_total <= config.small_data.max_rows
        sched = config.schedule
        if self.small:  # no nets to wait for: no freeze, moves more often
            sched = sched.model_copy(update={"warmup_epochs": config.small_data.warmup_epochs,
                                             "move_every": config.small_data.move_every, "freeze_epochs": 0})
        self.schedule = MoveSchedule(sched, config.moves)

    # ------------------------------------------------------------------ set-up
    def _init_data(self, x: Tensor) -> None:
        """The fit's coordinates (:mod:`deepdpm_core.data.coordinates`), the data in them, and
        the NIW prior.

        Works through the rows in chunks: a float64 copy of the whole data would be twice
        its float32 size, and at ImageNet scale the data are most of the memory.
        """
        n_local, d, chunk = x.shape[0], self.dim, 1 << 16
        self.coords, self.n_total, self.rank_rows = fit_coordinates(
            x, self.config.data, self.comm, self.device)
        #: per-feature variance (D,) of the (transformed) features, float64, for diagnostics
        self.feature_variance = self.coords.feature_std.square()
        self.prior_fit = PriorFit(self.config.prior, self.coords, self.device)
        self.x = torch.empty(n_local, d, dtype=torch.float32, device=self.device)
        for s in range(0, n_local, chunk):  # x̃ in float64, then stored as float32
            self.x[s : s + chunk] = self.coords.apply(x[s : s + chunk]).to(self.device)
        # per rank; "auto" aims at steps_per_epoch steps over this rank's share of the rows,
        # so W ranks step as often as one process would, on a W times larger global batch
        o = self.config.optim
        share = -(-self.n_total // self.comm.world_size)
        self.batch_size = (auto_batch_size(share, o.steps_per_epoch, o.base_batch_size, o.max_batch_size)
                           if o.batch_size == "auto" else int(o.batch_size))

    def initialize(self, init_labels: Tensor | None = None) -> None:
        """k-means clusters (rank 0, on a sample gathered from all ranks), MAP parameters,
        principal-axis subclusters.

        ``init_labels`` (this rank's rows, int64 [n]) warm-starts from given hard clusters
        instead of k-means (the AE alternation re-clusters from the previous clusters).
        """
        cfg = self.config
        z, n_init = initial_clusters(self.x, cfg.init, self.n_total, self.rank_rows, self.comm, self.rng,
                                     init_labels)
        # float64 GEMMs: the initial mixture is the same to round-off on any number of ranks
        local = grouped_stats(self.x, torch.arange(z.shape[0], device=self.device), z,
                              torch.ones_like(z, dtype=torch.float64), n_init, dtype=torch.float64)
        stats = SuffStats.from_flat(self.comm.all_reduce(local.flat()), n_init, self.dim)
        keep = torch.nonzero(stats.n > 0).squeeze(1)
        stats = stats.rows(keep)
        self.anchors = new_row_of(keep, n_init)[z]
        self.prior_fit.fit(stats)
        means, covs = map_estimate(self.prior_fit.prior, stats)
        self.state = MixtureState.without_subclusters(
            means, covs, log_weights_from_counts(stats.n, cfg.prior.weight_pseudocount))
        self._build_nets(self.state.n_clusters)
        reset_subclusters(self.state, self.nets, torch.arange(self.n_clusters, device=self.device),
                          self.torch_gen)
        self._rewrap()
        self._refresh_mixture()

    def _build_nets(self, k: int) -> None:
        """Fresh nets for K = ``k`` clusters (from ``torch_gen``) and their optimisers."""
        cfg = self.config
        cluster = ClusterNet(self.dim, cfg.model.hidden, k, self.torch_gen).to(self.device)
        sub = SubclusterNets(self.dim, cfg.model.sub_hidden, k, self.torch_gen).to(self.device)
        self.nets = Nets(cluster, sub, adam(cluster.parameters(), self.learning_rate(cfg.optim.lr_cluster)),
                         adam(sub.parameters(), self.learning_rate(cfg.optim.lr_subcluster)))

    def learning_rate(self, base: float) -> float:
        """Learning rate at the global batch W·B (``optim.batch_size`` is per rank)."""
        o = self.config.optim
        return scaled_lr(base, self.batch_size * self.comm.world_size, o.base_batch_size, o.lr_scaling)

    def _rewrap(self) -> None:  # after the nets are built or reshaped
        self.cluster_model, self.sub_model = self.wrap(self.nets.cluster), self.wrap(self.nets.sub)

    def _refresh_mixture(self) -> None:  # after the parameters change
        self.mixture, self._sub_means32 = self.state.mixture(), self.state.sub_means.to(torch.float32)

    @property
    def n_clusters(self) -> int:
        """K."""
        return self.state.n_clusters

    # ------------------------------------------------------------------ epochs
    def n_steps(self) -> tuple[int, int]:
        """:func:`~deepdpm_core.training.batching.epoch_steps` of this fit (collective)."""
        return epoch_steps(self.x.shape[0], self.batch_size, self.config.optim.min_steps_per_epoch,
                           self.comm, self.device)

    def _estep_targets(self) -> tuple[Tensor, Tensor]:
        """:func:`~deepdpm_core.estep.estep_targets` of the local rows under the current
        mixture (candidates and r^E, (N_local, m) each); the anchors move to each row's best."""
        k = self.n_clusters
        m = top_m(self.config.estep, k)
        # with every cluster allowed (m = K) the search starts from the mixture alone, so the
        # targets are a function of the checkpointed state and a resumed fit repeats them
        anchors = self.anchors if m < k else None
        candidates, resp, self.anchors = estep_targets(self.mixture, self.x, m, anchors)
        return candidates, resp

    def run_epoch(self, train: bool = True, seconds: dict[str, float] | None = None
                  ) -> tuple[SuffStats, SuffStats, dict[str, float]]:
        """One pass over the local rows; returns reduced soft cluster and hard subcluster
        stats and the mean losses.

        With ``train=False`` the nets are not updated (a pure statistics pass). When
        ``seconds`` is given, the durations of the E-step targets (``estep``) and the
        minibatch steps (``train``) are written into it (the statistics with their
        all-reduce take the rest). Small data (:attr:`small`) run :meth:`em_epoch` instead.
        """
        if self.small:
            return self.em_epoch(train, seconds)
        t_start = device_clock(self.device)
        k, bsz = self.n_clusters, self.batch_size
        n_local = self.x.shape[0]
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.epoch * 7919 + self.comm.rank)
        one_pass, n_steps = self.n_steps()
        perm = torch.randperm(n_local, generator=gen).to(self.device)
        if n_steps > one_pass and n_local:  # extra training-only batches, re-drawn at random
            extra = torch.randint(n_local, ((n_steps - one_pass) * bsz,), generator=gen).to(self.device)
            perm = torch.cat([perm, extra])
        m = top_m(self.config.estep, k)
        candidates, resp = self._estep_targets()
        t_estep = device_clock(self.device)
        self.cluster_model.train(train)
        self.sub_model.train(train)
        pass_rows = min(n_local, one_pass * bsz)
        stats = EpochStats(k, self.dim, pass_rows, m, self.device)
        for step in range(n_steps if train else one_pass):
            if step < one_pass:
                idx = perm[step * bsz : min((step + 1) * bsz, pass_rows)]
            else:
                start = n_local + (step - one_pass) * bsz
                idx = perm[start : start + bsz] if n_local else perm[:0]
            x = self.x.index_select(0, idx)
            slots, target = slot_targets(candidates, resp, idx)
            with torch.set_grad_enabled(train), net_precision(self.precision, self.device):
                # KL(r^E || r) also yields the hard clusters z and ln r on the slots
                logits = self.cluster_model(x)
                sum_cl, z, log_r_slots = slot_kl(logits, slots, target)
                sub_logits = self.sub_model(x, z)
                sub_r = torch.softmax(sub_logits, dim=1)
                dist2 = (x[:, None, :] - self._sub_means32.index_select(0, z)).square().sum(-1)
                # KL(r^E || r) and the subcluster loss summed over the local batch, divided
                # by G/W with G the step's points over all ranks: DDP averages gradients
                # over the W ranks, so the update is that of the per-point mean over the
                # global batch (W = 1: the batch mean). A rank with no rows left runs an
                # empty batch (zero gradients) so every rank takes the same steps.
                sum_sub = (sub_r * dist2).sum()
                per_rank = max(global_batch(step, one_pass, bsz, self.rank_rows), 1) / self.comm.world_size
                loss_cl, loss_sub = sum_cl / per_rank, sum_sub / per_rank
            if train:
                self.nets.opt_cluster.zero_grad(set_to_none=True)
                self.nets.opt_sub.zero_grad(set_to_none=True)
                with net_precision(self.precision, self.device, backward=True):
                    (loss_cl + loss_sub).backward()
                self.nets.opt_cluster.step()
                self.nets.opt_sub.step()
            if step < one_pass:
                stats.add(x, idx, logits, slots, target, log_r_slots,
                          2 * z + sub_logits.detach().argmax(1), sum_cl, sum_sub)
        t_train = device_clock(self.device)
        soft, sub, losses = stats.reduce(self.x, self.comm)
        if seconds is not None:
            seconds.update(estep=t_estep - t_start, train=t_train - t_estep)
        return soft, sub, losses

    def em_epoch(self, train: bool = True, seconds: dict[str, float] | None = None
                 ) -> tuple[SuffStats, SuffStats, dict[str, float]]:
        """One exact EM epoch (:func:`~deepdpm_core.training.small_data.exact_statistics`): soft
        statistics from r^E, hard 2-way subclusters; returns what :meth:`run_epoch` does.

        The clustering net takes one full-batch step on KL(r^E ‖ r) (with ``train``), so it
        follows the clusters through the moves and its loss is reported; it is fitted for
        good once K has settled (:meth:`distil`).
        """
        t_start = device_clock(self.device)
        k, n_local = self.n_clusters, self.x.shape[0]
        candidates, resp = self._estep_targets()
        t_estep = device_clock(self.device)
        self.cluster_model.train(train)
        with torch.set_grad_enabled(train), net_precision(self.precision, self.device):
            sum_cl, _, _ = slot_kl(self.cluster_model(self.x), candidates, resp)
        if train:
            self.nets.opt_cluster.zero_grad(set_to_none=True)
            with net_precision(self.precision, self.device, backward=True):
                (sum_cl / (max(self.n_total, 1) / self.comm.world_size)).backward()
            self.nets.opt_cluster.step()
        t_train = device_clock(self.device)
        soft, sub, sum_sub = exact_statistics(self.x, self.state, candidates, resp, self.anchors)
        sums = torch.stack([sum_cl.detach().double(), sum_sub,
                            torch.tensor(float(n_local), dtype=torch.float64, device=self.device)])
        flat = self.comm.all_reduce(torch.cat([soft.flat(), sub.flat(), sums]))
        a, b = SuffStats.numel(k, self.dim), SuffStats.numel(3 * k, self.dim)
        soft, sub = SuffStats.from_flat(flat[:a], k, self.dim), SuffStats.from_flat(flat[a:b], 2 * k, self.dim)
        n = float(flat[-1].clamp_min(1))
        if seconds is not None:
            seconds.update(estep=t_estep - t_start, train=t_train - t_estep)
        return soft, sub, {"loss_cluster": float(flat[-3]) / n, "loss_subcluster": float(flat[-2]) / n}

    def distil(self) -> dict[str, float]:
        """Fit the clustering net to the E-step of the final mixture
        (:func:`~deepdpm_core.training.small_data.distil`); returns ``distil_steps`` and
        ``distil_agreement`` for the history record."""
        candidates, resp = self._estep_targets()
        sd = self.config.small_data
        with net_precision(self.precision, self.device):
            steps, agreement = distil(self.cluster_model, self.x, candidates, resp, self.n_total, self.comm,
                                      sd.distil_lr, sd.distil_agreement, sd.distil_max_steps)
        return {"distil_steps": steps, "distil_agreement": agreement}

    def m_step(self, soft: SuffStats, sub: SuffStats) -> None:
        """Bayesian M-step from the net's responsibilities (paper §3.1) and subclusters."""
        pc = self.config.prior.weight_pseudocount
        self.prior_fit.fit(soft)
        prior, k, d = self.prior_fit.prior, self.n_clusters, self.dim
        means, covs = map_estimate(prior, soft)
        sm, sc = map_estimate(prior, sub)
        sub_n = sub.n.view(k, 2)
        self.state = MixtureState(means, covs, log_weights_from_counts(soft.n, pc), sm.view(k, 2, d),
                                  sc.view(k, 2, d, d), log_weights_from_counts(sub_n, pc))
        # a subcluster that lost all its points cannot propose a split: restart it
        dead = torch.nonzero(sub_n.min(1).values < 1).squeeze(1)
        reset_subclusters(self.state, self.nets, dead, self.torch_gen)

    # ------------------------------------------------------------------- moves
    def _decide(self, kind: str, sub: SuffStats) -> MovePlan:
        """Rank 0 decides the moves and broadcasts the plan, or the DataError it ran into,
        so that every rank raises it rather than wait for a plan."""
        plan: MovePlan | DataError | None = None
        valleys = self._valleys(kind)
        if self.comm.rank == 0:
            try:
                plan = plan_moves(kind, sub, self.state.means, self.prior_fit.prior, self.config.moves,
                                  self.config.prior.alpha, self.rng, self._coarsening(), valleys)
            except torch.linalg.LinAlgError:
                plan = self.prior_fit.numerical_failure(self.epoch)
        plan = self.comm.broadcast_object(plan, src=0)
        if isinstance(plan, DataError):
            raise plan
        return plan

    def _coarsening(self) -> float | None:
        """c of the coarsened move ratios (:func:`~deepdpm_core.moves.coarsening_constant`)."""
        p, prior = self.config.prior, self.prior_fit.prior
        return coarsening_constant(p.coarsening, p.coarsening_per_parameter, prior.dim, prior.diagonal)

    def _valleys(self, kind: str) -> np.ndarray | dict[tuple[int, int], float] | None:
        """The density valleys a move round judges (:mod:`deepdpm_core.moves.density_valleys`;
        collective): a split round's along each cluster's split axis, a merge round's
        along each candidate pair's axis, from the rows of each row's best cluster (the
        epoch's E-step anchors) summed over ranks. None when the round's rule
        (``moves.split_valley`` or ``moves.merge_valley``) is off."""
        mc = self.config.moves
        if (mc.split_valley if kind == "split" else mc.merge_valley) is None:
            return None
        if kind == "split":
            hist = self.comm.all_reduce(projection_histograms(self.x, self.anchors, self.state))
            return valley_ratios(hist.cpu().numpy(), mc.min_subcluster_size, mc.valley_bandwidth)
        pairs = merge_candidates(self.state.means, mc.merge_neighbours)
        hist = self.comm.all_reduce(pair_histograms(self.x, self.anchors, self.state, pairs))
        ratios = valley_ratios(hist.cpu().numpy(), mc.min_subcluster_size, mc.valley_bandwidth)
        return dict(zip(pairs, ratios.tolist(), strict=True))

    def apply_plan(self, plan: MovePlan, soft: SuffStats) -> Tensor:
        """Surgery on parameters, nets and optimiser state (identical on every rank);
        returns each old cluster's new row (:func:`~deepdpm_core.moves.surgery.apply_plan`)."""
        if plan.empty:
            return torch.arange(self.n_clusters)
        self.state, new_row = apply_plan(plan, self.state, self.nets, soft, self.prior_fit.prior,
                                         self.torch_gen)
        # anchors follow their cluster (−1 for a pruned one: the E-step searches afresh)
        if self.anchors is not None:
            self.anchors = new_row[self.anchors]
        self._rewrap()
        self._refresh_mixture()
        return new_row.cpu()

    def _births(self, candidates: list[int]) -> int:
        """Offer ``candidates`` (clusters whose split this round did not take) the cuts into
        3 .. ``moves.birth_parts`` parts (:mod:`deepdpm_core.moves.births`; collective), if they
        hold :func:`~deepdpm_core.moves.births.birth_min_points` points. Rank 0 chooses, every
        rank cuts; returns the births made."""
        mc = self.config.moves
        counts = self.comm.all_reduce(torch.bincount(self.anchors[self.anchors >= 0], minlength=self.n_clusters)
                                      .to(torch.float64))
        rows = [k for k in candidates if counts[k] >= birth_min_points(mc, self.dim)]
        if not rows:
            return 0
        prior = self.prior_fit.prior
        proposals = birth_proposals(self.x, self.anchors, self.state, rows, prior, self.config.prior.alpha, mc,
                                    self._coarsening(), self.comm)
        chosen = self.comm.broadcast_object(choose_births(proposals) if self.comm.rank == 0 else None, src=0)
        for i, prop in enumerate(proposals):
            born = [b for b, j in chosen.items() if j == i]
            if not born:
                continue
            keep = torch.tensor([b * prop.parts + j for b in born for j in range(prop.parts)], dtype=torch.long)
            self.state, part_rows = apply_births(self.state, self.nets, [rows[b] for b in born],
                                                 prop.stats.rows(keep), prior, self.torch_gen)
            # the rows of a cut cluster move to their part's row
            to_row = torch.full((len(rows) * prop.parts,), -1, dtype=torch.long, device=self.device)
            to_row[keep.to(self.device)] = part_rows.to(self.device)
            new_anchor = to_row[prop.part.clamp_min(0)]
            self.anchors = torch.where((prop.part >= 0) & (new_anchor >= 0), new_anchor, self.anchors)
        if chosen:
            self._rewrap()
            self._refresh_mixture()
        return len(chosen)

    # --------------------------------------------------------------------- fit
    def step_epoch(self) -> dict:
        """Train one epoch, M-step, maybe a move; returns the history record.

        Raises
        ------
        DataError
            A cluster covariance is not positive-definite: the data's clusters are
            degenerate at the prior's scale (raised on every rank alike).
        """
        with flush_denormals():
            try:
                return self._step_epoch()
            except torch.linalg.LinAlgError as exc:
                raise self.prior_fit.numerical_failure(self.epoch) from exc

    def _step_epoch(self) -> dict:
        t0 = device_clock(self.device)
        phases: dict[str, float] = {}
        epoch = self.epoch + 1  # 1-based, as the schedule counts
        soft, sub, losses = self.run_epoch(train=True, seconds=phases)
        t_mstep = device_clock(self.device)
        # the statistics (and the all-reduce) run on to the M-step, so the phases add up to
        # the epoch's seconds even when the process waits for a core between two clock reads
        phases["stats"] = (t_mstep - t0) - phases["estep"] - phases["train"]
        if not self.schedule.frozen(epoch):
            self.m_step(soft, sub)
            self._refresh_mixture()
        t_moves = device_clock(self.device)
        splits = merges = 0
        move = self.schedule.move_at(epoch)
        if move is not None:
            plan = self._decide(move, sub)
            unsplit = [k for k in range(self.n_clusters) if k not in plan.splits and k not in plan.prunes]
            new_row = self.apply_plan(plan, soft)
            splits, merges = len(plan.splits), len(plan.merges)
            if move == "split" and self.small and self.config.moves.birth_parts:
                splits += self._births([int(new_row[k]) for k in unsplit])
            self.schedule.moved(epoch, splits + merges, self.n_clusters)
        distilled = {}
        if self.schedule.finished(epoch):
            if self.small:  # the net learns the clusters the search found
                distilled = self.distil()
            self.prune_unused(self.hard_counts())  # last epoch: K = clusters that own points
        t_end = device_clock(self.device)
        prior = self.prior_fit.prior
        record = {
            "epoch": self.epoch,
            "n_clusters": self.n_clusters,
            "loss_cluster": losses["loss_cluster"],
            "loss_subcluster": losses["loss_subcluster"],
            "move": move,
            "splits_accepted": splits,
            "merges_accepted": merges,
            "prior_scale": self.prior_fit.sigma_scale,
            "prior_nu": prior.nu,
            "diagonal_covariances": int(prior.diagonal),
            "seconds": t_end - t0,
            # where it went (EPOCH_PHASES); the M-step includes subcluster restarts, the
            # split/merge round the last epoch's pruning
            **{f"seconds_{name}": seconds for name, seconds in phases.items()},
            "seconds_mstep": t_moves - t_mstep,
            "seconds_moves": t_end - t_moves,
            **distilled,
        }
        self.history.append(record)
        self.epoch += 1
        for cb in self.callbacks:
            cb(record)
        return record

    @property
    def finished(self) -> bool:
        """The schedule stops the fit here (``max_epochs`` reached, or converged)."""
        return self.schedule.finished(self.epoch)

    def fit(self, init_labels: Tensor | None = None) -> None:
        """Initialise if needed (from ``init_labels`` when given), then run epochs until
        the schedule stops the fit."""
        if not hasattr(self, "nets"):
            self.initialize(init_labels)
        while not self.finished:
            self.step_epoch()

    def check_consistency(self, rtol: float = 1e-9) -> None:
        """Raise RuntimeError if the ranks' models differ (by :meth:`checksum`, relative
        gap above ``rtol``); the message names the epoch."""
        check_ranks_agree(self.comm, self.checksum(), self.device, rtol, f"at epoch {self.epoch}",
                          f"K = {self.n_clusters} on rank {self.comm.rank}")

    def checksum(self) -> float:
        """:func:`~deepdpm_core.training.consistency.position_checksum` of the nets, the mixture state
        and the schedule's counters."""
        c = self.schedule.counters()
        return position_checksum([*self.nets.parameters(), *self.state.tensors(), torch.tensor(
            [self.epoch, self.n_clusters, c["move_round"], c["frozen_until"]])], self.device)

    @torch.no_grad()
    def hard_counts(self, batch_size: int = 65536) -> Tensor:
        """Points per cluster under the clustering net's argmax, summed over ranks; (K,)."""
        counts = torch.zeros(self.n_clusters, dtype=torch.float64, device=self.device)
        for s in range(0, self.x.shape[0], batch_size):
            with net_precision(self.precision, self.device):
                z = self.nets.cluster(self.x[s : s + batch_size]).argmax(1)
            counts += torch.bincount(z, minlength=self.n_clusters).to(counts)
        return self.comm.all_reduce(counts)

    def prune_unused(self, labels_counts: Tensor) -> None:
        """Drop clusters that own no point (hard counts over all ranks are given)."""
        empty = [int(k) for k in torch.nonzero(labels_counts <= 0).squeeze(1).tolist()]
        if empty and len(empty) < self.n_clusters:
            soft = SuffStats.zeros(self.n_clusters, self.dim, device=self.device)
            self.apply_plan(MovePlan(prunes=empty), soft)

    # ---------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """:func:`~deepdpm_core.model.files.trainer_state`: what resuming needs."""
        return trainer_state(self)

    @classmethod
    def from_state(cls, state: dict[str, Any], x: Tensor, comm: Communicator | None = None,
                   wrap: Callable[[nn.Module], nn.Module] | None = None,
                   callbacks: list[EpochCallback] | None = None, config: Config | None = None) -> Trainer:
        """A trainer resuming from :meth:`state_dict` output on this rank's rows ``x``
        (N_local, D), which must be the rows the state was trained on. ``comm``, ``wrap``
        and ``callbacks`` are as for the constructor; ``config`` replaces the stored one
        (e.g. another device).

        Raises
        ------
        CheckpointError
            ``x`` has another dimension, row count or mean than the training data.
        """
        dim = int(state["dim"])
        if x.shape[1] != dim:
            raise CheckpointError(f"the checkpoint was trained on {dim}-D rows, these have {x.shape[1]}")
        trainer = cls(config or from_dict(state["config"]), x, comm, wrap, callbacks)
        check_same_data(trainer, state, stored_coordinates(state).center)
        trainer.load_state_dict(state)
        return trainer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the data and config come from the constructor)."""
        self.epoch = int(state["epoch"])
        self.schedule.restore(state)
        self.history = list(state["history"])
        self.state = MixtureState.from_state(state, self.device)
        self.prior_fit.restore(state)
        self._build_nets(self.n_clusters)
        self.nets.cluster.load_state_dict(state["cluster_net"])
        self.nets.sub.load_state_dict(state["sub_nets"])
        restore_optimisers(self, state)
        self._rewrap()
        self._refresh_mixture()
