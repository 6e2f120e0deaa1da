"""One writer per output: a lock on the folder (or file) a command writes.

``deepdpm fit``, ``extract``, ``predict``, ``embed`` and ``report`` hold an exclusive ``flock`` on
``.<name>.lock`` beside their output while they run (:func:`output_lock`, taken by the CLI:
:data:`OUTPUT_ARGUMENTS`); a second command on the same output fails at once naming the
holder, and a lock of a killed run never blocks (the kernel releases it). The lock sits
beside the output, not inside it, because a fit replaces its whole output folder when it
publishes (docs/reliability.md, "One writer per output folder"). An existing output the
user may not write is refused before the lock is taken (:func:`check_writable`).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from deepdpm_core.errors import DeepDPMError
from pipeline.io.run_folder import remove_leftovers

#: command -> the arguments naming what it writes (the first one given is locked)
OUTPUT_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "fit": ("resume", "output"),
    "extract": ("output",),
    "predict": ("output",),
    "embed": ("output",),
    "report": ("output",),
}


class OutputLockedError(DeepDPMError):
    """Another process is writing the same output."""


class OutputNotWritableError(DeepDPMError):
    """The output exists and its owner may not write it."""


def check_writable(output: str | Path) -> None:
    """Refuse an existing output that the user cannot write, or that has no write
    permission for anyone (``chmod a-w``: a folder kept read-only on purpose, which the
    superuser could otherwise replace). A command would not write into it, but replace it
    whole, which only its parent's permissions govern.

    Raises
    ------
    OutputNotWritableError
        One line naming the output and its mode.
    """
    path = Path(output)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not os.access(path, os.W_OK) or not mode & 0o222:
        kind = "folder" if stat.S_ISDIR(mode) else "file"
        raise OutputNotWritableError(
            f"{output} is a {kind} you may not write (mode {stat.S_IMODE(mode):o}): make it "
            f"writable (chmod u+w {output}) or choose another output")


def lock_path(output: str | Path) -> Path:
    """The lock file of ``output``: ``.<name>.lock`` in the same folder."""
    out = Path(output).resolve()
    return out.parent / f".{out.name}.lock"


@contextmanager
def output_lock(output: str | Path, command: str) -> Iterator[Path]:
    """Hold the lock of ``output`` for ``command`` (e.g. ``"fit"``) while the block runs.

    The folders the lock file needs are created, and removed again at the end where the
    command left them empty (e.g. it refused its arguments).

    Raises
    ------
    OutputLockedError
        Another live process holds it; the message names that process.
    OutputNotWritableError
        ``output`` exists and may not be written (:func:`check_writable`).
    """
    check_writable(output)
    path = lock_path(output)
    created = _make_folders(path.parent)
    try:
        fd = _acquire(path, output)
    except BaseException:
        _remove_if_empty(created)
        raise
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.write(fd, f"deepdpm {command} (pid {os.getpid()} on {socket.gethostname()}, "
                     f"since {started})\n".encode())
        remove_leftovers(output)
        yield path
    finally:
        # unlinked while still held: a process that opened the old file re-checks the
        # path after its flock succeeds (see _acquire) and retries on the new one
        path.unlink(missing_ok=True)
        os.close(fd)
        # a command refused after the lock was taken leaves no empty folder behind
        _remove_if_empty(created)


def _make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those it created, deepest first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for created in reversed(missing):
        created.mkdir(exist_ok=True)
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) that are empty; one that is not stops the walk up."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty: the command wrote into it
            return


def _acquire(path: Path, output: str | Path) -> int:
    """An fd of ``path`` holding its exclusive flock; the file is still at ``path``."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OutputLockedError(f"{output} is being written by {holder}: wait for it to "
                                    "finish or choose another output") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        held = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)  # its holder removed the file after we opened it: lock the new one


def command_lock(args: argparse.Namespace) -> AbstractContextManager:
    """The lock of the output of the command ``args`` runs (none for read-only commands)."""
    for name in OUTPUT_ARGUMENTS.get(args.command, ()):
        target = getattr(args, name, None)
        if target:
            return output_lock(target, args.command)
    return nullcontext()


__all__ = ["OUTPUT_ARGUMENTS", "OutputLockedError", "OutputNotWritableError", "check_writable",
           "command_lock", "lock_path", "output_lock"]
