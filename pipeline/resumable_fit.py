"""A single-process ``deepdpm fit`` that can be stopped and resumed (no Ray).

``deepdpm fit --checkpoint-every N`` without ``--num-workers`` >= 2 or ``--ray-address``
trains in the calling process and keeps, beside the outputs:

``OUT/fit_request.json``
    the request (:class:`pipeline.ray_fit.FitRequest` with ``in_process`` set), so
    ``deepdpm fit --resume OUT`` continues the run as it was started;
``OUT/checkpoints/epoch_EEEEEE.pt``
    a checkpoint every N epochs, in the format of the Ray fit's checkpoints and of
    ``model.pt`` (:class:`~deepdpm_core.estimator.DeepDPM`'s: nets, optimisers, NIW
    parameters, K, epoch, history, the numpy and torch generator states, config), each
    written atomically; the last :data:`CHECKPOINTS_KEPT` are kept.

A resumed fit restores the latest checkpoint through the one safe loader
(:func:`deepdpm_core.checkpoints.safe_load`) and runs the remaining epochs exactly as the
uninterrupted fit would have: every random draw of an epoch comes from the stored
generators or from seeds fixed by (seed, epoch), so K, the losses, the moves and the
labels are the same (tested by killing a real ``deepdpm fit`` with SIGKILL).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core.checkpoints import safe_load
from deepdpm_core.config import Config
from deepdpm_core.errors import CheckpointError
from deepdpm_core.estimator import FORMAT
from deepdpm_core.progress import epoch_updater, progress_bar
from deepdpm_core.trainer import Trainer
from deepdpm_core.validation import readonly_tensor
from pipeline.io import atomic_path

CHECKPOINT_DIR = "checkpoints"
#: checkpoints kept (older ones are removed once a newer one is written), as on Ray
CHECKPOINTS_KEPT = 2
_NAME = re.compile(r"epoch_(\d+)\.pt")


def checkpoint_paths(out: str | Path) -> list[Path]:
    """The checkpoints in ``out``, oldest first."""
    folder = Path(out) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def has_local_checkpoints(out: str | Path) -> bool:
    """True when ``out`` holds checkpoints of a single-process fit."""
    return bool(checkpoint_paths(out))


def remove_checkpoints(out: str | Path) -> None:
    """Drop the checkpoints of an earlier fit (``--overwrite``)."""
    shutil.rmtree(Path(out) / CHECKPOINT_DIR, ignore_errors=True)


def latest_state(out: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint's trainer state, or None when there is none yet.

    Raises
    ------
    CheckpointError
        The file is unreadable, unsafe (a pickle referencing Python globals) or not a
        DeepDPM checkpoint.
    """
    paths = checkpoint_paths(out)
    if not paths:
        return None
    state = safe_load(paths[-1])
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{paths[-1]} is not a DeepDPM checkpoint ({FORMAT})")
    return state


def write_checkpoint(trainer: Trainer, out: str | Path) -> Path:
    """Write the trainer's state atomically, then keep only the newest
    :data:`CHECKPOINTS_KEPT` (and no temporary file a killed write left behind)."""
    folder = Path(out) / CHECKPOINT_DIR
    path = folder / f"epoch_{trainer.epoch:06d}.pt"
    with atomic_path(path) as tmp:
        torch.save({"format": FORMAT, **trainer.state_dict()}, tmp)
    for old in checkpoint_paths(out)[:-CHECKPOINTS_KEPT]:
        old.unlink(missing_ok=True)
    for stale in folder.glob(".epoch_*.tmp"):  # a write killed mid-way (SIGKILL skips cleanup)
        stale.unlink(missing_ok=True)
    return path


def start_trainer(config: Config, X: np.ndarray, state: dict[str, Any] | None) -> Trainer:
    """A fresh (initialised) trainer on ``X`` (N, D), or one restored from ``state``.

    Raises
    ------
    CheckpointError
        ``state`` was trained on other data (dimension, row count or mean).
    """
    x = readonly_tensor(X)
    if state is not None:
        return Trainer.from_state(state, x, config=config)
    trainer = Trainer(config, x)
    trainer.initialize()
    return trainer


class TrainerLabels:
    """``predict`` with a trainer's clustering net as it stands (what
    :class:`pipeline.epoch_scores.EpochLabelScores` scores after each epoch)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Hard cluster of each raw row of X (N, D); shape (N,)."""
        return self.trainer.predict_labels(torch.as_tensor(X)).numpy()


def train(trainer: Trainer, out: str | Path, checkpoint_every: int, progress: bool) -> None:
    """Run the remaining epochs (as :meth:`Trainer.fit`), checkpointing every
    ``checkpoint_every`` epochs (0: never) except after the last one."""
    sch = trainer.config.schedule
    with progress_bar(progress, total=sch.max_epochs, initial=trainer.epoch, desc="deepdpm fit",
                      unit="epoch") as bar:
        if bar is not None:
            show = epoch_updater(bar)
            trainer.callbacks.append(show)
        while trainer.epoch < sch.max_epochs and not trainer.converged:
            trainer.step_epoch()
            if trainer.epoch >= sch.max_epochs or trainer.converged:
                break
            if checkpoint_every and trainer.epoch % checkpoint_every == 0:
                write_checkpoint(trainer, out)
        if bar is not None:
            trainer.callbacks.remove(show)


__all__ = ["CHECKPOINTS_KEPT", "CHECKPOINT_DIR", "TrainerLabels", "checkpoint_paths", "has_local_checkpoints",
           "latest_state", "remove_checkpoints", "start_trainer", "train", "write_checkpoint"]
