"""Building feature and assignment tables from arrays, and writing them to Parquet atomically."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.atomic_files import atomic_path

if TYPE_CHECKING:
    from pipeline.io.tables import FeatureTable


def feature_schema(dim: int) -> pa.Schema:
    """Arrow schema of a feature table with ``dim``-dimensional embeddings."""
    return pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("embedding", pa.list_(pa.float32(), dim), nullable=False),
            pa.field("label", pa.int64(), nullable=True),
        ]
    )


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
