"""``deepdpm report``: one self-contained HTML page about a fit."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.io.existing_outputs import add_overwrite_argument
from pipeline.io.results import add_json_argument

HELP = "Render a self-contained HTML report of a fit (output directory or MLflow run id)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN_DIR_OR_RUN_ID",
        help="output directory of 'deepdpm fit' (has summary.json) or an MLflow run id",
    )  # fmt: skip
    parser.add_argument("--output", "-o",
                        help="HTML file to write (default: report.html in the fit's folder; a "
                             "run id needs one)")
    add_overwrite_argument(parser, "an existing --output file")
    parser.add_argument(
        "--images", metavar="DIR_OR_SHARDS",
        help="webdataset shard(s) or image directory whose keys match the assignments: "
        "adds the most confident sample images of each cluster",
    )  # fmt: skip
    parser.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI for a run id (default: $MLFLOW_TRACKING_URI, else the "
        "per-user store ~/.local/share/deepdpm/mlflow.db)",
    )
    parser.add_argument("--max-clusters", type=int, default=30, help="largest clusters shown")
    parser.add_argument("--per-cluster", type=int, default=8,
                        help="sample images per cluster (rows: at most 5)")
    parser.add_argument("--row-shape", metavar="HxW",
                        help="draw each sample row as an H x W image (rows of pixels, e.g. 8x8 "
                             "for scikit-learn's digits) instead of as numbers")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from deepdpm_core.errors import ConfigError
    from pipeline.report import run_source

    # checked before matplotlib loads, so that a mistake is answered at once
    if args.max_clusters < 1 or args.per_cluster < 1:
        raise ConfigError("--max-clusters and --per-cluster must be >= 1")
    from pipeline.report import parse_row_shape

    row_shape = parse_row_shape(args.row_shape)
    if run_source(args.run) == "run_id":
        from pipeline.extras import require

        require(f"an MLflow run id ({args.run})", "mlflow")
    if args.images and not Path(args.images).exists():
        raise FileNotFoundError(f"--images not found: {args.images}")
    if args.output is None:  # beside the fit, never in the working directory
        if run_source(args.run) == "run_id":
            raise ConfigError("a report of an MLflow run needs --output/-o FILE (a fit "
                              "folder's report goes beside the fit)")
        args.output = str(Path(args.run) / "report.html")
        from pipeline.io.locks import output_lock

        with output_lock(args.output, "report"):  # the CLI had no output to lock yet
            return _write(args, row_shape)
    return _write(args, row_shape)


def _write(args: argparse.Namespace, row_shape: tuple[int, int] | None) -> int:
    """Render the report of ``args.run`` and write it to ``args.output``."""
    from pipeline.io.existing_outputs import refuse_existing_file

    refuse_existing_file(args.output, args.overwrite)

    from pipeline.io.results import print_result, shown_path
    from pipeline.report.html_report import render_report, write_report
    from pipeline.report.run_data import load_run
    from pipeline.tracking.environment import resolve_tracking_uri

    data = load_run(args.run, resolve_tracking_uri(args.tracking_uri))
    try:
        text = render_report(data, args.images, args.max_clusters, args.per_cluster, row_shape)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        # a summary.json edited or written by something else: its values are not a fit's
        from deepdpm_core.errors import DataError

        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise DataError(f"{data.source}: summary.json does not hold a deepdpm fit's values "
                        f"({type(exc).__name__}: {first})") from None
    path = shown_path(write_report(text, args.output))
    print_result(args, f"report written to {path}", {
        "output": path, "source": data.source,
        "n_clusters": data.summary.get("n_clusters"), "metrics": data.summary.get("metrics") or {},
    })  # fmt: skip
    return 0
