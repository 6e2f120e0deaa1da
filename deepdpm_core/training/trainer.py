"""The DeepDPM epoch loop over a :class:`~deepdpm_core.runtime.communicator.Communicator`.

One epoch (paper §3; docs/design.md, "One epoch"): the E-step targets under the mixture,
the epoch body for the statistics (:mod:`~deepdpm_core.training.epoch_body`: the nets'
minibatch steps with the statistics of one pass, or exact EM on small data), reduced over
the ranks as one flat float64 tensor, the M-step on every rank (NIW MAP) unless the
parameters are frozen, when the :class:`~deepdpm_core.moves.schedule.MoveSchedule` says so
a split or merge round (:mod:`~deepdpm_core.training.move_round`), and at the schedule's
end where the search settles. The helpers take what they need (some, such as the births,
update the mixture state they are handed in place); only the trainer keeps the fit's state.

Data live on the device as one (N_local, dim) float32 tensor in the fit's own coordinates
(:mod:`~deepdpm_core.training.fit_context`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.bayes import PriorFit, SuffStats, map_estimate, posterior_mean
from deepdpm_core.config import Config
from deepdpm_core.data import readonly_tensor
from deepdpm_core.errors import CheckpointError
from deepdpm_core.estep import EStep, MixtureState, SubclusterMAP, log_weights_from_counts
from deepdpm_core.moves import MovePlan, MoveSchedule, apply_plan, reset_subclusters
from deepdpm_core.runtime import Communicator, LocalCommunicator, device_clock, flush_denormals
from deepdpm_core.training.consistency import check_ranks_agree, position_checksum
from deepdpm_core.training.em_epoch import ExactEM
from deepdpm_core.training.epoch_body import EpochBody
from deepdpm_core.training.fit_context import fit_context
from deepdpm_core.training.hooks import EpochHooks, RecordCallback
from deepdpm_core.training.minibatch_epoch import MinibatchEpochs
from deepdpm_core.training.move_round import decide_moves, unowned_clusters
from deepdpm_core.training.resume import check_same_data, model_state, restore_model
from deepdpm_core.training.search_model import SearchModel, estep_targets, start_model, wrapped

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
    ctx : FitContext
        The rows in the fit's coordinates and what stays fixed through the fit.
    body : EpochBody
        The epoch body: :class:`~deepdpm_core.training.em_epoch.ExactEM` up to
        ``small_data.max_rows`` rows, :class:`~deepdpm_core.training.minibatch_epoch.MinibatchEpochs` above.
    """

    def __init__(self, config: Config, x: Tensor, comm: Communicator | None = None,
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self.config = config
        self.comm = comm or LocalCommunicator()
        self.wrap = wrap or (lambda m: m)
        self.estep = EStep(config.estep)
        self.rng = np.random.default_rng(config.seed)  # move decisions (rank 0) and init
        self.torch_gen = torch.Generator().manual_seed(config.seed)  # net initialisation
        self.epoch = 0
        #: the epoch a resumed fit continued from (:meth:`resume`); None for a fresh fit
        self.resumed_from: int | None = None
        self.history: list[dict[str, Any]] = []
        #: each local row's best cluster (:class:`~deepdpm_core.training.search_model.SearchModel`)
        self.anchors: Tensor | None = None
        self.ctx = ctx = fit_context(config, x, self.comm, self.wrap)
        self.x, self.coords, self.n_total, self.rank_rows = ctx.x, ctx.coords, ctx.n_total, ctx.rank_rows
        self.device, self.precision, self.batch_size = ctx.device, ctx.precision, ctx.batch_size
        #: per-feature variance (D,) of the (transformed) features, float64, for diagnostics
        self.feature_variance = self.coords.feature_std.square()
        self.prior_fit = PriorFit(config.prior, self.coords, self.device)
        self.body: EpochBody = (ExactEM(ctx, config, self.estep) if self.n_total <= config.small_data.max_rows
                                else MinibatchEpochs(ctx, config))
        self.schedule = MoveSchedule(self.body.schedule(config.schedule), config.moves, self.body.freeze_epochs)

    # ------------------------------------------------------------------ set-up
    def initialize(self, init_labels: Tensor | None = None) -> None:
        """k-means clusters (rank 0, on a sample gathered from all ranks), MAP parameters,
        principal-axis subclusters.

        ``init_labels`` (this rank's rows, int64 [n]) warm-starts from given hard clusters
        instead of k-means (the AE alternation re-clusters from the previous clusters).
        """
        self._adopt(start_model(self.ctx, self.config, self.prior_fit, self.rng, self.torch_gen, init_labels))

    def _adopt(self, model: SearchModel) -> None:
        """Go on with ``model``."""
        self.state, self.nets, self.anchors = model.state, model.nets, model.anchors
        self.cluster_model, self.sub_model, self.mixture = model.cluster_model, model.sub_model, model.mixture

    def _model(self) -> SearchModel:
        """The model as it is now."""
        return SearchModel(self.state, self.nets, self.anchors, self.cluster_model, self.sub_model, self.mixture)

    @property
    def dim(self) -> int:
        """The coordinates of x̃: D, fewer where features are left out (``coords.dim``)."""
        return self.ctx.dim

    @property
    def n_clusters(self) -> int:
        """K."""
        return self.state.n_clusters

    # ------------------------------------------------------------------ epochs
    def estep_targets(self) -> tuple[Tensor, Tensor]:
        """:func:`~deepdpm_core.training.search_model.estep_targets` of the local rows
        (candidates and r^E, (N_local, m) each); the anchors move to each row's best."""
        candidates, resp, self.anchors = estep_targets(self.estep, self.mixture, self.x, self.anchors)
        return candidates, resp

    def run_epoch(self, seconds: dict[str, float] | None = None) -> tuple[SuffStats, SuffStats, dict[str, float]]:
        """The E-step targets, then one pass of the epoch body (:attr:`body`) over the local
        rows, the nets training on the way; returns reduced soft cluster and hard
        subcluster stats and the mean losses.

        When ``seconds`` is given, the durations of the E-step targets (``estep``) and the
        nets' steps (``train``) are written into it (the statistics with their all-reduce
        take the rest).
        """
        t_start = device_clock(self.device)
        candidates, resp = self.estep_targets()
        t_estep = device_clock(self.device)
        out = self.body.statistics(self._model(), candidates, resp, self.epoch)
        if seconds is not None:
            seconds.update(estep=t_estep - t_start, train=out.train_seconds)
        return out.soft, out.sub, out.losses

    def m_step(self, soft: SuffStats, sub: SuffStats) -> None:
        """Bayesian M-step from the net's responsibilities (paper §3.1) and subclusters."""
        self.prior_fit.fit(soft)
        prior, k, d = self.prior_fit.prior, self.n_clusters, self.dim
        means, covs = map_estimate(prior, soft)
        sub_n = sub.n.view(k, 2)
        # the subclusters' covariances are computed where they are read (SubclusterMAP)
        self.state = MixtureState(means, covs, log_weights_from_counts(soft.n),
                                  posterior_mean(prior, sub).view(k, 2, d),
                                  SubclusterMAP(prior, sub), log_weights_from_counts(sub_n))
        # a subcluster that lost all its points cannot propose a split: restart it
        dead = torch.nonzero(sub_n.min(1).values < 1).squeeze(1)
        reset_subclusters(self.state, self.nets, dead, self.torch_gen)
        # nothing reads the last M-step's mixture once this one is made: its memory is reused
        self.mixture = self.state.mixture(recycled=self.mixture)

    # ------------------------------------------------------------------- moves
    def apply_plan(self, plan: MovePlan, soft: SuffStats) -> Tensor:
        """Surgery on parameters, nets and optimiser state (identical on every rank);
        returns each old cluster's new row (:func:`~deepdpm_core.moves.surgery.apply_plan`)."""
        if plan.empty:
            return torch.arange(self.n_clusters)
        state, new_row = apply_plan(plan, self.state, self.nets, soft, self.prior_fit.prior, self.torch_gen)
        # anchors follow their cluster (−1 for a pruned one: the E-step searches afresh)
        self._adopt(wrapped(self.ctx, state, self.nets, None if self.anchors is None else new_row[self.anchors]))
        return new_row.cpu()

    def _move(self, move: str, soft: SuffStats, sub: SuffStats) -> tuple[int, int, int]:
        """A ``move`` ("split" or "merge") round (collective); returns the splits (births
        included), the merges accepted and the clusters pruned (too small to keep)."""
        plan = decide_moves(self.ctx, self.config, move, sub, self.state, self.anchors, self.prior_fit, self.rng,
                            self.epoch)
        unsplit = [k for k in range(self.n_clusters) if k not in plan.splits and k not in plan.prunes]
        new_row = self.apply_plan(plan, soft)
        born = 0
        if move == "split":
            model, born = self.body.after_split(self._model(), [int(new_row[k]) for k in unsplit],
                                                self.prior_fit, self.torch_gen)
            self._adopt(model)
        return len(plan.splits) + born, len(plan.merges), len(plan.prunes)

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
        soft, sub, losses = self.run_epoch(seconds=phases)
        t_mstep = device_clock(self.device)
        # the statistics (and the all-reduce) run on to the M-step, so the phases add up to
        # the epoch's seconds even when the process waits for a core between two clock reads
        phases["stats"] = (t_mstep - t0) - phases["estep"] - phases["train"]
        if not self.schedule.frozen(epoch):
            self.m_step(soft, sub)
        t_moves = device_clock(self.device)
        splits = merges = prunes = 0
        move = self.schedule.move_at(epoch)
        if move is not None:
            splits, merges, prunes = self._move(move, soft, sub)
            self.schedule.moved(epoch, splits + merges, self.n_clusters)
        final = self._settle(epoch) if self.schedule.finished(epoch) else {}
        prunes += final.pop("prunes", 0)
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
            # clusters removed without a merge (too small in a move round, empty at the
            # end): with the splits and merges, every change of K a record shows
            "prunes": prunes,
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
            # what the live schedule says after this epoch (a grown partition searches on),
            # so that whoever reads the records need not replay the schedule
            "stop_reason": self.schedule.stop_reason(epoch),
            "converged": self.schedule.converged(),
        }
        self.history.append(record)
        self.epoch += 1
        for callback in on_epoch:
            callback(record)
        return record

    def _settle(self, epoch: int) -> dict:
        """Where the search settled after epoch ``epoch`` (1-based): what the epoch body
        adds (:meth:`~deepdpm_core.training.epoch_body.EpochBody.settle`; a grown partition
        restarts the schedule), then K becomes the clusters that own points. Returns the
        record's entries (``prunes``: the clusters dropped for owning none)."""
        settled = self.body.settle(self._model(), self.prior_fit, self.rng, self.torch_gen,
                                   epoch < self.schedule.schedule.max_epochs, self.schedule.growths)
        self._adopt(settled.model)
        if settled.grown:
            self.schedule.restart(epoch)  # settled far below the model's answer: search again
            return settled.record
        empty = unowned_clusters(self.ctx, self.nets.cluster, self.n_clusters)
        if empty and len(empty) < self.n_clusters:
            self.apply_plan(MovePlan(prunes=empty), SuffStats.zeros(self.n_clusters, self.dim, device=self.device))
            return {**settled.record, "prunes": len(empty)}
        return settled.record

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
        """Everything a fit needs to resume (tensors and plain containers only,
        :mod:`~deepdpm_core.training.resume`); also a model file's dict, which
        :class:`~deepdpm_core.model.fitted_model.FittedModel` reads."""
        return {"config": self.config.to_dict(), "dim": self.coords.n_features, "n_total": self.n_total,
                "coordinates": self.coords.state_dict(), **self.prior_fit.state_dict(), "epoch": self.epoch,
                **self.schedule.counters(), "history": list(self.history),
                **model_state(self.state, self.nets, self.rng, self.torch_gen)}

    def resume(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` output, a state of this trainer's rows.

        Raises
        ------
        CheckpointError
            The rows have another row count or mean than the state's, or ``state`` lacks a
            key a trainer's state holds.
        """
        try:
            check_same_data(self.ctx, state)
            self.epoch, self.history = int(state["epoch"]), list(state["history"])
            self.resumed_from = self.epoch
            self.schedule.restore(state)
            self.prior_fit.restore(state)
            mixture, nets = restore_model(self.ctx, self.config, state, self.rng, self.torch_gen)
        except KeyError as exc:  # e.g. a model file, which keeps neither Adam's moments nor the generators
            raise CheckpointError(f"a DeepDPM checkpoint without the key {exc}: not a fit's resume state") from None
        self._adopt(wrapped(self.ctx, mixture, nets, None))


def start_fit(config: Config, rows: np.ndarray, *, comm: Communicator | None = None,
              wrap: Callable[[nn.Module], nn.Module] | None = None,
              state: dict[str, Any] | None = None) -> Trainer:
    """The trainer of a fit of ``rows``, fresh or resuming ``state``: how the estimator and
    every fit mode of the pipeline start a fit.

    Parameters
    ----------
    config : Config
    rows : ndarray of shape (N_local, D)
        This rank's rows, checked; the trainer reads them through a read-only view.
    comm, wrap : optional
        A data-parallel fit's communicator and net wrapper (:class:`Trainer`).
    state : dict, optional
        A checkpoint's :meth:`Trainer.state_dict`, of these rows, to resume from.

    Raises
    ------
    CheckpointError
        The rows are not the state's (:meth:`Trainer.resume`).
    """
    x = readonly_tensor(rows)
    if state is not None and x.shape[1] != state.get("dim", x.shape[1]):
        raise CheckpointError(f"the checkpoint was trained on {state['dim']}-D rows, these have {x.shape[1]}")
    trainer = Trainer(config, x, comm, wrap)
    if state is not None:
        trainer.resume(state)
    return trainer
