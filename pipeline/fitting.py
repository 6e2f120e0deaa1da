"""What a fit leaves on disk, shared by the single-process and the Ray fit.

``DIR/summary.json``, ``DIR/assignments.parquet`` (key, cluster, confidence, label),
``DIR/model.pt``, ``DIR/config.yaml`` and the plots, each written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml

from deepdpm_core import Config, DeepDPM
from deepdpm_core.config import from_dict, load_config, parse_overrides
from deepdpm_core.metrics import clustering_scores
from pipeline.io import FeatureTable, atomic_path, write_json_atomic, write_parquet_atomic
from pipeline.plots import write_fit_plots


def config_from_args(config_path: str | None, overrides: list[str] | None, seed: int | None) -> Config:
    """``--config`` YAML (or defaults) + ``--set key=value`` overrides + ``--seed``."""
    cfg = load_config(config_path) if config_path else from_dict(None)
    over = parse_overrides(overrides or [])
    if seed is not None:
        over["seed"] = seed
    return cfg.with_overrides(over) if over else cfg


def label_metrics(labels_true: np.ndarray | None, labels_pred: np.ndarray) -> dict[str, float]:
    """NMI/ARI/ACC over the rows that have a label (label >= 0); {} without labels."""
    if labels_true is None:
        return {}
    known = labels_true >= 0
    if not known.any():
        return {}
    return clustering_scores(labels_true[known], labels_pred[known])


def assignments_table(table: FeatureTable, labels: np.ndarray, confidence: np.ndarray) -> pa.Table:
    """Arrow table: key, cluster:int32, confidence:float32, label:int64 (nullable).

    ``labels`` and ``confidence`` are (N,): the hard cluster and its responsibility.
    """
    cols = {
        "key": pa.array([str(k) for k in table.keys], pa.string()),
        "cluster": pa.array(labels.astype(np.int32)),
        "confidence": pa.array(confidence.astype(np.float32)),
    }
    if table.labels is not None:
        cols["label"] = pa.array(table.labels.astype(np.int64), mask=table.labels < 0)
    return pa.table(cols)


def write_fit_outputs(
    out_dir: str | Path,
    model: DeepDPM,
    table: FeatureTable,
    fit_seconds: float,
    input_path: str | Path,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write every output of a fit and return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # label + max responsibility per batch: the (N, K) array is 5 GB at 1.28M x 1000
    labels, confidence = model.predict_confidence(table.X)
    summary: dict[str, Any] = {
        "n_clusters": int(model.n_clusters_),
        "n_clusters_nonempty": int(len(np.unique(labels))),
        "epochs": len(model.history_),
        "fit_seconds": round(float(fit_seconds), 3),
        "input": str(input_path),
        "n_samples": int(table.X.shape[0]),
        "n_features": int(table.X.shape[1]),
        "metrics": label_metrics(table.labels, labels),
        "cluster_sizes": np.bincount(labels, minlength=model.n_clusters_).tolist(),
        "history": model.history_,
        "config": model.config.to_dict(),
        **(extra or {}),
    }
    with atomic_path(out / "config.yaml") as tmp:
        tmp.write_text(yaml.safe_dump(model.config.to_dict(), sort_keys=False))
    model.save(out / "model.pt")
    write_parquet_atomic(assignments_table(table, labels, confidence), out / "assignments.parquet")
    write_fit_plots(model.history_, summary["cluster_sizes"], out)
    write_json_atomic(summary, out / "summary.json")
    return summary
