"""The input shards of ``deepdpm extract``: which ``.tar`` files a run reads, and how many
webdataset samples each holds (from its tar headers, before the run)."""

from __future__ import annotations

import glob
import io
import os
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deepdpm_core.errors import ConfigError, DataError

#: webdataset's sample grouping rule (same regex as webdataset and Ray's reader):
#: the key is the member name up to the first dot of its last path component
_SAMPLE_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def resolve_shards(shards: str | Path | Sequence[str | Path]) -> list[Path]:
    """Shard files named by a directory (its ``*.tar``), a glob, a file, or a list of these.

    Raises
    ------
    FileNotFoundError
        A name that matches no ``.tar`` file.
    ConfigError
        Two shards with the same file name (their outputs would collide).
    """
    items = [shards] if isinstance(shards, (str, Path)) else list(shards)
    found: list[Path] = []
    for item in items:
        text = str(item)
        if Path(text).is_dir():
            matches = sorted(Path(text).glob("*.tar"))
        elif glob.has_magic(text):
            matches = sorted(Path(p) for p in glob.glob(text) if p.endswith(".tar"))
        else:
            matches = [Path(text)] if Path(text).is_file() else []
        if not matches:
            raise FileNotFoundError(f"no .tar shards found at {text}")
        found.extend(p.resolve() for p in matches if not p.name.startswith("."))
    found = list(dict.fromkeys(found))
    names: dict[str, Path] = {}
    for path in found:
        if path.stem in names:
            raise ConfigError(
                f"two shards share the name {path.name} ({names[path.stem]} and {path}): "
                "outputs are named after shards, so extract them into separate --output folders"
            )
        names[path.stem] = path
    return found


@dataclass
class ShardSamples:
    """The webdataset samples of one shard, from its tar headers.

    Attributes
    ----------
    read : int
        Samples with at least one regular file: the reader yields each of them once.
    unread : list of dict
        ``{"key", "reason"}`` of each sample whose files are all links (hard or symbolic)
        or other non-regular members, which the reader passes over: they are counted as
        skipped, never lost.
    """

    read: int = 0
    unread: list[dict] = field(default_factory=list)


def _not_regular(member: tarfile.TarInfo) -> str:
    if member.islnk():
        return f"{member.name} is a hard link to {member.linkname}"
    if member.issym():
        return f"{member.name} is a symbolic link to {member.linkname}"
    return f"{member.name} is not a regular file"


def count_samples(shard: str | Path) -> ShardSamples:
    """The webdataset samples in ``shard``, from its tar headers (data are seeked over).

    Raises
    ------
    DataError
        Not a readable tar, or a sample's files are not contiguous (webdataset needs them
        adjacent; Ray's reader would fail mid-run).
    """
    count, previous, seen = 0, None, set()
    # samples named by members that are not regular files, in order: key -> reasons
    links: dict[str, list[str]] = {}
    try:
        file_size = os.path.getsize(shard)
        with tarfile.open(shard, "r:*") as tar:
            # tarfile stops quietly at a cut header, but a member whose data runs past the
            # end of the file would make the streaming reader fail mid-run: check it here
            plain = isinstance(tar.fileobj, io.BufferedReader)
            for member in tar:
                if plain and member.offset_data + member.size > file_size:
                    raise DataError(
                        f"{shard}: truncated tar file (member {member.name} is cut off)"
                    )
                match = _SAMPLE_NAME.match(member.name)
                if match is not None and not member.isreg() and not member.isdir():
                    links.setdefault(match.group(1), []).append(_not_regular(member))
                    continue
                if not member.isreg() or match is None or match.group(1) == previous:
                    continue
                previous = match.group(1)
                if previous in seen:
                    raise DataError(
                        f"{shard}: files of sample '{previous}' are not contiguous in the tar "
                        "(webdataset needs them adjacent; rewrite it with `deepdpm shards`)"
                    )
                seen.add(previous)
                count += 1
            if plain and file_size - tar.offset < tarfile.BLOCKSIZE:
                # a complete tar ends with zero blocks; tarfile reads a cut header as the end
                raise DataError(f"{shard}: truncated tar file (no end-of-archive marker)")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataError(f"{shard}: not a readable tar file ({exc})") from exc
    unread = [{"key": key, "reason": f"not read: {'; '.join(reasons)} (only regular files are read)"}
              for key, reasons in links.items() if key not in seen]
    return ShardSamples(count, unread)
