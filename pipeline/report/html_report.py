"""A self-contained HTML report of one fit.

One HTML file with every image inlined as a base64 PNG, so it opens offline: the result
(K, tiny clusters, metrics) and the warnings of :mod:`deepdpm_core.model.diagnostics`; the
data, read again from the fit's input, in 2-D coloured by cluster with a few rows of each
cluster (:mod:`pipeline.report.data_view`); the clusters, tiny ones listed apart; how the
search went (K over epochs, moves, losses, scores) and, for image features, sample images
per cluster (docs/tracking.md, "Report"). Every plot has one sentence on how to read it.
A run is read from a fit output directory or from an MLflow run id (the same files,
downloaded from the run's artifacts: :mod:`pipeline.report.run_data`). The clusters as
counted: :mod:`pipeline.report.clusters`; the sections: :mod:`pipeline.report.sections`.
"""

from __future__ import annotations

import html
import tempfile
from pathlib import Path

import yaml

from deepdpm_core.atomic_files import atomic_path
from deepdpm_core.model import diagnose
from pipeline.report import data_view, plots
from pipeline.report.clusters import KCount, cluster_rows, tiny_of
from pipeline.report.run_data import RunData
from pipeline.report.sections import cluster_table, data_section, figure, overview, samples

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
    tiny, tiny_rows = tiny_of(summary, rows)
    count = KCount.of(summary, rows, tiny) if (rows or "n_clusters" in summary) else None
    title = "DeepDPM report: K = " + ("?" if count is None else str(count.k)) + (
        f" ({count.parts()})" if count is not None and count.parts() else "")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="source">{html.escape(run.source)}</p>',
        overview(summary, tiny, tiny_rows, rows, count),
    ]
    for diagnostic in diagnose(history, config, summary.get("feature_variance_ratio")):
        parts.append(f'<div class="warn">{html.escape(diagnostic.message)}</div>')

    with tempfile.TemporaryDirectory(prefix="deepdpm-report-") as tmp:
        tmp_dir = Path(tmp)
        styles = data_view.cluster_styles([r.cluster for r in rows if r.cluster not in set(tiny)])
        parts.append(data_section(summary, run.assignments, rows[:max_clusters], set(tiny),
                                   tmp_dir, min(per_cluster, 5), row_shape, styles))
        if rows:
            normal = [r for r in rows if r.cluster not in set(tiny)]
            small = [r for r in rows if r.cluster in set(tiny)]
            below = "the tiny one is below" if len(small) == 1 else f"the {len(small)} tiny ones are below"
            above = "the other one is above" if len(normal) == 1 else f"the other {len(normal)} are above"
            parts.append(cluster_table(normal[:max_clusters], len(normal), "Clusters",
                                        _of_k(count, below if small else None), styles))
            if small:
                parts.append(cluster_table(small[:max_clusters], len(small), "Tiny clusters",
                                            _of_k(count, above)))
                parts.append(f"<p>A tiny cluster holds fewer than {tiny_rows} rows: too few to "
                             "be a group, it is most likely outliers or a splinter of a larger "
                             "cluster. K counts it.</p>")
            owned = {r.cluster for r in rows}
            empty = [k for k in range(count.k) if k not in owned][:count.empty] if count else []
            sizes = plots.plot_cluster_sizes([r.size for r in rows] + [0] * len(empty),
                                             tmp_dir / "sizes.png",
                                             ids=[r.cluster for r in rows] + empty)
            parts.append(figure(sizes.read_bytes(), "Cluster sizes",
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
        parts.append(figure(k_plot.read_bytes(), "K over epochs", k_caption))
        parts.append(figure(plots.plot_moves(history, tmp_dir / "moves.png").read_bytes(),
                             "Moves per epoch",
                             "Clusters split, merged and pruned in each epoch (top) and so far "
                             "(bottom). Move rounds take turns, splits then merges; the search "
                             "ends once rounds in a row change nothing."))
        exact = bool(history) and history[-1].get("search") == "exact_em"  # as the fit's records say
        losses_caption = (
            "The search was exact EM: no net is trained during the search, and the "
            "clustering net is fitted to the clusters after the last epoch. The sub-cluster "
            "loss is the mean squared distance of a row to the nearer of its cluster's two "
            "sub-cluster means (paper Eq. 7); it jumps when a move changes the sub-clusters."
            if exact else
            "Mean loss per row of the clustering net (left axis) and of the sub-cluster "
            "split proposals (right axis). Lower is better, and a level end means the nets "
            "have learned the mixture; both jump after an accepted move, which changes what "
            "they learn.")
        parts.append(figure(plots.plot_losses(history, tmp_dir / "losses.png").read_bytes(),
                             "Losses", losses_caption))
        if plots.has_scores(history):
            scores = plots.plot_scores(history, tmp_dir / "scores.png")
            parts.append(figure(scores.read_bytes(), "NMI / ARI / ACC over epochs",
                                 "Agreement with the input's labels (1 = the same grouping) of "
                                 "the fit's partition after each epoch: each row's most likely "
                                 "cluster under the mixture, on up to 10,000 labelled rows. "
                                 "The scores move when K does; the Result's are of the final "
                                 "assignments of every row."))
        parts.append("</div>")
        if images is not None and run.assignments is not None:
            parts.append(samples(run.assignments, rows[:max_clusters], images, per_cluster))
        if plots.has_phases(history):
            seconds = plots.plot_epoch_time(history, tmp_dir / "time.png", summary.get("fit_seconds"))
            parts.append("<h2>Details</h2>")
            parts.append(figure(seconds.read_bytes(), "Where the epochs went",
                                 "Seconds each epoch spent in each step of the fit: for tuning "
                                 "its speed, not needed to read the result." + (
                                     " The last epoch's split / merge round also ends the "
                                     "search: it checks k-means partitions and fits the "
                                     "clustering net to the clusters, hence its taller bar."
                                     if exact else "")))
    if config:
        parts.append("<h2>Config</h2><pre>")
        parts.append(html.escape(yaml.safe_dump(config, sort_keys=False)))
        parts.append("</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _of_k(count: KCount | None, apart: str | None) -> str:
    """How a table's clusters stand to K: ``of K = 5; the 2 tiny ones are below`` (``apart``:
    where K's other clusters are listed, None when there are none)."""
    if count is None:
        return ""
    if apart is None:
        return f"K = {count.k}" if not count.empty else f"of K = {count.k}: {count.parts()}"
    return f"of K = {count.k}; {apart}"


def write_report(html_text: str, output: str | Path) -> Path:
    """Write the HTML atomically."""
    output = Path(output)
    with atomic_path(output) as tmp:
        tmp.write_text(html_text, encoding="utf-8")
    return output


__all__ = ["render_report", "write_report"]
