"""The epoch loop: the trainer, exact EM on small data, the nets' optimisers, progress
bars, rank consistency and the resume format."""

from deepdpm_core.training.batching import adam, auto_batch_size, scaled_lr
from deepdpm_core.training.hooks import EpochHooks
from deepdpm_core.training.progress import epoch_updater, progress_bar
from deepdpm_core.training.small_data import distil, exact_statistics
from deepdpm_core.training.trainer import EPOCH_PHASES, Trainer

__all__ = [
    "adam", "auto_batch_size", "distil", "EPOCH_PHASES", "EpochHooks", "epoch_updater", "exact_statistics",
    "progress_bar", "scaled_lr", "Trainer"
]
