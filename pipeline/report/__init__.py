"""What a fit shows its user: the HTML report, the plots, and the warnings about K.

:func:`run_source` and :func:`parse_row_shape` are here, apart from the report's heavy modules (matplotlib, PIL), so
that ``deepdpm report`` refuses a wrong source before they load.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from deepdpm_core.errors import ConfigError, DataError

#: an MLflow run id
RUN_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")


def run_source(source: str) -> Literal["folder", "run_id"]:
    """What ``source`` names: a fit output folder or an MLflow run id (32 hex digits).

    Raises
    ------
    DataError
        ``source`` is neither.
    """
    if Path(source).is_dir():
        return "folder"
    if RUN_ID_PATTERN.match(source):
        return "run_id"
    raise DataError(f"'{source}' is neither a fit output directory nor an MLflow run id")


def parse_row_shape(text: str | None) -> tuple[int, int] | None:
    """``"8x8"`` -> (8, 8), the report's ``--row-shape``; None for None.

    Raises
    ------
    ConfigError
        Not two positive integers joined by ``x``.
    """
    if text is None:
        return None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"--row-shape must be HEIGHTxWIDTH, e.g. 8x8, got {text!r}")
    return int(parts[0]), int(parts[1])
