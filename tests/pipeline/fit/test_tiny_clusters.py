"""Clusters of a few rows are named as tiny wherever K is: the estimator, the result line,
``summary.json`` and the report, which lists them apart and shows the data in 2-D."""

import json

import numpy as np
import pytest
from sklearn.datasets import make_blobs

from deepdpm_core import DeepDPM
from pipeline.cli import main


@pytest.fixture(scope="module")
def blobs_and_outliers(tmp_path_factory):
    """Three blobs of 300 rows and five far rows, three at (40, 40) and two at (-40, -40): K = 4,
    the mixture's fourth cluster the five far rows."""
    X, _ = make_blobs(n_samples=900, centers=3, n_features=2, random_state=1, cluster_std=0.6)
    far = np.array([[40, 40], [40.5, 40.2], [39.8, 40.4], [-40, -40], [-40.3, -40.1]])
    path = tmp_path_factory.mktemp("tiny") / "x.npy"
    np.save(path, np.vstack([X, far]).astype(np.float32))
    return path


def test_tiny_clusters_are_named_everywhere(blobs_and_outliers, tmp_path, capsys):
    X = np.load(blobs_and_outliers)
    model = DeepDPM(random_state=0).fit(X)
    assert model.n_clusters_ == 4 and model.tiny_cluster_rows_ == 12
    (tiny,) = model.tiny_clusters_
    assert model.cluster_sizes_[tiny] == 5 and model.cluster_sizes_.sum() == len(X)

    out = tmp_path / "fit"
    assert main(["fit", "--input", str(blobs_and_outliers), "--output", str(out), "--quiet",
                 "--no-tracking", "--seed", "0"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("K=4 (1 tiny: 5 rows) "), line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tiny_cluster_rows"] == 12 and len(summary["tiny_clusters"]) == 1
    assert summary["cluster_sizes"][summary["tiny_clusters"][0]] == 5

    assert main(["report", str(out)]) == 0  # beside the fit
    text = (out / "report.html").read_text()
    assert "<h1>DeepDPM report: K = 4 (3 clusters + 1 tiny)</h1>" in text
    assert "4: 3 clusters + 1 tiny (a tiny cluster holds fewer than 12 rows; these hold 5)" in text
    assert "<h2>Tiny clusters: 1 (of K = 4; the other 3 are above)</h2>" in text
    assert "<h2>Clusters: 3 (of K = 4; the tiny one is below)</h2>" in text
    assert 'alt="The rows in 2-D"' in text and "Sample rows per cluster" in text
    assert text.count("<figcaption>") >= 5  # a sentence under every plot


def test_the_report_marks_where_a_resumed_fit_continued(blobs_and_outliers, tmp_path):
    from pipeline.report.html_report import render_report
    from pipeline.report.run_data import load_run_dir

    out = tmp_path / "fit"
    assert main(["fit", "--input", str(blobs_and_outliers), "--output", str(out), "--quiet",
                 "--no-tracking", "--seed", "0", "--set", "schedule.max_epochs=6"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "resumed_from_epoch": 3}))
    text = render_report(load_run_dir(out))
    assert "This fit was resumed after epoch 3 (the dashed line)." in text
    assert "<th>resumed after epoch</th><td>3</td>" in text


def test_the_report_reads_a_table_by_the_columns_the_fit_named(blobs_and_outliers, tmp_path):
    """A CSV fitted with ``--key`` and ``--label``: the report re-reads its rows by the same
    columns, so the keys match the assignments and the data are drawn."""
    X = np.load(blobs_and_outliers)
    csv = tmp_path / "rows.csv"
    lines = ["id,a,b,group"] + [f"r{i},{a},{b},g{i % 3}" for i, (a, b) in enumerate(X)]
    csv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fit"
    assert main(["fit", "--input", str(csv), "--key", "id", "--label", "group", "--output",
                 str(out), "--quiet", "--no-tracking", "--seed", "0",
                 "--set", "schedule.max_epochs=6"]) == 0
    assert json.loads((out / "summary.json").read_text())["columns"] == {"label": "group", "key": "id"}
    assert main(["report", str(out)]) == 0
    assert 'alt="The rows in 2-D"' in (out / "report.html").read_text()
