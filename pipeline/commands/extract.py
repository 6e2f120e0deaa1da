"""``deepdpm extract``: webdataset shards -> embeddings (Parquet), with Ray Data actors.

Each run is an MLflow run: the options as params, the counts and throughput of
:meth:`pipeline.extract.manifest.ExtractReport.metrics` as metrics, the manifest as an artifact.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from pipeline.extract.encoder_choices import ENCODERS, PRECISIONS, RESNET_ARCHS

HELP = "embed the images of webdataset shards (MoCo/torchvision ResNet or pixels) into Parquet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeline.io.existing_outputs import add_overwrite_argument
    from pipeline.io.results import add_json_argument
    from pipeline.tracking.options import add_tracking_arguments

    parser.add_argument("--shards", required=True,
                        help="folder of .tar shards, a glob, or one file")
    parser.add_argument("--output", required=True,
                        help="folder for <shard>.parquet + _manifest.json")
    add_overwrite_argument(parser, "features of another encoder (or files deepdpm extract did not "
                           "write) in --output: every shard is extracted again")
    parser.add_argument("--encoder", choices=ENCODERS, default="moco_v2", help="default: moco_v2")
    parser.add_argument("--weights", default=None,
                        help="checkpoint (.pth/.pth.tar); none: random init")
    parser.add_argument("--arch", choices=RESNET_ARCHS, default="resnet50",
                        help="default: resnet50")
    parser.add_argument("--head", action="store_true",
                        help="projection-head output (MoCo v2: 128-D) instead of the pooled trunk")
    parser.add_argument("--l2-normalize", action="store_true", help="unit-length embeddings")
    parser.add_argument("--pixel-size", type=int, default=8,
                        help="thumbnail side of --encoder pixels (default: 8)")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="images per encoder call (default: 256)")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="encoder actors: one per GPU or CPU slot (default: 1)")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per encoder actor")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0,
                        help="CPUs per encoder actor without GPU (default: 1)")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--address", default=None,
                        help="Ray address (default: $RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tracking_arguments(parser)
    add_json_argument(parser)


#: options logged as the MLflow run's params
TRACKED_OPTIONS = ("encoder", "weights", "arch", "head", "l2_normalize", "pixel_size", "batch_size",
                   "num_workers", "use_gpu", "cpus_per_worker", "precision", "output")


def run(args: argparse.Namespace) -> int:
    from pipeline.extract.shard_inputs import resolve_shards
    from pipeline.extras import require
    from pipeline.tracking.options import tracking_on

    # the extras and the inputs first: a mistake is answered before torch and Ray load and
    # no MLflow run is started for it
    require("extracting image features", "extract")
    tracking_on(args)
    resolve_shards(args.shards)
    if args.weights and not Path(args.weights).is_file():
        raise FileNotFoundError(f"weights not found: {args.weights}")
    from pipeline.io.existing_outputs import refuse_foreign_folder

    # a shard's features (<shard>.parquet) or the manifest make the folder an extract's
    refuse_foreign_folder(args.output, args.overwrite, ("*.parquet", "_manifest.json"), "extract")

    from pipeline.extract.ray_pipeline import extract_features
    from pipeline.io.results import print_result, shown_path
    from pipeline.tracking.environment import environment_tags
    from pipeline.tracking.fit_runs import tracker_from_args

    with tracker_from_args(args) as tracker:
        tracker.log_params({name: getattr(args, name) for name in TRACKED_OPTIONS})
        tracker.set_tags({**environment_tags(args.shards, command="extract"), "deepdpm.command": "extract"})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            report = extract_features(
                args.shards, args.output, args.encoder, weights=args.weights, arch=args.arch,
                head=args.head, pixel_size=args.pixel_size, l2_normalize=args.l2_normalize,
                batch_size=args.batch_size, num_workers=args.num_workers, use_gpu=args.use_gpu,
                cpus_per_worker=args.cpus_per_worker, precision=args.precision,
                ray_address=args.address, progress=not args.no_progress, overwrite=args.overwrite)
        tracker.log_params({"embedding_dim": report.dim})
        tracker.log_metrics(report.metrics())
        tracker.log_artifacts([report.manifest])
        if report.shards_failed:
            tracker.close("FAILED")
    for warning in caught:  # one line each, not Python's file:line format
        print(f"warning: {warning.message}", file=sys.stderr)
    totals = report.totals
    print_result(args, [
        f"embedded {report.images_embedded}/{report.images_read} images of {report.shards_done} "
        f"shards ({report.shards_reused} already done) in {report.seconds:.1f} s "
        f"({report.images_per_s:.1f} images/s); dim {report.dim}",
        f"features:  {shown_path(report.output_dir)} ({totals['embedded']} rows in "
        f"{totals['shards']} files, {totals['skipped']} images skipped)",
        f"manifest:  {shown_path(report.manifest)}",
    ], {**report.to_dict(), "output": shown_path(report.output_dir),
        "output_dir": shown_path(report.output_dir), "manifest": shown_path(report.manifest),
        "mlflow_run_id": tracker.run_id})
    for failed in report.shards_failed:
        print(f"error: shard not extracted: {failed['shard']}: {failed['reason']}", file=sys.stderr)
    return 1 if report.shards_failed else 0
