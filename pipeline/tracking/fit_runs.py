"""What the fit commands log to an MLflow run: params, per-epoch records with the K
diagnostics, and the finished fit's outputs and model."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.io.columns import summary_columns
from pipeline.tracking.environment import environment_tags
from pipeline.tracking.options import DEFAULT_MODEL_ALIAS, default_run_name, tracking_on
from pipeline.tracking.run_tracker import RunTracker

#: files of a fit output directory logged as artifacts (those that exist)
FIT_ARTIFACTS = ("config.yaml", "summary.json", "k_over_epochs.png", "cluster_sizes.png",
                 "moves.png", "losses.png", "scores.png", "epoch_time.png", "model.pt",
                 "assignments.parquet")


def tracker_from_args(args: argparse.Namespace, rank: int = 0) -> RunTracker:
    """A :class:`RunTracker` configured by :func:`add_tracking_arguments` (and
    :func:`add_registry_arguments`) flags."""
    return RunTracker(
        tracking_uri=args.tracking_uri, experiment=args.experiment, enabled=tracking_on(args),
        run_name=default_run_name(args), rank=rank,
        register_model=getattr(args, "register_model", None),
        model_alias=getattr(args, "model_alias", DEFAULT_MODEL_ALIAS),
        output=getattr(args, "output", None),
    )


def fit_params(
    flat_config: Mapping[str, Any], n_samples: int, n_features: int, num_workers: int = 1
) -> dict[str, Any]:
    """Params of a fit run: the flattened config plus data shape and worker count."""
    return {**flat_config, "data.n_samples": int(n_samples), "data.n_features": int(n_features),
            "num_workers": int(num_workers)}


def log_fit_start(tracker: RunTracker, config: Any, shape: tuple[int, int],
                  source: str | Path | None = None, *, num_workers: int = 1,
                  resumed_from: int | None = None, command: str = "fit", **params: Any) -> None:
    """Log a fit's params: :func:`fit_params` of ``config``, the rows' ``shape`` (all
    ranks' rows) and ``num_workers``, and ``params``; and, unless it is a nested run
    (``source`` None), its tags: :func:`~pipeline.tracking.environment.environment_tags` of
    the input ``source`` and the deepdpm ``command``, and the epoch a resumed fit continues
    from."""
    tracker.log_params({**fit_params(config.flat(), *shape, num_workers=num_workers), **params})
    if source is None:
        return
    tracker.set_tags({**environment_tags(source, command=command), "deepdpm.command": command,
                      **({"resumed_from_epoch": resumed_from} if resumed_from is not None else {})})


def epoch_callback(
    tracker: RunTracker, config: Any, variance_ratio: float | None = None,
) -> Callable[[Mapping[str, Any]], None]:
    """Per-epoch callback for the estimator: log the record and run the diagnostics
    (:class:`deepdpm_core.model.diagnostics.DiagnosticsMonitor`, warnings through
    ``tracker.warn`` once the fit stops).

    ``variance_ratio`` (largest per-feature variance over the median) lets a warning
    advise standardising the features.
    """
    from deepdpm_core.model import DiagnosticsMonitor

    monitor = DiagnosticsMonitor(config, tracker.warn, variance_ratio)

    def on_epoch(record: Mapping[str, Any]) -> None:
        tracker.log_epoch(record)
        monitor(record)

    return on_epoch


def log_fit_outputs(tracker: RunTracker, out_dir: str | Path, example_rows: np.ndarray | None = None) -> None:
    """Log a finished fit's output directory: :data:`FIT_ARTIFACTS`, the final metrics from its
    ``summary.json`` (docs/tracking.md, "Tracking runs in MLflow"), the input as the run's
    dataset, and the fit as the MLflow model ``model`` (:mod:`pipeline.tracking.mlflow_model`),
    registered when the tracker has ``register_model``.

    ``example_rows`` (n, D) are the model's input example when the input file is not an
    [N, D] table (images that ``--alternate`` flattens); else its first rows are."""
    out_dir = Path(out_dir)
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    step = int(summary.get("epochs") or 0)
    if summary:
        final = {f"final_{k}": v for k, v in (summary.get("metrics") or {}).items()}
        if summary.get("fit_seconds") is not None:
            final["fit_seconds"] = summary["fit_seconds"]
        final["final_n_clusters"] = summary.get("n_clusters", 0)
        # the per-epoch metrics' last values are 0 on most epochs: the overview shows these
        for move in ("splits_accepted", "merges_accepted"):
            final[f"{move}_total"] = sum(int(r.get(move) or 0) for r in summary.get("history") or [])
        tracker.log_metrics(final, step=step)
    tracker.log_artifacts(p for name in FIT_ARTIFACTS if (p := out_dir / name).exists())
    if not (out_dir / "model.pt").exists():
        return
    input_path = summary.get("input")
    columns = summary_columns(summary)  # a wide table is read by the columns the fit used
    name, alias = tracker.register_model, tracker.model_alias

    def log_model(client: Any, run_id: str) -> None:
        from pipeline.tracking.mlflow_model import EXAMPLE_ROWS, log_fit_model, register_fit_model
        from pipeline.tracking.run_dataset import feature_input, input_rows

        example = None
        if input_path is not None:
            dataset = feature_input(input_path, columns)
            if dataset is not None:
                client.log_inputs(run_id, datasets=[dataset])
            example = input_rows(input_path, EXAMPLE_ROWS, columns)
        if example is None and example_rows is not None:
            example = np.ascontiguousarray(example_rows[:EXAMPLE_ROWS], dtype=np.float32)
        try:
            log_fit_model(client, run_id, out_dir, input_example=example, step=step)
            if name:
                register_fit_model(client, run_id, name, alias)
        except Exception as exc:  # the run keeps model.pt and still ends as it should
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"deepdpm: warning: the fit's MLflow model was not logged "
                  f"({type(exc).__name__}: {reason[:300]})", file=sys.stderr, flush=True)  # fmt: skip

    tracker.log_with(log_model)
