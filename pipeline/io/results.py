"""What a command prints: its result on stdout, everything else on stderr.

A result is a short human line (or a few) on stdout, e.g. ``K=8 epochs=40 time=12.3s
nmi=0.912 -> /home/me/runs/x``, or with ``--json`` exactly one line of strict JSON, for
scripts; progress bars, warnings and step logs go to stderr. Every path printed is
absolute and resolved (:func:`shown_path`), so a line names the same file wherever it is read.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the result as one JSON object on stdout."""
    parser.add_argument(
        "--json", action="store_true",
        help="print the result as one JSON object on stdout (instead of the human lines)",
    )  # fmt: skip


def print_result(args: argparse.Namespace, human: str | list[str], data: Mapping[str, Any]) -> None:
    """Print ``data`` as one JSON line when ``args.json``, else the ``human`` line(s); on stdout."""
    from deepdpm_core.atomic_files import json_text

    if getattr(args, "json", False):
        text = json_text({"command": getattr(args, "command", None), **data}, indent=None)
    else:
        text = human if isinstance(human, str) else "\n".join(human)
    print(text, file=sys.stdout, flush=True)


def shown_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a command prints it: absolute, with ``~``, ``..`` and links resolved.

    Parameters
    ----------
    path : str or path-like
        Relative to the working directory, or absolute.

    Returns
    -------
    str
    """
    return str(Path(path).expanduser().resolve())


def scores_text(metrics: Mapping[str, float]) -> str:
    """``nmi=0.912 ari=0.871 acc=0.930`` (empty without labels)."""
    return " ".join(f"{k}={v:.3f}" for k, v in metrics.items())


__all__ = ["add_json_argument", "print_result", "scores_text", "shown_path"]
