"""Feature tables: reading inputs whole or in batches, and building and writing Parquet tables.

The feature table is the hand-off between ``extract``/``embed`` and ``fit``/``predict``
(its columns and the ``.npy``/``.npz`` inputs: docs/design.md, "Fitted model and file
formats"). Atomic writing is :mod:`pipeline.io.atomic_files`; an input's shape and row
ranges, read without loading it, :mod:`pipeline.io.feature_rows`.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.atomic_files import atomic_path
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


def _default_keys(n: int, start: int = 0) -> np.ndarray:
    """Row numbers ``start`` .. ``start + n - 1`` as string keys, for files without keys."""
    return np.array([str(i) for i in range(start, start + n)], dtype=object)


def _check_label_type(label_type: pa.DataType, path: str | Path) -> None:
    if not pa.types.is_integer(label_type):
        raise DataError(f"{path}: column 'label' must hold integers, got {label_type}")


def embedding_matrix(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Turn an Arrow list/fixed-size-list column of floats into an [N, D] float32 array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if n == 0:
        return np.zeros((0, 0), dtype=np.float32)
    typ = column.type
    is_list = pa.types.is_fixed_size_list(typ) or pa.types.is_list(typ) or pa.types.is_large_list(typ)
    if not is_list or not (pa.types.is_floating(typ.value_type) or pa.types.is_integer(typ.value_type)):
        raise DataError(f"column 'embedding' must be a list of numbers, got {typ}")
    if pa.types.is_fixed_size_list(typ):
        dim = typ.list_size
        flat = column.flatten().to_numpy(zero_copy_only=False)
        return flat.astype(np.float32, copy=False).reshape(n, dim)
    lengths = np.asarray(column.value_lengths().fill_null(-1))  # a variable-size list
    if (lengths != lengths[0]).any() or lengths[0] < 0:
        raise DataError("column 'embedding' has rows of different lengths or nulls")
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return flat.astype(np.float32, copy=False).reshape(n, int(lengths[0]))


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
    if path.is_dir() and not parquet_files(path):
        raise DataError(f"{path} is a folder without .parquet files")
    if suffix == ".npy":
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise DataError(f"{path} is not a .npy file (no NumPy header)")
        try:
            X = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise DataError(f"cannot read {path}: {exc}") from exc
        _check_rows(X, path)
        return FeatureTable(X=X, labels=None, keys=_default_keys(len(X)))
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                if "X" not in data:
                    raise DataError(f"{path} has no array 'X' (found: {', '.join(data.files)})")
                X = np.asarray(data["X"])
                y = np.asarray(data["y"]) if "y" in data else None
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise DataError(f"cannot read {path}: {exc}") from exc
        _check_rows(X, path)
        return FeatureTable(X=X, labels=None if y is None else _check_labels(y, len(X), path),
                            keys=_default_keys(len(X)))
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
                _check_label_type(col.type, path)
                labels = np.asarray(col.fill_null(-1).to_numpy(), dtype=np.int64)
        keys = (
            np.asarray(table.column("key").to_pylist(), dtype=object)
            if "key" in table.column_names
            else _default_keys(len(X))
        )
        return FeatureTable(X=X, labels=labels, keys=keys)
    raise DataError(f"unsupported input '{path}': expected .npy, .npz or .parquet")


#: bytes read at a time from a Parquet column chunk by :func:`open_parquet`
PARQUET_READ_BUFFER = 4 * 2**20


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """A Parquet file to read batch by batch in memory bounded by the batch.

    Without pre-buffering (which holds every row group asked for, ahead of the batches)
    and through a buffer of :data:`PARQUET_READ_BUFFER` bytes, not each column chunk
    whole (512 MB for a row group of 1M rows of 128 float32 features).

    Raises
    ------
    DataError
        Not a readable Parquet file.
    """
    try:
        return pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_READ_BUFFER)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read Parquet {path}: {exc}") from exc


def parquet_labelled(parquet: pq.ParquetFile, path: str | Path) -> bool:
    """True when the file's ``label`` column holds a value (nulls only: no labels), read
    from that column alone; as :func:`read_features` decides it.

    Raises
    ------
    DataError
        Labels that are not integers.
    """
    schema = parquet.schema_arrow
    if "label" not in schema.names:
        return False
    nulls = sum(b.column(0).null_count for b in parquet.iter_batches(columns=["label"]))
    labelled = nulls < parquet.metadata.num_rows
    if labelled:
        _check_label_type(schema.field("label").type, path)
    return labelled


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


def feature_batches(path: str | Path, batch_size: int) -> Iterator[FeatureTable]:
    """The rows of a feature file in order, as :func:`read_features` reads them.

    A Parquet file is read ``batch_size`` rows at a time, across row groups (about two
    batches in memory whatever the file's size); keys are row numbers where the file has
    none, labels are given for every batch when the file holds any. ``.npy`` and ``.npz``
    are read whole and given as one batch.

    Raises
    ------
    DataError
        As :func:`read_features`; rows with NaN or inf values in a Parquet file
        (:func:`check_finite_rows`).
    FileNotFoundError
        ``path`` does not exist.
    """
    path = Path(path)
    if path.suffix.lower() != ".parquet" or not path.is_file():
        yield read_features(path)
        return
    parquet = open_parquet(path)
    names = parquet.schema_arrow.names
    if "embedding" not in names:
        raise DataError(f"{path} has no column 'embedding' (found: {names})")
    labelled = parquet_labelled(parquet, path)
    columns = ["embedding", *(["key"] if "key" in names else []), *(["label"] if labelled else [])]
    start = 0
    for table in _fixed_size_batches(parquet.iter_batches(batch_size=batch_size, columns=columns),
                                     pa.schema([parquet.schema_arrow.field(c) for c in columns]),
                                     batch_size):
        X = embedding_matrix(table.column("embedding"))
        check_finite_rows(X, path, start)
        n = len(table)
        keys = (np.asarray(table.column("key").to_pylist(), dtype=object) if "key" in names
                else _default_keys(n, start))
        labels = (np.asarray(table.column("label").fill_null(-1).to_numpy(), dtype=np.int64)
                  if labelled else None)
        yield FeatureTable(X=X, labels=labels, keys=keys)
        start += n


def _fixed_size_batches(batches: Iterator[pa.RecordBatch], schema: pa.Schema, size: int
                        ) -> Iterator[pa.Table]:
    """``batches`` regrouped into tables of ``size`` rows (the last one fewer), in order.

    Parquet batches stop at row-group boundaries; fixed batches give every forward pass
    the rows it had when the file was read whole, so the results agree to the last bit.
    """
    pending: list[pa.RecordBatch] = []
    rows = 0
    for batch in batches:
        pending.append(batch)
        rows += batch.num_rows
        if rows >= size:
            table = pa.Table.from_batches(pending, schema)
            whole = rows - rows % size
            for at in range(0, whole, size):
                yield table.slice(at, size)
            pending, rows = table.slice(whole).to_batches(), rows - whole
    if rows:
        yield pa.Table.from_batches(pending, schema)


def assignments_table(table: FeatureTable, labels: np.ndarray, confidence: np.ndarray) -> pa.Table:
    """Arrow table: key, cluster:int32, confidence:float32, label:int64 (nullable).

    ``labels`` and ``confidence`` are (N,): the hard cluster and its responsibility.
    """
    cols = {
        "key": pa.array([str(k) for k in table.keys], pa.string()),
        "cluster": pa.array(labels.astype(np.int32)),
        "confidence": pa.array(confidence.astype(np.float32)),
    }
    if table.labels is not None:
        cols["label"] = pa.array(table.labels.astype(np.int64), mask=table.labels < 0)
    return pa.table(cols)


def write_parquet_atomic(table: pa.Table, path: str | Path) -> None:
    """Write an Arrow table to Parquet atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


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


def parquet_files(path: Path) -> list[str]:
    """The files of a Parquet file or directory, in the order ``pq.read_table`` reads them."""
    import pyarrow.dataset as pads

    try:
        return list(pads.dataset(path, format="parquet").files)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read Parquet {path}: {exc}") from exc


def check_real_dtype(dtype: np.dtype, path: Path) -> None:
    # imported here: the module imports torch, which the folder predict's driver goes without
    from deepdpm_core.data import is_real_dtype

    if not is_real_dtype(dtype):
        raise DataError(f"{path}: features must be real numbers, got dtype {dtype}")


def _check_rows(X: np.ndarray, path: Path) -> None:
    """An array of rows of real numbers ([N, D], or [N, ...] images that ``embed`` flattens)."""
    if X.ndim == 0:
        raise DataError(f"{path}: features must be an array of rows [N, D], got a single value")
    check_real_dtype(X.dtype, path)


def _check_labels(y: np.ndarray, n_rows: int, path: Path) -> np.ndarray:
    """The ``y`` of an .npz as int64 (N,): integers, or floats that are whole numbers."""
    if y.ndim != 1:
        raise DataError(f"{path}: 'y' must be one label per row, shape ({n_rows},), got {y.shape}")
    if len(y) != n_rows:
        raise DataError(f"{path}: 'y' has {len(y)} rows but 'X' has {n_rows}")
    if y.dtype.kind in "f" and not (np.isfinite(y).all() and (y == np.round(y)).all()):
        raise DataError(f"{path}: 'y' must hold integer labels, got non-integer or NaN values")
    if y.dtype.kind not in "iuf" and y.dtype != bool:
        raise DataError(f"{path}: 'y' must hold integer labels, got dtype {y.dtype}")
    return y.astype(np.int64)
