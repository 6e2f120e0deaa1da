"""A self-contained HTML report of one fit.

One HTML file with every image inlined as a base64 PNG, so it opens offline: K over epochs,
split/merge acceptance, losses, cluster sizes, final metrics, the diagnostics of
:mod:`deepdpm_core.model.diagnostics`, the largest clusters and, for image features, sample
images per cluster (docs/tracking.md, "Report"). A run is read from a fit output directory
or from an MLflow run id (the same files, downloaded from the run's artifacts).
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from deepdpm_core.atomic_files import atomic_path
from deepdpm_core.errors import DataError
from deepdpm_core.model import diagnose, stop_reason
from pipeline.report import plots, run_source
from pipeline.report.sample_images import find_images, image_strip, sample_keys


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


# -- clusters ----------------------------------------------------------------------------


@dataclass
class ClusterRow:
    """One line of the cluster table."""

    cluster: int
    size: int
    confidence: float | None
    majority_label: int | None
    purity: float | None


def cluster_rows(assignments: pa.Table) -> list[ClusterRow]:
    """Per-cluster size, mean confidence and majority label/purity, largest first."""
    cluster = assignments.column("cluster").to_numpy().astype(np.int64)
    conf = (
        assignments.column("confidence").to_numpy().astype(np.float64)
        if "confidence" in assignments.column_names
        else None
    )
    labels = None
    if "label" in assignments.column_names:
        col = assignments.column("label")
        if col.null_count < len(col):
            labels = np.asarray(col.fill_null(-1).to_numpy(), dtype=np.int64)
    ids, counts = np.unique(cluster, return_counts=True)
    rows = []
    for k, n in zip(ids, counts, strict=True):
        members = cluster == k
        majority = purity = None
        if labels is not None:
            known = labels[members & (labels >= 0)]
            if len(known):
                values, freq = np.unique(known, return_counts=True)
                majority = int(values[freq.argmax()])
                purity = float(freq.max() / len(known))
        rows.append(
            ClusterRow(
                int(k), int(n), float(conf[members].mean()) if conf is not None else None,
                majority, purity,
            )
        )  # fmt: skip
    rows.sort(key=lambda r: (-r.size, r.cluster))
    return rows


# -- HTML --------------------------------------------------------------------------------


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _img(png: bytes, alt: str) -> str:
    return f'<img src="{_data_uri(png)}" alt="{html.escape(alt)}">'


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:0}.source{color:#666;margin-top:.2em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(460px,1fr));gap:1em}
.grid img{max-width:100%}.warn{background:#fff4e5;border-left:4px solid #f0a020;padding:.5em 1em;margin:.5em 0}
.samples td{text-align:left;vertical-align:middle}pre{background:#f7f7f7;padding:1em;overflow:auto}
"""


def render_report(
    run: RunData,
    images: str | Path | None = None,
    max_clusters: int = 30,
    per_cluster: int = 8,
) -> str:
    """The report of ``run`` as one self-contained HTML string.

    Parameters
    ----------
    run : RunData
    images : path or None
        Shards or image directory for the sample strips (see :func:`find_images`).
    max_clusters : int
        Clusters shown in the table and the sample strips (the largest ones).
    per_cluster : int
        Sample images per cluster.
    """
    summary = run.summary
    history = summary.get("history") or []
    config = summary.get("config") or {}
    rows = cluster_rows(run.assignments) if run.assignments is not None else []
    title = f"DeepDPM report: K = {summary.get('n_clusters', '?')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="source">{html.escape(run.source)}</p>',
        _overview(summary),
    ]
    for diagnostic in diagnose(history, config, summary.get("median_feature_variance"),
                               summary.get("feature_variance_ratio")):
        parts.append(f'<div class="warn">{html.escape(diagnostic.message)}</div>')

    with tempfile.TemporaryDirectory(prefix="deepdpm-report-") as tmp:
        tmp_dir = Path(tmp)
        figures = [
            ("K over epochs", plots.plot_k_over_epochs(history, tmp_dir / "k.png")),
            ("Split / merge acceptance", plots.plot_moves(history, tmp_dir / "moves.png")),
        ]
        if rows:
            sizes = plots.plot_cluster_sizes([r.size for r in rows], tmp_dir / "sizes.png",
                                             ids=[r.cluster for r in rows])
            figures.append(("Cluster sizes", sizes))
        figures.append(("Losses", plots.plot_losses(history, tmp_dir / "losses.png")))
        if plots.has_phases(history):
            figures.append(("Where the epochs went", plots.plot_epoch_time(history, tmp_dir / "time.png",
                                                                       summary.get("fit_seconds"))))
        if plots.has_scores(history):
            scores = plots.plot_scores(history, tmp_dir / "scores.png")
            figures.append(("NMI / ARI / ACC over epochs", scores))
        parts.append('<h2>Training</h2><div class="grid">')
        parts.extend(_img(path.read_bytes(), name) for name, path in figures)
        parts.append("</div>")

    if rows:
        parts.append(_cluster_table(rows[:max_clusters], len(rows)))
    if images is not None and run.assignments is not None:
        parts.append(_samples(run.assignments, rows[:max_clusters], images, per_cluster))
    if config:
        parts.append("<h2>Config</h2><pre>")
        parts.append(html.escape(yaml.safe_dump(config, sort_keys=False)))
        parts.append("</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _overview(summary: dict[str, Any]) -> str:
    facts = [
        ("clusters found (K)", summary.get("n_clusters")),
        ("epochs", summary.get("epochs")),
        ("stopped", stop_reason(summary.get("history") or [], summary.get("config"))),
        ("fit time (s)", summary.get("fit_seconds")),
        # what the epoch-time plot adds up; the fit time also counts the initialisation
        ("of which epochs (s)", sum(r.get("seconds") or 0.0 for r in summary.get("history") or [])
         if summary.get("history") else None),
        ("points (N)", summary.get("n_samples")),
        ("features (D)", summary.get("n_features")),
        ("input", summary.get("input")),
    ]
    metrics = summary.get("metrics") or {}
    facts += [(name.upper(), metrics[name]) for name in ("nmi", "ari", "acc") if name in metrics]
    cells = "".join(
        f"<tr><th>{html.escape(name)}</th><td>{_fmt(value)}</td></tr>"
        for name, value in facts
        if value is not None
    )
    note = "" if metrics else "<p>No labels: NMI/ARI/ACC not computed.</p>"
    return f"<h2>Result</h2><table>{cells}</table>{note}"


def _cluster_table(rows: list[ClusterRow], total: int) -> str:
    has_labels = any(r.majority_label is not None for r in rows)
    head = "<tr><th>cluster</th><th>size</th><th>mean confidence</th>"
    head += "<th>majority label</th><th>purity</th></tr>" if has_labels else "</tr>"
    body = []
    for r in rows:
        cells = [r.cluster, r.size, r.confidence if r.confidence is not None else ""]
        if has_labels:
            cells += [
                "" if r.majority_label is None else r.majority_label,
                "" if r.purity is None else r.purity,
            ]
        body.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    shown = f"the {len(rows)} largest of {total}" if len(rows) < total else f"all {total}"
    return f"<h2>Clusters ({shown})</h2><table>{head}{''.join(body)}</table>"


def _samples(
    assignments: pa.Table, rows: list[ClusterRow], images: str | Path, per_cluster: int
) -> str:
    wanted = sample_keys(assignments, [r.cluster for r in rows], per_cluster)
    found = find_images(images, (k for keys in wanted.values() for k in keys))
    if not found:
        return (
            f"<h2>Samples</h2><p>No image under {html.escape(str(images))} matched the "
            "keys of the assignments.</p>"
        )
    lines = ['<h2>Most confident samples per cluster</h2><table class="samples">']
    for row in rows:
        strip = image_strip([found[k] for k in wanted[row.cluster] if k in found])
        if strip is not None:
            lines.append(
                f"<tr><th>cluster {row.cluster}<br>{row.size} points</th>"
                f"<td>{_img(strip, f'cluster {row.cluster}')}</td></tr>"
            )
    lines.append("</table>")
    return "\n".join(lines)


def write_report(html_text: str, output: str | Path) -> Path:
    """Write the HTML atomically."""
    output = Path(output)
    with atomic_path(output) as tmp:
        tmp.write_text(html_text, encoding="utf-8")
    return output


__all__ = ["ClusterRow", "RunData", "cluster_rows", "load_mlflow_run", "load_run", "load_run_dir",
           "render_report", "write_report"]
