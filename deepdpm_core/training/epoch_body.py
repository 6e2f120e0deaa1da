"""What runs between a fit's E-step and its M-step, chosen once a fit: the nets' minibatch
steps (:class:`~deepdpm_core.training.minibatch_epoch.MinibatchEpochs`) or, on small data,
exact EM (:class:`~deepdpm_core.training.em_epoch.ExactEM`), which also owns what a
small-data search adds: births in split rounds, and polish, growth and the net's
distillation where the search settles."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from deepdpm_core.bayes import PriorFit, SuffStats
from deepdpm_core.config import Config, ScheduleConfig
from deepdpm_core.moves import FREEZE_EPOCHS
from deepdpm_core.training.fit_context import FitContext
from deepdpm_core.training.search_model import SearchModel

Tensor = torch.Tensor


class EpochStatistics(NamedTuple):
    """One epoch's statistics over all ranks: ``soft`` (K rows, soft), ``sub`` (2K rows,
    cluster k's subclusters at 2k, 2k + 1, hard), the mean ``losses`` (``loss_cluster``,
    ``loss_subcluster``) and the seconds of the nets' steps."""

    soft: SuffStats
    sub: SuffStats
    losses: dict[str, float]
    train_seconds: float


class Settled(NamedTuple):
    """Where a search settled: entries of the last epoch's history ``record``, the
    ``model`` to go on with, and whether it is a ``grown`` partition to search again from."""

    record: dict[str, Any]
    model: SearchModel
    grown: bool = False


class EpochBody:
    """The part of an epoch that differs between the kinds of search; every method is
    collective. A subclass gives :meth:`statistics`; the others default to a search with
    nothing to add.

    Parameters
    ----------
    ctx : FitContext
    config : Config
    """

    #: epochs without M-step or moves after an accepted move, while the nets learn the new
    #: clusters (:data:`~deepdpm_core.moves.FREEZE_EPOCHS`)
    freeze_epochs = FREEZE_EPOCHS

    def __init__(self, ctx: FitContext, config: Config) -> None:
        self.ctx, self.config = ctx, config

    def schedule(self, config: ScheduleConfig) -> ScheduleConfig:
        """The schedule this kind of epoch runs: ``config``."""
        return config

    def statistics(self, model: SearchModel, candidates: Tensor, resp: Tensor, epoch: int) -> EpochStatistics:
        """Train on the E-step targets ``candidates`` and ``resp`` ((N_local, m) each) of
        epoch ``epoch`` (0-based) and return the epoch's statistics."""
        raise NotImplementedError

    def after_split(self, model: SearchModel, unsplit: list[int], prior_fit: PriorFit,
                    torch_gen: torch.Generator) -> tuple[SearchModel, int]:
        """After a split round: the model, and the splits added to those of the round
        (``unsplit``: the clusters whose split was not taken); none here."""
        return model, 0

    def settle(self, model: SearchModel, prior_fit: PriorFit, rng: np.random.Generator,
               torch_gen: torch.Generator, may_grow: bool, growths: int) -> Settled:
        """Where the search settles at the schedule's end (``may_grow``: before
        ``max_epochs``; ``growths``: the fit's growths so far): where it is, here."""
        return Settled({}, model)
