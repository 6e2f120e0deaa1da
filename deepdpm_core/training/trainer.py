"""The DeepDPM epoch loop over a :class:`~deepdpm_core.runtime.communicator.Communicator`.

One epoch (paper §3; docs/design.md, "One epoch"): the nets' minibatch steps against the
E-step targets with the statistics of one pass (:mod:`~deepdpm_core.training.minibatch_epoch`;
exact EM on small data, :mod:`~deepdpm_core.training.em_epoch`), one all-reduce of the
statistics as a flat float64 tensor, the M-step on every rank (NIW MAP) unless the parameters
are frozen, and, when the :class:`~deepdpm_core.moves.schedule.MoveSchedule` says so, a
split or merge round (:mod:`~deepdpm_core.training.move_round`).

Data live on the device as one (N_local, dim) float32 tensor in the fit's own coordinates
(:mod:`deepdpm_core.data.coordinates`: centred, so the prior mean is 0 and uncentred float64
sums stay accurate, and scaled to unit mean variance, so nothing depends on the units).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.bayes import PriorFit, SuffStats, grouped_stats, map_estimate
from deepdpm_core.config import Config, from_dict
from deepdpm_core.data import fit_coordinates
from deepdpm_core.errors import CheckpointError
from deepdpm_core.estep import EStep, MixtureState, log_weights_from_counts
from deepdpm_core.moves import (
    MovePlan,
    MoveSchedule,
    Nets,
    apply_plan,
    initial_clusters,
    reset_subclusters,
)
from deepdpm_core.nets import ClusterNet, SubclusterNets, new_row_of
from deepdpm_core.runtime import (
    Communicator,
    LocalCommunicator,
    device_clock,
    flush_denormals,
    net_precision,
    resolve_device,
    resolve_precision,
)
from deepdpm_core.training.batching import adam, auto_batch_size, epoch_steps, scaled_lr
from deepdpm_core.training.consistency import check_ranks_agree, position_checksum
from deepdpm_core.training.em_epoch import em_epoch
from deepdpm_core.training.growth import grow
from deepdpm_core.training.hooks import EpochHooks, RecordCallback
from deepdpm_core.training.minibatch_epoch import minibatch_epoch
from deepdpm_core.training.move_round import move_round, prune_unowned
from deepdpm_core.training.polish import polish
from deepdpm_core.training.resume import check_same_data, restore_trainer, trainer_state
from deepdpm_core.training.small_data import distil

Tensor = torch.Tensor

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
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self.config = config
        self.comm = comm or LocalCommunicator()
        self.wrap = wrap or (lambda m: m)
        self.device = resolve_device(config.device)
        self.precision = resolve_precision(config.model.precision, self.device)
        self.estep = EStep(config.estep)
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
        """The fit's coordinates (:mod:`deepdpm_core.data.coordinates`), the data in them (by
        chunks: a float64 copy of all rows would double their memory) and the NIW prior."""
        self.coords, self.n_total, self.rank_rows = fit_coordinates(
            x, self.config.data, self.comm, self.device)
        n_local, d, chunk = x.shape[0], self.coords.dim, 1 << 16
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
        stats, keep = self.partition_stats(z, n_init)
        self.anchors = new_row_of(keep, n_init)[z]
        self.prior_fit.fit(stats)
        means, covs = map_estimate(self.prior_fit.prior, stats)
        self.state = MixtureState.without_subclusters(
            means, covs, log_weights_from_counts(stats.n, cfg.prior.weight_pseudocount))
        self.build_nets(self.state.n_clusters)
        reset_subclusters(self.state, self.nets, torch.arange(self.n_clusters, device=self.device),
                          self.torch_gen)
        self.reshaped()

    def partition_stats(self, labels: Tensor, n_groups: int) -> tuple[SuffStats, Tensor]:
        """The statistics of the hard partition ``labels`` (this rank's rows, int64 in
        [0, ``n_groups``)) over all ranks (collective), and which groups they are: the
        non-empty ones, shape (K',), in order."""
        # float64 GEMMs: the statistics are the same to round-off on any number of ranks
        local = grouped_stats(self.x, torch.arange(labels.shape[0], device=self.device), labels,
                              torch.ones_like(labels, dtype=torch.float64), n_groups, dtype=torch.float64)
        stats = SuffStats.from_flat(self.comm.all_reduce(local.flat()), n_groups, self.dim)
        keep = torch.nonzero(stats.n > 0).squeeze(1)
        return stats.rows(keep), keep

    def build_nets(self, k: int) -> None:
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

    def _refresh_mixture(self) -> None:  # after the parameters change
        self.mixture, self.sub_means32 = self.state.mixture(), self.state.sub_means.to(torch.float32)

    def reshaped(self) -> None:
        """After the nets were built or surgery changed the clusters: wrap the nets
        (``wrap``), refresh the mixture."""
        self.cluster_model, self.sub_model = self.wrap(self.nets.cluster), self.wrap(self.nets.sub)
        self._refresh_mixture()

    @property
    def dim(self) -> int:
        """The coordinates of x̃: D, fewer where features are left out (``coords.dim``)."""
        return self.coords.dim

    @property
    def n_clusters(self) -> int:
        """K."""
        return self.state.n_clusters

    # ------------------------------------------------------------------ epochs
    def n_steps(self) -> tuple[int, int]:
        """:func:`~deepdpm_core.training.batching.epoch_steps` of this fit (collective)."""
        return epoch_steps(self.x.shape[0], self.batch_size, self.config.optim.min_steps_per_epoch,
                           self.comm, self.device)

    def estep_targets(self) -> tuple[Tensor, Tensor]:
        """:meth:`~deepdpm_core.estep.EStep.targets` of the local rows under the current
        mixture (candidates and r^E, (N_local, m) each); the anchors move to each row's best."""
        k = self.n_clusters
        # with every cluster allowed (m = K) the search starts from the mixture alone, so the
        # targets are a function of the checkpointed state and a resumed fit repeats them
        anchors = self.anchors if self.estep.support(k) < k else None
        candidates, resp, self.anchors = self.estep.targets(self.mixture, self.x, anchors)
        return candidates, resp

    def run_epoch(self, train: bool = True, seconds: dict[str, float] | None = None
                  ) -> tuple[SuffStats, SuffStats, dict[str, float]]:
        """One pass over the local rows; returns reduced soft cluster and hard subcluster
        stats and the mean losses.

        With ``train=False`` the nets are not updated (a pure statistics pass). When
        ``seconds`` is given, the durations of the E-step targets (``estep``) and the
        minibatch steps (``train``) are written into it (the statistics with their
        all-reduce take the rest). Small data (:attr:`small`) run :func:`~deepdpm_core.training.em_epoch.em_epoch` instead.
        """
        if self.small:
            return em_epoch(self, train, seconds)
        return minibatch_epoch(self, train, seconds)

    def distil(self) -> dict[str, float]:
        """Fit the clustering net to the E-step of the final mixture
        (:func:`~deepdpm_core.training.small_data.distil`); returns ``distil_steps`` and
        ``distil_agreement`` for the history record."""
        candidates, resp = self.estep_targets()
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
        self.reshaped()
        return new_row.cpu()

    # --------------------------------------------------------------------- fit
    def step_epoch(self, on_epoch: Sequence[RecordCallback] = ()) -> dict:
        """Train one epoch, M-step, maybe a move; returns the history record, which each
        of ``on_epoch`` is called with first (within the epoch).

        Raises
        ------
        DataError
            A cluster covariance is not positive-definite: the data's clusters are
            degenerate at the prior's scale (raised on every rank alike).
        """
        with flush_denormals():
            try:
                return self._step_epoch(on_epoch)
            except torch.linalg.LinAlgError as exc:
                raise self.prior_fit.numerical_failure(self.epoch) from exc

    def _step_epoch(self, on_epoch: Sequence[RecordCallback]) -> dict:
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
            splits, merges = move_round(self, move, soft, sub)
            self.schedule.moved(epoch, splits + merges, self.n_clusters)
        final = self._settle(epoch) if self.schedule.finished(epoch) else {}
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
            **final,
        }
        self.history.append(record)
        self.epoch += 1
        for callback in on_epoch:
            callback(record)
        return record

    def _settle(self, epoch: int) -> dict:
        """Where the search settled after epoch ``epoch`` (1-based): on small data the model's
        best partition of K or K − 1 (:func:`polish`), then either a search again from a grown
        partition (:func:`grow`) or the net fitted to the result; the last epoch's K is the
        clusters that own points. Returns the record's entries."""
        final = {}
        if self.small:
            final["polished"] = int(polish(self))
            if epoch < self.schedule.schedule.max_epochs and grow(self):
                self.schedule.restart(epoch)  # settled far below the model's answer: search again
                return {**final, "grown": self.n_clusters}
            final.update(self.distil())
        prune_unowned(self)
        return final

    @property
    def finished(self) -> bool:
        """The schedule stops the fit here (``max_epochs`` reached, or converged)."""
        return self.schedule.finished(self.epoch)

    def fit(self, init_labels: Tensor | None = None, hooks: EpochHooks | None = None) -> None:
        """Initialise unless restored (from ``init_labels`` when given), then run epochs
        until the schedule stops the fit: the one epoch loop of every fit, with what the
        caller adds as ``hooks``."""
        hooks = hooks or EpochHooks()
        if not hasattr(self, "nets"):
            self.initialize(init_labels)
        while not self.finished:
            for before in hooks.before_epoch:
                before(self)
            self.step_epoch(hooks.on_epoch)
            for after in hooks.after_epoch:
                after(self)
        for done in hooks.after_fit:
            done(self)

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

    # ---------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """:func:`~deepdpm_core.training.resume.trainer_state`: what resuming needs."""
        return trainer_state(self)

    @classmethod
    def from_state(cls, state: dict[str, Any], x: Tensor, comm: Communicator | None = None,
                   wrap: Callable[[nn.Module], nn.Module] | None = None,
                   config: Config | None = None) -> Trainer:
        """A trainer resuming from :meth:`state_dict` output on this rank's rows ``x``
        (N_local, D), which must be the rows the state was trained on. ``comm`` and ``wrap``
        are as for the constructor; ``config`` replaces the stored one
        (e.g. another device).

        Raises
        ------
        CheckpointError
            ``x`` has another dimension, row count or mean than the training data.
        """
        dim = int(state["dim"])
        if x.shape[1] != dim:
            raise CheckpointError(f"the checkpoint was trained on {dim}-D rows, these have {x.shape[1]}")
        trainer = cls(config or from_dict(state["config"]), x, comm, wrap)
        check_same_data(trainer, state)
        restore_trainer(trainer, state)
        return trainer
