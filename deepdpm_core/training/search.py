"""The DeepDPM search over a :class:`~deepdpm_core.runtime.communicator.Communicator`: a fit's
state and its epoch loop (paper §3; docs/design.md, "One epoch").

Each epoch (:meth:`Search.step_epoch`) takes the E-step targets under the mixture, the
statistics of the epoch (:meth:`Search.statistics`, reduced over the ranks as one flat
float64 tensor), the M-step on every rank (NIW MAP) unless the parameters are frozen, the
split or merge round the :class:`~deepdpm_core.moves.schedule.MoveSchedule` calls for
(:meth:`Search.move`) and, at the schedule's end, where the search settles
(:meth:`Search.settle`). The two searches are subclasses that give the statistics and their
own rules: :class:`~deepdpm_core.training.minibatch.MinibatchSearch` (the nets' minibatch
steps) and :class:`~deepdpm_core.training.exact_em.ExactEM` (exact EM, the default).

Data live on the device as one (N_local, dim) float32 tensor in the fit's own coordinates
(:mod:`~deepdpm_core.training.fit_context`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from deepdpm_core.bayes import PriorFit, SuffStats, map_covariance_writer, posterior_mean
from deepdpm_core.config import Config
from deepdpm_core.errors import CheckpointError
from deepdpm_core.estep import EStep, MixtureState, SubclusterMAP, log_weights_from_counts
from deepdpm_core.moves import (
    FREEZE_EPOCHS,
    MovePlan,
    MoveSchedule,
    Nets,
    apply_plan,
    reset_subclusters,
)
from deepdpm_core.runtime import device_clock, flush_denormals
from deepdpm_core.training.consistency import check_ranks_agree, position_checksum
from deepdpm_core.training.fit_context import (
    FitContext,
    check_same_data,
    model_state,
    restore_model,
    start_model,
)
from deepdpm_core.training.move_round import decide_moves, unowned_clusters

Tensor = torch.Tensor
#: called with each epoch's history record, within the epoch, in order (it may add keys to
#: the record; one that raises stops the fit with the search whole at that epoch's end)
EpochCallback = Callable[[dict[str, Any]], None]


class Search:
    """A fit of DeepDPM to this rank's rows; collective steps go through ``ctx.comm``.

    Parameters
    ----------
    config : Config
    ctx : FitContext
        The rows in the fit's coordinates and what stays fixed through the fit.

    Attributes
    ----------
    state : MixtureState
        The clusters and subclusters (after :meth:`initialize`).
    nets : Nets
        The clustering and subclustering nets (none where :attr:`subnets` is false) and
        their optimisers.
    cluster_model, sub_model : nn.Module
        The nets as the ranks run them (``ctx.wrap``); ``sub_model`` None without
        subclustering nets.
    mixture : GaussianMixture
        ``state.mixture()``.
    anchors : Tensor of shape (N_local,), int64, or None
        Each local row's best cluster (its initial cluster, then the last E-step's best),
        the sparse E-step's anchors; None: not known (a resumed fit).
    schedule : MoveSchedule
        When moves run and when the fit stops.
    prior_fit : PriorFit
        The NIW prior and its refit.
    epoch : int
        Epochs done.
    history : list of dict
        One record per epoch done.
    """

    #: the search's name in every epoch record (``search``), for whoever reads the records
    name: str
    #: the schedule's entries this search sets whatever the config says
    schedule_rules: dict[str, int] = {}
    #: epochs without M-step or moves after an accepted move, while the nets learn the new
    #: clusters (:data:`~deepdpm_core.moves.FREEZE_EPOCHS`)
    freeze_epochs = FREEZE_EPOCHS
    #: whether the search trains subclustering nets (and so builds, reshapes and saves them)
    subnets = True

    def __init__(self, config: Config, ctx: FitContext) -> None:
        self.config, self.ctx, self.comm = config, ctx, ctx.comm
        self.estep = EStep(config.estep)
        self.rng = np.random.default_rng(config.seed)  # move decisions (rank 0) and init
        self.torch_gen = torch.Generator().manual_seed(config.seed)  # net initialisation
        self.epoch = 0
        #: the epoch a resumed fit continued from (:meth:`resume`); None for a fresh fit
        self.resumed_from: int | None = None
        self.history: list[dict[str, Any]] = []
        self.anchors: Tensor | None = None
        self.x, self.coords, self.n_total, self.rank_rows = ctx.x, ctx.coords, ctx.n_total, ctx.rank_rows
        self.device, self.precision, self.batch_size = ctx.device, ctx.precision, ctx.batch_size
        #: per-feature variance (D,) of the (transformed) features, float64, for diagnostics
        self.feature_variance = self.coords.feature_std.square()
        self.prior_fit = PriorFit(config.prior, self.coords, self.device)
        self.schedule = MoveSchedule(config.schedule.model_copy(update=self.schedule_rules), config.moves,
                                     self.freeze_epochs)

    # ------------------------------------------------------------------ set-up
    def initialize(self, init_labels: Tensor | None = None) -> None:
        """k-means clusters (rank 0, on a sample gathered from all ranks), MAP parameters,
        principal-axis subclusters.

        ``init_labels`` (this rank's rows, int64 [n]) starts from given hard clusters
        instead of k-means (the AE alternation re-clusters from the previous clusters).
        """
        self._take(*start_model(self.ctx, self.config, self.prior_fit, self.rng, self.torch_gen, self.subnets,
                                init_labels))

    def _take(self, state: MixtureState, nets: Nets, anchors: Tensor | None) -> None:
        """Go on with these clusters, nets and anchors: the nets wrapped (``ctx.wrap``),
        the mixture refreshed."""
        self.state, self.nets, self.anchors = state, nets, anchors
        self.cluster_model = self.ctx.wrap(nets.cluster)
        self.sub_model = None if nets.sub is None else self.ctx.wrap(nets.sub)
        self.mixture = state.mixture()

    @property
    def dim(self) -> int:
        """The coordinates of x̃: D, fewer where features are left out (``coords.dim``)."""
        return self.ctx.dim

    @property
    def n_clusters(self) -> int:
        """K."""
        return self.state.n_clusters

    @property
    def finished(self) -> bool:
        """The schedule stops the fit here (``max_epochs`` reached, or converged)."""
        return self.schedule.finished(self.epoch)

    # -------------------------------------------------------------- the loop
    def fit(self, init_labels: Tensor | None = None, callbacks: Sequence[EpochCallback] = ()) -> None:
        """Initialise unless restored (from ``init_labels`` when given), then run epochs
        until the schedule stops the fit, each of ``callbacks`` called with each epoch's
        record: the one epoch loop of every fit."""
        if not hasattr(self, "nets"):
            self.initialize(init_labels)
        while not self.finished:
            self.step_epoch(callbacks)

    def step_epoch(self, callbacks: Sequence[EpochCallback] = ()) -> dict:
        """Run one epoch; returns its history record, which each of ``callbacks`` is
        called with first (within the epoch).

        Raises
        ------
        DataError
            A cluster covariance is not positive-definite: the data's clusters are
            degenerate at the prior's scale (raised on every rank alike).
        """
        with flush_denormals():
            try:
                record = self._epoch()
                for callback in callbacks:
                    callback(record)
                return record
            except torch.linalg.LinAlgError as exc:
                raise self.prior_fit.numerical_failure(self.epoch) from exc

    def _epoch(self) -> dict:
        """E-step targets, statistics, M-step, the move round, settling: one epoch."""
        epoch, t0, seconds = self.epoch + 1, device_clock(self.device), {}
        soft, sub, losses = self.run_epoch(seconds)
        t_mstep = device_clock(self.device)
        if not self.schedule.frozen(epoch):
            self.m_step(soft, sub)
        t_moves = device_clock(self.device)
        move, moved = self.schedule.move_at(epoch), {"splits_accepted": 0, "merges_accepted": 0, "prunes": 0}
        if move is not None:
            moved = self.move(move, soft, sub)
            self.schedule.moved(epoch, moved["splits_accepted"] + moved["merges_accepted"], self.n_clusters)
        settled = self.settle(epoch) if self.schedule.finished(epoch) else {}
        moved["prunes"] += settled.pop("prunes", 0)
        t_end = device_clock(self.device)
        # the statistics (and the all-reduce) run on to the M-step, so the phases add up to
        # the epoch's seconds even when the process waits for a core between two clock reads
        seconds.update(stats=(t_mstep - t0) - seconds["estep"] - seconds["train"], mstep=t_moves - t_mstep,
                       moves=t_end - t_moves)
        self.epoch = epoch
        record = self._record(move, losses, moved, t_end - t0, seconds, settled)
        self.history.append(record)
        return record

    def run_epoch(self, seconds: dict[str, float] | None = None) -> tuple[SuffStats, SuffStats, dict[str, float | None]]:
        """The E-step targets, then :meth:`statistics`; returns the reduced soft cluster and
        hard subcluster statistics and the mean losses. When ``seconds`` is given, the
        durations of the E-step targets (``estep``) and the nets' steps (``train``) go in it."""
        t_start = device_clock(self.device)
        candidates, resp = self.estep_targets()
        t_estep = device_clock(self.device)
        soft, sub, losses, train_seconds = self.statistics(candidates, resp)
        if seconds is not None:
            seconds.update(estep=t_estep - t_start, train=train_seconds)
        return soft, sub, losses

    def estep_targets(self) -> tuple[Tensor, Tensor]:
        """:meth:`~deepdpm_core.estep.EStep.targets` of the local rows under the mixture:
        candidates and r^E, (N_local, m) each; the anchors move to each row's best."""
        k = self.mixture.n_components
        # with every cluster allowed (m = K) the search starts from the mixture alone, so the
        # targets are a function of the checkpointed state and a resumed fit repeats them
        candidates, resp, self.anchors = self.estep.targets(
            self.mixture, self.x, self.anchors if self.estep.support(k) < k else None)
        return candidates, resp

    def statistics(self, candidates: Tensor, resp: Tensor) -> tuple[SuffStats, SuffStats, dict[str, float | None], float]:
        """Train on the E-step targets ``candidates`` and ``resp`` ((N_local, m) each) and
        return the epoch's statistics over all ranks: soft (K rows), hard subclusters (2K
        rows, cluster k's at 2k, 2k + 1), the mean losses (``loss_cluster``, None where no
        net trained, ``loss_subcluster``) and the seconds of the nets' steps. Collective."""
        raise NotImplementedError

    def m_step(self, soft: SuffStats, sub: SuffStats) -> None:
        """Bayesian M-step from the responsibilities (paper §3.1) and subclusters."""
        self.prior_fit.fit(soft)
        prior, k, d = self.prior_fit.prior, self.n_clusters, self.dim
        # nothing reads the last M-step's mixture once this one is made: the memory of its
        # covariances and factors is reused where it fits, and the covariances are written
        # block by block as they are factored, while they are in cache
        covs, write = map_covariance_writer(prior, soft, out=self.mixture.covariances)
        sub_n = sub.n.view(k, 2)
        # the subclusters' covariances are computed where they are read (SubclusterMAP)
        self.state = MixtureState(posterior_mean(prior, soft), covs, log_weights_from_counts(soft.n),
                                  posterior_mean(prior, sub).view(k, 2, d),
                                  SubclusterMAP(prior, sub), log_weights_from_counts(sub_n))
        self.mixture = self.state.mixture(recycled=self.mixture, fill=write)
        # a subcluster that lost all its points cannot propose a split: restart it
        dead = torch.nonzero(sub_n.min(1).values < 1).squeeze(1)
        reset_subclusters(self.state, self.nets, dead, self.torch_gen)

    def move(self, kind: str, soft: SuffStats, sub: SuffStats) -> dict[str, int]:
        """A ``kind`` ("split" or "merge") round (collective); returns the record's counts
        of splits (:meth:`births` included) and merges accepted and of clusters pruned (too
        small to keep)."""
        plan = decide_moves(self.ctx, self.config, kind, sub, self.state, self.anchors, self.prior_fit, self.rng,
                            self.epoch)
        unsplit = [k for k in range(self.n_clusters) if k not in plan.splits and k not in plan.prunes]
        new_row = self.apply_plan(plan, soft)
        born = self.births([int(new_row[k]) for k in unsplit]) if kind == "split" else 0
        return {"splits_accepted": len(plan.splits) + born, "merges_accepted": len(plan.merges),
                "prunes": len(plan.prunes)}

    def births(self, unsplit: list[int]) -> int:
        """After a split round, the splits added to those of the round (``unsplit``: the
        clusters whose split was not taken): none here."""
        return 0

    def apply_plan(self, plan: MovePlan, soft: SuffStats) -> Tensor:
        """Surgery on parameters, nets and optimiser state (identical on every rank);
        returns each old cluster's new row (:func:`~deepdpm_core.moves.surgery.apply_plan`)."""
        if plan.empty:
            return torch.arange(self.n_clusters)
        state, new_row = apply_plan(plan, self.state, self.nets, soft, self.prior_fit.prior, self.torch_gen)
        # anchors follow their cluster (−1 for a pruned one: the E-step searches afresh)
        self._take(state, self.nets, None if self.anchors is None else new_row[self.anchors])
        return new_row.cpu()

    def settle(self, epoch: int) -> dict[str, Any]:
        """Where the search settles after epoch ``epoch`` (1-based), the schedule's end: K
        becomes the clusters that own points under the clustering net. Returns the
        record's entries (``prunes``: the clusters dropped for owning none)."""
        empty = unowned_clusters(self.ctx, self.nets.cluster, self.n_clusters)
        if empty and len(empty) < self.n_clusters:
            self.apply_plan(MovePlan(prunes=empty), SuffStats.zeros(self.n_clusters, self.dim, device=self.device))
            return {"prunes": len(empty)}
        return {}

    def _record(self, move: str | None, losses: dict[str, float | None], moved: dict[str, int], seconds: float,
                phases: dict[str, float], settled: dict[str, Any]) -> dict[str, Any]:
        """The history record of the epoch just run, :attr:`epoch` (1-based, as the
        schedule counts: the record of the e-th epoch says ``"epoch": e``)."""
        prior = self.prior_fit.prior
        return {
            "epoch": self.epoch,
            "search": self.name,
            "n_clusters": self.n_clusters,
            "loss_cluster": losses["loss_cluster"],
            "loss_subcluster": losses["loss_subcluster"],
            "move": move,
            # with the prunes (clusters removed without a merge: too small in a move round,
            # empty at the end), every change of K a record shows
            **moved,
            "prior_scale": self.prior_fit.sigma_scale,
            "prior_nu": prior.nu,
            "diagonal_covariances": int(prior.diagonal),
            "seconds": seconds,
            # where it went (EPOCH_PHASES); the M-step includes subcluster restarts, the
            # split/merge round the last epoch's pruning
            **{f"seconds_{name}": phases[name] for name in ("estep", "train", "stats", "mstep", "moves")},
            **settled,
            # what the live schedule says after this epoch (a grown partition searches on),
            # so that whoever reads the records need not replay the schedule
            "stop_reason": self.schedule.stop_reason(self.epoch),
            "converged": self.schedule.converged(),
        }

    # ---------------------------------------------------- ranks and resuming
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

    def state_dict(self) -> dict[str, Any]:
        """Everything a fit needs to resume (tensors and plain containers only); also a
        model file's dict, which :class:`~deepdpm_core.model.fitted_model.FittedModel` reads."""
        return {"config": self.config.to_dict(), "dim": self.coords.n_features, "n_total": self.n_total,
                "coordinates": self.coords.state_dict(), **self.prior_fit.state_dict(), "epoch": self.epoch,
                **self.schedule.counters(), "history": list(self.history),
                **model_state(self.state, self.nets, self.rng, self.torch_gen)}

    def resume(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` output, a state of this search's rows.

        Raises
        ------
        CheckpointError
            The rows have another row count or mean than the state's, or ``state`` lacks a
            key a fit's state holds.
        """
        try:
            check_same_data(self.ctx, state)
            self.epoch, self.history = int(state["epoch"]), list(state["history"])
            if self.history and self.history[-1]["epoch"] < self.epoch:  # records counted from 0 then
                self.history = [{**record, "epoch": record["epoch"] + 1} for record in self.history]
            self.resumed_from = self.epoch
            self.schedule.restore(state)
            self.prior_fit.restore(state)
            mixture, nets = restore_model(self.ctx, self.config, state, self.rng, self.torch_gen, self.subnets)
        except KeyError as exc:  # e.g. a model file, which keeps neither Adam's moments nor the generators
            raise CheckpointError(f"a DeepDPM checkpoint without the key {exc}: not a fit's resume state") from None
        self._take(mixture, nets, None)
