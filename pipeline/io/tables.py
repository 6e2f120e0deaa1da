"""Feature tables: reading a feature input whole into a :class:`FeatureTable`.

The feature table is the hand-off between ``extract``/``embed`` and ``fit``/``predict``
(its columns and the ``.npy``/``.npz`` inputs: docs/design.md, "Fitted model and file
formats"). A folder's files: :mod:`pipeline.io.folder_inputs`; a Parquet file batch by
batch: :mod:`pipeline.io.parquet_batches`; the rows a fit accepts:
:mod:`pipeline.io.row_checks`; building and writing tables: :mod:`pipeline.io.table_writing`;
an input's shape and row ranges, read without loading it, :mod:`pipeline.io.feature_rows`.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from deepdpm_core.errors import DataError
from pipeline.io.columns import ChosenColumns, TableColumns, choose_columns
from pipeline.io.folder_inputs import folder_files
from pipeline.io.row_checks import check_real_dtype
from pipeline.io.wide_tables import (
    KNOWN_FORMATS,
    file_kind,
    key_values,
    label_codes,
    label_values,
    read_any_table,
    read_parquet,
    read_parquet_schema,
    rows_of,
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


def default_keys(n: int, start: int = 0) -> np.ndarray:
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
        Rows as read; :func:`~pipeline.io.row_checks.check_fit_rows` checks that they can be clustered.

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


def _read_npy(path: Path, data: bytes | None = None) -> FeatureTable:
    with open(path, "rb") if data is None else io.BytesIO(data) as f:
        if f.read(6) != b"\x93NUMPY":
            raise DataError(f"{path} is not a .npy file (no NumPy header)")
    try:
        X = np.load(path if data is None else io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    _check_rows(X, path)
    return FeatureTable(X=X, labels=None, keys=default_keys(len(X)))


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
                        keys=default_keys(len(X)))


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
        schema = read_parquet_schema(first)
    else:
        schema = read_any_table(first, kind, columns.header).schema
    if is_embedding_layout(schema.names, columns):
        return None
    return choose_columns(schema, columns, first)


def _read_table_file(path: Path, kind: str, columns: TableColumns, data: bytes | None = None
                     ) -> _Part:
    """The rows of one table file (parsed from ``data``, its bytes, where given)."""
    if kind == "parquet":
        schema = read_parquet_schema(path, data)
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
        keys = default_keys(len(X))
    return FeatureTable(X=X, labels=labels, keys=keys, label_names=names,
                        feature_names=first.features, label_column=first.label,
                        key_column=first.key)


def _columns_text(part: _Part) -> str:
    if part.features is None:
        return f"an embedding of {part.X.shape[1]}"
    return f"{len(part.features)} columns ({', '.join(part.features[:4])}{', ...' if len(part.features) > 4 else ''})"


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
