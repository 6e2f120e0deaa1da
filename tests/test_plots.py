"""Plots write valid PNGs that depend on the data they are given."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pipeline import plots


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


def test_cluster_sizes_sorted_bars(tmp_path):
    balanced = _pixels(plots.plot_cluster_sizes([100, 100, 100, 100], tmp_path / "b.png"))
    shuffled = _pixels(plots.plot_cluster_sizes([5, 300, 40, 2000], tmp_path / "s.png"))
    ordered = _pixels(plots.plot_cluster_sizes([2000, 300, 40, 5], tmp_path / "o.png"))
    assert _differ(balanced, ordered)
    np.testing.assert_array_equal(shuffled, ordered)  # sorted: input order does not matter


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
