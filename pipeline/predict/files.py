"""The per-file side of the folder predict (:mod:`pipeline.predict.folder`): which input
files there are and what each needs, the model's digest and assigner, whether an output
is complete already, and writing one output atomically with its metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.atomic_files import atomic_path
from deepdpm_core.errors import CheckpointError, ConfigError, DataError
from pipeline.io.parquet_batches import open_parquet, parquet_labelled
from pipeline.io.table_writing import assignments_table
from pipeline.io.tables import FeatureTable

#: the output's Parquet metadata key: ``{"rows": n, "model_sha256": ...}``
METADATA_KEY = b"deepdpm.predict"


@dataclass(frozen=True)
class InputFile:
    """One input file and what its output needs.

    Attributes
    ----------
    path : absolute path of the input file
    output : where its predictions go (same name relative to the output folder)
    rows : rows in the file
    row_groups : indices of its Parquet row groups that hold rows (the work items)
    labelled : the file has a ``label`` column with at least one value (the single-file
        path writes a ``label`` column exactly then)
    """

    path: str
    output: Path
    rows: int
    row_groups: tuple[int, ...]
    labelled: bool


def input_files(folder: str | Path) -> list[str]:
    """The ``*.parquet`` files under ``folder`` (subfolders included), sorted; files and
    folders whose names start with ``.`` or ``_`` (temporary files, ``_SUCCESS``,
    ``_metadata``) are left out, as Parquet readers do.

    Raises
    ------
    DataError
        The folder holds no Parquet file.
    """
    folder = Path(folder)
    files = sorted(
        str(p) for p in folder.rglob("*.parquet")
        if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(folder).parts)
    )  # fmt: skip
    if not files:
        raise DataError(f"{folder} is a folder without .parquet files")
    return files


def read_assigner(model_file: str | Path) -> tuple[int, int, bytes]:
    """D, K and the :class:`~deepdpm_core.model.fitted_model.ClusterAssigner` of a model file,
    as the bytes of a torch file of its state (0.2 MB at K = 1000, D = 128).

    A driver without torch reads them in a child process (:mod:`pipeline.predict.model_assigner`),
    so it never holds the torch runtime (about 470 MB resident) nor any part of the model;
    a driver that imported torch already (a notebook, the tests) reads them itself.

    Raises
    ------
    CheckpointError
        Not a PyTorch checkpoint, not safe to read, or not a DeepDPM model.
    """
    from pipeline.predict.model_assigner import BAD_MODEL, assigner_state
    from pipeline.ray_cluster.local import tree_pythonpath

    if "torch" in sys.modules:
        return assigner_state(model_file)
    env = {**os.environ, "PYTHONPATH": tree_pythonpath()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "assigner.pt"
        done = subprocess.run([sys.executable, "-m", "pipeline.predict.model_assigner", str(model_file), str(out)],
                              env=env, capture_output=True, text=True)
        if done.returncode == BAD_MODEL:
            raise CheckpointError(done.stderr.strip().splitlines()[-1])
        if done.returncode != 0:
            raise RuntimeError(f"reading the model {model_file} failed (exit status "
                               f"{done.returncode}):\n{done.stderr[-3000:]}")
        shape = json.loads(done.stdout.strip().splitlines()[-1])
        return int(shape["dim"]), int(shape["n_clusters"]), out.read_bytes()


def inspect_input(path: str, output: Path, dim: int) -> InputFile:
    """Check one input file against a model of ``dim`` features, from its footer (and its
    ``label`` column when that may be all null).

    Raises
    ------
    DataError
        Unreadable file, no ``embedding`` column, embeddings that are not numbers or
        not ``dim`` long, labels that are not integers.
    """
    parquet = open_parquet(path)
    schema = parquet.schema_arrow
    if "embedding" not in schema.names:
        raise DataError(f"{path} has no column 'embedding' (found: {schema.names})")
    typ = schema.field("embedding").type
    is_list = pa.types.is_fixed_size_list(typ) or pa.types.is_list(typ) or pa.types.is_large_list(typ)
    if not is_list or not (pa.types.is_floating(typ.value_type) or pa.types.is_integer(typ.value_type)):
        raise DataError(f"{path}: column 'embedding' must be a list of numbers, got {typ}")
    if pa.types.is_fixed_size_list(typ) and typ.list_size != dim:
        raise DataError(f"{path}: embeddings have {typ.list_size} features, the model expects {dim}")
    rows = parquet.metadata.num_rows
    groups = tuple(g for g in range(parquet.metadata.num_row_groups) if parquet.metadata.row_group(g).num_rows)
    return InputFile(path=path, output=output, rows=rows, row_groups=groups,
                     labelled=parquet_labelled(parquet, path))


def is_complete(output: Path, rows: int, digest: str) -> bool:
    """True when ``output`` holds all ``rows`` predictions of the model ``digest``.

    A file that cannot be read, or was written without this module's metadata or for
    another row count, is not complete (it is predicted again).

    Raises
    ------
    ConfigError
        ``output`` holds predictions of another model.
    """
    if not output.exists():
        return False
    try:
        metadata = pq.read_schema(output).metadata or {}
        done = json.loads(metadata[METADATA_KEY])
    except (pa.ArrowInvalid, OSError, KeyError, ValueError):
        # a killed run's outputs are renamed into place whole: this is someone else's file
        raise ConfigError(f"{output} exists and was not written by deepdpm predict: pass "
                          "--overwrite to replace it, or predict into a new --output folder") from None
    if done.get("model_sha256") != digest:
        raise ConfigError(f"{output} holds predictions of another model: pass --overwrite to "
                          "replace them, or predict into a new --output folder")
    return done.get("rows") == rows


def shared_columns(paths: list[str]) -> list[str]:
    """The columns to read: ``embedding``, and ``key``/``label`` where every file has them."""
    names = [set(pq.read_schema(p).names) & {"key", "label"} for p in paths]
    if any(n != names[0] for n in names):
        differ = next(p for p, n in zip(paths, names, strict=True) if n != names[0])
        raise DataError(f"the files differ in their columns: {paths[0]} has "
                        f"{sorted(names[0]) or 'neither key nor label'}, {differ} has "
                        f"{sorted(n for n in names[paths.index(differ)]) or 'neither'}")
    return ["embedding", *sorted(names[0])]


def write_output(f: InputFile, chunks, digest: str) -> int:
    """Write one output atomically from its chunks of actor output; returns its rows."""
    metadata = {METADATA_KEY: json.dumps({"rows": f.rows, "model_sha256": digest}).encode()}
    done = 0
    with atomic_path(f.output) as tmp:
        writer = None
        for chunk in chunks:
            table = assignments_table(_feature_rows(chunk, done, f.labelled),
                                      chunk.column("cluster").to_numpy(),
                                      chunk.column("confidence").to_numpy())
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema.with_metadata(metadata))
            writer.write_table(table)
            done += len(table)
        if writer is None:  # a file without rows: the empty table of the single-file path
            empty = FeatureTable(np.zeros((0, 0), np.float32), None, np.zeros(0, object))
            table = assignments_table(empty, np.zeros(0, np.int32), np.zeros(0, np.float32))
            writer = pq.ParquetWriter(tmp, table.schema.with_metadata(metadata))
        writer.close()
        if done != f.rows:  # never rename a partial file into place
            raise RuntimeError(f"{f.path}: {done} of {f.rows} rows came back")
    return done


def _feature_rows(chunk: pa.Table, offset: int, labelled: bool) -> FeatureTable:
    """Keys and labels of a chunk of one file's rows, as the single-file reader gives them
    (keys ``"0"``, ``"1"``, ... by row number when the file has none; labels only when
    the file holds some, nulls as -1)."""
    n = len(chunk)
    if "key" in chunk.column_names:
        keys = np.asarray(chunk.column("key").to_pylist(), dtype=object)
    else:
        keys = np.array([str(i) for i in range(offset, offset + n)], dtype=object)
    labels = None
    if labelled:
        labels = np.asarray(chunk.column("label").fill_null(-1).to_numpy(), dtype=np.int64)
    return FeatureTable(X=np.zeros((n, 0), np.float32), labels=labels, keys=keys)


__all__ = ["METADATA_KEY", "InputFile", "input_files", "inspect_input", "is_complete",
           "read_assigner", "shared_columns", "write_output"]
