"""The rows a fit accepts: a 2-D table of real numbers, not empty, finite."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from deepdpm_core.errors import DataError
from pipeline.io.wide_tables import check_float32_range

if TYPE_CHECKING:
    from pipeline.io.tables import FeatureTable


def check_fit_rows(table: FeatureTable, path: str | Path) -> FeatureTable:
    """Refuse rows that cannot be clustered, before anything heavy loads: not a 2-D table
    of numbers, no rows or no features, rows with NaN or inf values (named).

    Returns
    -------
    FeatureTable
        ``table``, its ``X`` as float32.

    Raises
    ------
    DataError
    """
    X = table.X
    if X.ndim != 2:
        raise DataError(f"{path}: features must be a 2-D array [N, D] (rows of numbers), got "
                        f"shape {X.shape}")
    if X.shape[0] == 0:
        raise DataError(f"{path} has no rows")
    if X.shape[1] == 0:
        raise DataError(f"{path} has no feature columns")
    check_float32_range(X, str(path))
    table.X = X.astype(np.float32, copy=False)
    check_finite_rows(table.X, path, 0)
    return table


def check_finite_rows(X: np.ndarray, path: str | Path, start: int) -> None:
    """Refuse rows (B, D) with NaN or inf values, naming the file and their row numbers in
    it (the batch's first row is row ``start``).

    Raises
    ------
    DataError
        Some rows hold NaN or inf values (the first five are named).
    """
    bad = np.flatnonzero(~np.isfinite(X).all(1))
    if bad.size:
        shown = ", ".join(str(start + i) for i in bad[:5]) + (", ..." if bad.size > 5 else "")
        raise DataError(f"{path} has {bad.size} row(s) with NaN or inf values (rows {shown})")


def check_real_dtype(dtype: np.dtype, path: Path) -> None:
    """Refuse features that are not real numbers or booleans (strings, objects, complex),
    as :func:`deepdpm_core.data.is_real_dtype`, without importing torch."""
    if dtype.hasobject or dtype.kind not in "biuf":
        raise DataError(f"{path}: features must be real numbers, got dtype {dtype}")
