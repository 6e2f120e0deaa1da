"""A command never silently replaces what is already there: ``--overwrite`` or another output.

``deepdpm fit`` refuses an output folder that holds a fit; ``predict``, ``embed``,
``report`` and ``extract`` refuse an existing output in the same words unless
``--overwrite`` is given, and then replace it in one step (their files are written
atomically: :func:`deepdpm_core.atomic_files.atomic_path`). A command that writes a folder
(``fit``, ``demo``, ``extract``, ``shards``, a folder ``predict``) also refuses an existing
folder holding files none of which it wrote (:func:`refuse_foreign_folder`); with
``--overwrite`` it writes its own files there and leaves the others. Details:
docs/reliability.md, "Existing outputs are replaced only on --overwrite".
"""

from __future__ import annotations

import argparse
import fnmatch
import os
from collections.abc import Collection
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


def refuse_foreign_folder(path: str | Path, overwrite: bool, own: Collection[str], command: str,
                          flag: str = "--output") -> None:
    """Refuse to write into an existing folder that holds files but none that ``command``
    writes (a folder of the user's), unless ``overwrite``.

    Parameters
    ----------
    own : collection of str
        Names (or shell patterns, ``shard-*.tar``) of what ``command`` writes into such a
        folder: one of them there makes it the command's own output (a rerun, a resume).

    Raises
    ------
    ConfigError
        One line naming the folder and some of its files.
    """
    path = Path(path)
    if overwrite or not path.is_dir():
        return
    names = sorted(entry.name for entry in path.iterdir())
    if not names or any(fnmatch.fnmatchcase(n, pattern) for n in names for pattern in own):
        return
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise ConfigError(f"{flag} {path} is a folder of other files ({shown}), not an output of "
                      f"deepdpm {command}: pass --overwrite to write into it (its files are "
                      f"kept), or choose another {flag}")


__all__ = ["add_overwrite_argument", "refuse_existing_file", "refuse_foreign_folder"]
