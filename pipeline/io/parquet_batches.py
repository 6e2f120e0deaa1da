"""A feature input read batch by batch, in memory bounded by the batch (Parquet files).

The rows and their order are those :func:`pipeline.io.tables.read_features` reads whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.errors import DataError
from pipeline.io.columns import TableColumns, choose_columns
from pipeline.io.row_checks import check_finite_rows
from pipeline.io.tables import (
    FeatureTable,
    default_keys,
    embedding_matrix,
    is_embedding_layout,
    read_features,
)
from pipeline.io.wide_tables import file_kind, key_values, wide_matrix

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
        (:func:`~pipeline.io.row_checks.check_finite_rows`).
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
        keys = key_values(table.column(key)) if key is not None else default_keys(n, start)
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
