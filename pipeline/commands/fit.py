"""``deepdpm fit``: cluster a feature table; K is inferred."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

HELP = "fit DeepDPM to features (.npy, .npz or Parquet) and write model, assignments, summary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeline.results import add_json_argument
    from pipeline.tracking_options import add_registry_arguments, add_tracking_arguments

    parser.add_argument("--input", help=".npy [N, D], .npz (X, y) or Parquet (embedding, label, key)")
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
    add_tracking_arguments(parser)
    add_registry_arguments(parser)
    add_json_argument(parser)


def _distributed(args: argparse.Namespace) -> bool:
    """Ray when asked for (W >= 2, an address) or when resuming a run that was on Ray."""
    if args.resume:
        from pipeline.ray_fit import FitRequest

        return not FitRequest.load(args.resume).in_process
    return bool((args.num_workers or 0) >= 2 or args.ray_address)


def _resumed_request(args: argparse.Namespace):
    """The stored request of ``--resume DIR`` with this command's flags applied."""
    from deepdpm_core.errors import ConfigError
    from pipeline.ray_fit import FitRequest

    if args.input or args.config or args.overrides or args.seed is not None:
        raise ConfigError("--resume DIR continues a run as it was started: drop --input, "
                          "--config, --set and --seed")
    if args.output and Path(args.output).resolve() != Path(args.resume).resolve():
        raise ConfigError("--resume DIR writes to DIR: drop --output or make it DIR")
    request = FitRequest.load(args.resume)
    # the directory may have moved since: its checkpoints and outputs are where it is now
    changes = {"output": str(Path(args.resume).resolve()), "max_failures": args.max_failures,
               "quiet": args.quiet}
    if args.num_workers is not None and not request.in_process:  # statistics add up over any split
        changes["num_workers"] = args.num_workers
    if args.use_gpu:
        changes["use_gpu"] = True
    if args.checkpoint_every is not None:
        changes["checkpoint_every"] = args.checkpoint_every
    return request.with_(**changes)


def _new_request(args: argparse.Namespace, in_process: bool):
    """The request of a new fit that keeps checkpoints (stored for ``--resume``)."""
    from pipeline.fitting import config_from_args
    from pipeline.ray_fit import FitRequest
    from pipeline.tracking import default_run_name, resolve_tracking_uri

    config = config_from_args(args.config, args.overrides, args.seed)
    return FitRequest(
        input=str(Path(args.input).resolve()),
        output=str(Path(args.output).resolve()),
        config=config.to_dict(),
        num_workers=1 if in_process else 2 if args.num_workers is None else args.num_workers,
        use_gpu=args.use_gpu,
        checkpoint_every=(0 if in_process else 5) if args.checkpoint_every is None else args.checkpoint_every,
        max_failures=args.max_failures,
        tracking=not args.no_tracking,
        # resolved here: the workers' (or a resumed run's) working directory may be another
        tracking_uri=None if args.no_tracking else resolve_tracking_uri(args.tracking_uri),
        experiment=args.experiment,
        run_name=default_run_name(args),
        register_model=args.register_model,
        model_alias=args.model_alias,
        quiet=args.quiet,
        in_process=in_process,
    )


def _run_distributed(args: argparse.Namespace) -> int:
    from deepdpm_core.errors import ConfigError
    from pipeline.ray_fit import run_fit

    if args.resume:
        request = _resumed_request(args)
    else:
        if not args.input or not args.output:
            raise ConfigError("--input and --output are required (unless --resume DIR)")
        request = _new_request(args, in_process=False)
    summary = run_fit(request, resume=bool(args.resume), ray_address=args.ray_address,
                      wait_for_workers_s=args.wait_for_workers, overwrite=args.overwrite)
    _print_summary(args, summary, request.output)
    return 0


#: what every fit leaves in its output directory (``--alternate`` adds two files)
FIT_FILES = ("summary.json", "assignments.parquet", "model.pt", "config.yaml")


def _print_summary(args: argparse.Namespace, summary: dict, output: str,
                   run_id: str | None = None, extra_files: tuple[str, ...] = ()) -> None:
    """The result: one line on stdout (``--json``: one JSON object)."""
    from pipeline.results import print_result, scores_text

    steps = (f"alternations={len(summary['alternation']) - 1}" if "alternation" in summary
             else f"epochs={summary['epochs']}")
    human = (f"K={summary['n_clusters']} {steps} time={summary['fit_seconds']:.1f}s "
             f"{scores_text(summary['metrics'])}".rstrip() + f" -> {output}")
    out = Path(output)
    data = {
        "output": str(output),
        **{key: summary.get(key) for key in ("n_clusters", "n_clusters_nonempty", "epochs",
                                             "fit_seconds", "n_samples", "n_features", "metrics")},
        "files": {name: str(out / name) for name in (*FIT_FILES, *extra_files)},
        "mlflow_run_id": run_id,
    }
    if "alternation" in summary:
        data["alternations"] = len(summary["alternation"]) - 1
    print_result(args, human, data)


#: files whose presence means a directory holds a fit (finished, or its checkpoints)
EARLIER_FIT_FILES = ("summary.json", "model.pt", "assignments.parquet")


def _refuse_an_earlier_fit(out: Path) -> None:
    """A fit never silently replaces another: ConfigError when ``out`` holds one."""
    from deepdpm_core.errors import ConfigError
    from pipeline.ray_fit import has_checkpoints
    from pipeline.resumable_fit import has_local_checkpoints

    if has_checkpoints(out) or has_local_checkpoints(out):
        raise ConfigError(f"{out} holds checkpoints of an earlier fit: continue it with "
                          f"--resume {out}, start afresh with --overwrite, or choose another "
                          "--output")
    held = [name for name in EARLIER_FIT_FILES if (out / name).exists()]
    if held:
        raise ConfigError(f"--output {out} already holds a fit ({', '.join(held)}): pass "
                          "--overwrite to replace it, or choose another --output")


def run(args: argparse.Namespace) -> int:
    from deepdpm_core.errors import ConfigError

    if args.num_workers is not None and args.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {args.num_workers}")
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        # checked before the fit: its outputs would otherwise be lost at the end
        raise ConfigError(f"--output {args.output} exists and is not a directory")
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite starts afresh and --resume continues: give one of them")
    if args.output and not args.resume and not args.overwrite:
        _refuse_an_earlier_fit(Path(args.output))
    if args.alternate is not None and (_distributed(args) or args.resume
                                       or args.checkpoint_every is not None):
        raise ConfigError("--alternate runs in this process without checkpoints: drop "
                          "--num-workers, --ray-address, --resume and --checkpoint-every")
    if _distributed(args):
        return _run_distributed(args)
    if args.resume:
        if (args.num_workers or 0) >= 2 or args.ray_address:
            raise ConfigError(f"{args.resume} holds a fit that ran in one process: resume it "
                              "without --num-workers and --ray-address")
        return _run_local(args, _resumed_request(args))
    if not args.input or not args.output:
        raise ConfigError("--input and --output are required (unless --resume DIR)")
    return _run_local(args, _new_request(args, in_process=True)
                      if args.checkpoint_every is not None else None)


def _run_local(args: argparse.Namespace, request=None) -> int:
    """The fit in this process; with a ``request`` (``--checkpoint-every``, ``--resume``)
    it keeps checkpoints and the request in the output directory."""
    from deepdpm_core import DeepDPM
    from deepdpm_core.config import from_dict
    from deepdpm_core.errors import ConfigError
    from deepdpm_core.init import rows_needed
    from deepdpm_core.validation import check_features
    from pipeline import resumable_fit
    from pipeline.epoch_scores import EpochLabelScores
    from pipeline.fitting import config_from_args, write_fit_outputs
    from pipeline.io import read_features
    from pipeline.ray_fit import TRAIN_DIR
    from pipeline.tracking import (
        RunTracker,
        environment_tags,
        epoch_callback,
        fit_params,
        log_fit_outputs,
        tracker_from_args,
    )

    if request is None:
        config = config_from_args(args.config, args.overrides, args.seed)
        input_path, output, tracker = args.input, args.output, tracker_from_args(args)
    else:
        config = from_dict(request.config)
        input_path, output = request.input, request.output
        tracker = RunTracker(request.tracking_uri, request.experiment, enabled=request.tracking,
                             run_name=request.run_name, register_model=request.register_model,
                             model_alias=request.model_alias)
    if args.use_gpu or (request is not None and request.use_gpu):
        config = config.with_overrides({"device": "cuda"})
    table = read_features(input_path)
    if args.alternate is not None:
        from pipeline.alternate import run_alternating_fit

        if args.alternate < 0:
            raise ConfigError(f"--alternate must be >= 0, got {args.alternate}")
        summary = run_alternating_fit(args, config, table)
        _print_summary(args, summary, args.output,
                       extra_files=("autoencoder.pt", "embedding.parquet"))
        return 0
    table.X = check_features(table.X, min_rows=rows_needed(config.init.n_clusters))
    # in float64: the squares of float32 features beyond ~1e19 overflow float32
    feature_variance = float(np.median(table.X.var(axis=0, dtype=np.float64)))
    state = None
    if request is not None:
        out = Path(output)
        if args.resume:
            state = resumable_fit.latest_state(out)  # None: stopped before its first checkpoint
        else:
            if args.overwrite:  # a later --resume must not restore the earlier fit's
                resumable_fit.remove_checkpoints(out)
                shutil.rmtree(out / TRAIN_DIR, ignore_errors=True)
            out.mkdir(parents=True, exist_ok=True)
            request.save()
    # nmi/ari/acc on <= 10k labelled rows every epoch; runs before the tracker's
    # callback, adding its keys to the record the tracker logs
    scores = EpochLabelScores.for_labels(table.X, table.labels, seed=config.seed)
    with tracker:
        tracker.log_params(fit_params(config.flat(), *table.X.shape, num_workers=1))
        tracker.set_tags({**environment_tags(input_path),
                          **({"resumed_from_epoch": state["epoch"]} if state is not None else {})})
        on_epoch = epoch_callback(tracker, config, feature_variance)
        callbacks = [scores, on_epoch] if scores is not None else [on_epoch]
        t0 = time.perf_counter()
        if request is None:
            model, before = DeepDPM(config), 0.0
            if scores is not None:
                scores.bind(model)
            model.fit(table.X, callbacks=callbacks, progress=not args.quiet)
        else:
            trainer = resumable_fit.start_trainer(config, table.X, state)
            if scores is not None:
                scores.bind(resumable_fit.TrainerLabels(trainer))
            trainer.callbacks.extend(callbacks)
            before = sum(record["seconds"] for record in trainer.history)
            resumable_fit.train(trainer, output, request.checkpoint_every, progress=not args.quiet)
            model = DeepDPM.from_trainer(trainer)
        fit_seconds = before + time.perf_counter() - t0
        summary = write_fit_outputs(output, model, table, fit_seconds, input_path,
                                    extra={"median_feature_variance": feature_variance,
                                           **({"resumed_from_epoch": state["epoch"]}
                                              if state is not None else {})})
        log_fit_outputs(tracker, output)  # + final_nmi/ari/acc over all labelled rows
    _print_summary(args, summary, output, run_id=tracker.run_id)
    return 0
