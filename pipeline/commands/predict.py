"""``deepdpm predict``: assign rows of a feature table with a fitted model."""

from __future__ import annotations

import argparse

from pipeline.results import add_json_argument

HELP = "assign features to the clusters of a fitted model (writes a Parquet table)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model.pt written by deepdpm fit, or its MLflow model: runs:/RUN_ID/model, "
                             "models:/NAME@ALIAS (server: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--input", required=True, help=".npy, .npz or Parquet features")
    parser.add_argument("--output", required=True, help="output .parquet (key, cluster, confidence, label)")
    parser.add_argument("--batch-size", type=int, default=65536, help="rows per forward pass")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from deepdpm_core import DeepDPM
    from deepdpm_core.validation import check_features
    from pipeline.fitting import assignments_table, label_metrics
    from pipeline.io import read_features, write_parquet_atomic
    from pipeline.model_uri import local_model_path
    from pipeline.results import print_result, scores_text

    model = DeepDPM.load(local_model_path(args.model))
    table = read_features(args.input)
    table.X = check_features(table.X, n_features=model.n_features_in_)
    labels, confidence = model.predict_confidence(table.X, batch_size=args.batch_size)
    write_parquet_atomic(assignments_table(table, labels, confidence), args.output)
    scores = label_metrics(table.labels, labels)
    human = f"assigned {len(labels)} rows to {model.n_clusters_} clusters {scores_text(scores)}"
    print_result(args, f"{human.rstrip()} -> {args.output}", {
        "output": str(args.output), "model": str(args.model), "n_rows": int(len(labels)),
        "n_clusters": int(model.n_clusters_), "n_clusters_used": int(len(np.unique(labels))),
        "metrics": scores,
    })  # fmt: skip
    return 0
