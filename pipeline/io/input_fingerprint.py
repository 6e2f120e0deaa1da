"""What identifies a fit's input: its size and a hash of its content (or of its Parquet footer).

A resumable fit stores the fingerprint of its ``--input`` in ``fit_request.json``;
``--resume`` compares it with the input as it is now, so a checkpoint is never continued
on other rows (docs/reliability.md, "A folder holds one fit"). A Parquet file is
identified by its size and its footer (schema, row groups with their offsets, sizes and
statistics), which every rewrite of its rows changes, so a large table is not read
whole; any other file by its size and the SHA-256 of its bytes; a folder by those of
the files a fit reads in it (:func:`pipeline.io.folder_inputs.folder_files`: no link followed).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

#: a Parquet file starts and ends with these 4 bytes; the 4 before the last give the
#: footer's length
_PARQUET_MAGIC = b"PAR1"
_CHUNK = 1 << 20


def input_fingerprint(path: str | Path) -> dict[str, Any]:
    """The fingerprint of the file or folder ``path``.

    Returns
    -------
    dict
        A file: ``{"size": bytes, "sha256": hex}`` (``"parquet_footer_sha256"`` instead for a
        Parquet file). A folder: ``{"files": {relative path: file fingerprint}}`` over the
        files a fit reads in it, and only those.

    Raises
    ------
    OSError
        ``path`` cannot be read.
    DataError
        A folder that is not an input (:func:`pipeline.io.folder_inputs.folder_files`).
    """
    path = Path(path)
    if path.is_dir():
        from pipeline.io.folder_inputs import folder_files

        files = [Path(f) for f in folder_files(path)[1]]
        return {"files": {str(p.relative_to(path)): _file_fingerprint(p) for p in files}}
    return _file_fingerprint(path)


def fingerprint_change(stored: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How ``now`` differs from ``stored`` in words (None: the same input)."""
    if stored == now:
        return None
    if "size" in stored and "size" in now and stored["size"] != now["size"]:
        return f"its size was {stored['size']} bytes, it is {now['size']} now"
    if "files" in stored and "files" in now and stored["files"].keys() != now["files"].keys():
        return "its files are not the same"
    return "its content differs"


def bytes_fingerprint(data: bytes) -> dict[str, Any]:
    """The fingerprint of a file whose bytes are ``data``: what :func:`input_fingerprint`
    gives for it, taken from the bytes a reader parsed (no second read)."""
    size = len(data)
    if data[:4] == _PARQUET_MAGIC and size >= 12:
        footer_length = int.from_bytes(data[-8:-4], "little")
        if data[-4:] == _PARQUET_MAGIC and footer_length <= size - 12:
            footer = hashlib.sha256(data[size - 8 - footer_length:size - 8]).hexdigest()
            return {"size": size, "parquet_footer_sha256": footer}
    return {"size": size, "sha256": hashlib.sha256(data).hexdigest()}


def _file_fingerprint(path: Path) -> dict[str, Any]:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(4)
        if head == _PARQUET_MAGIC and size >= 12:
            fh.seek(size - 8)
            tail = fh.read(8)
            footer_length = int.from_bytes(tail[:4], "little")
            if tail[4:] == _PARQUET_MAGIC and footer_length <= size - 12:
                fh.seek(size - 8 - footer_length)
                footer = hashlib.sha256(fh.read(footer_length)).hexdigest()
                return {"size": size, "parquet_footer_sha256": footer}
    return {"size": size, "sha256": file_sha256(path)}


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of the file ``path``, read 1 MiB at a time (never whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = ["bytes_fingerprint", "file_sha256", "fingerprint_change", "input_fingerprint"]
