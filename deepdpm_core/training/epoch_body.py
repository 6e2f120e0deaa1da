"""What runs between a fit's E-step and its M-step, chosen once a fit: the nets' minibatch
steps (:class:`~deepdpm_core.training.minibatch_epoch.MinibatchEpochs`) or, on small data,
exact EM (:class:`~deepdpm_core.training.em_epoch.ExactEM`), which also owns what a
small-data search adds: births in split rounds, and polish, growth and the net's
distillation where the search settles."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from deepdpm_core.bayes import PriorFit, SuffStats
from deepdpm_core.config import ScheduleConfig
from deepdpm_core.training.search_model import SearchModel

Tensor = torch.Tensor


class EpochStatistics(NamedTuple):
    """One epoch's statistics, reduced over all ranks.

    Attributes
    ----------
    soft : SuffStats
        K rows, the soft cluster statistics.
    sub : SuffStats
        2K rows (cluster k's subclusters at 2k, 2k + 1), hard counts.
    losses : dict of str to float
        ``loss_cluster`` and ``loss_subcluster``, means over the rows.
    train_seconds : float
        Spent on the nets' steps.
    """

    soft: SuffStats
    sub: SuffStats
    losses: dict[str, float]
    train_seconds: float


class Settled(NamedTuple):
    """Where a search settled (:meth:`EpochBody.settle`).

    Attributes
    ----------
    record : dict
        Entries of the last epoch's history record.
    model : SearchModel
        The model to go on with.
    grown : bool
        The model is a grown partition: the search starts again from it.
    """

    record: dict[str, Any]
    model: SearchModel
    grown: bool = False


class EpochBody(Protocol):
    """The part of an epoch that differs between the nets' minibatch steps and exact EM;
    every method is collective."""

    def schedule(self, config: ScheduleConfig) -> ScheduleConfig:
        """The schedule this kind of epoch runs."""

    def statistics(self, model: SearchModel, candidates: Tensor, resp: Tensor, epoch: int,
                   train: bool) -> EpochStatistics:
        """Train on the E-step targets ``candidates`` and ``resp`` ((N_local, m) each) of
        epoch ``epoch`` (0-based; the nets are left as they are unless ``train``) and
        return the epoch's statistics."""

    def after_split(self, model: SearchModel, unsplit: list[int], prior_fit: PriorFit,
                    torch_gen: torch.Generator) -> tuple[SearchModel, int]:
        """After a split round: the model, and the splits added to those of the round
        (``unsplit``: the clusters whose split was not taken)."""

    def settle(self, model: SearchModel, prior_fit: PriorFit, rng, torch_gen: torch.Generator,
               may_grow: bool, growths: int) -> Settled:
        """Where the search settles, at the last epoch of the schedule (``may_grow``:
        before ``max_epochs``; ``growths``: the fit's growths so far)."""
