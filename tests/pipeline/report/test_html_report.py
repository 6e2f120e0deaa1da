"""The HTML report of a real fit: one K everywhere, the data drawn in the fit's own
coordinates, clusters told apart by colour and marker at K = 30, legends beside the data."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pyarrow as pa
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from sklearn.datasets import load_wine

from pipeline.cli import main
from pipeline.report import data_view
from pipeline.report.html_report import render_report
from pipeline.report.run_data import RunData, load_run_dir


@pytest.fixture(scope="module")
def wine_fit(tmp_path_factory):
    """A fit of the wine table (13 features in units from 0.1 to 1,000) by the CLI."""
    folder = tmp_path_factory.mktemp("wine")
    load_wine(as_frame=True).frame.to_csv(folder / "wine.csv", index=False)
    assert main(["fit", "--input", str(folder / "wine.csv"), "--label", "target", "--output",
                 str(folder / "fit"), "--no-tracking", "--quiet"]) == 0
    return folder / "fit"


def _headings(page: str) -> list[str]:
    return [re.sub("<[^>]+>", "", h) for h in re.findall(r"<h[12]>(.*?)</h[12]>", page)]


def test_the_projection_is_of_the_fits_coordinates(wine_fit, figures):
    page = render_report(load_run_dir(wine_fit))
    projection = next(f.axes[0] for f in figures if f.axes[0].get_xlabel().startswith("PC 1"))
    share = float(re.search(r"\((\d+)% of", projection.get_xlabel()).group(1))
    # in raw units proline (variance ~1e5) is the whole first axis: "PC 1 (100 %)"
    assert share < 60, projection.get_xlabel()
    assert "standardised features" in projection.get_title()
    assert "standardised features" in page


def test_the_captions_tell_the_search_the_records_name(wine_fit):
    run = load_run_dir(wine_fit)
    assert {r["search"] for r in run.summary["history"]} == {"exact_em"}
    assert "The search was exact EM" in render_report(run)
    net = [{**r, "search": "net"} for r in run.summary["history"]]
    page = render_report(RunData({**run.summary, "history": net}, run.assignments, run.source))
    assert "The search was exact EM" not in page and "the nets have learned the mixture" in page


def test_read_only_rows_are_projected_without_a_warning():
    # features read from Arrow or a memory map come as read-only arrays; torch warns on a
    # from_numpy of one, and the warning landed in the middle of `deepdpm demo`'s output
    X = np.random.default_rng(0).normal(size=(50, 3)).astype(np.float32)
    X.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        view, _ = data_view.fit_view(X, {"data": {"transform": "standard"}})
    assert view.shape == (50, 3)


def _run(sizes: list[int], n_clusters: int, tiny: list[int]) -> RunData:
    cluster = np.repeat(np.arange(len(sizes)), sizes)
    assignments = pa.table({"key": np.arange(len(cluster)), "cluster": cluster,
                            "confidence": np.full(len(cluster), 0.9)})
    summary = {"n_clusters": n_clusters, "tiny_clusters": tiny, "tiny_cluster_rows": 10,
               "n_samples": int(len(cluster)), "history": []}
    return RunData(summary, assignments, "test")


def test_one_k_in_the_header_the_overview_and_the_tables():
    page = render_report(_run([58, 7, 50, 54, 9], 5, tiny=[1, 4]))
    headings = _headings(page)
    assert headings[0] == "DeepDPM report: K = 5 (3 clusters + 2 tiny)"
    tables = [h for h in headings if h.startswith(("Clusters", "Tiny clusters"))]
    assert tables == ["Clusters: 3 (of K = 5; the 2 tiny ones are below)",
                      "Tiny clusters: 2 (of K = 5; the other 3 are above)"]
    assert "5: 3 clusters + 2 tiny" in page  # the overview's K
    assert page.count("too few to be a group") == 1  # what tiny means, said once
    # a cluster that owns no row is counted too
    empty = _headings(render_report(_run([58, 7, 50, 54, 0, 9], 6, tiny=[1, 5])))
    assert empty[0] == "DeepDPM report: K = 6 (3 clusters + 2 tiny + 1 owning no row)"


def _lightness(colour) -> float:
    """CIE L* (0 black .. 100 white) of a colour."""
    linear = np.array([c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
                       for c in to_rgb(colour)])
    y = float(linear @ [0.2126, 0.7152, 0.0722])
    return 116 * np.cbrt(y) - 16 if y > 0.008856 else 903.3 * y


def test_thirty_clusters_each_have_their_own_colour_and_marker(tmp_path, figures):
    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(30), 20)
    xy = rng.normal(size=(600, 2)) + clusters[:, None] * 0.3
    data_view.plot_projection(xy, clusters, set(), np.array([0.5, 0.2]), tmp_path / "p.png")
    (fig,) = figures
    ax = fig.axes[0]
    drawn = ax.collections  # no tiny cluster: one collection per cluster
    colours = {tuple(np.round(c.get_facecolor()[0][:3], 3)) for c in drawn}
    assert len(drawn) == 30 and len(colours) == 30  # not 20 colours cycled
    assert max(_lightness(c) for c in colours) < 80  # no pale colour on the white page
    styles = {(tuple(np.round(c.get_facecolor()[0][:3], 3)), c.get_paths()[0].vertices.tobytes())
              for c in drawn}
    assert len(styles) == 30
    markers = {c.get_paths()[0].vertices.tobytes() for c in drawn}
    assert len(markers) > 1  # a second cue beside the colour
    # every cluster is named, and the legend hides none of the points
    renderer = FigureCanvasAgg(fig).get_renderer()
    legend = ax.get_legend()
    assert len(legend.get_texts()) == 30
    assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
