"""The one epoch loop of every fit: local, each Ray worker, each alternation round.

:func:`run_epochs` runs :meth:`Search.fit <deepdpm_core.training.search.Search.fit>` with one
list of per-epoch callbacks: label scores first, then tracking and diagnostics
(:func:`epoch_callbacks`), progress, then what a mode adds: a Ctrl-C's stop request
(:func:`stop_on`, honoured at an epoch's end, so the search is left whole for a
checkpoint), checkpoints and the cross-rank checksum (:func:`every`) and, in tests only,
fault injection (:func:`fault_before_next`) (docs/design.md, "Fit modes").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.config import Config
from deepdpm_core.model import variance_summary
from deepdpm_core.runtime import Communicator
from deepdpm_core.training import EpochCallback, Search, start_fit
from pipeline.fit.interrupts import FitInterrupted, StopRequest
from pipeline.tracking.fit_runs import epoch_callback, log_fit_start

#: test-only crash injection: called with (epochs done, rank) before each epoch
FaultHook = Callable[[int, int], None]
#: a context that yields a per-epoch callback drawing progress (or None)
ProgressFactory = Callable[[Search], AbstractContextManager]
#: epochs between the cross-rank model checksums of a data-parallel fit (one 16-byte
#: all-reduce each)
CONSISTENCY_EVERY = 5


def start_job(config: Config, rows: np.ndarray, tracker: Any, source: str | Path | None, *,
              shape: tuple[int, int] | None = None, num_workers: int = 1,
              state: dict[str, Any] | None = None, comm: Communicator | None = None,
              wrap: Callable[[nn.Module], nn.Module] | None = None, command: str = "fit",
              **params: Any) -> Search:
    """Start a fit of ``rows`` (this rank's) as every fit mode and the demo does: the
    search, fresh or resuming ``state`` (:func:`~deepdpm_core.training.start_fit`, with
    ``comm`` and ``wrap``; it checks a single process's rows), and the run's params and tags
    (:func:`~pipeline.tracking.fit_runs.log_fit_start`, with ``source``, ``num_workers``,
    ``command``, ``params`` and ``shape``, all ranks' rows, by default ``rows.shape``).

    Raises
    ------
    DeepDPMError
        Bad rows, or a checkpoint of other rows (decided from global quantities: the same
        on every rank).
    """
    search = start_fit(config, rows, comm=comm, wrap=wrap, state=state)
    log_fit_start(tracker, config, shape or rows.shape, source, num_workers=num_workers,
                  resumed_from=search.resumed_from, command=command, **params)
    return search


def run_epochs(search: Search, callbacks: list[EpochCallback], tracker: Any = None, scores: Any = None,
               init_labels: torch.Tensor | None = None, progress: ProgressFactory | None = None) -> float:
    """Run ``search``'s remaining epochs (:meth:`Search.fit`, initialising it unless it was
    restored from a checkpoint) with every fit's per-epoch callbacks
    (:func:`epoch_callbacks`), the ``progress`` bar's, then what the mode adds
    (``callbacks``: e.g. :func:`stop_on`, :func:`every`, :func:`fault_before_next`); return
    the fit's seconds, those before a resume included.

    Parameters
    ----------
    search : Search
    callbacks : list of callables
    tracker : pipeline.tracking.run_tracker.RunTracker, optional
        Logs each epoch's record (with the diagnostics); None: this rank logs none.
    scores : EpochLabelScores, optional
        Per-epoch NMI/ARI/ACC on labelled rows, added to each record before it is logged.
    init_labels : Tensor of shape (N_rank,), optional
        Warm start for :meth:`Search.initialize` (the alternation's previous clusters).
    progress : callable, optional
        ``progress(search)``: a context manager yielding a per-epoch callback or None.

    Raises
    ------
    FitInterrupted
        A :func:`stop_on` callback's stop was requested: the search stands at the end of
        an epoch.
    """
    start = time.perf_counter()
    before = sum(record["seconds"] for record in search.history)
    logged = epoch_callbacks(search, tracker, scores) if tracker is not None else []
    with progress(search) if progress else contextlib.nullcontext() as show:
        search.fit(init_labels, [*logged, *([show] if show else []), *callbacks])
    return before + time.perf_counter() - start


def stop_on(stop: StopRequest) -> EpochCallback:
    """A callback raising :class:`~pipeline.fit.interrupts.FitInterrupted` after the
    epoch in which ``stop`` was requested (honoured at an epoch's end, so the search is
    left whole for a checkpoint)."""
    def check(record: dict) -> None:
        if stop.requested:
            stop.honoured = True
            raise FitInterrupted
    return check


def every(search: Search, epochs: int, action: Callable[[Search], None], last: bool = False) -> list[EpochCallback]:
    """The callback running ``action(search)`` after every ``epochs``-th epoch but the
    last, and after the last too if ``last`` (a checkpoint is not written there: the fit's
    outputs follow; a consistency check is, as that epoch pruned the clusters that own no
    point), as a list: empty for ``epochs`` 0."""
    def maybe(record: dict) -> None:
        if (last and search.finished) or (not search.finished and search.epoch % epochs == 0):
            action(search)
    return [maybe] if epochs else []


def fault_before_next(search: Search, fault: FaultHook | None, rank: int = 0) -> list[EpochCallback]:
    """Test-only crash injection: ``fault(epochs done, rank)`` after each epoch but the
    last, i.e. before the next one."""
    def inject(record: dict) -> None:
        if not search.finished:
            fault(search.epoch, rank)
    return [inject] if fault is not None else []


def data_variance_summary(search: Search) -> dict[str, float]:
    """``median_feature_variance`` and ``feature_variance_ratio`` (largest over median) of
    the data being fitted (:func:`deepdpm_core.model.diagnostics.variance_summary`), from
    the search's global moments: the same on every rank, in the (transformed) features'
    units the prior is given in. Kept in ``summary.json`` for the report's diagnostics."""
    return variance_summary(search.feature_variance.cpu().numpy())


class SearchPredictor:
    """``predict`` with the partition a search holds as it stands: each row's most likely
    cluster under its mixture, found by the fit's own E-step search (what
    :class:`pipeline.fit.epoch_scores.EpochLabelScores` scores after each epoch).

    Not the clustering net's argmax: a small-data fit searches by exact EM and fits the net
    to the mixture only once K has settled, so until its last epoch the net's argmax scores
    the untrained net (NMI 0.23 on digits at K = 11, then 0.77 at the end). The mixture is
    what K counts in every fit mode, and what the net is fitted to.
    """

    def __init__(self, search: Search) -> None:
        self.search = search

    @torch.no_grad()
    def predict(self, X: Any) -> np.ndarray:
        """Hard cluster of each raw row of X (N, D); shape (N,)."""
        search = self.search
        x = search.coords.apply(torch.as_tensor(X).to(search.device)).to(torch.float32)  # as the fit's rows
        return search.estep.targets(search.mixture, x, None)[2].cpu().numpy()


def epoch_callbacks(search: Search, tracker: Any, scores: Any = None) -> list[EpochCallback]:
    """The per-epoch callbacks of every fit mode, in their order.

    Parameters
    ----------
    search : Search
    tracker : pipeline.tracking.run_tracker.RunTracker
        Logs each record and prints the diagnostics' warnings.
    scores : EpochLabelScores, optional
        Per-epoch NMI/ARI/ACC on labelled rows; bound to ``search`` here, and run
        first so the tracker logs its keys.
    """
    callbacks: list[EpochCallback] = []
    if scores is not None:
        scores.bind(SearchPredictor(search))
        callbacks.append(scores)
    variances = data_variance_summary(search)
    callbacks.append(epoch_callback(tracker, search.config, variances["feature_variance_ratio"]))
    return callbacks


__all__ = ["CONSISTENCY_EVERY", "FaultHook", "ProgressFactory", "SearchPredictor", "data_variance_summary",
           "epoch_callbacks", "every", "fault_before_next", "run_epochs", "start_job", "stop_on"]
