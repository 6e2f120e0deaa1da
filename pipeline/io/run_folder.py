"""Publishing a run folder in one step: a fit's outputs appear together or not at all.

A fit writes into a staging folder beside ``OUT`` (:func:`staging_folder`); :func:`publish_run`
hard-links the entries of ``OUT`` that are not run outputs into it and exchanges the two
folders in one ``renameat2(RENAME_EXCHANGE)`` (two renames where unsupported, mended by
:func:`remove_leftovers`; a mount point is filled in place, ``summary.json`` last:
:func:`publishes_in_place`). Details: docs/reliability.md, "A run folder is never a mix of
two runs" and "Clean up after failures".
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

#: renameat2 flag: swap the two paths atomically (linux/fs.h)
RENAME_EXCHANGE = 2
#: renameat2's "path relative to the working directory" (linux/fcntl.h)
AT_FDCWD = -100
#: the end of atomic_path's temporary names: ".<name>.<pid>.<8 hex digits>.tmp"
_ATOMIC_TMP = re.compile(r"\.\d+\.[0-9a-f]{8}\.tmp$")
#: errnos of a renameat2 that the kernel or the filesystem does not offer
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


#: the entry a fit writes last: while it is absent the folder claims no finished fit
LAST_OUTPUT = "summary.json"


def staging_folder(out: str | Path, pid: int | None = None) -> Path:
    """A new, empty staging folder beside ``out`` (``.OUT.staging-<pid>``), or inside it
    (``OUT/.staging-<pid>``) where ``out`` publishes in place (:func:`publishes_in_place`)."""
    out = Path(out).resolve()
    pid = os.getpid() if pid is None else pid
    staging = (out / f".staging-{pid}" if publishes_in_place(out)
               else out.parent / f".{out.name}.staging-{pid}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publishes_in_place(out: str | Path) -> bool:
    """True when the folder ``out`` is a mount point or holds one.

    Swapping it would fail at the mount (``EBUSY``), and carrying its entries into a
    staging folder beside it would copy a mounted volume and then empty it; such a folder
    is published entry by entry instead (:func:`publish_run`).
    """
    out = Path(out).resolve()
    if not out.is_dir():
        return False
    return any(m == out or out in m.parents for m in _mount_points(out))


def _mount_points(out: Path) -> set[Path]:
    """The mount points at or under ``out``: from ``/proc/self/mountinfo`` (bind mounts of
    the same filesystem included) and, where that cannot be read, from a change of device
    between a folder and its parent."""
    found: set[Path] = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(" ")
                if len(fields) > 4:  # field 5: the mount point, spaces as octal escapes
                    found.add(Path(_unescape_octal(fields[4])))
    except OSError:
        pass
    if os.path.ismount(out):
        found.add(out)
    for folder, dirs, _ in os.walk(out):  # links are not followed
        for name in dirs:
            if os.path.ismount(os.path.join(folder, name)):
                found.add(Path(folder) / name)
    return found


def _unescape_octal(text: str) -> str:
    """``/proc/self/mountinfo``'s ``\\040``-style escapes turned back into characters."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def publish_run(staging: str | Path, out: str | Path, outputs: Collection[str]) -> None:
    """Make the run written in ``staging`` the content of ``out`` in one step.

    Parameters
    ----------
    staging : path
        A folder beside ``out`` holding the new run's outputs (see :func:`staging_folder`).
    out : path
        The output folder; may not exist yet.
    outputs : collection of str
        Names of run outputs: entries of ``out`` with these names belong to the earlier
        run and are dropped; every other entry is carried over into the new ``out``.
    """
    staging, out = Path(staging), Path(out)
    if staging.parent == out.resolve():
        _publish_entries(staging, out, outputs)
        return
    if not out.exists():
        os.rename(staging, out)
        return
    if not out.is_dir():
        raise NotADirectoryError(f"output {out} exists and is not a folder")
    shutil.copymode(out, staging)  # the folder keeps its permissions
    for entry in out.iterdir():
        if entry.name not in outputs and not (staging / entry.name).exists():
            _carry(entry, staging / entry.name)
    if _exchange(staging, out):
        shutil.rmtree(staging)  # the earlier run
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old)


def _publish_entries(staging: Path, out: Path, outputs: Collection[str]) -> None:
    """Publish the staging folder inside ``out`` entry by entry (:func:`publishes_in_place`).

    The earlier run's :data:`LAST_OUTPUT` goes first and the new one's comes last, so a
    kill in between leaves a folder that claims no finished fit; the earlier run's other
    outputs are replaced or removed, and an entry that is or holds a mount point is never
    removed (nor walked into).
    """
    (out / LAST_OUTPUT).unlink(missing_ok=True)
    mounts = _mount_points(out)
    new = sorted(staging.iterdir(), key=lambda p: p.name == LAST_OUTPUT)
    for entry in out.iterdir():
        if entry.name in outputs and not (staging / entry.name).exists():
            _remove_owned(entry, mounts)
    for entry in new:
        target = out / entry.name
        if target.is_dir() and not target.is_symlink():
            _remove_owned(target, mounts)
        os.replace(entry, target)
    staging.rmdir()


def _remove_owned(entry: Path, mounts: set[Path]) -> None:
    """Remove ``entry`` (a file or a tree) unless it is or holds a mount point."""
    if any(m == entry or entry in m.parents for m in mounts):
        return
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)


def remove_leftovers(output: str | Path) -> None:
    """Remove what writers of ``output`` killed before they finished left behind.

    Call only while holding ``output``'s lock (:func:`pipeline.io.locks.output_lock`): then
    no other process is writing these. Removes the staging folders ``.OUT.staging-*``
    (and ``OUT/.staging-*`` of a folder published in place), the temporary files
    ``.OUT.<pid>.<hex>.tmp`` of an atomic write of ``OUT`` (``atomic_path``'s names) and
    those of the files directly inside ``OUT``; a ``.OUT.old-*`` of a publish stopped
    between its two renames is moved back to ``OUT`` (or removed when ``OUT`` exists).
    """
    out = Path(output).resolve()
    parent, name = out.parent, glob.escape(out.name)
    for old in sorted(parent.glob(f".{name}.old-*")):
        if not out.exists():
            os.rename(old, out)
        else:
            shutil.rmtree(old)
    stagings = list(parent.glob(f".{name}.staging-*"))
    if out.is_dir() and not out.is_symlink():
        stagings += out.glob(".staging-*")
    for staging in stagings:
        shutil.rmtree(staging)
    stale = [p for p in parent.glob(f".{name}.*.tmp")
             if _ATOMIC_TMP.fullmatch(p.name[len(out.name) + 1:])]
    if out.is_dir():
        stale += [p for p in out.glob(".*.tmp") if _ATOMIC_TMP.search(p.name)]
    for tmp in stale:
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink()


def _carry(src: Path, dst: Path) -> None:
    """Hard-link ``src`` (a file or a whole tree) at ``dst``; copy where links fail."""
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links on this filesystem
        shutil.copy2(src, dst)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically; False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # C library older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


__all__ = ["LAST_OUTPUT", "publish_run", "publishes_in_place", "remove_leftovers", "staging_folder"]
