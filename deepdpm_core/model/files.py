"""Model and checkpoint files: written atomically (:func:`save_checkpoint`), read safely
(:func:`safe_load`, ``torch.load(weights_only=True)``) with one-line errors.

Every checkpoint the project reads or writes goes through these two. A pickle that
references a Python global other than tensors and plain containers is refused, by name,
before anything in it runs (docs/reliability.md, "Checkpoints that would run code are
refused by name"); torch's advice to load it with ``weights_only=False`` is never passed on.
"""

from __future__ import annotations

import collections
import pickle
import pickletools
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from deepdpm_core.atomic_files import atomic_path
from deepdpm_core.errors import CheckpointError

#: torch's wordings of a refused global (``Unsupported global: GLOBAL m.f was not an
#: allowed global``, ``unsupported GLOBAL m.f whose module m is blocked``); a builtin is
#: named without its module (``GLOBAL eval``)
_REFUSED_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)")
#: globals named in an error message at most (a crafted pickle may reference thousands)
_NAMED_AT_MOST = 3


def safe_load(path: str | Path, what: str = "checkpoint", *, mmap: bool = False) -> object:
    """``torch.load(path, map_location="cpu", weights_only=True)``.

    Parameters
    ----------
    mmap : bool
        Map a torch zip archive into memory instead of reading it (``torch.load(mmap=True)``):
        a tensor's bytes are read from disk when first touched, so a caller that uses a few
        of a file's tensors never reads the others. Other files (raw pickles) are read whole.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    CheckpointError
        One line naming ``what`` and ``path``: refused as unsafe, naming the Python
        global(s) it references (nothing in the file has run), or not a PyTorch
        checkpoint (garbage, empty, truncated).
    """
    try:
        with warnings.catch_warnings():  # torch's note on a raw pickle's protocol: not one line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True,
                              mmap=mmap and zipfile.is_zipfile(path))
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as exc:
        # the one torch stopped at first, then every other global it would refuse
        found = _REFUSED_GLOBAL.search(str(exc))
        names = list(dict.fromkeys([_qualified(found.group(1))] if found else [])
                     | dict.fromkeys(_refused_globals(Path(path))))
        if not names:  # garbage bytes also land here
            raise CheckpointError(f"cannot read {what} {path}: not a PyTorch checkpoint") from exc
        listed = ", ".join(names[:_NAMED_AT_MOST]) + (", ..." if len(names) > _NAMED_AT_MOST else "")
        raise CheckpointError(
            f"cannot read {what} {path}: refused as unsafe, torch.load(weights_only=True) does "
            f"not allow the Python global{'s' if len(names) > 1 else ''} {listed} it references "
            "(loading it could run code); "
            "only tensors and plain containers are read, so re-save just the tensors (a state "
            "dict) from a copy you trust"
        ) from exc
    except Exception as exc:  # empty, not a zip or pickle, truncated download, a folder...
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "empty or truncated"
        raise CheckpointError(
            f"cannot read {what} {path}: not a PyTorch checkpoint ({type(exc).__name__}: {reason})"
        ) from exc


def _qualified(name: str) -> str:
    """``module.name`` of a global as torch or a pickle names it (a builtin without its
    module, or in Python 2's ``__builtin__``)."""
    if "." not in name:
        return f"builtins.{name}"
    return "builtins." + name.split(".", 1)[1] if name.startswith("__builtin__.") else name


def _refused_globals(path: Path) -> list[str]:
    """The globals the file's pickle references that ``weights_only=True`` does not allow
    (tensor rebuilds, storages and plain containers are left out: they did not cause the
    refusal)."""
    from torch._weights_only_unpickler import _get_allowed_globals
    from torch.serialization import get_safe_globals

    allowed = set(_get_allowed_globals()) | {
        f"{g.__module__}.{g.__qualname__}" for g in get_safe_globals() if hasattr(g, "__qualname__")}
    return [_qualified(name) for name in _referenced_globals(path)
            if name not in allowed and _qualified(name) not in allowed]


def _referenced_globals(path: Path) -> list[str]:
    """``module.name`` of the globals the file's pickle references, read without running it.

    For a torch zip archive the pickle is its ``data.pkl`` member, otherwise the file
    itself (a raw pickle). ``pickletools.genops`` only decodes opcodes; a protocol-4+
    ``STACK_GLOBAL`` takes the two strings pushed before it. Unreadable data give [].
    """
    names: list[str] = []
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                member = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if member is None:
                    return []
                with archive.open(member) as stream:
                    _collect_globals(stream, names)
        else:
            with open(path, "rb") as stream:
                _collect_globals(stream, names)
    except Exception:  # not a pickle after all: whatever was named so far
        pass
    return list(dict.fromkeys(names))


def _collect_globals(stream, names: list[str]) -> None:
    strings: collections.deque[str] = collections.deque(maxlen=2)  # the last two pushed
    for opcode, arg, _ in pickletools.genops(stream):
        if opcode.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(f"{strings[-2]}.{strings[-1]}")
        elif isinstance(arg, str) and "UNICODE" in opcode.name:
            strings.append(arg)


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save(state, path)`` atomically (:func:`~deepdpm_core.atomic_files.atomic_path`):
    a reader never sees half a file, a crash leaves the old one, and the file gets the mode
    ``open(path, "w")`` would give (the umask's).

    Raises
    ------
    IsADirectoryError
        ``path`` is a folder (before anything is written).
    """
    # through a file object: given a path, torch.save names the archive's records after the
    # (temporary, random) file name, and the same state would give different bytes
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        torch.save(state, fh)
