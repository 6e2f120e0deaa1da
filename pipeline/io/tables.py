"""Feature tables: reading inputs whole or in batches, and building and writing Parquet tables.

The feature table is the hand-off between ``extract``/``embed`` and ``fit``/``predict``
(its columns and the ``.npy``/``.npz`` inputs: docs/design.md, "Fitted model and file
formats"). Atomic writing is :mod:`deepdpm_core.atomic_files`; an input's shape and row
ranges, read without loading it, :mod:`pipeline.io.feature_rows`.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.atomic_files import atomic_path
from deepdpm_core.errors import DataError
from pipeline.io.columns import ChosenColumns, TableColumns, choose_columns
from pipeline.io.wide_tables import (
    KNOWN_FORMATS,
    check_float32_range,
    file_kind,
    key_values,
    label_codes,
    label_values,
    read_any_table,
    read_parquet,
    rows_of,
    wide_matrix,
)


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
    label_names : list of str, optional
        For labels that were strings: the string of each label code.
    feature_names : list of str, optional
        The columns the features came from (a wide table).
    label_column, key_column : str, optional
        The columns the labels and the keys came from (a table).
    fingerprint : dict, optional
        The input's fingerprint (:func:`pipeline.io.input_fingerprint.input_fingerprint`)
        taken from the very bytes these rows were parsed from, when asked for.
    """

    X: np.ndarray
    labels: np.ndarray | None
    keys: np.ndarray
    label_names: list[str] | None = None
    feature_names: list[str] | None = None
    label_column: str | None = None
    key_column: str | None = None
    fingerprint: dict[str, Any] | None = None


def _default_keys(n: int, start: int = 0) -> np.ndarray:
    """Row numbers ``start`` .. ``start + n - 1`` as string keys, for files without keys."""
    return np.array([str(i) for i in range(start, start + n)], dtype=object)


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


def read_features(path: str | Path, columns: TableColumns | Mapping[str, Any] | None = None,
                  *, fingerprint: bool = False) -> FeatureTable:
    """Read the rows of a feature input: the one loader of the commands and the Python API.

    Parameters
    ----------
    path : path
        ``.npy`` ([N, D], or [N, ...] images that ``embed`` flattens); ``.npz`` (``X``,
        optional ``y``); a table, ``.csv``/``.tsv`` (with or without a header),
        ``.parquet`` or ``.arrow``/``.feather``: the feature-table layout (``embedding``
        list column, optional ``label`` and ``key``) or a wide one (one column per
        feature); or a folder of such tables (Parquet, CSV or Arrow files, read in name
        order as one table).
    columns : TableColumns or mapping, optional
        Which columns of a wide table are the features, the label and the key, and
        whether a CSV has a header (:class:`~pipeline.io.columns.TableColumns`); by
        default every numeric column is a feature but ``label`` and ``key``.
    fingerprint : bool
        Also fingerprint the input from the bytes parsed (each file is read once, whole,
        and hashed and parsed from memory), so the fingerprint a resumable fit stores is
        that of the rows it fitted even while the file is being replaced.

    Returns
    -------
    FeatureTable
        Rows as read; :func:`check_fit_rows` checks that they can be clustered.

    Raises
    ------
    DataError
        Unknown format, unreadable or empty file, missing ``X`` or columns, ragged
        embeddings, non-numeric feature columns (named), files of a folder that differ.
    FileNotFoundError
        ``path`` does not exist.

    Examples
    --------
    >>> table = read_features("cells.csv", TableColumns(label="type", key="cell_id"))
    >>> DeepDPM().fit(table.X)  # doctest: +SKIP
    """
    path = Path(path)
    columns = TableColumns.of(columns)
    if not path.exists():
        raise FileNotFoundError(f"input not found: {path}")
    if path.is_dir():
        kind, files = folder_files(path)
    elif not path.is_file():  # a FIFO or a device would block or never end
        raise DataError(f"{path} is not a regular file")
    else:
        kind, files = file_kind(path), [path]
        if kind is None:
            raise DataError(f"unsupported input '{path}': expected {KNOWN_FORMATS}")
    from pipeline.io.input_fingerprint import bytes_fingerprint

    prints: dict[str, Any] = {}

    def contents(file: Path) -> bytes | None:  # the bytes parsed, fingerprinted as read
        if not fingerprint:
            return None
        data = file.read_bytes()
        prints[str(file.relative_to(path)) if path.is_dir() else ""] = bytes_fingerprint(data)
        return data

    if kind == "npy":
        table = _read_npy(path, contents(path))
    elif kind == "npz":
        table = _read_npz(path, contents(path))
    else:
        table = _joined([_read_table_file(Path(f), kind, columns, contents(Path(f)))
                         for f in files], path)
    if fingerprint:
        table.fingerprint = {"files": prints} if path.is_dir() else prints[""]
    return table


def folder_files(path: Path) -> tuple[str, list[str]]:
    """The kind (``parquet``, ``csv``, ``arrow``) and the files of a folder of tables.

    Parquet files are the folder's ``.parquet`` files, sub-folders included (a partitioned
    dataset); CSV and Arrow files are the folder's own. Names starting with ``.`` or ``_``
    are left out, as Parquet readers do, and so are other files (a README); files come in
    the order of their paths. Links are never followed (:func:`_table_entries`), so
    nothing outside the folder is read, and nothing twice.

    Raises
    ------
    DataError
        A folder without tables, with tables of different kinds, or with a link where a
        table or a sub-folder would be read.
    """
    found: dict[str, list[str]] = {}
    for entry in _table_entries(path, recursive=False):
        found.setdefault(file_kind(entry), []).append(str(entry))
    if not found and (nested := [str(p) for p in _table_entries(path, recursive=True)
                                 if file_kind(p) == "parquet"]):
        found["parquet"] = nested  # Parquet in sub-folders (a partitioned dataset)
    if not found:
        raise DataError(f"{path} is a folder without .parquet files (nor .csv, .tsv or "
                        ".arrow/.feather files)")
    if len(found) > 1:
        raise DataError(f"{path} holds tables of different kinds ({', '.join(sorted(found))}): "
                        "give a folder of one kind")
    kind = next(iter(found))
    return kind, parquet_files(path) if kind == "parquet" else found[kind]


def _table_entries(folder: Path, recursive: bool) -> list[Path]:
    """The table files (``.parquet``, ``.csv``, ``.arrow``, ...) of ``folder``, sorted by
    path; with ``recursive``, those of its sub-folders too. Names starting with ``.`` or
    ``_`` are left out.

    Raises
    ------
    DataError
        A symbolic link named like a table or pointing at a folder (following it could
        leave the folder, or loop back into it).
    """
    found = []
    for parent, dirs, files in os.walk(folder, onerror=_raise_walk_error):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in [*dirs, *files]:
            entry = Path(parent) / name
            if name.startswith((".", "_")) or not entry.is_symlink():
                continue
            if file_kind(entry) in ("parquet", "csv", "arrow") or entry.is_dir():
                raise DataError(f"{entry} is a symbolic link: the tables of a folder input are "
                                "read without following links; put the file itself there")
        found += [Path(parent) / name for name in files
                  if not name.startswith((".", "_")) and not (Path(parent) / name).is_symlink()
                  and file_kind(name) in ("parquet", "csv", "arrow")
                  and (Path(parent) / name).is_file()]
        dirs[:] = [d for d in dirs if not (Path(parent) / d).is_symlink()]
        if not recursive:
            break
    return sorted(found, key=str)


def _raise_walk_error(exc: OSError) -> None:
    raise exc


def _read_npy(path: Path, data: bytes | None = None) -> FeatureTable:
    with open(path, "rb") if data is None else io.BytesIO(data) as f:
        if f.read(6) != b"\x93NUMPY":
            raise DataError(f"{path} is not a .npy file (no NumPy header)")
    try:
        X = np.load(path if data is None else io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    _check_rows(X, path)
    return FeatureTable(X=X, labels=None, keys=_default_keys(len(X)))


def _read_npz(path: Path, data: bytes | None = None) -> FeatureTable:
    try:
        with np.load(path if data is None else io.BytesIO(data), allow_pickle=False) as arrays:
            if "X" not in arrays:
                raise DataError(f"{path} has no array 'X' (found: {', '.join(arrays.files)})")
            X = np.asarray(arrays["X"])
            y = np.asarray(arrays["y"]) if "y" in arrays else None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    _check_rows(X, path)
    return FeatureTable(X=X, labels=None if y is None else _check_labels(y, len(X), path),
                        keys=_default_keys(len(X)))


@dataclass
class _Part:
    """The rows of one table file: features, raw labels (:func:`label_values`), keys, and
    the columns they came from."""

    X: np.ndarray
    labels: np.ndarray | None
    keys: np.ndarray | None
    features: list[str] | None
    label: str | None = None
    key: str | None = None


def is_embedding_layout(names: list[str], columns: TableColumns) -> bool:
    """A feature table (``embedding`` list column) rather than a wide one."""
    return "embedding" in names and columns.features is None


def input_columns(path: str | Path, columns: TableColumns | Mapping[str, Any] | None = None
                  ) -> ChosenColumns | None:
    """The columns :func:`read_features` would read a wide table by (of a folder: its first
    file's), from its schema; None for an input without named columns (``.npy``, ``.npz``,
    the feature-table layout) or in a format it does not know.

    Raises
    ------
    DataError
        As :func:`read_features`, for the table's columns.
    """
    path, columns = Path(path), TableColumns.of(columns)
    if path.is_dir():
        kind, files = folder_files(path)
        first = Path(files[0]) if files else None
    else:
        kind, first = file_kind(path), path
    if first is None or kind not in ("parquet", "csv", "arrow"):
        return None
    if kind == "parquet":
        try:
            schema = pq.read_schema(first)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read Parquet {first}: {exc}") from exc
    else:
        schema = read_any_table(first, kind, columns.header).schema
    if is_embedding_layout(schema.names, columns):
        return None
    return choose_columns(schema, columns, first)


def _read_table_file(path: Path, kind: str, columns: TableColumns, data: bytes | None = None
                     ) -> _Part:
    """The rows of one table file (parsed from ``data``, its bytes, where given)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path if data is None else pa.BufferReader(data))
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read Parquet {path}: {exc}") from exc
        if is_embedding_layout(schema.names, columns):
            return _embedding_part(read_parquet(path, data=data), path)
        chosen = choose_columns(schema, columns, path)
        wanted = [*chosen.features, *(c for c in (chosen.label, chosen.key) if c is not None)]
        table = read_parquet(path, list(dict.fromkeys(wanted)), data)
    else:
        table = read_any_table(path, kind, columns.header, data)
        if is_embedding_layout(table.column_names, columns):
            return _embedding_part(table, path)
        chosen = choose_columns(table.schema, columns, path)
    X, labels, keys = rows_of(table, chosen, path)
    return _Part(X, labels, keys, chosen.features, chosen.label, chosen.key)


def _embedding_part(table: pa.Table, path: Path) -> _Part:
    """The rows of a table in the feature-table layout (:func:`feature_schema`)."""
    try:
        X = embedding_matrix(table.column("embedding"))
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    labels = None
    if "label" in table.column_names:
        col = table.column("label")
        if col.null_count < len(col):
            labels = label_values(col)
    keys = key_values(table.column("key")) if "key" in table.column_names else None
    return _Part(X, labels, keys, None, "label" if labels is not None else None,
                 "key" if keys is not None else None)


def _joined(parts: list[_Part], path: Path) -> FeatureTable:
    """One table of the files' rows, in order (a folder's files must agree)."""
    first = parts[0]
    for part in parts[1:]:
        if part.features != first.features or part.X.shape[1:] != first.X.shape[1:]:
            raise DataError(f"the files of {path} differ in their feature columns: "
                            f"{_columns_text(first)} and {_columns_text(part)}")
    X = np.concatenate([p.X for p in parts]) if len(parts) > 1 else first.X
    labels = names = None
    if any(p.labels is not None for p in parts):
        strings = any(p.labels is not None and p.labels.dtype == object for p in parts)
        raw = []
        for p in parts:
            if p.labels is None:
                raw.append(np.full(len(p.X), None if strings else -1,
                                   dtype=object if strings else np.int64))
            elif strings and p.labels.dtype != object:
                raw.append(np.array([None if v < 0 else str(v) for v in p.labels], dtype=object))
            else:
                raw.append(p.labels)
        labels, names = label_codes(np.concatenate(raw))
    if all(p.keys is not None for p in parts):
        keys = np.concatenate([p.keys for p in parts])
    else:
        keys = _default_keys(len(X))
    return FeatureTable(X=X, labels=labels, keys=keys, label_names=names,
                        feature_names=first.features, label_column=first.label,
                        key_column=first.key)


def _columns_text(part: _Part) -> str:
    if part.features is None:
        return f"an embedding of {part.X.shape[1]}"
    return f"{len(part.features)} columns ({', '.join(part.features[:4])}{', ...' if len(part.features) > 4 else ''})"


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


def parquet_labelled(parquet: pq.ParquetFile, path: str | Path, column: str = "label") -> bool:
    """True when the file's label ``column`` holds a value (nulls only: no labels), read
    from that column alone; as :func:`read_features` decides it.

    Raises
    ------
    DataError
        The labels are not integers (read batch by batch, they cannot be numbered over
        the whole file as :func:`read_features` numbers strings).
    """
    schema = parquet.schema_arrow
    if column not in schema.names:
        return False
    nulls = sum(b.column(0).null_count for b in parquet.iter_batches(columns=[column]))
    labelled = nulls < parquet.metadata.num_rows
    if labelled and not pa.types.is_integer(schema.field(column).type):
        raise DataError(f"{path}: column '{column}' must hold integers, got "
                        f"{schema.field(column).type}")
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


def feature_batches(path: str | Path, batch_size: int,
                    columns: TableColumns | Mapping[str, Any] | None = None
                    ) -> Iterator[FeatureTable]:
    """The rows of a feature input in order, as :func:`read_features` reads them.

    A Parquet file is read ``batch_size`` rows at a time, across row groups (about two
    batches in memory whatever the file's size); keys are row numbers where the file has
    none, labels are given for every batch when the file holds any. Other inputs, and a
    Parquet file whose labels are strings (numbered over the whole file), are read whole
    and given as one batch.

    Raises
    ------
    DataError
        As :func:`read_features`; rows with NaN or inf values in a Parquet file
        (:func:`check_finite_rows`).
    FileNotFoundError
        ``path`` does not exist.
    """
    path = Path(path)
    columns = TableColumns.of(columns)
    if file_kind(path) != "parquet" or not path.is_file():
        yield read_features(path, columns)
        return
    parquet = open_parquet(path)
    schema = parquet.schema_arrow
    if is_embedding_layout(schema.names, columns):
        features, label = None, "label" if "label" in schema.names else None
        key = "key" if "key" in schema.names else None
    else:
        chosen = choose_columns(schema, columns, path)
        features, label, key = chosen.features, chosen.label, chosen.key
    if label is not None and not pa.types.is_integer(schema.field(label).type):
        yield read_features(path, columns)  # string labels are numbered over the whole file
        return
    if label is not None and not parquet_labelled(parquet, path, label):
        label = None
    read = list(dict.fromkeys([*(features or ["embedding"]),
                               *(c for c in (key, label) if c is not None)]))
    start = 0
    for table in _fixed_size_batches(parquet.iter_batches(batch_size=batch_size, columns=read),
                                     pa.schema([schema.field(c) for c in read]), batch_size):
        X = embedding_matrix(table.column("embedding")) if features is None \
            else wide_matrix(table, features, path)
        check_finite_rows(X, path, start)
        n = len(table)
        keys = key_values(table.column(key)) if key is not None else _default_keys(n, start)
        labels = (np.asarray(table.column(label).fill_null(-1).to_numpy(), dtype=np.int64)
                  if label is not None else None)
        yield FeatureTable(X=X, labels=labels, keys=keys, feature_names=features)
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
    """The files of a Parquet file or folder, in the order they are read (a folder: its
    ``.parquet`` files, sub-folders included, sorted by path, links never followed;
    see :func:`folder_files`)."""
    path = Path(path)
    if not path.is_dir():
        return [str(path)]
    files = [str(p) for p in _table_entries(path, recursive=True) if file_kind(p) == "parquet"]
    if not files:
        raise DataError(f"{path} is a folder without .parquet files")
    return files


def check_real_dtype(dtype: np.dtype, path: Path) -> None:
    """Refuse features that are not real numbers or booleans (strings, objects, complex),
    as :func:`deepdpm_core.data.is_real_dtype`, without importing torch."""
    if dtype.hasobject or dtype.kind not in "biuf":
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
