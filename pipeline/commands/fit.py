"""``deepdpm fit``: cluster a feature table; K is inferred."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.fit.outputs import FitResult
    from pipeline.fit.request import FitRequest
    from pipeline.io.tables import FeatureTable

HELP = ("fit DeepDPM to features (.npy, .npz, CSV, Parquet or Arrow, or a folder of tables) and "
        "write model, assignments, summary")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeline.io.columns import add_column_arguments
    from pipeline.io.results import add_json_argument
    from pipeline.tracking.options import add_registry_arguments, add_tracking_arguments

    parser.add_argument("--input", help=".npy [N, D], .npz (X, y), a table (.csv, .tsv, .parquet, "
                        ".arrow: one column per feature, or an 'embedding' list column) or a "
                        "folder of tables")
    parser.add_argument("--output", help="output directory")
    parser.add_argument("--config", help="YAML config (default: built-in defaults = cluster_configs/default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set prior.sigma_scale=0.01 (repeatable)")
    parser.add_argument("--seed", type=int, help="random seed (overrides the config's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--alternate", type=int, metavar="N",
                        help="learn features too: pretrain an MLP autoencoder on the (raw) input, then "
                        "alternate N times between DeepDPM on its embedding and AE training with the "
                        "clusters fixed; stops early once K is stable (config section 'ae')")
    dist = parser.add_argument_group(
        "distributed (Ray Train, DDP) and checkpoints",
        "Ray is used when --num-workers >= 2 or --ray-address is given (and by --resume of a "
        "run started so); otherwise the fit runs in this process, --checkpoint-every and "
        "--resume included.")
    dist.add_argument("--num-workers", type=int, metavar="W",
                      help="Ray Train workers, each with its slice of the rows (default 2 when a Ray "
                           "flag is given; 0 or 1 alone: this process)")
    dist.add_argument("--use-gpu", action="store_true",
                      help="one GPU per worker (NCCL); in-process: config device=cuda")
    dist.add_argument("--ray-address", metavar="ADDR",
                      help="Ray cluster (auto, host:port, ray://...); default $RAY_ADDRESS, else a new "
                           "local cluster")
    dist.add_argument("--checkpoint-every", type=int, metavar="N",
                      help="checkpoint every N epochs, so --resume can continue a stopped fit "
                           "(Ray: default 5, 0 only at the end; in this process: off by default)")
    dist.add_argument("--max-failures", type=int, default=3, metavar="N",
                      help="worker failures to recover from the last checkpoint (default 3)")
    dist.add_argument("--resume", metavar="DIR",
                      help="continue the stopped fit (with checkpoints) whose --output was DIR")
    parser.add_argument("--overwrite", action="store_true",
                        help="fit into an --output that already holds a fit, replacing its "
                             "outputs (and, for a distributed fit, its checkpoints)")
    dist.add_argument("--wait-for-workers", type=float, default=120.0, metavar="S",
                      help="seconds to wait for an existing cluster to offer W workers' "
                           "CPUs/GPUs before failing (default 120)")
    add_column_arguments(parser)
    add_tracking_arguments(parser)
    add_registry_arguments(parser)
    add_json_argument(parser)


def _distributed(args: argparse.Namespace) -> bool:
    """Ray when asked for (W >= 2, an address) or when resuming a run that was on Ray."""
    if args.resume:
        from pipeline.fit.request import FitRequest

        return FitRequest.load(args.resume).mode == "ray"
    return bool((args.num_workers or 0) >= 2 or args.ray_address)


def _resumed_request(args: argparse.Namespace) -> FitRequest:
    """The stored request of ``--resume DIR`` with this command's flags applied."""
    from deepdpm_core.errors import ConfigError
    from pipeline.extras import require
    from pipeline.fit.request import FitRequest

    if (args.input or args.config or args.overrides or args.seed is not None
            or args.features or args.label or args.key or args.header is not None):
        raise ConfigError("--resume DIR continues a run as it was started: drop --input, "
                          "--config, --set, --seed and the table column flags")
    if args.output and Path(args.output).resolve() != Path(args.resume).resolve():
        raise ConfigError("--resume DIR writes to DIR: drop --output or make it DIR")
    request = FitRequest.load(args.resume)
    # the directory may have moved since: its checkpoints and outputs are where it is now
    changes = {"output": str(Path(args.resume).resolve()), "max_failures": args.max_failures,
               "quiet": args.quiet, "resume": True, "ray_address": args.ray_address,
               "wait_for_workers_s": args.wait_for_workers}
    if args.num_workers is not None and request.mode == "ray":  # statistics add up over any split
        changes["num_workers"] = args.num_workers
    if args.use_gpu:
        changes["use_gpu"] = True
    if args.checkpoint_every is not None:
        changes["checkpoint_every"] = args.checkpoint_every
    if args.no_tracking:
        changes["tracking"] = False
    elif request.tracking:
        require("resuming a tracked fit", "mlflow", note="or pass --no-tracking")
    return request.with_(**changes)


def _new_request(args: argparse.Namespace) -> FitRequest:
    """The request of a new fit (stored for ``--resume`` when it keeps checkpoints)."""
    from pipeline.fit.request import FitRequest, config_from_args
    from pipeline.io.columns import columns_from_args
    from pipeline.tracking.environment import resolve_tracking_uri
    from pipeline.tracking.options import default_run_name, tracking_on

    distributed = _distributed(args)
    mode = "ray" if distributed else "alternating" if args.alternate is not None else "local"
    config = config_from_args(args.config, args.overrides, args.seed)
    tracking = tracking_on(args)
    return FitRequest(
        input=str(Path(args.input).resolve()), output=str(Path(args.output).resolve()),
        config=config, mode=mode,
        num_workers=(2 if args.num_workers is None else args.num_workers) if distributed else 1,
        use_gpu=args.use_gpu,
        checkpoint_every=(5 if distributed else 0) if args.checkpoint_every is None
        else args.checkpoint_every,
        resumable=distributed or args.checkpoint_every is not None, max_failures=args.max_failures,
        tracking=tracking,
        # resolved here: the workers' (or a resumed run's) working directory may be another
        tracking_uri=resolve_tracking_uri(args.tracking_uri) if tracking else None,
        experiment=args.experiment, run_name=default_run_name(args),
        register_model=args.register_model, model_alias=args.model_alias, quiet=args.quiet,
        alternations=args.alternate or 0, overwrite=args.overwrite, ray_address=args.ray_address,
        wait_for_workers_s=args.wait_for_workers, columns=columns_from_args(args).to_dict())


def check_input(request: FitRequest) -> None:
    """Read and check a new fit's input before torch, Ray or MLflow load, so that bad data
    is answered within a second: a fit in this process reads it whole (format, columns,
    shape, empty, NaN or inf rows), a Ray fit its metadata (its workers check their rows),
    an alternating fit (which flattens images) its format. A fit in this process whose
    memory need exceeds what is available is refused too
    (:func:`pipeline.fit.memory.check_fit_memory`).

    Raises
    ------
    DataError
    """
    from deepdpm_core.config import check_row_count
    from deepdpm_core.errors import DataError
    from pipeline.io.feature_rows import feature_shape
    from pipeline.io.row_checks import check_fit_rows
    from pipeline.io.tables import read_features

    if request.mode == "ray":
        n, dim = feature_shape(request.input, request.table_columns)
        if n == 0 or dim == 0:
            raise DataError(f"{request.input} has no {'rows' if n == 0 else 'feature columns'}")
        return
    table = read_features(request.input, request.table_columns)
    if request.mode != "alternating":
        from pipeline.fit.memory import check_fit_memory

        check_fit_rows(table, request.input)
        config = request.fit_config()
        check_row_count(len(table.X), config.init.rows_needed, str(request.input))
        check_fit_memory(config, *table.X.shape, request.input)
    if table.feature_names and request.table_columns.features is None:
        _warn_of_class_codes(table)


def _warn_of_class_codes(table: FeatureTable) -> None:
    """One line on stderr naming the feature columns that look like class codes
    (:func:`deepdpm_core.class_codes.class_code_columns`) and the flags that take them out."""
    import sys

    from deepdpm_core.class_codes import class_code_columns

    found = class_code_columns(table.X, table.feature_names)
    if found:
        shown = ", ".join(repr(n) for n in found[:5]) + (", ..." if len(found) > 5 else "")
        one = len(found) == 1
        print(f"deepdpm fit: warning: column{'' if one else 's'} {shown} look{'s' if one else ''} "
              f"like {'a class code' if one else 'class codes'} but {'is' if one else 'are'} "
              f"clustered as {'a feature' if one else 'features'}: name the label column with "
              f"--label {found[0] if one else 'NAME'}, or the features with --features",
              file=sys.stderr)


def request_from_args(args: argparse.Namespace) -> FitRequest:
    """The :class:`~pipeline.fit.request.FitRequest` of ``deepdpm fit`` flags, checked.

    Nothing heavy (torch, scikit-learn, MLflow, Ray) is imported here, so a bad flag, path,
    config key or missing extra (:mod:`pipeline.extras`) is answered at once.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed by :func:`add_arguments`.

    Returns
    -------
    FitRequest

    Raises
    ------
    ConfigError
        Flags that do not go together, a bad config, or an output that holds an earlier fit.
    MissingExtraError
        Ray (``--num-workers 2``, ``--ray-address``) or MLflow (a tracking flag) asked for
        and not installed.
    FileNotFoundError
        ``--input`` does not exist.
    """
    from deepdpm_core.errors import ConfigError
    from pipeline.extras import require

    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        # checked before the fit: its outputs would otherwise be lost at the end
        raise ConfigError(f"--output {args.output} exists and is not a directory")
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts afresh and --resume continues: give one of them")
    if args.output and not args.resume and not args.overwrite:
        _refuse_an_earlier_fit(Path(args.output))
        from pipeline.io.existing_outputs import refuse_foreign_folder

        # a report beside the fit, or a fit's leftovers, make the folder a fit's
        refuse_foreign_folder(args.output, args.overwrite, FIT_ENTRIES, "fit")
    if args.alternate is not None and (_distributed(args) or args.resume
                                       or args.checkpoint_every is not None):
        raise ConfigError("--alternate runs in this process without checkpoints: drop "
                          "--num-workers, --ray-address, --resume and --checkpoint-every")
    if args.resume:
        if not _distributed(args) and ((args.num_workers or 0) >= 2 or args.ray_address):
            raise ConfigError(f"{args.resume} holds a fit that ran in one process: resume it "
                              "without --num-workers and --ray-address")
        if _distributed(args):
            require("resuming a fit that ran on Ray", "ray")
        return _resumed_request(args)
    if not args.input or not args.output:
        raise ConfigError("--input and --output are required (unless --resume DIR)")
    if not Path(args.input).exists():  # here, not when the fit reads it after loading torch
        raise FileNotFoundError(f"input not found: {args.input}")
    source, out = Path(args.input).resolve(), Path(args.output).resolve()
    if source.is_dir() and (out == source or source in out.parents):
        # its outputs would become input: read by the next fit, and a changed input to --resume
        raise ConfigError(f"--output {args.output} is inside the --input folder {args.input}: "
                          "choose an output outside it")
    if _distributed(args):
        flags = " ".join(([f"--num-workers {args.num_workers}"] if args.num_workers else [])
                         + (["--ray-address"] if args.ray_address else []))
        require(f"a fit on Ray ({flags})", "ray")
    return _new_request(args)


def _print_summary(args: argparse.Namespace, result: FitResult) -> None:
    """The result: one line on stdout (``--json``: one JSON object)."""
    from pipeline.io.results import print_result, scores_text, shown_path

    summary, output = result.summary, shown_path(result.output)
    steps = (f"alternations={len(summary['alternation']) - 1}" if "alternation" in summary
             else f"epochs={summary['epochs']}")
    tiny = summary.get("tiny_clusters") or []
    sizes = summary.get("cluster_sizes") or []
    tiny_text = (f" ({len(tiny)} tiny: {', '.join(str(sizes[k]) for k in tiny[:5])}"
                 f"{', ...' if len(tiny) > 5 else ''} rows)" if tiny else "")
    human = (f"K={summary['n_clusters']}{tiny_text} {steps} time={summary['fit_seconds']:.1f}s "
             f"{scores_text(summary['metrics'])}".rstrip() + _columns_text(summary)
             + f" -> {output}" + _tracking_text(result))
    out = Path(output)
    data = {
        "output": output,
        "n_clusters_tiny": len(tiny), "tiny_clusters": tiny,
        **{key: summary.get(key) for key in ("n_clusters", "n_clusters_nonempty", "epochs",
                                             "fit_seconds", "n_samples", "n_features", "metrics")},
        "files": {name: str(out / name) for name in result.files},
        "mlflow_run_id": result.run_id, "mlflow_tracking_uri": result.tracking_uri,
        "columns_used": summary.get("columns_used"),
    }
    if "alternation" in summary:
        data["alternations"] = len(summary["alternation"]) - 1
    print_result(args, human, data)


def _tracking_text(result: FitResult) -> str:
    """`` [MLflow run ID in URI]``: where a tracked fit's run went (empty untracked)."""
    if result.tracking_uri is None:
        return ""
    run = f"run {result.run_id}" if result.run_id else "run"
    return f" [MLflow {run} in {result.tracking_uri}]"


def _columns_text(summary: dict) -> str:
    """`` features=64 (pixel_0_0 … pixel_7_7) label=digit key=none``: the columns a fit
    from a table used (empty for an input without named columns)."""
    used = summary.get("columns_used")
    if not used:
        return ""
    names = used["features"]
    span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
    return (f" features={len(names)} ({span}) label={used['label'] or 'none'} "
            f"key={used['key'] or 'none'}")


#: files whose presence means a directory holds a fit (finished, or its checkpoints)
EARLIER_FIT_FILES = ("summary.json", "model.pt", "assignments.parquet")
#: what a fit (or a report of it) writes into its folder: the entries that make an existing
#: folder a fit's own rather than one of the user's (kept in step with
#: pipeline.fit.outputs.RUN_OUTPUTS and FIT_STATE, which load numpy and torch)
FIT_ENTRIES = (*EARLIER_FIT_FILES, "config.yaml", "*.png", "autoencoder.pt", "embedding.parquet",
               "checkpoints", "ray_train", "fit_request.json", "worker_error.json",
               "stop_requested", "report.html")


def _refuse_an_earlier_fit(out: Path) -> None:
    """A fit never silently replaces another: ConfigError when ``out`` holds one."""
    from deepdpm_core.errors import ConfigError
    from pipeline.fit.checkpoints import refuse_earlier_checkpoints

    refuse_earlier_checkpoints(out)
    held = [name for name in EARLIER_FIT_FILES if (out / name).exists()]
    if held:
        raise ConfigError(f"--output {out} already holds a fit ({', '.join(held)}): pass "
                          "--overwrite to replace it, or choose another --output")


def run(args: argparse.Namespace) -> int:
    """``deepdpm fit``: build the request from the flags and run it in its mode."""
    import sys

    from pipeline.io.run_folder import LAST_OUTPUT, publishes_in_place

    request = request_from_args(args)
    if publishes_in_place(request.output):  # said before the fit, not found out after it
        print(f"deepdpm fit: warning: {request.output} is or holds a mount point: its outputs "
              f"are replaced one by one, {LAST_OUTPUT} last (not in one step)", file=sys.stderr)
    if not request.resume:
        check_input(request)
    from pipeline.fit import run_fit

    _print_summary(args, run_fit(request))
    return 0
