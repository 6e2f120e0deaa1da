"""``deepdpm fit``: cluster a feature table; K is inferred."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

HELP = "fit DeepDPM to features (.npy, .npz or Parquet) and write model, assignments, summary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeline.tracking import add_tracking_arguments

    parser.add_argument("--input", required=True, help=".npy [N, D], .npz (X, y) or Parquet (embedding, label, key)")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--config", help="YAML config (default: built-in defaults = cluster_configs/default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set prior.sigma_scale=0.01 (repeatable)")
    parser.add_argument("--seed", type=int, help="random seed (overrides the config's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--alternate", type=int, metavar="N",
                        help="learn features too: pretrain an MLP autoencoder on the (raw) input, then "
                        "alternate N times between DeepDPM on its embedding and AE training with the "
                        "clusters fixed; stops early once K is stable (config section 'ae')")
    add_tracking_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from deepdpm_core import DeepDPM
    from deepdpm_core.errors import ConfigError
    from deepdpm_core.validation import check_features
    from pipeline.epoch_scores import EpochLabelScores
    from pipeline.fitting import config_from_args, write_fit_outputs
    from pipeline.io import read_features
    from pipeline.tracking import (
        environment_tags,
        epoch_callback,
        fit_params,
        log_fit_outputs,
        tracker_from_args,
    )

    config = config_from_args(args.config, args.overrides, args.seed)
    table = read_features(args.input)
    if args.alternate is not None:
        from pipeline.alternate import run_alternating_fit

        if args.alternate < 0:
            raise ConfigError(f"--alternate must be >= 0, got {args.alternate}")
        summary = run_alternating_fit(args, config, table)
        scores = " ".join(f"{k}={v:.3f}" for k, v in summary["metrics"].items())
        print(f"K={summary['n_clusters']} alternations={len(summary['alternation']) - 1} "
              f"time={summary['fit_seconds']:.1f}s {scores}".rstrip(), file=sys.stderr)
        print(f"wrote {args.output}/summary.json, assignments.parquet, model.pt, autoencoder.pt, "
              "embedding.parquet", file=sys.stderr)
        return 0
    table.X = check_features(table.X, min_rows=max(2, config.init.n_clusters))
    feature_variance = float(np.median(table.X.var(axis=0)))
    # nmi/ari/acc on <= 10k labelled rows every epoch; runs before the tracker's
    # callback, adding its keys to the record the tracker logs
    scores = EpochLabelScores.for_labels(table.X, table.labels, seed=config.seed)
    with tracker_from_args(args) as tracker:
        tracker.log_params(fit_params(config.flat(), *table.X.shape, num_workers=1))
        tracker.set_tags(environment_tags(args.input))
        on_epoch = epoch_callback(tracker, config, feature_variance)
        t0 = time.perf_counter()
        model = DeepDPM(config)
        if scores is not None:
            scores.bind(model)
        callbacks = [scores, on_epoch] if scores is not None else [on_epoch]
        model.fit(table.X, callbacks=callbacks, progress=not args.quiet)
        fit_seconds = time.perf_counter() - t0
        summary = write_fit_outputs(args.output, model, table, fit_seconds, args.input,
                                    extra={"median_feature_variance": feature_variance})
        log_fit_outputs(tracker, args.output)  # + final_nmi/ari/acc over all labelled rows
    score_text = " ".join(f"{k}={v:.3f}" for k, v in summary["metrics"].items())
    print(f"K={summary['n_clusters']} epochs={summary['epochs']} time={fit_seconds:.1f}s {score_text}".rstrip(),
          file=sys.stderr)
    print(f"wrote {args.output}/summary.json, assignments.parquet, model.pt", file=sys.stderr)
    return 0
