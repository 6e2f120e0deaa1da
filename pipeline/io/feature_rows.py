"""(N, D) and row ranges of a feature input, read without loading it whole: what one
rank of a distributed fit reads (formats as in :mod:`pipeline.io.tables`). ``.npy``,
``.npz`` and Parquet are read in part; a CSV or Arrow table is read whole and sliced."""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.errors import DataError
from pipeline.io.columns import TableColumns, choose_columns
from pipeline.io.folder_inputs import folder_files, parquet_files
from pipeline.io.row_checks import check_real_dtype
from pipeline.io.tables import embedding_matrix, is_embedding_layout, read_features
from pipeline.io.wide_tables import KNOWN_FORMATS, file_kind, wide_matrix

_NPY_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def rank_rows(n_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous, balanced row range [start, stop) of ``rank`` among ``world_size``.

    Ranges are in rank order and differ in length by at most one row; a rank beyond
    the last row gets an empty range.
    """
    return n_rows * rank // world_size, n_rows * (rank + 1) // world_size


def _npz_member(path: Path) -> tuple[zipfile.ZipFile, str]:
    zf = zipfile.ZipFile(path)
    if "X.npy" not in zf.namelist():
        names = ", ".join(n.removesuffix(".npy") for n in zf.namelist())
        zf.close()
        raise DataError(f"{path} has no array 'X' (found: {names})")
    return zf, "X.npy"


def _npy_stream_header(stream, path: Path) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(stream)
    reader = _NPY_HEADER_READERS.get(version)
    if reader is None:
        raise DataError(f"{path}: unsupported .npy format version {version} for 'X'")
    return reader(stream)


def _check_matrix(shape: tuple[int, ...], dtype: np.dtype, path: Path) -> tuple[int, int]:
    if len(shape) != 2:
        raise DataError(f"{path}: features must be a 2-D array [N, D], got shape {shape}")
    check_real_dtype(dtype, path)
    return int(shape[0]), int(shape[1])


def _kind(path: Path) -> str:
    kind = folder_files(path)[0] if path.is_dir() else file_kind(path)
    if kind is None:
        raise DataError(f"unsupported input '{path}': expected {KNOWN_FORMATS}")
    return kind


def feature_shape(path: str | Path, columns: TableColumns | Mapping[str, Any] | None = None
                  ) -> tuple[int, int]:
    """(N, D) of a feature input (see :func:`read_features`) from its metadata only (a CSV
    or Arrow table: read whole).

    Raises
    ------
    DataError
        Unknown format, no ``embedding``/``X``, not a numeric 2-D array.
    FileNotFoundError
        ``path`` does not exist.
    """
    path = Path(path)
    columns = TableColumns.of(columns)
    if not path.exists():
        raise FileNotFoundError(f"input not found: {path}")
    suffix = "." + _kind(path)
    if suffix in (".csv", ".arrow"):
        return read_features(path, columns).X.shape
    try:
        if suffix == ".npy":
            X = np.load(path, mmap_mode="r", allow_pickle=False)
            return _check_matrix(X.shape, X.dtype, path)
        if suffix == ".npz":
            zf, member = _npz_member(path)
            with zf, zf.open(member) as stream:
                shape, _, dtype = _npy_stream_header(stream, path)
            return _check_matrix(shape, dtype, path)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if suffix == ".parquet" or path.is_dir():
        n, dim = 0, None
        for name in parquet_files(path):
            meta = pq.ParquetFile(name)
            if not is_embedding_layout(meta.schema_arrow.names, columns):
                n += meta.metadata.num_rows
                dim = len(choose_columns(meta.schema_arrow, columns, name).features)
                continue
            n += meta.metadata.num_rows
            typ = meta.schema_arrow.field("embedding").type
            if dim is None and pa.types.is_fixed_size_list(typ):
                dim = typ.list_size
            elif dim is None and meta.metadata.num_rows:
                dim = embedding_matrix(meta.read_row_group(0, columns=["embedding"])
                                       .column("embedding").slice(0, 1)).shape[1]
        return n, int(dim or 0)
    raise DataError(f"unsupported input '{path}': expected {KNOWN_FORMATS}")


def read_feature_rows(path: str | Path, start: int, stop: int,
                      columns: TableColumns | Mapping[str, Any] | None = None) -> np.ndarray:
    """Embeddings of rows [start, stop) of a feature input, float32 of shape (stop − start, D).

    Reads only those rows: ``.npy`` through a memory map, ``.npz`` by streaming the
    ``X`` member of the archive up to the range, Parquet by reading only the row groups
    that overlap it. Row order is that of :func:`read_features`.
    """
    path = Path(path)
    columns = TableColumns.of(columns)
    suffix = "." + _kind(path)
    if suffix in (".csv", ".arrow"):
        return np.asarray(read_features(path, columns).X[start:stop], dtype=np.float32)
    n, dim = feature_shape(path, columns)
    start, stop = max(0, min(start, n)), max(0, min(stop, n))
    stop = max(start, stop)
    if suffix == ".npy":
        X = np.load(path, mmap_mode="r", allow_pickle=False)
        return np.array(X[start:stop], dtype=np.float32)
    if suffix == ".npz":
        zf, member = _npz_member(path)
        with zf, zf.open(member) as stream:
            shape, fortran, dtype = _npy_stream_header(stream, path)
            if fortran:  # column-major rows are not contiguous: read the member whole
                stream.seek(0)
                return np.array(np.load(stream, allow_pickle=False)[start:stop], dtype=np.float32)
            row_bytes = dim * dtype.itemsize
            stream.seek(stream.tell() + start * row_bytes)
            buf = stream.read((stop - start) * row_bytes)
        return np.frombuffer(buf, dtype=dtype).reshape(stop - start, dim).astype(np.float32)
    parts, offset = [], 0
    for name in parquet_files(path):
        meta = pq.ParquetFile(name)
        for group in range(meta.metadata.num_row_groups):
            rows = meta.metadata.row_group(group).num_rows
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi and is_embedding_layout(meta.schema_arrow.names, columns):
                col = meta.read_row_group(group, columns=["embedding"]).column("embedding")
                parts.append(embedding_matrix(col.slice(lo - offset, hi - lo)))
            elif lo < hi:
                features = choose_columns(meta.schema_arrow, columns, name).features
                group_rows = meta.read_row_group(group, columns=features)
                parts.append(wide_matrix(group_rows.slice(lo - offset, hi - lo), features, name))
            offset += rows
            if offset >= stop:
                break
        if offset >= stop:
            break
    if not parts:
        return np.zeros((0, dim), dtype=np.float32)
    return np.concatenate(parts).astype(np.float32, copy=False)
