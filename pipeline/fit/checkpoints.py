"""Every file a fit keeps to resume or to reuse, written atomically and read through the one
safe loader (:mod:`deepdpm_core.model.files`, which refuses a pickle that would run code).

``OUT/checkpoints/epoch_EEEEEE.pt`` (a fit in this process, the newest
:data:`CHECKPOINTS_KEPT` kept) and ``OUT/ray_train/checkpoint_*/model.pt`` (a Ray fit;
:func:`prune_checkpoints` removes orphans) hold a search's state in the model file format,
so a resumed fit runs its remaining epochs exactly as the uninterrupted fit would have.
Torch is imported on use, so ``deepdpm fit`` can look for checkpoints while it checks its
arguments.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepdpm_core.errors import CheckpointError, ConfigError
from pipeline.fit.request import REQUEST_FILE

if TYPE_CHECKING:
    from deepdpm_core.training import Search

CHECKPOINT_DIR = "checkpoints"
#: checkpoints kept (older ones are removed once a newer one is written), as on Ray
CHECKPOINTS_KEPT = 2
#: Ray Train's storage in the output folder
TRAIN_DIR = "ray_train"
#: the search state in a Ray Train checkpoint folder
CHECKPOINT_FILE = "model.pt"
_NAME = re.compile(r"epoch_(\d+)\.pt")


def read_search_state(path: str | Path) -> dict[str, Any]:
    """A search state written by :func:`write_search_state`.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    CheckpointError
        The file is unreadable, unsafe or not a DeepDPM checkpoint.
    """
    from deepdpm_core.model import FORMAT, safe_load

    state = safe_load(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a DeepDPM checkpoint ({FORMAT})")
    return state


def write_search_state(search: Search, path: str | Path, fit_id: str | None = None) -> Path:
    """Write the search's state (model file format) to ``path`` atomically, with the
    :attr:`~pipeline.fit.request.FitRequest.fit_id` of the fit it belongs to."""
    from deepdpm_core.model import FORMAT, save_checkpoint

    save_checkpoint({"format": FORMAT, "fit_id": fit_id, **search.state_dict()}, path)
    return Path(path)


def check_fit_id(state: dict[str, Any], fit_id: str | None, path: str | Path) -> dict[str, Any]:
    """``state`` when it is a checkpoint of the fit ``fit_id``.

    Raises
    ------
    CheckpointError
        It belongs to another fit (or to one of an older version, which recorded none).
    """
    if state.get("fit_id") != fit_id:
        raise CheckpointError(
            f"checkpoint {path} belongs to another fit than the {REQUEST_FILE} beside it: "
            "resuming would mix two fits; start afresh with --overwrite")
    return state


# ----------------------------------------------------------- a fit in this process
def checkpoint_paths(out: str | Path) -> list[Path]:
    """The checkpoints of a fit in this process in ``out``, oldest first."""
    folder = Path(out) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def remove_checkpoints(out: str | Path) -> None:
    """Drop the checkpoints of an earlier fit, of either mode (``--overwrite``)."""
    shutil.rmtree(Path(out) / CHECKPOINT_DIR, ignore_errors=True)
    shutil.rmtree(Path(out) / TRAIN_DIR, ignore_errors=True)


def latest_state(out: str | Path, fit_id: str | None) -> dict[str, Any] | None:
    """The newest local checkpoint's search state, checked to belong to the fit
    ``fit_id`` (:func:`check_fit_id`); None when there is none yet."""
    paths = checkpoint_paths(out)
    return check_fit_id(read_search_state(paths[-1]), fit_id, paths[-1]) if paths else None


def write_checkpoint(search: Search, out: str | Path, fit_id: str | None) -> Path:
    """Write the search's state as the newest local checkpoint of the fit ``fit_id``,
    then keep only the newest :data:`CHECKPOINTS_KEPT` (and no temporary file a killed
    write left behind)."""
    folder = Path(out) / CHECKPOINT_DIR
    path = write_search_state(search, folder / f"epoch_{search.epoch:06d}.pt", fit_id)
    for old in checkpoint_paths(out)[:-CHECKPOINTS_KEPT]:
        old.unlink(missing_ok=True)
    for stale in folder.glob(".epoch_*.tmp"):  # a write killed mid-way (SIGKILL skips cleanup)
        stale.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------ a Ray fit
def has_ray_checkpoints(out: str | Path) -> bool:
    """True when ``out`` holds the Ray Train checkpoints of a distributed fit."""
    return (Path(out) / TRAIN_DIR / "checkpoint_manager_snapshot.json").exists()


def refuse_earlier_checkpoints(out: str | Path) -> None:
    """A fresh fit never resumes another's checkpoints silently: ConfigError when ``out``
    holds those of a fit in this process or on Ray."""
    if has_ray_checkpoints(out) or checkpoint_paths(out):
        raise ConfigError(f"{out} holds checkpoints of an earlier fit: continue it with "
                          f"--resume {out}, start afresh with --overwrite, or choose another "
                          "--output")


def load_ray_checkpoint(checkpoint: Any, fit_id: str | None = None) -> dict[str, Any]:
    """The search state in a ``ray.train.Checkpoint``.

    Parameters
    ----------
    checkpoint : ray.train.Checkpoint
    fit_id : str, optional
        The fit the checkpoint must belong to (:func:`check_fit_id`); None: not checked.

    Raises
    ------
    CheckpointError
        The folder has no :data:`CHECKPOINT_FILE`, it is unsafe or not a checkpoint, or
        of another fit than ``fit_id``.
    """
    with checkpoint.as_directory() as path:
        try:
            state = read_search_state(Path(path) / CHECKPOINT_FILE)
            if fit_id is None:
                return state
            return check_fit_id(state, fit_id, Path(path) / CHECKPOINT_FILE)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} has no {CHECKPOINT_FILE}") from None


def checkpoint_dir_names(node: Any) -> list[str]:
    """Every ``checkpoint_dir_name`` value in a Ray Train checkpoint-manager snapshot."""
    if isinstance(node, dict):
        names = [v for k, v in node.items() if k == "checkpoint_dir_name" and isinstance(v, str)]
        return names + [n for v in node.values() for n in checkpoint_dir_names(v)]
    if isinstance(node, list):
        return [n for v in node for n in checkpoint_dir_names(v)]
    return []


def latest_ray_epoch(out: str | Path) -> int | None:
    """The epoch of the checkpoint a resumed Ray fit in ``out`` starts from (the latest
    that Ray Train's snapshot registered, as its reported metrics say); None when there is
    none or the snapshot cannot be read."""
    try:
        path = Path(out) / TRAIN_DIR / "checkpoint_manager_snapshot.json"
        return int(json.loads(path.read_text())["latest_checkpoint_result"]["metrics"]["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prune_checkpoints(out: str | Path) -> list[Path]:
    """Remove the checkpoint folders in ``OUT/ray_train`` that Ray Train's snapshot does
    not list (uploaded just before a run died, so never registered nor pruned); returns
    them. Nothing is removed without a readable snapshot.
    """
    train_dir = Path(out) / TRAIN_DIR
    try:
        snapshot = json.loads((train_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):
        return []
    listed = set(checkpoint_dir_names(snapshot))
    orphans = [path for path in train_dir.glob("checkpoint_*")
               if path.is_dir() and path.name not in listed]
    for path in orphans:
        shutil.rmtree(path)
    return orphans


__all__ = ["CHECKPOINTS_KEPT", "CHECKPOINT_DIR", "CHECKPOINT_FILE", "TRAIN_DIR",
           "check_fit_id", "checkpoint_dir_names", "checkpoint_paths", "has_ray_checkpoints",
           "latest_ray_epoch", "latest_state", "load_ray_checkpoint", "prune_checkpoints",
           "remove_checkpoints", "read_search_state", "write_checkpoint", "write_search_state"]
