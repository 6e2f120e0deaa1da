"""A self-contained HTML report of one fit.

One HTML file with every image inlined as a base64 PNG, so it opens offline: the result
(K, tiny clusters, metrics) and the warnings of :mod:`deepdpm_core.model.diagnostics`; the
data, read again from the fit's input, in 2-D coloured by cluster with a few rows of each
cluster (:mod:`pipeline.report.data_view`); the clusters, tiny ones listed apart; how the
search went (K over epochs, moves, losses, scores) and, for image features, sample images
per cluster (docs/tracking.md, "Report"). Every plot has one sentence on how to read it.
A run is read from a fit output directory or from an MLflow run id (the same files,
downloaded from the run's artifacts).
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
from deepdpm_core.model import diagnose, stop_reason, tiny_cluster_rows, tiny_clusters
from pipeline.report import data_view, plots, run_source
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
figure{margin:0}figcaption{color:#444;font-size:.92em;margin:.2em 0 .8em}
.rows td{font-family:ui-monospace,monospace;font-size:.85em}
.swatch{display:inline-block;width:.8em;height:.8em;margin-right:.35em;vertical-align:baseline;border-radius:2px}
"""


def _tiny(summary: dict[str, Any], rows: list[ClusterRow]) -> tuple[list[int], int]:
    """The tiny clusters and the size below which a cluster is tiny: from ``summary.json``,
    or (summaries written before they were) from the assignments' cluster sizes."""
    if "tiny_clusters" in summary:
        return list(summary["tiny_clusters"]), int(summary.get("tiny_cluster_rows") or 0)
    sizes = np.zeros(max((r.cluster for r in rows), default=-1) + 1, dtype=np.int64)
    for r in rows:
        sizes[r.cluster] = r.size
    threshold = tiny_cluster_rows(int(sizes.sum()), int((sizes > 0).sum()))
    return tiny_clusters(sizes, threshold), threshold


@dataclass
class KCount:
    """K and its parts, the one count the header, the overview and the tables give.

    Attributes
    ----------
    k : int
        Clusters of the fit (``summary.json``'s ``n_clusters``; the assignments' clusters
        when it is missing).
    clusters, tiny, empty : int
        Of them: the clusters that are not tiny, the tiny ones, and those that own no row
        of the assignments (k = clusters + tiny + empty).
    """

    k: int
    clusters: int
    tiny: int
    empty: int

    @classmethod
    def of(cls, summary: dict[str, Any], rows: list[ClusterRow], tiny: list[int]) -> KCount:
        owned = {r.cluster for r in rows}
        n_tiny = len(owned & set(tiny)) if rows else len(tiny)
        k = int(summary.get("n_clusters") or len(owned))
        clusters = len(owned) - n_tiny if rows else k - n_tiny
        return cls(k, clusters, n_tiny, max(k - clusters - n_tiny, 0))

    def parts(self) -> str:
        """``3 clusters + 2 tiny`` (empty when every cluster is a plain one)."""
        if not (self.tiny or self.empty):
            return ""
        out = [f"{self.clusters} cluster{'s' * (self.clusters != 1)}"]
        out += [f"{self.tiny} tiny"] if self.tiny else []
        out += [f"{self.empty} owning no row"] if self.empty else []
        return " + ".join(out)


def _figure(png: bytes, name: str, caption: str) -> str:
    return f"<figure>{_img(png, name)}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _small_data(summary: dict[str, Any]) -> int | None:
    """``small_data.max_rows`` when the fit searched by exact EM (at most that many rows),
    else None."""
    limit = ((summary.get("config") or {}).get("small_data") or {}).get("max_rows", 100_000)
    n = summary.get("n_samples")
    return int(limit) if n is not None and int(n) <= int(limit) else None


def render_report(
    run: RunData,
    images: str | Path | None = None,
    max_clusters: int = 30,
    per_cluster: int = 8,
    row_shape: tuple[int, int] | None = None,
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
        Sample images (or rows) per cluster.
    row_shape : (int, int), optional
        Draw each sample row as an image of this height and width (rows of pixels).
    """
    summary = run.summary
    history = summary.get("history") or []
    config = summary.get("config") or {}
    rows = cluster_rows(run.assignments) if run.assignments is not None else []
    tiny, tiny_rows = _tiny(summary, rows)
    count = KCount.of(summary, rows, tiny) if (rows or "n_clusters" in summary) else None
    title = "DeepDPM report: K = " + ("?" if count is None else str(count.k)) + (
        f" ({count.parts()})" if count is not None and count.parts() else "")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="source">{html.escape(run.source)}</p>',
        _overview(summary, tiny, tiny_rows, rows, count),
    ]
    for diagnostic in diagnose(history, config, summary.get("feature_variance_ratio")):
        parts.append(f'<div class="warn">{html.escape(diagnostic.message)}</div>')

    with tempfile.TemporaryDirectory(prefix="deepdpm-report-") as tmp:
        tmp_dir = Path(tmp)
        styles = data_view.cluster_styles([r.cluster for r in rows if r.cluster not in set(tiny)])
        parts.append(_data_section(summary, run.assignments, rows[:max_clusters], set(tiny),
                                   tmp_dir, min(per_cluster, 5), row_shape, styles))
        if rows:
            normal = [r for r in rows if r.cluster not in set(tiny)]
            small = [r for r in rows if r.cluster in set(tiny)]
            below = "the tiny one is below" if len(small) == 1 else f"the {len(small)} tiny ones are below"
            above = "the other one is above" if len(normal) == 1 else f"the other {len(normal)} are above"
            parts.append(_cluster_table(normal[:max_clusters], len(normal), "Clusters",
                                        _of_k(count, below if small else None), styles))
            if small:
                parts.append(_cluster_table(small[:max_clusters], len(small), "Tiny clusters",
                                            _of_k(count, above)))
                parts.append(f"<p>A tiny cluster holds fewer than {tiny_rows} rows: too few to "
                             "be a group, it is most likely outliers or a splinter of a larger "
                             "cluster. K counts it.</p>")
            owned = {r.cluster for r in rows}
            empty = [k for k in range(count.k) if k not in owned][:count.empty] if count else []
            sizes = plots.plot_cluster_sizes([r.size for r in rows] + [0] * len(empty),
                                             tmp_dir / "sizes.png",
                                             ids=[r.cluster for r in rows] + empty)
            parts.append(_figure(sizes.read_bytes(), "Cluster sizes",
                                 "Rows in each cluster, largest first (a log scale when they "
                                 "differ by more than 50 times); the bars at the right end "
                                 "are the smallest clusters."))
        parts.append("<h2>How the search went</h2>"
                     "<p>The fit starts from k-means clusters and, epoch by epoch, fits a "
                     "Gaussian mixture while split and merge moves change K, until K "
                     "settles; a clustering net learns the mixture, to assign new rows.</p>")
        parts.append('<div class="grid">')
        resumed = summary.get("resumed_from_epoch")
        k_caption = ("K after each epoch. Every change is marked with what the epoch's record "
                     "says made it: splits accepted (up-triangles), merges accepted "
                     "(down-triangles), clusters pruned, too small to keep or owning no row "
                     "at the end (crosses), and the k-means partition of K or K - 1 clusters "
                     "the end of the search takes when the model's evidence prefers it "
                     "(diamond). A flat end means K settled.")
        if resumed:
            k_caption += f" This fit was resumed after epoch {resumed} (the dashed line)."
        k_plot = plots.plot_k_over_epochs(history, tmp_dir / "k.png", resumed)
        parts.append(_figure(k_plot.read_bytes(), "K over epochs", k_caption))
        parts.append(_figure(plots.plot_moves(history, tmp_dir / "moves.png").read_bytes(),
                             "Moves per epoch",
                             "Clusters split, merged and pruned in each epoch (top) and so far "
                             "(bottom). Move rounds take turns, splits then merges; the search "
                             "ends once rounds in a row change nothing."))
        small_limit = _small_data(summary)
        losses_caption = (
            "Mean loss per row of the clustering net (left axis) and of the sub-cluster "
            "split proposals (right axis). " + (
                f"With at most {small_limit:,} rows the search is exact EM: the clustering "
                "net takes one step per epoch and is fitted to the clusters only after the "
                "last one, so its loss here stays near ln K and drops when K does; it does "
                "not measure the clusters. The sub-cluster loss jumps when a move changes "
                "the sub-clusters." if small_limit is not None else
                "Lower is better, and a level end means the nets have learned the mixture; "
                "both jump after an accepted move, which changes what they learn."))
        parts.append(_figure(plots.plot_losses(history, tmp_dir / "losses.png").read_bytes(),
                             "Losses", losses_caption))
        if plots.has_scores(history):
            scores = plots.plot_scores(history, tmp_dir / "scores.png")
            parts.append(_figure(scores.read_bytes(), "NMI / ARI / ACC over epochs",
                                 "Agreement with the input's labels (1 = the same grouping) of "
                                 "the fit's partition after each epoch: each row's most likely "
                                 "cluster under the mixture, on up to 10,000 labelled rows. "
                                 "The scores move when K does; the Result's are of the final "
                                 "assignments of every row."))
        parts.append("</div>")
        if images is not None and run.assignments is not None:
            parts.append(_samples(run.assignments, rows[:max_clusters], images, per_cluster))
        if plots.has_phases(history):
            seconds = plots.plot_epoch_time(history, tmp_dir / "time.png", summary.get("fit_seconds"))
            parts.append("<h2>Details</h2>")
            parts.append(_figure(seconds.read_bytes(), "Where the epochs went",
                                 "Seconds each epoch spent in each step of the fit: for tuning "
                                 "its speed, not needed to read the result." + (
                                     " The last epoch's split / merge round also ends the "
                                     "search: it checks k-means partitions and fits the "
                                     "clustering net to the clusters, hence its taller bar."
                                     if small_limit is not None else "")))
    if config:
        parts.append("<h2>Config</h2><pre>")
        parts.append(html.escape(yaml.safe_dump(config, sort_keys=False)))
        parts.append("</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _data_section(summary: dict[str, Any], assignments: pa.Table | None, rows: list[ClusterRow],
                  tiny: set[int], tmp_dir: Path, per_cluster: int,
                  row_shape: tuple[int, int] | None, styles: dict[int, tuple[str, str]]) -> str:
    """The rows in 2-D coloured by cluster, and the most confident rows of each cluster."""
    read = data_view.fit_rows(summary, assignments)
    if read is None:
        return ("<h2>The data</h2><p>The fit's input "
                f"({html.escape(str(summary.get('input')))}) could not be read as the rows "
                "of these assignments, so the data are not shown.</p>")
    X, names = read
    clusters = assignments.column("cluster").to_numpy()
    coords, space = data_view.fit_view(X, summary.get("config"))
    xy, picked, explained = data_view.pca_2d(coords)
    png = data_view.plot_projection(xy, clusters[picked], tiny, explained,
                                    tmp_dir / "projection.png", styles, space).read_bytes()
    parts = ["<h2>The data</h2>", _figure(
        png, "The rows in 2-D",
        f"Each row at its place on the two directions along which the data vary most (PCA) in "
        f"the coordinates the fit clustered ({space}), in its cluster's colour and marker; "
        "tiny clusters are black crosses. Clusters that overlap here may still be apart in "
        "the other dimensions.")]
    confidence = (assignments.column("confidence").to_numpy()
                  if "confidence" in assignments.column_names else np.zeros(len(X)))
    shown = names[:data_view.SHOWN_COLUMNS]
    if row_shape is not None and row_shape[0] * row_shape[1] != X.shape[1]:
        row_shape = None  # not this many pixels: shown as numbers
    head = "<tr><th>cluster</th>" + ("<th>most confident rows</th>" if row_shape else "".join(
        f"<th>{html.escape(n)}</th>" for n in shown)) + "</tr>"
    body = []
    for r in rows:
        members = np.flatnonzero(clusters == r.cluster)
        best = members[np.argsort(-confidence[members], kind="stable")[:per_cluster]]
        label = (_swatch(styles.get(r.cluster)) + f"{r.cluster}<br>{r.size} rows"
                 + ("<br>(tiny)" if r.cluster in tiny else ""))
        if row_shape:
            body.append(f"<tr><th>{label}</th><td>"
                        f"{_img(data_view.row_image(X[best], row_shape), f'cluster {r.cluster}')}"
                        "</td></tr>")
            continue
        for i, row in enumerate(best):
            cells = "".join(f"<td>{_fmt(float(v))}</td>" for v in X[row, :len(shown)])
            first = f'<th rowspan="{len(best)}">{label}</th>' if i == 0 else ""
            body.append(f"<tr>{first}{cells}</tr>")
    more = (f" (the first {len(shown)} of {len(names)} columns)" if len(names) > len(shown)
            else "")
    how = ("drawn as images" if row_shape else f"as numbers{more}")
    parts.append(f"<h3>Sample rows per cluster</h3><p>The {per_cluster} rows of each cluster "
                 f"the model is most sure of, {how}: rows of one cluster should look alike."
                 f'</p><table class="rows">{head}{"".join(body)}</table>')
    return "\n".join(parts)


def _overview(summary: dict[str, Any], tiny: list[int], tiny_rows: int,
              rows: list[ClusterRow], count: KCount | None) -> str:
    sizes = {r.cluster: r.size for r in rows}
    k_text = None if count is None else str(count.k)
    if count is not None and tiny:
        shown = ", ".join(str(sizes.get(k, "?")) for k in tiny[:8])
        k_text += (f": {count.parts()} (a tiny cluster holds fewer than {tiny_rows} rows; "
                   f"these hold {shown}{', ...' if len(tiny) > 8 else ''})")
    elif count is not None and rows:
        k_text += (f" (none tiny: a cluster of fewer than {tiny_rows} rows would be)"
                   + (f"; {count.parts()}" if count.parts() else ""))
    facts = [
        ("clusters found (K)", k_text),
        ("epochs", summary.get("epochs")),
        ("stopped", stop_reason(summary.get("history") or [], summary.get("config"))),
        ("resumed after epoch", summary.get("resumed_from_epoch")),
        ("fit time (s)", summary.get("fit_seconds")),
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


def _of_k(count: KCount | None, apart: str | None) -> str:
    """How a table's clusters stand to K: ``of K = 5; the 2 tiny ones are below`` (``apart``:
    where K's other clusters are listed, None when there are none)."""
    if count is None:
        return ""
    if apart is None:
        return f"K = {count.k}" if not count.empty else f"of K = {count.k}: {count.parts()}"
    return f"of K = {count.k}; {apart}"


def _swatch(style: tuple[str, str] | None) -> str:
    """A square of the cluster's colour in the projection (nothing for tiny clusters)."""
    if style is None:
        return ""
    return (f'<span class="swatch" style="background:{style[0]}" '
            'title="its colour in the 2-D view"></span>')


def _cluster_table(rows: list[ClusterRow], total: int, title: str = "Clusters", of_k: str = "",
                   styles: dict[int, tuple[str, str]] | None = None) -> str:
    has_labels = any(r.majority_label is not None for r in rows)
    head = "<tr><th>cluster</th><th>size</th><th>mean confidence</th>"
    head += "<th>majority label</th><th>purity</th></tr>" if has_labels else "</tr>"
    body = []
    for r in rows:
        cells = [r.size, r.confidence if r.confidence is not None else ""]
        if has_labels:
            cells += [
                "" if r.majority_label is None else r.majority_label,
                "" if r.purity is None else r.purity,
            ]
        first = f"<td>{_swatch((styles or {}).get(r.cluster))}{r.cluster}</td>"
        body.append("<tr>" + first + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    shown = f": the {len(rows)} largest of {total}" if len(rows) < total else (
        "" if of_k.startswith("K =") else f": {total}")
    heading = f"{title}{shown}" + (f" ({of_k})" if of_k else "")
    return f"<h2>{html.escape(heading)}</h2><table>{head}{''.join(body)}</table>"


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


__all__ = ["ClusterRow", "KCount", "RunData", "cluster_rows", "load_mlflow_run", "load_run", "load_run_dir",
           "render_report", "write_report"]
