"""``deepdpm fit --alternate N``: the AE <-> DeepDPM alternation with its outputs and tracking.

The loop itself is :func:`deepdpm_core.alternation.fit_alternating`; this module adds
what a command needs around it: progress, one MLflow run for the whole fit with a
nested run per clustering (parent tag ``mlflow.parentRunId``: step 0 clusters the
pretrained AE, step t the AE after t alternations), and the outputs on disk:

``DIR/`` the usual fit outputs for the final clustering (``summary.json`` with an
``alternation`` list, ``assignments.parquet``, ``model.pt``, ``config.yaml``, plots) plus
``autoencoder.pt`` (see :func:`save_autoencoder`) and ``embedding.parquet`` (the final
learned features; ``deepdpm predict --model DIR/model.pt`` applies to such features).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core import Config, DeepDPM
from deepdpm_core.alternation import AlternationStep, fit_alternating
from deepdpm_core.autoencoder import MLPAutoencoder
from deepdpm_core.checkpoints import safe_load
from deepdpm_core.embedding import as_feature_matrix
from deepdpm_core.errors import CheckpointError
from deepdpm_core.progress import progress_bar
from pipeline.io import FeatureTable, atomic_path, features_table, write_parquet_atomic

_AE_FORMAT = "deepdpm-autoencoder-v1"


def save_autoencoder(model: MLPAutoencoder, config: Config, path: str | Path) -> None:
    """Write an autoencoder (architecture, weights, input scaling) and its config atomically."""
    payload = {
        "format": _AE_FORMAT,
        "architecture": model.architecture(),
        "state_dict": model.state_dict(),
        "config": config.to_dict(),
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_autoencoder(path: str | Path) -> MLPAutoencoder:
    """Read a model written by :func:`save_autoencoder` (``torch.load(weights_only=True)``)."""
    payload = safe_load(path, "autoencoder")
    if not isinstance(payload, dict) or payload.get("format") != _AE_FORMAT:
        raise CheckpointError(f"{path} is not a deepdpm autoencoder ({_AE_FORMAT})")
    arch = payload["architecture"]
    model = MLPAutoencoder(arch["input_dim"], arch["latent_dim"], arch["hidden"])
    model.load_state_dict(payload["state_dict"])
    return model.eval()


class _Progress:
    """One tqdm bar per stage (AE pretraining / AE alternation t), on stderr."""

    def __init__(self, enabled: bool, config: Config):
        self.enabled = enabled
        self.config = config
        self.bar: Any = None
        self._open = contextlib.ExitStack()
        self.stage = 0

    def ae_epoch(self, record: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            ae = self.config.ae
            total, desc = (
                (ae.pretrain_epochs, "AE pretraining")
                if self.stage == 0
                else (ae.epochs, f"AE alternation {self.stage}")
            )
            self._open = contextlib.ExitStack()  # stderr lines go above the bar until closed
            self.bar = self._open.enter_context(progress_bar(total=total, desc=desc, unit="epoch"))
        self.bar.set_postfix(loss=f"{record['loss']:.4g}", refresh=False)
        self.bar.update(1)

    def end_stage(self) -> None:
        if self.bar is not None:
            self._open.close()
            self.bar = None
        self.stage += 1


def run_alternating_fit(
    args: argparse.Namespace, config: Config, table: FeatureTable
) -> dict[str, Any]:
    """Run ``fit --alternate N`` on ``table`` (raw features) and write every output.

    Parameters
    ----------
    args : argparse.Namespace
        ``deepdpm fit`` arguments (``alternate``, ``output``, ``input``, ``quiet`` and the
        tracking flags).
    config : Config
    table : FeatureTable
        Raw data: pixels or backbone features, one row per item.

    Returns
    -------
    dict
        The fit summary (also written to ``DIR/summary.json``).
    """
    from pipeline.fitting import label_metrics, write_fit_outputs
    from pipeline.tracking import (
        RunTracker,
        default_run_name,
        environment_tags,
        epoch_callback,
        fit_params,
        log_fit_outputs,
        tracker_from_args,
    )

    X = as_feature_matrix(table.X, name=str(args.input))
    out = Path(args.output)
    progress = _Progress(not args.quiet, config)
    steps_summary: list[dict[str, Any]] = []

    with tracker_from_args(args) as parent:
        parent.log_params(
            {**fit_params(config.flat(), *X.shape, num_workers=1), "alternate": args.alternate}
        )
        parent.set_tags(environment_tags(args.input))
        parent_id = parent.run_id
        children: dict[int, RunTracker] = {}

        def child_tracker(step: int) -> RunTracker:
            name = f"{default_run_name(args) or 'fit'}/alternation-{step}"
            child = RunTracker(
                args.tracking_uri,
                args.experiment,
                enabled=not args.no_tracking and parent_id is not None,
                run_name=name,
            )
            child.start()
            if parent_id is not None:
                child.set_tags({"mlflow.parentRunId": parent_id, "alternation": str(step)})
            return child

        def cluster(Z: np.ndarray, init_labels: np.ndarray | None, step: int) -> DeepDPM:
            progress.end_stage()
            child = children[step] = child_tracker(step)
            child.log_params(
                {**fit_params(config.flat(), *Z.shape, num_workers=1), "alternation": step}
            )
            on_epoch = epoch_callback(child, config, float(np.median(Z.var(axis=0))))
            model = DeepDPM(config, random_state=config.seed + step)
            model.fit(Z, callbacks=[on_epoch], progress=not args.quiet, init_labels=init_labels)
            return model

        def on_step(step: AlternationStep) -> None:
            child = children.pop(step.step)
            for record in step.ae_history:
                child.log_metrics(
                    {f"ae_{k}": v for k, v in record.items() if k != "epoch"},
                    step=int(record["epoch"]),
                )
            metrics = label_metrics(table.labels, step.labels)
            child.log_metrics(
                {
                    "final_n_clusters": step.n_clusters,
                    "ae_seconds": step.ae_seconds,
                    "cluster_seconds": step.cluster_seconds,
                    **{f"final_{k}": v for k, v in metrics.items()},
                },
                step=step.step,
            )
            parent.log_metrics(
                {
                    "alternation_n_clusters": step.n_clusters,
                    **{f"alternation_{k}": v for k, v in metrics.items()},
                },
                step=step.step,
            )
            child.close()
            steps_summary.append(
                {
                    "step": step.step,
                    "n_clusters": step.n_clusters,
                    "metrics": metrics,
                    "ae_epochs": len(step.ae_history),
                    "ae_final_loss": step.ae_history[-1]["loss"] if step.ae_history else None,
                    "ae_seconds": round(step.ae_seconds, 3),
                    "cluster_seconds": round(step.cluster_seconds, 3),
                }
            )
            scores = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
            print(
                f"alternation {step.step}: K={step.n_clusters} {scores}".rstrip(), file=sys.stderr
            )

        start = time.perf_counter()
        try:
            result = fit_alternating(
                X,
                config,
                alternations=args.alternate,
                cluster_fn=cluster,
                on_step=on_step,
                on_ae_epoch=progress.ae_epoch,
            )
        finally:
            progress.end_stage()
            for child in children.values():  # a step that failed before on_step
                child.close("FAILED")
        seconds = time.perf_counter() - start

        learned = FeatureTable(X=result.embedding, labels=table.labels, keys=table.keys)

        def write_encoder(folder: Path) -> None:  # published with the fit's outputs
            save_autoencoder(result.autoencoder, config, folder / "autoencoder.pt")
            write_parquet_atomic(
                features_table(result.embedding, table.keys, table.labels),
                folder / "embedding.parquet",
            )

        summary = write_fit_outputs(
            out,
            result.clustering,
            learned,
            seconds,
            args.input,
            extra={"alternation": steps_summary, "stopped_because": result.stopped_because},
            more_outputs=write_encoder,
        )
        if summary["metrics"]:
            parent.log_metrics(summary["metrics"], step=len(result.steps) - 1)
        log_fit_outputs(parent, out)
        parent.log_artifacts([out / "autoencoder.pt"])
    return summary


__all__ = ["load_autoencoder", "run_alternating_fit", "save_autoencoder"]
