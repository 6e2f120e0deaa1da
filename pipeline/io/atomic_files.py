"""Writing outputs atomically: a file is either its old content or its new, never half.

:func:`atomic_path` writes beside the final path and renames over it; JSON is written
strict (NaN and ±inf as ``null``) through :func:`write_json_atomic`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux:
    ``/proc/self/status``); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666`` less the umask."""
    return 0o666 & ~current_umask()


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it over ``final`` on success.

    A crash mid-write leaves ``final`` untouched (old content or absent). The file gets
    the mode a plain ``open(final, "w")`` would (``0o666`` less the umask), not
    ``mkstemp``'s private ``0o600``.
    """
    final = Path(final)
    if final.is_dir():  # before anything is written; os.replace would name the temporary file
        raise IsADirectoryError(f"output {final} is a folder; expected a file path")
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, default_file_mode())
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def json_text(obj: object, indent: int | None = 2) -> str:
    """``obj`` as strict JSON: NaN and ±inf become ``null`` (JSON has no literal for
    them, and other readers reject Python's ``NaN``); numpy values and paths are converted."""
    return json.dumps(_finite_or_none(json.loads(json.dumps(obj, default=_json_default))),
                      indent=indent, allow_nan=False)


def write_json_atomic(obj: object, path: str | Path) -> None:
    """Write ``obj`` as indented strict JSON (:func:`json_text`) atomically."""
    text = json_text(obj)
    with atomic_path(path) as tmp:
        tmp.write_text(text + "\n")


def _finite_or_none(obj: object) -> object:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


def _json_default(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
