"""Plots write valid PNGs that depend on the data they are given."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from pipeline.report import plots


def _history(k_values: list[int]) -> list[dict]:
    out = []
    for e, k in enumerate(k_values):
        prev = k_values[e - 1] if e else k
        out.append(
            {
                "epoch": e,
                "n_clusters": k,
                "loss_cluster": 10.0 * k / (e + 1),
                "loss_subcluster": 3.0 + np.sin(e),
                "splits_accepted": max(k - prev, 0),
                "merges_accepted": max(prev - k, 0),
                "seconds": 0.5 + 0.04 * k,
                "seconds_estep": 0.01 * k,
                "seconds_train": 0.4,
                "seconds_stats": 0.03 * k,
                "seconds_mstep": 0.05,
                "seconds_moves": 0.05 * (k != prev),
            }
        )
    return out


def _differ(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape != b.shape or bool((a != b).any())


def _pixels(path) -> np.ndarray:
    with Image.open(path) as img:
        assert img.format == "PNG"
        return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize(
    "plot",
    [plots.plot_k_over_epochs, plots.plot_moves, plots.plot_losses, plots.plot_epoch_time],
    ids=lambda f: f.__name__,
)
def test_history_plots_are_pngs_that_follow_the_data(plot, tmp_path):
    a = _pixels(plot(_history([1, 1, 3, 3, 5, 4, 4]), tmp_path / "a.png"))
    b = _pixels(plot(_history([1, 2, 2, 2, 2, 2, 2]), tmp_path / "b.png"))
    assert a.shape[0] > 200 and a.shape[1] > 300
    assert _differ(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png"]  # no temp files left


def test_history_plots_accept_an_empty_history(tmp_path):
    for plot in (plots.plot_k_over_epochs, plots.plot_moves, plots.plot_losses, plots.plot_epoch_time):
        assert _pixels(plot([], tmp_path / f"{plot.__name__}.png")).size > 0


def test_the_losses_plot_draws_the_cluster_loss_only_where_the_records_have_one(tmp_path, monkeypatch):
    drawn = []
    save = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: (drawn.append(fig), save(fig, path))[1])
    nets = _history([1, 3, 3, 2])
    exact = [{**r, "loss_cluster": None} for r in nets]  # exact EM: no net trains during the search
    plots.plot_losses(nets, tmp_path / "nets.png")
    plots.plot_losses(exact, tmp_path / "exact.png")
    assert [len(f.axes) for f in drawn] == [2, 1]
    assert [a.get_ylabel() for a in drawn[1].axes] == ["subcluster loss"]


def test_cluster_sizes_sorted_bars(tmp_path):
    balanced = _pixels(plots.plot_cluster_sizes([100, 100, 100, 100], tmp_path / "b.png"))
    shuffled = _pixels(plots.plot_cluster_sizes([5, 300, 40, 2000], tmp_path / "s.png",
                                                ids=[3, 1, 2, 0]))
    ordered = _pixels(plots.plot_cluster_sizes([2000, 300, 40, 5], tmp_path / "o.png"))
    assert _differ(balanced, ordered)
    np.testing.assert_array_equal(shuffled, ordered)  # sorted: input order does not matter


def _is_integer(values) -> bool:
    return all(float(v).is_integer() for v in values)


def _in_view(ax, ticks) -> list[float]:
    lo, hi = sorted(ax.get_ylim())
    return [t for t in ticks if lo <= t <= hi]


def test_counts_have_integer_axes_even_when_k_stays_at_1(tmp_path, figures):
    flat = _history([1] * 12)  # K = 1 throughout, no move accepted
    plots.plot_k_over_epochs(flat, tmp_path / "k.png")
    plots.plot_moves(flat, tmp_path / "m.png")
    plots.plot_epoch_time(flat, tmp_path / "t.png")
    plots.plot_scores([{**r, "nmi": 0.0, "ari": 0.0, "acc": 0.3} for r in flat], tmp_path / "s.png")
    k_axes, (per_epoch, total), (_, time_k), (_, score_k) = (
        fig.axes if len(fig.axes) > 1 else fig.axes[0] for fig in figures)
    for ax in (k_axes, per_epoch, total, time_k, score_k):
        ticks = _in_view(ax, ax.get_yticks())
        assert len(ticks) >= 2 and _is_integer(ticks), ticks  # not 0.945 ... 1.05
        assert _is_integer(ax.get_xticks()) if ax is not time_k else True
    for ax in (k_axes, total, time_k, score_k):
        assert ax.get_ylim()[0] >= 0 and 1 in _in_view(ax, ax.get_yticks())
    # merges are drawn downwards but counted upwards: no "-1" (or -0.045) accepted moves
    labels = [t.get_text() for t in per_epoch.get_yticklabels() if t.get_text()]
    assert labels and not any(text.startswith(("-", "\N{MINUS SIGN}")) for text in labels), labels


def test_epoch_time_shows_the_tallest_bar_whole(tmp_path, figures):
    history = _history([1, 1, 3, 3, 5, 4, 4])
    history[2]["seconds_train"] = 25.0  # one slow epoch
    plots.plot_epoch_time(history, tmp_path / "t.png")
    ax = figures[0].axes[0]
    tallest = max(sum(r[f"seconds_{p}"] for p, _ in plots.EPOCH_PHASES) for r in history)
    assert ax.get_ylim()[1] >= 1.05 * tallest  # room above it, not cut at the frame
    legend = ax.get_legend()
    renderer = FigureCanvasAgg(figures[0]).get_renderer()
    inside = ax.get_window_extent(renderer)
    assert legend.get_window_extent(renderer).y1 <= inside.y0  # below the axes, hiding no bar


def test_cluster_sizes_are_labelled_with_cluster_ids(tmp_path, figures):
    plots.plot_cluster_sizes([40, 7, 300, 7, 0, 90], tmp_path / "c.png")
    ax = figures[0].axes[0]
    # the report's table order: largest first, ties by id
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "5", "0", "1", "3", "4"]
    assert [p.get_height() for p in ax.patches] == [300, 90, 40, 7, 7, 0]
    plots.plot_cluster_sizes([5, 9], tmp_path / "r.png", ids=[17, 4])
    assert [t.get_text() for t in figures[1].axes[0].get_xticklabels()] == ["4", "17"]


def test_write_fit_plots_names(tmp_path):
    paths = plots.write_fit_plots(_history([1, 2, 2]), [10, 20], tmp_path)
    assert [p.name for p in paths] == [
        "k_over_epochs.png", "cluster_sizes.png", "moves.png", "losses.png", "epoch_time.png",
    ]  # fmt: skip
    for path in paths:
        _pixels(path)
    # records of older versions (a resumed checkpoint) do not say where their seconds went
    untimed = [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in _history([1, 2])]
    assert not plots.has_phases(untimed)
    assert "epoch_time.png" not in [p.name for p in plots.write_fit_plots(untimed, [10, 20], tmp_path / "old")]
    scored = [{**r, "nmi": 0.5, "ari": 0.4, "acc": 0.7} for r in _history([1, 2, 2])]
    paths = plots.write_fit_plots(scored, [10, 20], tmp_path / "scored")
    assert [p.name for p in paths][-1] == "scores.png"  # labelled data only


def test_scores_plot_follows_the_scores(tmp_path):
    history = _history([1, 1, 3, 3, 3])
    rising = [{**r, "nmi": e / 4, "ari": e / 5, "acc": 0.5 + e / 10} for e, r in enumerate(history)]
    flat = [{**r, "nmi": 0.2, "ari": 0.2, "acc": 0.5} for r in history]
    assert plots.has_scores(rising) and not plots.has_scores(history)
    a = _pixels(plots.plot_scores(rising, tmp_path / "a.png"))
    b = _pixels(plots.plot_scores(flat, tmp_path / "b.png"))
    assert a.shape[0] > 200 and _differ(a, b)


def _marks(ax) -> dict[str, list[tuple[float, float]]]:
    """The markers of each legend label: (x, y) of every point."""
    return {c.get_label(): [tuple(p) for p in c.get_offsets()] for c in ax.collections
            if not c.get_label().startswith("_")}


def test_k_markers_are_the_moves_the_records_accepted(tmp_path, figures):
    # a split round that also prunes two small clusters (K 10 -> 9), then a merge round,
    # then the end's k-means partition with one cluster fewer
    k = [10, 10, 9, 9, 5, 5, 4]
    history = [{"epoch": e, "n_clusters": n, "splits_accepted": 0, "merges_accepted": 0,
                "prunes": 0} for e, n in enumerate(k)]
    history[2].update(splits_accepted=1, prunes=2)
    history[4].update(merges_accepted=4)
    history[6].update(polished=1)
    plots.plot_k_over_epochs(history, tmp_path / "k.png")
    marks = _marks(figures[0].axes[0])

    def epochs_of(word: str) -> list[int]:
        return sorted(round(x) for name, points in marks.items() if word in name for x, _ in points)

    assert epochs_of("prune") == [2]  # K fell 10 -> 9 in a split round: not only a split
    assert epochs_of("split") == [2] and epochs_of("merge") == [4]
    assert epochs_of("k-means") == [6]
    # every change of K has a marker, and there is none where K stayed
    changed = {e for e in range(1, len(k)) if k[e] != k[e - 1]}
    assert {round(x) for points in marks.values() for x, _ in points} == changed


def test_moves_tell_prunes_from_merges(tmp_path, figures):
    history = _history([10, 10, 9, 9, 5])
    history[2].update(splits_accepted=1, merges_accepted=0, prunes=2)
    plots.plot_moves(history, tmp_path / "m.png")
    top, bottom = figures[0].axes
    down = {round(p.get_x() + p.get_width() / 2): p for p in top.patches if p.get_height() < 0}
    assert sorted((e, -p.get_height()) for e, p in down.items()) == [(2, 2), (4, 4)]
    assert down[2].get_facecolor() != down[4].get_facecolor()  # a prune is not a merge
    totals = {line.get_label(): line.get_ydata()[-1] for line in bottom.get_lines()
              if not line.get_label().startswith("_")}
    assert totals == {"splits": 1, "merges": 4, "prunes": 2}


def _hides_nothing(fig, ax) -> bool:
    """The axes' legend lies wholly outside them."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    inside = ax.get_window_extent(renderer)
    return not legend.overlaps(inside)


def test_legends_sit_outside_the_axes(tmp_path, figures):
    history = [{**r, "nmi": 0.5, "ari": 0.4, "acc": 0.7} for r in _history([1, 1, 3, 3, 5, 4, 4])]
    plots.plot_k_over_epochs(history, tmp_path / "k.png", resumed_after=3)
    plots.plot_moves(history, tmp_path / "m.png")
    plots.plot_scores(history, tmp_path / "s.png")
    (k_fig, moves_fig, scores_fig) = figures
    assert _hides_nothing(k_fig, k_fig.axes[0])
    top, bottom = moves_fig.axes
    assert top.get_legend() is None and _hides_nothing(moves_fig, bottom)
    assert _hides_nothing(scores_fig, scores_fig.axes[0])
