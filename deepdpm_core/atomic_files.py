"""Writing a file atomically: it holds either its old content or its new, never half."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
    finally:
        tmp.unlink(missing_ok=True)
