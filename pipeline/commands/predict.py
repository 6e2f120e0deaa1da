"""``deepdpm predict``: assign rows of a feature table with a fitted model.

A file (``.npy``, ``.npz``, a CSV, Parquet or Arrow table) is predicted in this process
into one output file, and so is a folder of CSV or Arrow files or of wide Parquet files
(read as one table). A folder of Parquet feature tables (an ``embedding`` column) is
predicted with Ray Data, the model in an actor pool, into one output file per input file
(:mod:`pipeline.predict.folder`).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.io.columns import add_column_arguments
from pipeline.io.existing_outputs import add_overwrite_argument
from pipeline.io.results import add_json_argument

if TYPE_CHECKING:
    from pipeline.io.columns import TableColumns
    from pipeline.predict.model_header import ModelHeader

HELP = "assign features to the clusters of a fitted model (writes Parquet)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model.pt written by deepdpm fit (or the fit's folder), or its MLflow "
                             "model: runs:/RUN_ID/model, models:/NAME@ALIAS (server: "
                             "$MLFLOW_TRACKING_URI)")
    parser.add_argument("--input", required=True,
                        help=".npy, .npz, a table (.csv, .tsv, .parquet, .arrow) or a folder of "
                             "tables")
    parser.add_argument("--output", required=True,
                        help="output .parquet (key, cluster, confidence, label); for a folder "
                             "--input, a folder that gets one such file per input file")
    add_overwrite_argument(parser, "an existing --output file; for a folder --input, predict every "
                           "file again, replacing the outputs of another model or of no deepdpm "
                           "predict")
    parser.add_argument("--batch-size", type=int, default=4096,
                        help="rows per forward pass and per read of a Parquet input; memory grows "
                             "as batch size x K (default 4096: 16 MB of probabilities at K = 1000)")
    ray = parser.add_argument_group(
        "folder input (Ray Data)",
        "A folder --input runs as Ray Data map_batches with the model in an actor pool; a rerun "
        "predicts only the files without a complete output.")
    ray.add_argument("--num-workers", type=int, default=1, metavar="W",
                     help="model actors (default 1)")
    ray.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C",
                     help="CPUs (and torch threads) per model actor (default 1)")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="Ray cluster (auto, host:port, ray://...); default $RAY_ADDRESS, else a "
                          "new local cluster")
    ray.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_column_arguments(parser)
    add_json_argument(parser)


@contextlib.contextmanager
def model_file(model: str) -> Iterator[Path]:
    """The local model file that ``--model`` names, for the ``with`` block (every path
    predicts with this one): a file, or the ``model.pt`` of a fit's folder; an MLflow URI is
    downloaded into a folder removed when the block ends
    (:func:`pipeline.tracking.model_uri.local_model_path`).

    Raises
    ------
    FileNotFoundError
        ``model`` is a path that does not exist.
    ConfigError
        ``model`` is a folder without a ``model.pt``.
    """
    from pipeline.extras import require
    from pipeline.tracking.model_uri import is_mlflow_uri, local_model_path

    if is_mlflow_uri(model):
        require(f"--model {model}", "mlflow")
    with local_model_path(model) as path:
        if not path.exists():
            raise FileNotFoundError(f"model not found: {model}")
        if path.is_dir():
            if not (path / "model.pt").is_file():  # not the folder of a fit
                from deepdpm_core.errors import ConfigError

                raise ConfigError(f"--model {model} is a folder without a model.pt: name the "
                                  "model.pt that deepdpm fit wrote, or its folder")
            path = path / "model.pt"
        yield path


def shown_model(model: str, path: Path) -> str:
    """The model a result names: ``--model`` where it is an MLflow URI (its download is
    gone once the prediction ends), else the file predicted with (:func:`shown_path`)."""
    from pipeline.io.results import shown_path
    from pipeline.tracking.model_uri import is_mlflow_uri

    return model if is_mlflow_uri(model) else shown_path(path)


def matched_columns(args: argparse.Namespace, header: ModelHeader | None) -> TableColumns:
    """The columns to read ``--input`` by for the model ``header`` (None: a model file
    read only by torch, which names what is wrong with it): a table's features
    by the names the model was fitted on, in the fit's order (the label and key as the
    flags, or the defaults, choose them). Checked without torch.

    Warns (a line on stderr) when only one of the two has column names, as scikit-learn
    does: the columns are then taken by position.

    Raises
    ------
    DataError
        The table's feature columns are not the model's (the extra and the missing ones
        named).
    """
    from deepdpm_core.errors import DataError, listed
    from pipeline.io.columns import TableColumns, columns_from_args
    from pipeline.io.tables import input_columns

    columns = columns_from_args(args)
    if header is None:
        return columns
    chosen = input_columns(args.input, columns)
    names = header.feature_names
    if chosen is not None and names is None:  # scikit-learn's two warnings, in the CLI's words
        _warn(f"the model was fitted without column names, but {args.input} has them: its "
              "columns are taken by position")
    if chosen is None and names is not None:
        _warn(f"{args.input} has no column names, but the model was fitted with them: its "
              "columns are taken by position")
    if chosen is None or names is None:
        return columns
    fitted, given = set(names), set(chosen.features)
    extra = [n for n in chosen.features if n not in fitted]
    missing = [n for n in names if n not in given]
    if extra or missing:
        parts = ([f"{listed(extra)} {'is' if len(extra) == 1 else 'are'} not among them"]
                 if extra else []) + ([f"{listed(missing)} missing"] if missing else [])
        raise DataError(f"{args.input} does not hold the {len(names)} feature columns the model "
                        f"was fitted on ({'; '.join(parts)}): name the label column with "
                        "--label NAME, the row ids with --key NAME, or the features with "
                        "--features")
    return TableColumns(features=tuple(names), label=chosen.label, key=chosen.key,
                        header=columns.header)


def check_width(args: argparse.Namespace, header: ModelHeader | None, dim: int) -> None:
    """Refuse an input of ``dim`` features for a model of another D, naming the flags that
    take a label or key column out (without torch).

    Raises
    ------
    DataError
    """
    from deepdpm_core.errors import DataError

    if header is not None and header.dim != dim:
        raise DataError(f"{args.input} has {dim} feature columns but the model takes "
                        f"{header.dim}: name a label column with --label NAME, a row-id "
                        "column with --key NAME, or the features with --features")


def _warn(message: str) -> None:
    import sys

    print(f"deepdpm predict: warning: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if _ray_folder(args):
        return _run_folder(args)
    return _run_file(args)


def _ray_folder(args: argparse.Namespace) -> bool:
    """A folder of Parquet feature tables (an ``embedding`` column, no ``--features``):
    predicted with Ray Data, one output file per input file. Decided from the file names and
    the first file's schema, so that a missing Ray is named before the files are read."""
    path = Path(args.input)
    if not path.is_dir():
        return False
    from deepdpm_core.errors import DataError
    from pipeline.predict.files import input_files

    try:
        files = input_files(path)
    except DataError:  # no .parquet files: read as a folder of tables
        return False
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.io.columns import columns_from_args
    from pipeline.io.tables import is_embedding_layout

    try:
        names = pq.read_schema(files[0]).names
    except (pa.ArrowInvalid, OSError):
        return True  # the folder predict names what it cannot read
    return is_embedding_layout(names, columns_from_args(args))


def _run_file(args: argparse.Namespace) -> int:
    from deepdpm_core.errors import ConfigError

    # the arguments, the input and the model's path first: a mistake is answered before
    # torch loads
    if args.num_workers != 1 or args.ray_address:
        raise ConfigError("--num-workers and --ray-address apply to a folder --input; "
                          f"{args.input} is a file (predicted in this process)")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not Path(args.input).exists():
        raise FileNotFoundError(f"input not found: {args.input}")
    if Path(args.output).resolve() == Path(args.input).resolve():  # --overwrite would replace it
        raise ConfigError(f"--output {args.output} is the --input file: choose another output")
    from pipeline.io.existing_outputs import refuse_existing_file

    refuse_existing_file(args.output, args.overwrite)
    with model_file(args.model) as path:
        return _predict_file(args, path)


def _predict_file(args: argparse.Namespace, path: Path) -> int:
    """Predict the file ``--input`` with the local model file ``path``."""
    import itertools

    import numpy as np
    import pyarrow.parquet as pq

    from deepdpm_core.errors import DataError
    from pipeline.io.parquet_batches import feature_batches
    from pipeline.io.row_checks import check_fit_rows
    from pipeline.predict.model_header import read_model_header

    # the input's first rows are read and checked against the model before torch loads
    header = read_model_header(path)
    batches = feature_batches(args.input, args.batch_size, matched_columns(args, header))
    first = next(batches, None)  # an unreadable input fails before the output is touched
    if first is None:
        raise DataError(f"{args.input} has no rows")
    check_fit_rows(first, args.input)
    check_width(args, header, first.X.shape[1])

    from deepdpm_core.atomic_files import atomic_path
    from deepdpm_core.data import ContingencyCounts, contingency_scores
    from pipeline.io.results import print_result, scores_text, shown_path
    from pipeline.io.table_writing import assignments_table
    from pipeline.predict.numpy_assigner import read_numpy_assigner

    # the net in NumPy where it computes what torch would (importing torch takes ~2 s);
    # torch's loader reads any other file, or names what is wrong with it
    model = read_numpy_assigner(path)
    if model is None:
        from deepdpm_core.model import ClusterAssigner

        model = ClusterAssigner.load(path)
    # what the result reports, counted batch by batch: the input is never held whole
    used = np.zeros(model.n_clusters, dtype=bool)
    counts = ContingencyCounts()
    rows = 0
    with atomic_path(args.output) as tmp, contextlib.ExitStack() as open_writer:
        writer = None
        for batch in itertools.chain([first], batches):
            labels, confidence = model.predict_confidence(batch.X, batch_size=args.batch_size)
            table = assignments_table(batch, labels, confidence)
            if writer is None:
                writer = open_writer.enter_context(pq.ParquetWriter(tmp, table.schema))
            writer.write_table(table)
            used[labels] = True
            if batch.labels is not None:
                known = batch.labels >= 0
                counts.add(batch.labels[known], labels[known])
            rows += len(labels)
    table = counts.table()
    scores = contingency_scores(table) if table.size else {}
    human = f"assigned {rows} rows to {model.n_clusters} clusters {scores_text(scores)}"
    print_result(args, f"{human.rstrip()} -> {shown_path(args.output)}", {
        "output": shown_path(args.output), "model": shown_model(args.model, path), "n_rows": rows,
        "n_clusters": model.n_clusters, "n_clusters_used": int(used.sum()), "metrics": scores,
    })  # fmt: skip
    return 0


def _run_folder(args: argparse.Namespace) -> int:
    from pipeline.extras import require

    require(f"a folder --input ({args.input}, predicted with Ray Data)", "ray")
    from pipeline.io.existing_outputs import refuse_foreign_folder

    # its outputs are <input file>.parquet: one there makes the folder a predict's (a rerun)
    refuse_foreign_folder(args.output, args.overwrite, ("*.parquet",), "predict")
    from pipeline.io.results import print_result, shown_path
    from pipeline.predict.folder import predict_folder

    with model_file(args.model) as model:
        done = predict_folder(
            model, args.input, args.output, batch_size=args.batch_size,
            num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker,
            ray_address=args.ray_address, progress=not args.no_progress, overwrite=args.overwrite,
        )  # fmt: skip
    n_files = len(done.predicted) + len(done.skipped)
    print_result(args, (
        f"assigned {done.rows} rows of {len(done.predicted)} files to {done.n_clusters} clusters "
        f"({len(done.skipped)} of {n_files} files done already) in {done.seconds:.1f} s "
        f"-> {shown_path(args.output)}"
    ), {
        "output": shown_path(args.output), "model": shown_model(args.model, model),
        "n_files": n_files,
        "files_predicted": done.predicted, "files_skipped": done.skipped,
        "n_rows": done.rows, "n_clusters": done.n_clusters, "seconds": round(done.seconds, 3),
    })  # fmt: skip
    return 0
