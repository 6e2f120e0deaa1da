"""Reading feature tables and writing outputs atomically.

The feature table is the hand-off between ``extract``/``embed`` and ``fit``/``predict``:
Parquet with ``key: string``, ``embedding: fixed_size_list<float32>[D]`` and
``label: int64`` (nullable). ``.npy`` (an [N, D] array) and ``.npz`` (``X``, optional
``y``) are accepted as inputs too.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zipfile
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
    if path.is_dir() and not _parquet_files(path):
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

    Without pre-buffering, which reads every row group asked for ahead of the batches and
    holds them (a whole file, read from its start), and through a buffer of
    :data:`PARQUET_READ_BUFFER` bytes instead of each column chunk read whole (512 MB
    for a row group of 1M rows of 128 float32 features).

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

    A Parquet file is read ``batch_size`` rows at a time (every batch but the last has
    ``batch_size`` rows, across row groups), so about two batches of rows are in memory
    whatever the file's size; keys are row numbers where the file has none, labels are
    given for every batch when the file holds any. ``.npy`` and ``.npz`` are read whole
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


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux:
    ``/proc/self/status``); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666`` less the umask."""
    return 0o666 & ~current_umask()


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; rename it over ``final`` on success.

    A crash mid-write leaves ``final`` untouched (old content or absent). The file gets
    the mode a plain ``open(final, "w")`` would (``0o666`` less the umask), not
    ``mkstemp``'s private ``0o600``.
    """
    final = Path(final)
    if final.is_dir():  # before anything is written; os.replace would name the temporary file
        raise IsADirectoryError(f"output {final} is a folder; expected a file path")
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, default_file_mode())
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


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


# -- row ranges: what one rank of a distributed fit reads ------------------------------------

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


def _parquet_files(path: Path) -> list[str]:
    """The files of a Parquet file or directory, in the order ``pq.read_table`` reads them."""
    import pyarrow.dataset as pads

    try:
        return list(pads.dataset(path, format="parquet").files)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read Parquet {path}: {exc}") from exc


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
    _check_real(dtype, path)
    return int(shape[0]), int(shape[1])


def _check_real(dtype: np.dtype, path: Path) -> None:
    # imported here: the module imports torch, which the folder predict's driver goes without
    from deepdpm_core.validation import is_real_dtype

    if not is_real_dtype(dtype):
        raise DataError(f"{path}: features must be real numbers, got dtype {dtype}")


def _check_rows(X: np.ndarray, path: Path) -> None:
    """An array of rows of real numbers ([N, D], or [N, ...] images that ``embed`` flattens)."""
    if X.ndim == 0:
        raise DataError(f"{path}: features must be an array of rows [N, D], got a single value")
    _check_real(X.dtype, path)


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


def feature_shape(path: str | Path) -> tuple[int, int]:
    """(N, D) of a feature input (see :func:`read_features`) from its metadata only.

    Raises
    ------
    DataError
        Unknown format, no ``embedding``/``X``, not a numeric 2-D array.
    FileNotFoundError
        ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input not found: {path}")
    suffix = path.suffix.lower()
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
        for name in _parquet_files(path):
            meta = pq.ParquetFile(name)
            if "embedding" not in meta.schema_arrow.names:
                raise DataError(f"{name} has no column 'embedding' (found: {meta.schema_arrow.names})")
            n += meta.metadata.num_rows
            typ = meta.schema_arrow.field("embedding").type
            if dim is None and pa.types.is_fixed_size_list(typ):
                dim = typ.list_size
            elif dim is None and meta.metadata.num_rows:
                dim = embedding_matrix(meta.read_row_group(0, columns=["embedding"])
                                       .column("embedding").slice(0, 1)).shape[1]
        return n, int(dim or 0)
    raise DataError(f"unsupported input '{path}': expected .npy, .npz or .parquet")


def read_feature_rows(path: str | Path, start: int, stop: int) -> np.ndarray:
    """Embeddings of rows [start, stop) of a feature input, float32 of shape (stop − start, D).

    Reads only those rows: ``.npy`` through a memory map, ``.npz`` by streaming the
    ``X`` member of the archive up to the range, Parquet by reading only the row groups
    that overlap it. Row order is that of :func:`read_features`.
    """
    path = Path(path)
    n, dim = feature_shape(path)
    start, stop = max(0, min(start, n)), max(0, min(stop, n))
    stop = max(start, stop)
    suffix = path.suffix.lower()
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
    for name in _parquet_files(path):
        meta = pq.ParquetFile(name)
        for group in range(meta.metadata.num_row_groups):
            rows = meta.metadata.row_group(group).num_rows
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi:
                col = meta.read_row_group(group, columns=["embedding"]).column("embedding")
                parts.append(embedding_matrix(col.slice(lo - offset, hi - lo)))
            offset += rows
            if offset >= stop:
                break
        if offset >= stop:
            break
    if not parts:
        return np.zeros((0, dim), dtype=np.float32)
    return np.concatenate(parts).astype(np.float32, copy=False)
