"""The one epoch loop of every fit: local, each Ray worker, each alternation round.

:func:`run_epochs` runs :meth:`Trainer.fit <deepdpm_core.training.trainer.Trainer.fit>` with
the trainer's hooks (:func:`epoch_hooks`) built from what a mode adds, a :class:`FitHooks`:
per-epoch callbacks (label scores first, then tracking and diagnostics:
:func:`epoch_callbacks`), checkpoints, the cross-rank checksum, progress, a Ctrl-C's stop
request (honoured at an epoch's end, so the trainer is left whole for a checkpoint) and,
in tests only, fault injection (docs/design.md, "Fit modes").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.config import Config
from deepdpm_core.model import variance_summary
from deepdpm_core.runtime import Communicator
from deepdpm_core.training import EpochHooks, Trainer, start_fit
from pipeline.fit.interrupts import FitInterrupted, StopRequest
from pipeline.tracking.fit_runs import epoch_callback, log_fit_start

#: a per-epoch callback on the epoch record (it may add keys to it)
EpochCallback = Callable[[dict], None]
#: test-only crash injection: called with (epochs done, rank) before each epoch
FaultHook = Callable[[int, int], None]
#: a context that yields a per-epoch callback drawing progress (or None)
ProgressFactory = Callable[[Trainer], AbstractContextManager]
#: epochs between the cross-rank model checksums of a data-parallel fit (one 16-byte
#: all-reduce each)
CONSISTENCY_EVERY = 5


@dataclass
class FitHooks:
    """What a fit mode adds around the epochs of :func:`run_epochs`.

    Attributes
    ----------
    on_epoch : list of callables
        Called with each epoch's record, in order, while the loop runs.
    checkpoint : callable, optional
        ``checkpoint(trainer)``, every ``checkpoint_every`` epochs (0: never).
    checkpoint_every : int
    consistency_every : int
        Epochs between cross-rank consistency checks (0: never); with any value, one
        more check follows the last epoch.
    progress : callable, optional
        ``progress(trainer)``: a context manager yielding a per-epoch callback or None.
    fault : callable, optional
        Test-only crash injection, ``fault(epoch, rank)`` before each epoch.
    stop : StopRequest, optional
        Checked after each epoch: once ``requested``, :func:`run_epochs` raises
        :class:`~pipeline.fit.interrupts.FitInterrupted`.
    rank : int
        This process's rank (what ``fault`` is told).
    """

    on_epoch: list[EpochCallback] = field(default_factory=list)
    checkpoint: Callable[[Trainer], None] | None = None
    checkpoint_every: int = 0
    consistency_every: int = 0
    progress: ProgressFactory | None = None
    fault: FaultHook | None = None
    stop: StopRequest | None = None
    rank: int = 0


def start_job(config: Config, rows: np.ndarray, tracker: Any, source: str | Path | None, *,
              shape: tuple[int, int] | None = None, num_workers: int = 1,
              state: dict[str, Any] | None = None, comm: Communicator | None = None,
              wrap: Callable[[nn.Module], nn.Module] | None = None, command: str = "fit",
              **params: Any) -> Trainer:
    """Start a fit of ``rows`` (this rank's, checked) as every fit mode and the demo does:
    the trainer, fresh or resuming ``state`` (:func:`~deepdpm_core.training.start_fit`, with
    ``comm`` and ``wrap``), and the run's params and tags
    (:func:`~pipeline.tracking.fit_runs.log_fit_start`, with ``source``, ``num_workers``,
    ``command``, ``params`` and ``shape``, all ranks' rows, by default ``rows.shape``).

    Raises
    ------
    DeepDPMError
        Bad rows, or a checkpoint of other rows (decided from global quantities: the same
        on every rank).
    """
    trainer = start_fit(config, rows, comm=comm, wrap=wrap, state=state)
    log_fit_start(tracker, config, shape or rows.shape, source, num_workers=num_workers,
                  resumed_from=trainer.resumed_from, command=command, **params)
    return trainer


def run_epochs(trainer: Trainer, hooks: FitHooks, tracker: Any = None, scores: Any = None,
               init_labels: torch.Tensor | None = None) -> float:
    """Run ``trainer``'s remaining epochs (:meth:`Trainer.fit`, initialising it unless it
    was restored from a checkpoint) with every fit's per-epoch callbacks
    (:func:`epoch_callbacks`) ahead of what the mode adds, inside the mode's progress bar;
    return the fit's seconds, those before a resume included.

    Parameters
    ----------
    trainer : Trainer
    hooks : FitHooks
    tracker : pipeline.tracking.run_tracker.RunTracker, optional
        Logs each epoch's record (with the diagnostics); None: this rank logs none.
    scores : EpochLabelScores, optional
        Per-epoch NMI/ARI/ACC on labelled rows, added to each record before it is logged.
    init_labels : Tensor of shape (N_rank,), optional
        Warm start for :meth:`Trainer.initialize` (the alternation's previous clusters).

    Raises
    ------
    FitInterrupted
        ``hooks.stop`` was requested: the trainer stands at the end of an epoch.
    """
    start = time.perf_counter()
    before = sum(record["seconds"] for record in trainer.history)
    on_epoch = [*(epoch_callbacks(trainer, tracker, scores) if tracker is not None else []),
                *hooks.on_epoch]
    with hooks.progress(trainer) if hooks.progress else contextlib.nullcontext() as show:
        trainer.fit(init_labels, epoch_hooks(hooks, [*on_epoch, *([show] if show else [])]))
    return before + time.perf_counter() - start


def epoch_hooks(hooks: FitHooks, on_epoch: list[EpochCallback]) -> EpochHooks:
    """The trainer's hooks of a mode's ``hooks``: the per-epoch callbacks ``on_epoch``;
    after each epoch the stop request, then, unless it was the last, the consistency check
    and the checkpoint; the consistency check once more after the last epoch (it pruned
    the clusters that own no point)."""
    after: list[Callable[[Trainer], None]] = []
    if hooks.stop is not None:
        after.append(lambda trainer: _stop_if_requested(hooks.stop))
    if hooks.consistency_every:
        after.append(_every(hooks.consistency_every, lambda trainer: trainer.check_consistency()))
    if hooks.checkpoint and hooks.checkpoint_every:
        after.append(_every(hooks.checkpoint_every, hooks.checkpoint))
    fault = hooks.fault
    return EpochHooks(
        on_epoch=on_epoch,
        before_epoch=[lambda trainer: fault(trainer.epoch, hooks.rank)] if fault is not None else [],
        after_epoch=after,
        after_fit=[lambda trainer: trainer.check_consistency()] if hooks.consistency_every else [],
    )


def _stop_if_requested(stop: StopRequest) -> None:
    if stop.requested:
        stop.honoured = True
        raise FitInterrupted


def _every(epochs: int, action: Callable[[Trainer], None]) -> Callable[[Trainer], None]:
    """``action`` after every ``epochs``-th epoch but the last (the fit's outputs follow it)."""
    def maybe(trainer: Trainer) -> None:
        if not trainer.finished and trainer.epoch % epochs == 0:
            action(trainer)
    return maybe


def data_variance_summary(trainer: Trainer) -> dict[str, float]:
    """``median_feature_variance`` and ``feature_variance_ratio`` (largest over median) of
    the data being fitted (:func:`deepdpm_core.model.diagnostics.variance_summary`), from
    the trainer's global moments: the same on every rank, in the (transformed) features'
    units the prior is given in. Kept in ``summary.json`` for the report's diagnostics."""
    return variance_summary(trainer.feature_variance.cpu().numpy())


class TrainerModel:
    """``predict`` with the partition a trainer holds as it stands: each row's most likely
    cluster under its mixture, found by the fit's own E-step search (what
    :class:`pipeline.fit.epoch_scores.EpochLabelScores` scores after each epoch).

    Not the clustering net's argmax: a small-data fit searches by exact EM and fits the net
    to the mixture only once K has settled, so until its last epoch the net's argmax scores
    the untrained net (NMI 0.23 on digits at K = 11, then 0.77 at the end). The mixture is
    what K counts in every fit mode, and what the net is fitted to.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @torch.no_grad()
    def predict(self, X: Any) -> np.ndarray:
        """Hard cluster of each raw row of X (N, D); shape (N,)."""
        trainer = self.trainer
        x = trainer.coords.apply(torch.as_tensor(X).to(trainer.device)).to(torch.float32)  # as the fit's rows
        return trainer.estep.targets(trainer.mixture, x, None)[2].cpu().numpy()


def epoch_callbacks(trainer: Trainer, tracker: Any, scores: Any = None) -> list[EpochCallback]:
    """The per-epoch callbacks of every fit mode, in their order.

    Parameters
    ----------
    trainer : Trainer
    tracker : pipeline.tracking.run_tracker.RunTracker
        Logs each record and prints the diagnostics' warnings.
    scores : EpochLabelScores, optional
        Per-epoch NMI/ARI/ACC on labelled rows; bound to ``trainer`` here, and run
        first so the tracker logs its keys.
    """
    callbacks: list[EpochCallback] = []
    if scores is not None:
        scores.bind(TrainerModel(trainer))
        callbacks.append(scores)
    variances = data_variance_summary(trainer)
    callbacks.append(epoch_callback(tracker, trainer.config, variances["feature_variance_ratio"]))
    return callbacks


__all__ = ["CONSISTENCY_EVERY", "EpochCallback", "FaultHook", "FitHooks", "ProgressFactory",
           "TrainerModel", "data_variance_summary", "epoch_callbacks", "epoch_hooks",
           "run_epochs", "start_job"]
