"""The table files of a folder input: which are read, of which kind, in which order.

A folder input is read as one table (:func:`pipeline.io.tables.read_features`); its files
are listed here without following links, so nothing outside the folder is read, and
nothing twice.
"""

from __future__ import annotations

import os
from pathlib import Path

from deepdpm_core.errors import DataError
from pipeline.io.wide_tables import file_kind


def folder_files(path: Path) -> tuple[str, list[str]]:
    """The kind (``parquet``, ``csv``, ``arrow``) and the files of a folder of tables.

    Parquet files are the folder's ``.parquet`` files, sub-folders included (a partitioned
    dataset); CSV and Arrow files are the folder's own. Names starting with ``.`` or ``_``
    are left out, as Parquet readers do, and so are other files (a README); files come in
    the order of their paths. Links are never followed (:func:`_table_entries`), so
    nothing outside the folder is read, and nothing twice.

    Raises
    ------
    DataError
        A folder without tables, with tables of different kinds, or with a link where a
        table or a sub-folder would be read.
    """
    found: dict[str, list[str]] = {}
    for entry in _table_entries(path, recursive=False):
        found.setdefault(file_kind(entry), []).append(str(entry))
    if not found and (nested := [str(p) for p in _table_entries(path, recursive=True)
                                 if file_kind(p) == "parquet"]):
        found["parquet"] = nested  # Parquet in sub-folders (a partitioned dataset)
    if not found:
        raise DataError(f"{path} is a folder without .parquet files (nor .csv, .tsv or "
                        ".arrow/.feather files)")
    if len(found) > 1:
        raise DataError(f"{path} holds tables of different kinds ({', '.join(sorted(found))}): "
                        "give a folder of one kind")
    kind = next(iter(found))
    return kind, parquet_files(path) if kind == "parquet" else found[kind]


def parquet_files(path: Path) -> list[str]:
    """The files of a Parquet file or folder, in the order they are read (a folder: its
    ``.parquet`` files, sub-folders included, sorted by path, links never followed;
    see :func:`folder_files`)."""
    path = Path(path)
    if not path.is_dir():
        return [str(path)]
    files = [str(p) for p in _table_entries(path, recursive=True) if file_kind(p) == "parquet"]
    if not files:
        raise DataError(f"{path} is a folder without .parquet files")
    return files


def _table_entries(folder: Path, recursive: bool) -> list[Path]:
    """The table files (``.parquet``, ``.csv``, ``.arrow``, ...) of ``folder``, sorted by
    path; with ``recursive``, those of its sub-folders too. Names starting with ``.`` or
    ``_`` are left out.

    Raises
    ------
    DataError
        A symbolic link named like a table or pointing at a folder (following it could
        leave the folder, or loop back into it).
    """
    found = []
    for parent, dirs, files in os.walk(folder, onerror=_raise_walk_error):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in [*dirs, *files]:
            entry = Path(parent) / name
            if name.startswith((".", "_")) or not entry.is_symlink():
                continue
            if file_kind(entry) in ("parquet", "csv", "arrow") or entry.is_dir():
                raise DataError(f"{entry} is a symbolic link: the tables of a folder input are "
                                "read without following links; put the file itself there")
        found += [Path(parent) / name for name in files
                  if not name.startswith((".", "_")) and not (Path(parent) / name).is_symlink()
                  and file_kind(name) in ("parquet", "csv", "arrow")
                  and (Path(parent) / name).is_file()]
        dirs[:] = [d for d in dirs if not (Path(parent) / d).is_symlink()]
        if not recursive:
            break
    return sorted(found, key=str)


def _raise_walk_error(exc: OSError) -> None:
    raise exc
