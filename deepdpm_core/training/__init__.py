"""The epoch loop: the trainer, exact EM on small data, the nets' optimisers, progress
bars, rank consistency and the resume format."""

from deepdpm_core.training.batching import auto_batch_size
from deepdpm_core.training.hooks import EpochHooks
from deepdpm_core.training.progress import epoch_updater
from deepdpm_core.training.trainer import Trainer

__all__ = [
    "auto_batch_size", "epoch_updater", "EpochHooks", "Trainer"
]
