"""Writing outputs atomically: a file holds either its old content or its new, never half.

Files are written through :func:`atomic_path` (beside the final path, then renamed over it);
JSON is written strict (NaN and ±inf as ``null``) through :func:`write_json_atomic`.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a new temporary path beside ``final``; rename it over ``final`` on success.

    A crash mid-write leaves ``final`` untouched (old content or absent), and a failed
    write leaves no temporary file. The temporary file is created empty, as ``open(final,
    "w")`` would create it (``0o666`` less the umask), and the caller's writer overwrites
    it in place, so the output honours the umask.

    Raises
    ------
    IsADirectoryError
        ``final`` is a folder (before anything is written).
    OSError
        The write failed (a full disk: ``ENOSPC``); one that named no file is raised again
        naming ``final``.
    """
    final = Path(final)
    if final.is_dir():  # os.replace would name the temporary file instead
        raise IsADirectoryError(f"output {final} is a folder; expected a file path")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb"):
            pass
        yield tmp
        os.replace(tmp, final)
    except OSError as exc:
        if exc.filename is not None or type(exc) is not OSError:
            raise
        # writers (Parquet, torch) report a full disk without the file it was writing
        raise OSError(exc.errno, f"cannot write {final}: {exc.strerror or exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


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
