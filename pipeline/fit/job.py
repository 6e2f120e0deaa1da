"""One fit's assembly, the same in every fit mode (local, each Ray worker, each alternation
round, the demo): the trainer on this rank's rows, fresh or resumed from a checkpoint, the
per-epoch callbacks of every fit (label scores, tracking and diagnostics), the epochs with
what the mode adds (:class:`~pipeline.fit.runner.FitHooks`), and the fitted model. The modes
differ in where the rows come from and where the outputs go."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.config import Config
from deepdpm_core.data import readonly_tensor
from deepdpm_core.model import DeepDPM
from deepdpm_core.runtime import Communicator
from deepdpm_core.training import Trainer
from pipeline.fit.runner import FitHooks, data_variance_summary, epoch_callbacks, run_epochs


class FitJob:
    """A fit of ``rows`` under ``config`` on this rank.

    Parameters
    ----------
    config : Config
    rows : ndarray of shape (N_local, D)
        This rank's rows, checked.
    state : dict, optional
        A checkpoint's trainer state to resume from (:meth:`Trainer.from_state`).
    comm, wrap : optional
        A data-parallel fit's communicator and net wrapper (:class:`Trainer`).

    Attributes
    ----------
    trainer : Trainer
    resumed_from : int or None
        The epoch the fit resumed from.
    """

    def __init__(self, config: Config, rows: np.ndarray, *, state: dict[str, Any] | None = None, comm: Communicator | None = None,
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self._start = time.perf_counter()
        x = readonly_tensor(rows)
        self.trainer = Trainer(config, x, comm, wrap) if state is None \
            else Trainer.from_state(state, x, comm, wrap, config=config)
        self.resumed_from = None if state is None else self.trainer.epoch
        self._before = sum(record["seconds"] for record in self.trainer.history)

    def run(self, hooks: FitHooks, tracker: Any = None, scores: Any = None,
            init_labels: torch.Tensor | None = None) -> float:
        """Run the fit's remaining epochs (:func:`~pipeline.fit.runner.run_epochs`) and
        return the fit's seconds, those before a resume included.

        Parameters
        ----------
        hooks : FitHooks
            What the mode adds; every fit's per-epoch callbacks go ahead of its ``on_epoch``.
        tracker : pipeline.tracking.run_tracker.RunTracker, optional
            Logs each epoch's record (with the diagnostics); None: this rank logs none.
        scores : EpochLabelScores, optional
            Per-epoch NMI/ARI/ACC on labelled rows, added to each record before it is logged.
        init_labels : Tensor of shape (N_local,), optional
            A warm start (the alternation's previous clusters).
        """
        on_epoch = epoch_callbacks(self.trainer, tracker, scores) if tracker is not None else []
        run_epochs(self.trainer, replace(hooks, on_epoch=[*on_epoch, *hooks.on_epoch]), init_labels)
        return self._before + time.perf_counter() - self._start

    def model(self) -> DeepDPM:
        """The fitted estimator (:meth:`DeepDPM.from_trainer`)."""
        return DeepDPM.from_trainer(self.trainer)

    def variance(self) -> dict[str, float]:
        """:func:`~pipeline.fit.runner.data_variance_summary` of the rows fitted."""
        return data_variance_summary(self.trainer)


__all__ = ["FitJob"]
