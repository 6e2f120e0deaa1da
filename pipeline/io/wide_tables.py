"""Reading tables as Arrow: CSV (with or without a header), Parquet and Arrow/Feather files,
and turning a wide table (one column per feature) into rows.

What is read as what is :mod:`pipeline.io.tables`; which columns are the features, the
label and the key, :mod:`pipeline.io.columns`. Only numpy and pyarrow are imported here, so
a command reads and checks its data before torch loads.
"""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

import numpy as np
import pyarrow as pa

from deepdpm_core.errors import DataError
from pipeline.io.columns import ChosenColumns

#: file name endings -> kind of file
SUFFIX_KINDS: dict[str, str] = {
    ".npy": "npy", ".npz": "npz", ".parquet": "parquet", ".pq": "parquet",
    ".csv": "csv", ".tsv": "csv", ".csv.gz": "csv", ".tsv.gz": "csv",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
}  # fmt: skip
#: what an unknown input is told it may be
KNOWN_FORMATS = ".npy, .npz, .parquet, .csv, .tsv or .arrow/.feather"


def file_kind(path: str | Path) -> str | None:
    """``"npy"``, ``"npz"``, ``"parquet"``, ``"csv"`` or ``"arrow"`` from the file's name;
    None for another name."""
    name = Path(path).name.lower()
    for suffix, kind in sorted(SUFFIX_KINDS.items(), key=lambda item: -len(item[0])):
        if name.endswith(suffix):
            return kind
    return None


def _delimiter(path: Path) -> str:
    return "\t" if ".tsv" in path.name.lower() else ","


def _gzipped(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def _first_line(path: Path, data: bytes | None = None) -> list[str] | None:
    """The fields of the first non-blank line of a CSV (None: the file has none); read from
    ``data``, the file's bytes, where given."""
    raw = open(path, "rb") if data is None else io.BytesIO(data)  # closed by the with below
    binary = gzip.GzipFile(fileobj=raw) if _gzipped(path) else raw
    # utf-8-sig: a byte-order mark is not part of the first field (pyarrow drops it too)
    with raw, io.TextIOWrapper(binary, encoding="utf-8-sig", errors="replace", newline="") as f:
        for row in csv.reader(f, delimiter=_delimiter(path)):
            if any(field.strip() for field in row):
                return row
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _source(path: Path, data: bytes | None, gzipped: bool = False) -> str | pa.NativeFile:
    """What pyarrow reads: the path, or the file's bytes already read (``data``)."""
    if data is None:
        return str(path)
    buffer = pa.BufferReader(data)
    return pa.CompressedInputStream(buffer, "gzip") if gzipped else buffer


def read_csv(path: str | Path, header: bool | None = None, data: bytes | None = None) -> pa.Table:
    """A CSV (``.tsv``: tab-separated; ``.gz``: compressed) as an Arrow table.

    Parameters
    ----------
    header : bool, optional
        The first line names the columns; None: it does unless all its fields are
        numbers. Without a header the columns are named by position, ``"0"``, ``"1"``, ...
    data : bytes, optional
        The file's bytes, read already: parsed instead of reading ``path`` again.

    Raises
    ------
    DataError
        An empty or unreadable file (rows of different lengths, bad encoding).
    """
    import pyarrow.csv as pcsv

    path = Path(path)
    try:
        first = _first_line(path, data)
    except (OSError, UnicodeError, csv.Error, EOFError) as exc:
        raise DataError(f"cannot read CSV {path}: {exc}") from exc
    if first is None:
        raise DataError(f"{path} is empty")
    if header is None:
        header = not all(_is_number(field) for field in first)
    names = None if header else [str(i) for i in range(len(first))]
    try:
        table = pcsv.read_csv(
            _source(path, data, _gzipped(path)),
            read_options=pcsv.ReadOptions(column_names=names),
            parse_options=pcsv.ParseOptions(delimiter=_delimiter(path)),
            convert_options=pcsv.ConvertOptions(strings_can_be_null=True),
        )
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read CSV {path}: {str(exc).splitlines()[0]}") from exc
    try:
        table.column_names  # noqa: B018 - pyarrow decodes the names only when asked
    except UnicodeDecodeError as exc:
        raise DataError(f"cannot read CSV {path}: its header is not UTF-8 text (byte "
                        f"{exc.object[exc.start:exc.start + 1]!r}): save the file as UTF-8") from None
    return table


def read_arrow(path: str | Path, data: bytes | None = None) -> pa.Table:
    """An Arrow IPC file or stream, or a Feather file, as a table (from ``data``, the
    file's bytes, where given).

    Raises
    ------
    DataError
        Not an Arrow or Feather file.
    """
    import pyarrow.feather as feather

    path = Path(path)
    try:
        return feather.read_table(_source(path, data))
    except (pa.ArrowInvalid, OSError):
        pass
    try:
        with pa.OSFile(str(path), "rb") if data is None else pa.BufferReader(data) as f:
            return pa.ipc.open_stream(f).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read Arrow {path}: {exc}") from exc


def read_parquet_schema(path: str | Path, data: bytes | None = None) -> pa.Schema:
    """A Parquet file's schema (from ``data``, the file's bytes, where given), read as
    :func:`read_parquet` reads its rows."""
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(_source(Path(path), data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read Parquet {path}: {exc}") from exc


def read_parquet(path: str | Path, columns: list[str] | None = None, data: bytes | None = None
                 ) -> pa.Table:
    """One Parquet file (the ``columns`` asked for, or all) as a table (from ``data``, the
    file's bytes, where given).

    Raises
    ------
    DataError
        Not a readable Parquet file.
    """
    import pyarrow.parquet as pq

    try:
        return pq.read_table(_source(Path(path), data), columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read Parquet {path}: {exc}") from exc


def column_numbers(column: pa.ChunkedArray, dtype: type = np.float64, empty: float = np.nan
                   ) -> np.ndarray:
    """A numeric column as ``dtype`` (N,), empty cells as ``empty``.

    Read from the Arrow buffers: ``to_numpy`` and ``fill_null`` load pandas (0.3 s), which a
    command checking its data before anything heavy loads goes without.
    """
    out = np.full(len(column), empty, dtype=dtype)
    at = 0
    for chunk in column.chunks:
        n = len(chunk)
        if n and chunk.null_count < n:
            chunk = chunk.cast(pa.from_numpy_dtype(np.dtype(dtype)))
            validity, data = chunk.buffers()[:2]
            values = np.frombuffer(data, dtype=dtype, count=chunk.offset + n)[chunk.offset:]
            if validity is not None and chunk.null_count:
                bits = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")
                values = np.where(bits[chunk.offset:chunk.offset + n].astype(bool), values, empty)
            out[at:at + n] = values
        at += n
    return out


def wide_matrix(table: pa.Table, features: list[str], path: str | Path = "the table"
                ) -> np.ndarray:
    """The ``features`` columns of ``table`` as float32 (N, D), empty cells as NaN.

    Raises
    ------
    DataError
        A column of integers that a float cannot hold exactly (beyond 2^53: ids), named.
    """
    X = np.empty((table.num_rows, len(features)), dtype=np.float32)
    for j, name in enumerate(features):
        try:
            values = column_numbers(table.column(name), np.float64)
        except pa.ArrowInvalid:
            raise DataError(f"{path}: column {name!r} holds integers beyond 2^53, which features "
                            f"(floats) cannot hold: if it identifies rows, name it with --key "
                            f"{name}") from None
        check_float32_range(values, f"{path}: column {name!r}")
        X[:, j] = values
    return X


def check_float32_range(values: np.ndarray, where: str) -> None:
    """Refuse finite values beyond float32's range (|x| > 3.4e38), which the fit's float32
    features would hold as inf, naming the first row (``where`` names the data).

    Raises
    ------
    DataError
    """
    if values.dtype.kind != "f" or values.dtype.itemsize <= 4:
        return
    with np.errstate(invalid="ignore"):
        beyond = np.flatnonzero(np.isfinite(values) & (np.abs(values) > np.finfo(np.float32).max))
    if beyond.size:
        row = np.unravel_index(beyond[0], values.shape)[0]
        raise DataError(f"{where} holds {beyond.size} value(s) beyond float32's range (|x| > 3.4e38), "
                        f"e.g. {values.flat[beyond[0]]:g} in row {row}: rescale the features")


def label_values(column: pa.ChunkedArray) -> np.ndarray:
    """A label column as it was written: int64 (empty: -1) for integers and whole numbers,
    else an object array of strings (empty: None), which :func:`label_codes` numbers."""
    if pa.types.is_integer(column.type) or pa.types.is_boolean(column.type):
        return column_numbers(column, np.int64, -1)
    if pa.types.is_floating(column.type) or pa.types.is_null(column.type):
        v = column_numbers(column, np.float64)
        known = np.isfinite(v)
        if (v[known] == np.round(v[known])).all():
            return np.where(known, v, -1).astype(np.int64)
    return np.array([None if v is None else str(v) for v in column.to_pylist()], dtype=object)


def label_codes(values: np.ndarray) -> tuple[np.ndarray, list[str] | None]:
    """Labels as int64 (N,) (-1: none) and, for string labels, the name of each code.

    Strings are numbered in sorted order; integers are kept as they are.
    """
    if values.dtype != object:
        return values.astype(np.int64), None
    known = np.array([v is not None for v in values], dtype=bool)
    names, codes = np.unique(values[known].astype(str), return_inverse=True)
    out = np.full(len(values), -1, dtype=np.int64)
    out[known] = codes
    return out, [str(n) for n in names]


def key_values(column: pa.ChunkedArray) -> np.ndarray:
    """A key column as strings, object (N,)."""
    return np.array(["" if v is None else str(v) for v in column.to_pylist()], dtype=object)


def rows_of(table: pa.Table, chosen: ChosenColumns, path: str | Path = "the table"
            ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The features (N, D) float32, the raw labels (:func:`label_values`) and the keys
    (object, N) of a wide table; labels and keys None where no column gives them.

    Raises
    ------
    DataError
        A feature column without a value in any row (named), as :func:`wide_matrix`.
    """
    empty = [n for n in chosen.features if table.num_rows and table.column(n).null_count == table.num_rows]
    if empty:
        raise DataError(f"{path}: column(s) {', '.join(map(repr, empty[:8]))} have no value in any "
                        "row: drop them, or name the feature columns with --features")
    X = wide_matrix(table, chosen.features, path)
    labels = label_values(table.column(chosen.label)) if chosen.label is not None else None
    keys = key_values(table.column(chosen.key)) if chosen.key is not None else None
    return X, labels, keys


def read_any_table(path: Path, kind: str, header: bool | None, data: bytes | None = None
                   ) -> pa.Table:
    """A CSV, Arrow or Parquet file as a table (from ``data``, its bytes, where given)."""
    if kind == "csv":
        return read_csv(path, header, data)
    if kind == "arrow":
        return read_arrow(path, data)
    return read_parquet(path, data=data)


__all__ = ["KNOWN_FORMATS", "SUFFIX_KINDS", "check_float32_range", "column_numbers", "file_kind", "key_values",
           "label_codes", "label_values", "read_any_table", "read_arrow", "read_csv",
           "read_parquet", "rows_of", "wide_matrix"]
