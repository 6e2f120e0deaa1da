"""What a caller adds around the epochs of :meth:`~deepdpm_core.training.trainer.Trainer.fit`,
the one epoch loop of every fit (the estimator's, and each fit mode of the pipeline)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: called with each epoch's history record (it may add keys to it)
RecordCallback = Callable[[dict[str, Any]], None]
#: called with the trainer (:class:`~deepdpm_core.training.trainer.Trainer`) between epochs
TrainerCallback = Callable[[Any], None]


@dataclass
class EpochHooks:
    """Callbacks of :meth:`~deepdpm_core.training.trainer.Trainer.fit`, each list in order.

    Attributes
    ----------
    on_epoch : list of callables
        ``f(record)`` with each epoch's history record, inside the epoch (on every rank:
        a callback that logs or draws decides by rank itself).
    before_epoch : list of callables
        ``f(trainer)`` before each epoch.
    after_epoch : list of callables
        ``f(trainer)`` after each epoch, the last one included (``trainer.finished`` tells);
        an exception stops the loop with the trainer whole at that epoch's end.
    after_fit : list of callables
        ``f(trainer)`` once the schedule has stopped the fit.
    """

    on_epoch: list[RecordCallback] = field(default_factory=list)
    before_epoch: list[TrainerCallback] = field(default_factory=list)
    after_epoch: list[TrainerCallback] = field(default_factory=list)
    after_fit: list[TrainerCallback] = field(default_factory=list)
