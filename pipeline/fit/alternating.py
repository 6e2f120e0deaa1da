"""An alternating fit: the AE <-> DeepDPM alternation, each clustering a common-runner fit.

The loop is :func:`deepdpm_core.features.alternation.fit_alternating`; each clustering is a
:class:`~deepdpm_core.training.search.Search` driven by :func:`pipeline.fit.runner.run_epochs`
with the per-epoch callbacks of every fit. This module adds one MLflow run for the whole
fit with a nested run per clustering (step 0 clusters the pretrained AE, step t the AE after
t alternations), and the usual fit outputs of the final clustering (``summary.json`` with
an ``alternation`` list) plus ``autoencoder.pt`` and ``embedding.parquet``, the final
learned features that ``DIR/model.pt`` predicts (docs/features.md, "Learned feature spaces").
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core import Config, DeepDPM
from deepdpm_core.data import check_init_labels
from deepdpm_core.features import (
    AlternationStep,
    as_feature_matrix,
    fit_alternating,
    save_autoencoder,
)
from deepdpm_core.progress_bars import epoch_bar, progress_bar
from pipeline.fit import outputs
from pipeline.fit.request import FitRequest
from pipeline.fit.runner import (
    FaultHook,
    data_variance_summary,
    fault_before_next,
    run_epochs,
    start_job,
)
from pipeline.io.table_writing import features_table, write_parquet_atomic
from pipeline.io.tables import FeatureTable


class AEProgress:
    """One tqdm bar per AE stage (pretraining / alternation t), on stderr.

    Parameters
    ----------
    enabled : bool
    config : Config
        Its ``ae`` section gives each stage's epochs.
    """

    def __init__(self, enabled: bool, config: Config):
        self.enabled = enabled
        self.config = config
        self.bar: Any = None
        self.open = contextlib.ExitStack()
        self.stage = 0

    def ae_epoch(self, record: Mapping[str, float]) -> None:
        """Advance the stage's bar by one AE epoch."""
        if not self.enabled:
            return
        if self.bar is None:
            ae = self.config.ae
            total, desc = (
                (ae.pretrain_epochs, "AE pretraining")
                if self.stage == 0
                else (ae.epochs, f"AE alternation {self.stage}")
            )
            self.open = contextlib.ExitStack()  # stderr lines go above the bar until closed
            self.bar = self.open.enter_context(progress_bar(total=total, desc=desc, unit="epoch"))
        self.bar.set_postfix(loss=f"{record['loss']:.4g}", refresh=False)
        self.bar.update(1)

    def end_stage(self) -> None:
        """Close the stage's bar; the next AE epoch opens the next stage's."""
        if self.bar is not None:
            self.open.close()
            self.bar = None
        self.stage += 1


def run_alternating_fit(request: FitRequest, *, fault: FaultHook | None = None) -> outputs.FitResult:
    """Run an alternating fit of ``request.input`` (raw features) and write every output.

    Parameters
    ----------
    request : FitRequest
        ``mode`` "alternating", ``alternations`` rounds at most (config section ``ae``).
    fault : callable, optional
        Test-only crash injection, passed to each clustering's runner.

    Returns
    -------
    FitResult
        With ``summary["alternation"]``, one entry per clustering.
    """
    from pipeline.io.tables import read_features
    from pipeline.tracking.fit_runs import log_fit_outputs, log_fit_start
    from pipeline.tracking.run_tracker import RunTracker

    config = request.fit_config()
    table = read_features(request.input, request.table_columns)
    X = as_feature_matrix(table.X, name=str(request.input))
    out = Path(request.output)
    progress = AEProgress(not request.quiet, config)
    steps_summary: list[dict[str, Any]] = []
    variance: dict[str, float] = {}

    with request.tracker() as parent:
        log_fit_start(parent, config, X.shape, request.input, alternate=request.alternations)
        parent_id = parent.run_id
        children: dict[int, RunTracker] = {}

        def child_tracker(step: int) -> RunTracker:
            child = RunTracker(request.tracking_uri, request.experiment,
                               enabled=request.tracking and parent_id is not None,
                               run_name=f"{request.run_name or 'fit'}/alternation-{step}",
                               output=request.output)
            child.start()
            if parent_id is not None:
                child.set_tags({"mlflow.parentRunId": parent_id, "alternation": str(step)})
            return child

        def cluster(Z: np.ndarray, init_labels: np.ndarray | None, step: int) -> DeepDPM:
            progress.end_stage()
            child = children[step] = child_tracker(step)
            return _cluster(config.with_overrides({"seed": config.seed + step}), Z, table.labels,
                            init_labels, child, step, not request.quiet, fault, variance)

        def on_step(step: AlternationStep) -> None:
            child = children.pop(step.step)
            steps_summary.append(_log_step(step, table.labels, child, parent))

        start = time.perf_counter()
        try:
            result = fit_alternating(X, config, alternations=request.alternations,
                                     cluster_fn=cluster, on_step=on_step,
                                     on_ae_epoch=progress.ae_epoch)
        finally:
            progress.end_stage()
            for child in children.values():  # a step that failed before on_step
                child.close("FAILED")
        seconds = time.perf_counter() - start

        learned = FeatureTable(X=result.embedding, labels=table.labels, keys=table.keys)

        def write_encoder(folder: Path) -> None:  # published with the fit's outputs
            save_autoencoder(result.autoencoder, config, folder / "autoencoder.pt")
            write_parquet_atomic(features_table(result.embedding, table.keys, table.labels),
                                 folder / "embedding.parquet")

        extra = {**outputs.request_extra(request.fit_id, request.columns, variance), "alternation": steps_summary,
                 "stopped_because": result.stopped_because,
                 # the input's columns, not the learned embedding's
                 **({"columns_used": used} if (used := outputs.columns_used(table)) else {})}
        summary = outputs.write_fit_outputs(out, result.clustering, learned, seconds,
                                            request.input, extra=extra, more_outputs=write_encoder,
                                            replaced=outputs.replaced_entries(request.resumable))
        if summary["metrics"]:
            parent.log_metrics(summary["metrics"], step=len(result.steps) - 1)
        log_fit_outputs(parent, out, example_rows=X)
        parent.log_artifacts([out / "autoencoder.pt"])
    return outputs.FitResult(summary, str(out), parent.run_id,
                             outputs.FIT_FILES + outputs.ALTERNATING_FILES,
                             tracking_uri=parent.shown_uri if parent.run_id else None)


def _cluster(config: Config, Z: np.ndarray, labels: np.ndarray | None,
             init_labels: np.ndarray | None, tracker: Any, step: int, progress: bool,
             fault: FaultHook | None, variance: dict[str, float]) -> DeepDPM:
    """Clustering ``step`` of the alternation, as the estimator's ``fit`` would make it,
    with the per-epoch callbacks of every fit; ``variance`` keeps its
    :func:`~pipeline.fit.runner.data_variance_summary`."""
    from pipeline.fit.epoch_scores import EpochLabelScores

    search = start_job(config, Z, tracker, None, alternation=step)  # tagged by its parent
    start = None if init_labels is None else torch.from_numpy(check_init_labels(init_labels, len(Z)))
    run_epochs(search, fault_before_next(search, fault), tracker,
               EpochLabelScores.for_labels(Z, labels, seed=config.seed), init_labels=start,
               progress=epoch_bar if progress else None)
    variance.update(data_variance_summary(search))
    model = DeepDPM.from_search(search)
    model.labels_ = model.predict(Z)  # what the alternation reads, as after DeepDPM.fit
    return model


def _log_step(step: AlternationStep, labels: np.ndarray | None, child: Any,
              parent: Any) -> dict[str, Any]:
    """Log one finished clustering to its nested run and the parent; its summary entry."""
    for record in step.ae_history:
        child.log_metrics({f"ae_{k}": v for k, v in record.items() if k != "epoch"},
                          step=int(record["epoch"]))
    metrics = outputs.label_metrics(labels, step.labels)
    child.log_metrics({"final_n_clusters": step.n_clusters, "ae_seconds": step.ae_seconds,
                       "cluster_seconds": step.cluster_seconds,
                       **{f"final_{k}": v for k, v in metrics.items()}}, step=step.step)
    parent.log_metrics({"alternation_n_clusters": step.n_clusters,
                        **{f"alternation_{k}": v for k, v in metrics.items()}}, step=step.step)
    child.close()
    scores = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
    print(f"alternation {step.step}: K={step.n_clusters} {scores}".rstrip(), file=sys.stderr)
    return {
        "step": step.step,
        "n_clusters": step.n_clusters,
        "metrics": metrics,
        "ae_epochs": len(step.ae_history),
        "ae_final_loss": step.ae_history[-1]["loss"] if step.ae_history else None,
        "ae_seconds": round(step.ae_seconds, 3),
        "cluster_seconds": round(step.cluster_seconds, 3),
    }


__all__ = ["AEProgress", "run_alternating_fit"]
