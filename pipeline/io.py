"""Reading feature tables and writing outputs atomically.

The feature table is the hand-off between ``extract``/``embed`` and ``fit``/``predict``:
Parquet with ``key: string``, ``embedding: fixed_size_list<float32>[D]`` and
``label: int64`` (nullable). ``.npy`` (an [N, D] array) and ``.npz`` (``X``, optional
``y``) are accepted as inputs too.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.errors import DataError


def feature_schema(dim: int) -> pa.Schema:
    """Arrow schema of a feature table with ``dim``-dimensional embeddings."""
    return pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("embedding", pa.list_(pa.float32(), dim), nullable=False),
            pa.field("label", pa.int64(), nullable=True),
        ]
    )


@dataclass
class FeatureTable:
    """Features in memory.

    Attributes
    ----------
    X : ndarray of shape (N, D), float32
    labels : ndarray of shape (N,), int64, or None when the input has no labels
    keys : ndarray of shape (N,), object (str)
    """

    X: np.ndarray
    labels: np.ndarray | None
    keys: np.ndarray


def _default_keys(n: int) -> np.ndarray:
    return np.array([str(i) for i in range(n)], dtype=object)


def embedding_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Turn an Arrow list/fixed-size-list column of floats into an [N, D] float32 array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if n == 0:
        return np.zeros((0, 0), dtype=np.float32)
    if pa.types.is_fixed_size_list(column.type):
        dim = column.type.list_size
        flat = column.flatten().to_numpy(zero_copy_only=False)
        return flat.astype(np.float32, copy=False).reshape(n, dim)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        lengths = np.asarray(column.value_lengths().fill_null(-1))
        if (lengths != lengths[0]).any() or lengths[0] < 0:
            raise DataError("column 'embedding' has rows of different lengths or nulls")
        flat = column.flatten().to_numpy(zero_copy_only=False)
        return flat.astype(np.float32, copy=False).reshape(n, int(lengths[0]))
    raise DataError(f"column 'embedding' must be a list of floats, got {column.type}")


def read_features(path: str | Path) -> FeatureTable:
    """Read ``.npy``, ``.npz`` or Parquet (file or directory of files) features.

    Raises
    ------
    DataError
        Unknown format, missing ``embedding``/``X``, ragged embeddings.
    FileNotFoundError
        ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            X = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise DataError(f"cannot read {path}: {exc}") from exc
        return FeatureTable(X=np.asarray(X), labels=None, keys=_default_keys(len(X)))
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                if "X" not in data:
                    raise DataError(f"{path} has no array 'X' (found: {', '.join(data.files)})")
                X = np.asarray(data["X"])
                y = np.asarray(data["y"]).astype(np.int64) if "y" in data else None
        except (ValueError, OSError) as exc:
            raise DataError(f"cannot read {path}: {exc}") from exc
        if y is not None and len(y) != len(X):
            raise DataError(f"{path}: 'y' has {len(y)} rows but 'X' has {len(X)}")
        return FeatureTable(X=X, labels=y, keys=_default_keys(len(X)))
    if suffix == ".parquet" or path.is_dir():
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read Parquet {path}: {exc}") from exc
        if "embedding" not in table.column_names:
            raise DataError(f"{path} has no column 'embedding' (found: {table.column_names})")
        X = embedding_matrix(table.column("embedding"))
        labels = None
        if "label" in table.column_names:
            col = table.column("label")
            if col.null_count < len(col):
                labels = np.asarray(col.fill_null(-1).to_numpy(), dtype=np.int64)
        keys = (
            np.asarray(table.column("key").to_pylist(), dtype=object)
            if "key" in table.column_names
            else _default_keys(len(X))
        )
        return FeatureTable(X=X, labels=labels, keys=keys)
    raise DataError(f"unsupported input '{path}': expected .npy, .npz or .parquet")


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it over ``final`` on success.

    A crash mid-write leaves ``final`` untouched (old content or absent).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_json_atomic(obj: object, path: str | Path) -> None:
    """Write ``obj`` as indented JSON atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")


def write_parquet_atomic(table: pa.Table, path: str | Path) -> None:
    """Write an Arrow table to Parquet atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _json_default(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def features_table(X: np.ndarray, keys: np.ndarray, labels: np.ndarray | None) -> pa.Table:
    """Build a feature table (:func:`feature_schema`) from arrays."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    n, dim = X.shape
    emb = pa.FixedSizeListArray.from_arrays(pa.array(X.reshape(-1)), dim)
    label_arr = (
        pa.nulls(n, pa.int64())
        if labels is None
        else pa.array(np.asarray(labels, dtype=np.int64), mask=np.asarray(labels) < 0)
    )
    return pa.Table.from_arrays(
        [pa.array([str(k) for k in keys], pa.string()), emb, label_arr],
        schema=feature_schema(dim),
    )
