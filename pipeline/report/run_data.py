"""The files a report is made of, read from a fit output folder or an MLflow run."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from deepdpm_core.errors import DataError
from pipeline.report import run_source


@dataclass
class RunData:
    """What a report is made of.

    Attributes
    ----------
    summary : dict
        ``summary.json`` of the fit (``n_clusters``, ``history``, ``metrics``, ...).
    assignments : pyarrow.Table or None
        ``key``, ``cluster``, ``confidence`` and maybe ``label`` per point.
    source : str
        Where the run was read from (directory or ``run <id> at <uri>``).
    """

    summary: dict[str, Any]
    assignments: pa.Table | None
    source: str


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from exc
    history = summary.get("history") if isinstance(summary, dict) else None
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        raise DataError(f"{path} is not a deepdpm fit summary (no list of epoch records 'history')")
    return summary


def _read_assignments(path: Path) -> pa.Table | None:
    if not path.exists():
        return None
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    missing = {"key", "cluster"} - set(table.column_names)
    if missing:
        raise DataError(f"{path} lacks column(s) {sorted(missing)}")
    return table


def load_run_dir(run_dir: str | Path) -> RunData:
    """Read ``summary.json`` (required) and ``assignments.parquet`` (optional)."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise DataError(f"{run_dir} has no summary.json: is it the output directory of a fit?")
    return RunData(
        _read_summary(summary_path), _read_assignments(run_dir / "assignments.parquet"),
        str(run_dir),
    )  # fmt: skip


def load_mlflow_run(run_id: str, tracking_uri: str) -> RunData:
    """Download ``summary.json`` and ``assignments.parquet`` from an MLflow run."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        client.get_run(run_id)
        names = {a.path for a in client.list_artifacts(run_id)}
    except MlflowException as exc:
        raise DataError(f"cannot read MLflow run {run_id} at {tracking_uri}: {exc}") from exc
    if "summary.json" not in names:
        raise DataError(f"MLflow run {run_id} has no summary.json artifact")
    with tempfile.TemporaryDirectory(prefix="deepdpm-report-") as tmp:
        for name in ("summary.json", "assignments.parquet"):
            if name in names:
                client.download_artifacts(run_id, name, tmp)
        run = load_run_dir(tmp)  # read fully into memory before the directory goes
    run.source = f"MLflow run {run_id} at {tracking_uri}"
    return run


def load_run(source: str, tracking_uri: str) -> RunData:
    """A fit output directory, or an MLflow run id (32 hex digits) at ``tracking_uri``."""
    if run_source(source) == "folder":
        return load_run_dir(Path(source))
    return load_mlflow_run(source, tracking_uri)
