"""A command never silently replaces what is already there: ``--overwrite`` or another output.

``deepdpm fit`` refuses an output folder that holds a fit; ``predict``, ``embed``,
``report`` and ``extract`` refuse an existing output in the same words unless
``--overwrite`` is given, and then replace it in one step (their files are written
atomically: :func:`deepdpm_core.atomic_files.atomic_path`). Details: docs/reliability.md,
"Existing outputs are replaced only on --overwrite".
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from deepdpm_core.errors import ConfigError


def add_overwrite_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--overwrite``: replace ``what`` (e.g. "an existing --output file") if it exists."""
    parser.add_argument("--overwrite", action="store_true", help=f"replace {what}")


def refuse_existing_file(path: str | Path, overwrite: bool, flag: str = "--output") -> None:
    """Refuse to write the file ``path`` over something that exists, unless ``overwrite``.

    Raises
    ------
    ConfigError
        ``path`` exists (a file, a link) and ``overwrite`` is False; or it is a folder,
        which a file never replaces.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name a file, or choose another {flag}")
    if os.path.lexists(path) and not overwrite:
        raise ConfigError(f"{flag} {path} already exists: pass --overwrite to replace it, or "
                          f"choose another {flag}")


__all__ = ["add_overwrite_argument", "refuse_existing_file"]
