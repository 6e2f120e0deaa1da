"""The epoch loop: the trainer, exact EM on small data, the nets' optimisers, progress
bars, rank consistency and the resume format."""

from deepdpm_core.training.batching import auto_batch_size
from deepdpm_core.training.hooks import EpochHooks
from deepdpm_core.training.progress import epoch_bar
from deepdpm_core.training.trainer import Trainer, start_fit

__all__ = [
    "auto_batch_size", "epoch_bar", "EpochHooks", "start_fit", "Trainer"
]
