"""What a fit leaves on disk, the same in every mode (local, Ray, alternating).

``DIR/summary.json``, ``assignments.parquet``, ``model.pt``, ``config.yaml`` and the plots,
published together in one step (:mod:`pipeline.io.run_folder`), so ``DIR`` never holds a
mix of two runs.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from deepdpm_core import DeepDPM
from deepdpm_core.atomic_files import atomic_path, write_json_atomic
from deepdpm_core.data import clustering_scores
from deepdpm_core.model import tiny_cluster_rows, tiny_clusters
from pipeline.io.run_folder import publish_run, staging_folder
from pipeline.io.table_writing import assignments_table, write_parquet_atomic
from pipeline.io.tables import FeatureTable
from pipeline.report.plots import write_fit_plots

#: what every fit leaves in its output folder
FIT_FILES = ("summary.json", "assignments.parquet", "model.pt", "config.yaml")
#: what an alternating fit adds: the autoencoder and the features it learned
ALTERNATING_FILES = ("autoencoder.pt", "embedding.parquet")
#: every file a fit run writes: in a re-fit these names belong to the earlier run and
#: are replaced; other entries (checkpoints) stay
RUN_OUTPUTS = frozenset({
    *FIT_FILES, *ALTERNATING_FILES,
    "k_over_epochs.png", "cluster_sizes.png", "moves.png", "losses.png", "epoch_time.png",
    "scores.png",
})  # fmt: skip
#: what a fit keeps to be resumed: a new fit that keeps none drops an earlier fit's when
#: it publishes (stop and error files of a Ray driver included)
FIT_STATE = frozenset({"checkpoints", "ray_train", "fit_request.json", "worker_error.json",
                       "stop_requested"})


def replaced_entries(resumable: bool) -> frozenset[str]:
    """The entries of the output folder that belong to an earlier fit and go when a fit
    publishes: its outputs, and its checkpoints and request unless the fit keeps its own
    (``resumable``: they were replaced when it started)."""
    return RUN_OUTPUTS if resumable else RUN_OUTPUTS | FIT_STATE


def request_extra(fit_id: str | None, columns: dict[str, Any], variance: dict[str, float], *,
                  num_workers: int = 1, resumed_from: int | None = None) -> dict[str, Any]:
    """What ``summary.json`` keeps of every fit besides the model's answers: the request's
    ``fit_id`` and ``columns`` (:class:`~pipeline.fit.request.FitRequest`), its workers,
    the epoch it resumed from, and the ``variance`` of the rows it fitted
    (:func:`~pipeline.fit.runner.data_variance_summary`, for the report's diagnostics)."""
    return {"fit_id": fit_id, "columns": columns, "num_workers": num_workers,
            "resumed_from_epoch": resumed_from, **variance}


@dataclass(frozen=True)
class FitResult:
    """What a finished fit returns, in every mode.

    Attributes
    ----------
    summary : dict
        The fit's ``summary.json``.
    output : str
        The output folder.
    run_id : str, optional
        The MLflow run (None untracked, or when the driver did not log it: Ray).
    files : tuple of str
        The output files' names (:data:`FIT_FILES`, plus :data:`ALTERNATING_FILES`).
    tracking_uri : str, optional
        Where the run was tracked, without credentials (None untracked).
    """

    summary: dict[str, Any]
    output: str
    run_id: str | None = None
    files: tuple[str, ...] = FIT_FILES
    tracking_uri: str | None = None


def label_metrics(labels_true: np.ndarray | None, labels_pred: np.ndarray) -> dict[str, float]:
    """NMI/ARI/ACC over the rows that have a label (label >= 0); {} without labels.

    Parameters
    ----------
    labels_true : ndarray of shape (N,), optional
        Classes; negative: unlabelled.
    labels_pred : ndarray of shape (N,)
        Clusters.

    Returns
    -------
    dict
        ``nmi``, ``ari``, ``acc`` (empty without a labelled row).
    """
    if labels_true is None:
        return {}
    known = labels_true >= 0
    if not known.any():
        return {}
    return clustering_scores(labels_true[known], labels_pred[known])


def columns_used(table: FeatureTable) -> dict[str, Any] | None:
    """Which columns of a table were the features, the label and the key (None: the input
    was no table with named columns), as ``summary.json`` and the result line say."""
    if table.feature_names is None:
        return None
    return {"features": list(table.feature_names), "label": table.label_column,
            "key": table.key_column}


def write_fit_outputs(
    out_dir: str | Path,
    model: DeepDPM,
    table: FeatureTable,
    fit_seconds: float,
    input_path: str | Path,
    extra: dict[str, Any] | None = None,
    *,
    more_outputs: Callable[[Path], None] | None = None,
    publish: bool = True,
    replaced: Collection[str] = RUN_OUTPUTS,
) -> dict[str, Any]:
    """Write every output of a fit, publish them together and return the summary.

    Parameters
    ----------
    out_dir : path
        The output folder. The outputs are written into a staging folder beside it and
        then replace the earlier run's outputs in one step (:func:`publish_run`; the
        folder's other entries, e.g. checkpoints, stay).
    more_outputs : callable, optional
        ``more_outputs(folder)`` writes further outputs (named in :data:`RUN_OUTPUTS`)
        into the staging folder before it is published.
    publish : bool
        False: write into ``out_dir`` itself, a staging folder that the caller
        publishes (the Ray fit's rank 0 writes, its driver publishes).
    replaced : collection of str
        Entries of ``out_dir`` that belong to the earlier fit and are dropped in the
        publish (:func:`replaced_entries`); the others are kept.
    """
    staging = staging_folder(out_dir) if publish else Path(out_dir)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        summary = write_into(staging, model, table, fit_seconds, input_path, extra, more_outputs)
    except BaseException:
        if publish:  # nothing of this run is published; its half-written files go
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if publish:
        publish_run(staging, out_dir, replaced)
    return summary


def write_into(
    staging: Path,
    model: DeepDPM,
    table: FeatureTable,
    fit_seconds: float,
    input_path: str | Path,
    extra: dict[str, Any] | None,
    more_outputs: Callable[[Path], None] | None,
) -> dict[str, Any]:
    """Write every output of a fit into ``staging`` (see :func:`write_fit_outputs`) and
    return the summary."""
    # label + max responsibility per batch: the (N, K) array is 5 GB at 1.28M x 1000
    labels, confidence = model.predict_confidence(table.X)
    sizes = np.bincount(labels, minlength=model.n_clusters_)
    nonempty = int((sizes > 0).sum())
    tiny_rows = tiny_cluster_rows(len(labels), nonempty)
    summary: dict[str, Any] = {
        "n_clusters": int(model.n_clusters_),
        "n_clusters_nonempty": nonempty,
        "epochs": len(model.history_),
        "fit_seconds": round(float(fit_seconds), 3),
        "input": str(input_path),
        "n_samples": int(table.X.shape[0]),
        "n_features": int(table.X.shape[1]),
        "metrics": label_metrics(table.labels, labels),
        "cluster_sizes": sizes.tolist(),
        # clusters too small to be a group, smallest first, and the size that decides it
        "tiny_clusters": tiny_clusters(sizes, tiny_rows),
        "tiny_cluster_rows": tiny_rows,
        **({"feature_names": table.feature_names} if table.feature_names else {}),
        **({"columns_used": used} if (used := columns_used(table)) else {}),
        **({"label_names": table.label_names} if table.label_names else {}),
        "history": model.history_,
        "config": model.config.to_dict(),
        **(extra or {}),
    }
    with atomic_path(staging / "config.yaml") as tmp:
        tmp.write_text(yaml.safe_dump(model.config.to_dict(), sort_keys=False))
    if table.feature_names and model.model_.feature_names is None \
            and len(table.feature_names) == model.n_features_in_:
        # the table's columns, by which predict matches another table's
        model.model_.feature_names = list(table.feature_names)
    model.save(staging / "model.pt")
    write_parquet_atomic(assignments_table(table, labels, confidence), staging / "assignments.parquet")
    write_fit_plots(model.history_, summary["cluster_sizes"], staging, summary["fit_seconds"])
    if more_outputs is not None:
        more_outputs(staging)
    write_json_atomic(summary, staging / "summary.json")
    return summary


__all__ = ["ALTERNATING_FILES", "FIT_FILES", "FIT_STATE", "FitResult", "RUN_OUTPUTS", "columns_used",
           "label_metrics",
           "replaced_entries", "write_fit_outputs", "write_into"]
