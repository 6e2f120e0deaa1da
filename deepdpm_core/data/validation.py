"""Input checks that turn bad data into precise :class:`DataError` messages."""

from __future__ import annotations

import warnings

import numpy as np
import scipy.sparse
import torch

from deepdpm_core.config import check_row_count
from deepdpm_core.errors import DataError


def is_real_dtype(dtype: np.dtype) -> bool:
    """Real numbers or booleans: what features may hold (not objects, strings or complex)."""
    return not dtype.hasobject and dtype.kind in "biuf"


def check_features(X: object, *, min_rows: int = 1, n_features: int | None = None) -> np.ndarray:
    """Validate an embedding matrix and return it as a float32 array.

    Parameters
    ----------
    X : array-like of shape (N, D)
    min_rows : int
        Fewest rows accepted (e.g. the initial number of clusters).
    n_features : int, optional
        Required D (at predict time: the D the model was fitted on).

    Returns
    -------
    ndarray of shape (N, D), float32

    Raises
    ------
    DataError
        Sparse, not numeric, not 2-D, empty, NaN/inf entries (the first offending rows are
        named), too few rows, or the wrong number of features.
    """
    if scipy.sparse.issparse(X):  # np.asarray would make it a 0-d object array
        raise DataError(f"X is a sparse {X.format} matrix: DeepDPM fits dense arrays (pass X.toarray())")
    if isinstance(X, torch.Tensor):
        X = X.detach().cpu().numpy()
    try:
        arr = np.asarray(X)
    except (TypeError, ValueError) as exc:
        raise DataError(f"X must be a numeric array [N, D]: {exc}") from exc
    if not is_real_dtype(arr.dtype):
        raise DataError(f"X must be a numeric array [N, D], got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise DataError(f"X must be a 2-D array [N, D], got shape {arr.shape}")
    n, d = arr.shape
    if n == 0 or d == 0:
        raise DataError(f"X is empty (shape {arr.shape})")
    if n_features is not None and d != n_features:
        raise DataError(f"X has {d} features, but DeepDPM is expecting {n_features} features as input")
    source = arr
    with np.errstate(over="ignore"):  # float64 beyond float32's range: named below
        arr = arr.astype(np.float32, copy=False)
    finite = np.isfinite(arr).all(1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        head = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
        what = ("values beyond float32's range (|x| > 3.4e38)" if np.isfinite(source[bad]).all()
                else "NaN or inf values")
        raise DataError(f"X has {len(bad)} row(s) with {what} (rows {head})")
    check_row_count(n, min_rows)
    return arr


def check_init_labels(labels: object, n_rows: int) -> np.ndarray:
    """Validate warm-start cluster ids: integers >= 0, one per row -> int64 [N].

    Raises
    ------
    DataError
        Wrong length, non-integer values or negative ids.
    """
    arr = np.asarray(labels)
    if arr.shape != (n_rows,):
        raise DataError(f"init_labels must have shape ({n_rows},), got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"init_labels must be integers, got dtype {arr.dtype}")
    if n_rows and arr.min() < 0:
        raise DataError(f"init_labels must be >= 0, got {int(arr.min())}")
    return arr.astype(np.int64)


def readonly_tensor(X: np.ndarray) -> torch.Tensor:
    """A tensor view of ``X`` without a copy, also when ``X`` is read-only.

    Parquet/Arrow columns, memory maps and UMAP outputs come as read-only arrays, for
    which ``torch.from_numpy`` warns that writes would be undefined. The method only
    reads its input (the search keeps its own shifted copy), so the view is safe and a
    defensive copy would double the memory at ImageNet scale.

    Parameters
    ----------
    X : ndarray of shape (N, D)

    Returns
    -------
    Tensor of shape (N, D), sharing memory with ``X``
    """
    if X.flags.writeable:
        return torch.from_numpy(X)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(X)
