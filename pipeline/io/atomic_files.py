"""Writing outputs atomically: a file is either its old content or its new, never half.

Files are written through :func:`deepdpm_core.atomic_files.atomic_path` (beside the final
path, then renamed over it); JSON is written strict (NaN and ±inf as ``null``) through
:func:`write_json_atomic`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from deepdpm_core.atomic_files import atomic_path


def json_text(obj: object, indent: int | None = 2) -> str:
    """``obj`` as strict JSON: NaN and ±inf become ``null`` (JSON has no literal for
    them, and other readers reject Python's ``NaN``); numpy values and paths are converted."""
    return json.dumps(_finite_or_none(json.loads(json.dumps(obj, default=_json_default))),
                      indent=indent, allow_nan=False)


def write_json_atomic(obj: object, path: str | Path) -> None:
    """Write ``obj`` as indented strict JSON (:func:`json_text`) atomically."""
    text = json_text(obj)
    with atomic_path(path) as tmp:
        tmp.write_text(text + "\n")


def _finite_or_none(obj: object) -> object:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


def _json_default(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
