"""``deepdpm predict`` over a folder of Parquet files: Ray Data with the model in an actor pool.

One work item per Parquet row group of every input file without a finished output; each
actor (:class:`PredictRowGroups`) loads the model's assigner once, and the driver (which
imports no torch) collects a file's row groups by their (file, row group) index and writes
``IN/a/b.parquet``'s ``OUT/a/b.parquet`` atomically, its metadata naming the row count and
the model's SHA-256 so that a rerun skips it. Nothing holds the whole table or N x K
values. Details: docs/distributed.md, "Batch predict over a folder".
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from deepdpm_core.errors import ConfigError, DeepDPMError
from pipeline.io.input_fingerprint import file_sha256
from pipeline.io.parquet_batches import open_parquet
from pipeline.io.row_checks import check_finite_rows
from pipeline.io.tables import embedding_matrix
from pipeline.predict.files import (
    InputFile,
    input_files,
    inspect_input,
    is_complete,
    read_assigner,
    shared_columns,
    write_output,
)
from pipeline.ray_cluster.local import connect_ray, missing_resources

#: seconds an existing cluster may take to offer the actors' resources (nodes joining)
WAIT_FOR_RESOURCES_S = 120.0


@dataclass
class FolderPrediction:
    """What :func:`predict_folder` did.

    Attributes
    ----------
    predicted : relative names of the files predicted by this run
    skipped : relative names of the files whose output was complete already
    rows : rows predicted by this run
    n_clusters : K of the model
    seconds : wall time, Ray start and actor start-up included
    """

    predicted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    rows: int = 0
    n_clusters: int = 0
    seconds: float = 0.0


class PredictRowGroups:
    """Ray Data actor: loads the model's assigner once, then assigns whole Parquet row groups.

    Parameters
    ----------
    model : list of one ObjectRef
        The bytes of a torch file of the model's
        :class:`~deepdpm_core.model.fitted_model.ClusterAssigner` state (wrapped in a list so Ray
        hands the reference over as it is).
    files : list of str
        Input paths, in the order of their indices.
    columns : list of str
        The columns to read: ``embedding`` and the ``key``/``label`` every file has.
    batch_size : int
        Rows read and assigned at a time.
    threads : int
        Torch CPU threads.
    """

    def __init__(self, model: list, files: list[str], columns: list[str], batch_size: int,
                 threads: int) -> None:
        import ray
        import torch

        from deepdpm_core.model import ClusterAssigner

        torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.pt"
            path.write_bytes(ray.get(model[0]))
            self.model = ClusterAssigner.load(path)
        self.files, self.columns, self.batch_size = files, columns, batch_size

    def __call__(self, items: pa.Table) -> pa.Table:
        """Work items (``file``, ``row_group``) -> ``file``, ``row_group``, ``key`` (when
        read), ``cluster`` (int32), ``confidence`` (float32), ``label`` (as read) of every
        row of those row groups, in file order."""
        from ray.exceptions import UserCodeException

        parts = []
        for file, group in zip(items.column("file").to_pylist(), items.column("row_group").to_pylist(),
                               strict=True):
            parquet = open_parquet(self.files[file])
            start = sum(parquet.metadata.row_group(g).num_rows for g in range(group))
            for batch in parquet.iter_batches(batch_size=self.batch_size, row_groups=[group],
                                              columns=self.columns):
                try:
                    X = embedding_matrix(batch.column("embedding"))
                    check_finite_rows(X, self.files[file], start)
                    labels, confidence = self.model.predict_confidence(X, batch_size=self.batch_size)
                except DeepDPMError as exc:  # bad rows: Ray Data relays this one quietly, error inside
                    raise UserCodeException(exc) from None
                n = len(labels)
                start += n
                columns = {"file": pa.array(np.full(n, file, np.int32)),
                           "row_group": pa.array(np.full(n, group, np.int32))}
                if "key" in batch.schema.names:
                    columns["key"] = batch.column("key")
                columns["cluster"] = pa.array(labels.astype(np.int32))
                columns["confidence"] = pa.array(confidence.astype(np.float32))
                if "label" in batch.schema.names:
                    columns["label"] = batch.column("label")
                parts.append(pa.table(columns))
        return pa.concat_tables(parts)


def predict_folder(
    model_file: str | Path, input_dir: str | Path, output_dir: str | Path, *,
    batch_size: int = 4096, num_workers: int = 1, cpus_per_worker: float = 1.0,
    ray_address: str | None = None, progress: bool = True, overwrite: bool = False,
) -> FolderPrediction:
    """Predict every Parquet file of ``input_dir`` into ``output_dir`` (resumable).

    Parameters
    ----------
    model_file : a local model file (``deepdpm fit``'s ``model.pt``)
    input_dir : folder of feature tables (``embedding`` [D], optional ``key``, ``label``)
    output_dir : gets one Parquet file per input file, under the same relative name
    batch_size : rows per actor call and per forward pass; an actor's memory grows as
        batch_size x K
    num_workers : model actors, each ``cpus_per_worker`` CPUs (torch threads)
    ray_address : Ray cluster (``auto``, ``host:port``, ``ray://``); default
        ``$RAY_ADDRESS``, else a new local cluster; a connected driver is used as it is
    progress : show a progress bar (rows) on stderr
    overwrite : predict every file again, also over an output of another model or one
        that ``deepdpm predict`` did not write (refused otherwise)

    Returns
    -------
    FolderPrediction

    Raises
    ------
    DataError
        No Parquet file, a file the model cannot read (wrong D, no embeddings,
        non-finite values), files that differ in their ``key``/``label`` columns.
    ConfigError
        Bad options, an output folder with another model's predictions or with a file
        ``deepdpm predict`` did not write (without ``overwrite``), a cluster without the
        actors' resources.
    """
    start = time.perf_counter()
    if batch_size < 1 or num_workers < 1 or cpus_per_worker <= 0:
        raise ConfigError("--batch-size and --num-workers must be >= 1 and --cpus-per-worker > 0")
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output {output_dir} is a file; a folder --input needs a folder --output")
    paths = input_files(input_dir)
    digest = file_sha256(model_file)  # which model each output was predicted with
    dim, n_clusters, assigner = read_assigner(model_file)  # fails here, once, on a bad model file
    files = [inspect_input(p, output_dir / Path(p).relative_to(input_dir), dim) for p in paths]
    columns = shared_columns(paths)

    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.rglob(".*.parquet.*.tmp"):  # left by a killed run
        stale.unlink()
    report = FolderPrediction(n_clusters=n_clusters)
    todo = []
    for f in files:
        if not overwrite and is_complete(f.output, f.rows, digest):
            report.skipped.append(str(f.output.relative_to(output_dir)))
        else:
            todo.append(f)
    for f in [f for f in todo if f.rows == 0]:  # no rows reach the driver for these
        write_output(f, [], digest)
    todo_rows = [f for f in todo if f.rows > 0]
    if todo_rows:
        import ray

        with contextlib.redirect_stdout(sys.stderr):  # Ray relays worker logs to stdout
            # worker logs stay in Ray's log files: stdout is for the result, errors come back raised
            started_here = connect_ray(ray_address, include_dashboard=False, log_to_driver=False)
            try:
                _check_resources(num_workers, cpus_per_worker,
                                 0.0 if started_here == "local" else WAIT_FOR_RESOURCES_S)
                chunks = _predicted_row_groups(todo_rows, columns, ray.put(assigner), batch_size,
                                               num_workers, cpus_per_worker)
                report.rows = _write_files(todo_rows, chunks, digest, progress)
            except Exception as exc:
                user_error = _user_error(exc)
                if user_error is not None:
                    raise user_error from None
                raise
            finally:
                if started_here:
                    ray.shutdown()
    report.predicted = [str(f.output.relative_to(output_dir)) for f in todo]
    report.seconds = time.perf_counter() - start
    return report


def _check_resources(num_workers: int, cpus_per_worker: float, wait_s: float) -> None:
    """Fail fast when the cluster cannot host the actors and one read task besides
    (Ray Data would wait forever), waiting up to ``wait_s`` for joining nodes."""
    need = num_workers * cpus_per_worker + 1.0
    have = missing_resources({"CPU": need}, wait_s)
    if have is not None:
        raise ConfigError(f"{num_workers} model actors of {cpus_per_worker:g} CPUs and a read "
                          f"task need {need:g} CPUs, but the Ray cluster has {have.get('CPU', 0.0):g}; "
                          "lower --num-workers or --cpus-per-worker, or add nodes")


def _predicted_row_groups(files: list[InputFile], columns: list[str], model_ref, batch_size: int,
                          num_workers: int, cpus_per_worker: float) -> Iterator[tuple[int, int, pa.Table]]:
    """(file index, row group index, that row group's predictions), in any order."""
    import ray
    from ray.data import ActorPoolStrategy

    items = [{"file": i, "row_group": g} for i, f in enumerate(files) for g in f.row_groups]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(
        PredictRowGroups,
        fn_constructor_kwargs={"model": [model_ref], "files": [f.path for f in files], "columns": columns,
                               "batch_size": batch_size, "threads": max(1, int(cpus_per_worker))},
        compute=ActorPoolStrategy(size=num_workers),
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=cpus_per_worker,
    )
    ds.context.execution_options.preserve_order = True  # files finish one after another
    ds.context.enable_progress_bars = False  # the driver shows one bar
    ds.context.raise_original_map_exception = True  # the actor's error reaches the driver
    for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        key = block.column("file").to_numpy().astype(np.int64) << 32 | block.column("row_group").to_numpy()
        starts = [0, *(np.flatnonzero(np.diff(key)) + 1), len(key)]
        for lo, hi in itertools.pairwise(starts):
            if hi > lo:
                yield int(key[lo] >> 32), int(key[lo] & 0xFFFFFFFF), block.slice(lo, hi - lo)


def _write_files(files: list[InputFile], chunks: Iterator[tuple[int, int, pa.Table]], digest: str,
                 progress: bool) -> int:
    """Collect each file's row groups and write the file once all are in; returns the
    rows written."""
    from deepdpm_core.progress_bars import progress_bar

    pending: dict[int, dict[int, list[pa.Table]]] = {}
    done: set[int] = set()
    rows = 0
    with contextlib.closing(chunks), progress_bar(  # closing: stop Ray Data before Ray goes
            progress, total=sum(f.rows for f in files), desc="predict", unit="row") as bar:
        for index, group, chunk in chunks:
            if index in done:
                raise RuntimeError(f"row group {group} of {files[index].path} came back twice")
            pending.setdefault(index, {}).setdefault(group, []).append(chunk)
            if bar is not None:
                bar.update(len(chunk))
            f = files[index]
            got = pending[index]
            if set(got) == set(f.row_groups) and sum(len(c) for g in got.values() for c in g) == f.rows:
                rows += write_output(f, [c for g in sorted(got) for c in got[g]], digest)
                del pending[index]
                done.add(index)
    missing = [f.path for i, f in enumerate(files) if i not in done]
    if missing:
        raise RuntimeError(f"not every row came back for {', '.join(missing)}")
    return rows


def _user_error(exc: BaseException) -> DeepDPMError | None:
    """The user error (bad rows, say) an actor raised, if that is what failed the run:
    Ray hands it over wrapped (a RayTaskError whose ``cause`` is the actor's
    UserCodeException, which holds the error as its argument)."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        # Ray's copies subclass the error too but print a traceback: the original only
        if isinstance(e, DeepDPMError) and type(e).__module__ == DeepDPMError.__module__:
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None), *e.args]
    return None


__all__ = ["FolderPrediction", "PredictRowGroups", "predict_folder"]
