"""Publishing a run folder in one step: a fit's outputs appear together or not at all.

A fit writes its outputs into a staging folder beside ``OUT`` (:func:`staging_folder`);
:func:`publish_run` carries the entries of ``OUT`` that are not run outputs (checkpoints,
the user's files) into it as hard links and exchanges the two folders in one
``renameat2(RENAME_EXCHANGE)``, so ``OUT`` is at every instant either the earlier run or
the new one, never a mix. Where the exchange is not supported it falls back to two
renames, and :func:`remove_leftovers` (run by the next writer, under the output's lock)
puts back an earlier run that a kill between them left aside and removes staging folders
and temporary files of killed writers. Details: docs/reliability.md, "A run folder is
never a mix of two runs" and "Clean up after failures".
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

#: renameat2 flag: swap the two paths atomically (linux/fs.h)
RENAME_EXCHANGE = 2
#: renameat2's "path relative to the working directory" (linux/fcntl.h)
AT_FDCWD = -100
#: errnos of a renameat2 that the kernel or the filesystem does not offer
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def staging_folder(out: str | Path, pid: int | None = None) -> Path:
    """A new, empty staging folder beside ``out`` (``.OUT.staging-<pid>``)."""
    out = Path(out).resolve()
    staging = out.parent / f".{out.name}.staging-{os.getpid() if pid is None else pid}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


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


def remove_leftovers(output: str | Path) -> None:
    """Remove what writers of ``output`` killed before they finished left behind.

    Call only while holding ``output``'s lock (:func:`pipeline.io.locks.output_lock`): then
    no other process is writing these. Removes the staging folders ``.OUT.staging-*``,
    the temporary files ``.OUT.XXXXXXXX.tmp`` of an atomic write of ``OUT`` and those of
    the files directly inside ``OUT``; a ``.OUT.old-*`` of a publish stopped between its
    two renames is moved back to ``OUT`` (or removed when ``OUT`` exists).
    """
    out = Path(output).resolve()
    parent, name = out.parent, glob.escape(out.name)
    for old in sorted(parent.glob(f".{name}.old-*")):
        if not out.exists():
            os.rename(old, out)
        else:
            shutil.rmtree(old)
    for staging in parent.glob(f".{name}.staging-*"):
        shutil.rmtree(staging)
    # atomic_path's mkstemp names: ".<name>." + 8 random characters + ".tmp"
    stale = list(parent.glob(f".{name}.{'?' * 8}.tmp"))
    if out.is_dir():
        stale += out.glob(f".*.{'?' * 8}.tmp")
    for tmp in stale:
        if tmp.is_file():
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


__all__ = ["publish_run", "remove_leftovers", "staging_folder"]
