"""Reading checkpoints safely (``torch.load(weights_only=True)``), with one-line errors."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from deepdpm_core.errors import CheckpointError


def safe_load(path: str | Path, what: str = "checkpoint") -> object:
    """``torch.load(path, map_location="cpu", weights_only=True)``.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    CheckpointError
        One line naming ``what`` and ``path``: not a PyTorch checkpoint (garbage, empty,
        truncated), or one holding objects other than tensors and plain containers (with
        how to re-save it, never advice to load it unsafely).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as exc:
        unsupported = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if unsupported is None:  # garbage bytes also land here
            raise CheckpointError(f"cannot read {what} {path}: not a PyTorch checkpoint") from exc
        raise CheckpointError(
            f"cannot read {what} {path} safely (torch.load weights_only=True): it contains "
            f"a {unsupported.group(1)} object. If you trust the file, re-save only its state "
            "dict: torch.save(torch.load(src, weights_only=False)['state_dict'], dst)"
        ) from exc
    except Exception as exc:  # empty, not a zip or pickle, truncated download, a folder...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "empty or truncated"
        raise CheckpointError(
            f"cannot read {what} {path}: not a PyTorch checkpoint ({type(exc).__name__}: {reason})"
        ) from exc
