"""The report's HTML sections: the result, the data, the cluster tables and the sample
images, and the pieces they are built of (inlined images, numbers, colour swatches)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from deepdpm_core.model import stop_reason
from pipeline.report import data_view
from pipeline.report.clusters import ClusterRow, KCount
from pipeline.report.sample_images import find_images, image_strip, sample_keys


def _img(png: bytes, alt: str) -> str:
    return f'<img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" alt="{html.escape(alt)}">'


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def figure(png: bytes, name: str, caption: str) -> str:
    """A PNG inlined, with its one-sentence caption."""
    return f"<figure>{_img(png, name)}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _swatch(style: tuple[str, str] | None) -> str:
    """A square of the cluster's colour in the projection (nothing for tiny clusters)."""
    if style is None:
        return ""
    return (f'<span class="swatch" style="background:{style[0]}" '
            'title="its colour in the 2-D view"></span>')


def overview(summary: dict[str, Any], tiny: list[int], tiny_rows: int,
             rows: list[ClusterRow], count: KCount | None) -> str:
    """The Result: K and its tiny clusters, how the fit stopped, its size and scores."""
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
        ("stopped", stop_reason(summary.get("history") or [])),
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


def data_section(summary: dict[str, Any], assignments: pa.Table | None, rows: list[ClusterRow],
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
    parts = ["<h2>The data</h2>", figure(
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


def cluster_table(rows: list[ClusterRow], total: int, title: str = "Clusters", of_k: str = "",
                  styles: dict[int, tuple[str, str]] | None = None) -> str:
    """A table of ``rows`` (of ``total`` clusters): size, mean confidence and, with labels,
    majority label and purity; ``of_k`` says how they stand to K."""
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


def samples(
    assignments: pa.Table, rows: list[ClusterRow], images: str | Path, per_cluster: int
) -> str:
    """The most confident sample images of each cluster of ``rows``, found under ``images``."""
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
