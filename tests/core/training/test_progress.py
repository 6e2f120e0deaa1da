"""A fit's progress bar ends complete at the epochs the fit ran and says why it stopped,
in this process and as Ray's driver draws it."""

from __future__ import annotations

import re

import numpy as np

from deepdpm_core import DeepDPM


def _last_bar(err: str) -> str:
    """The bar as the terminal shows it last (each ``\\r`` redraws it)."""
    return [s for s in re.split(r"[\r\n]", err) if s.startswith("deepdpm fit")][-1]


def test_a_fit_that_stops_early_completes_its_bar_and_says_why(capsys):
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(c, 0.3, (80, 4)) for c in (0.0, 3.0, 6.0)])
    model = DeepDPM(random_state=0, max_epochs=200).fit(X, progress=True)
    epochs = len(model.history_)
    assert epochs < 200  # K settled
    bar = _last_bar(capsys.readouterr().err)
    assert "100%" in bar and f" {epochs}/{epochs} " in bar, bar
    assert f"stopped: K settled after {epochs} epochs (" in bar, bar
    assert f"K={model.n_clusters_}" in bar, bar


def test_a_fit_that_runs_out_of_epochs_says_so(capsys):
    X = np.random.default_rng(0).normal(size=(200, 3))
    DeepDPM(random_state=0, max_epochs=4).fit(X, progress=True)
    bar = _last_bar(capsys.readouterr().err)
    assert "100%" in bar and " 4/4 " in bar and bar.endswith("stopped: max_epochs (4) reached]"), bar


def test_rays_driver_draws_whole_counts_no_worker_prefix_and_closes_bars_left_open(monkeypatch, capsys):
    import tqdm.auto
    from ray.experimental import tqdm_ray

    from pipeline.ray_cluster.bars import plain_ray_bars

    # Ray's own drawing (an earlier Ray fit in this process may have replaced it already);
    # monkeypatch puts back whatever was there after the test
    monkeypatch.setattr(tqdm_ray, "real_tqdm", tqdm.auto)
    # the description as Ray's driver hands it over: the worker's pid in colour codes first
    prefix = "\x1b[2m\x1b[36m(pid=4242) \x1b[0m"
    state = {"x": 7, "pos": 0, "desc": prefix + "deepdpm fit K=3", "total": 200, "unit": "epoch",
             "ip": "", "pid": 0, "uuid": "a", "closed": False}
    assert "7.00/200" in str(tqdm_ray._Bar(dict(state), 0).bar)  # Ray's own drawing
    close_open = plain_ray_bars()
    drawn = tqdm_ray._Bar(dict(state), 0)
    assert str(drawn.bar).startswith("deepdpm fit K=3: ") and " 7/200 " in str(drawn.bar), str(drawn.bar)
    drawn.update({**state, "x": 33, "total": 33,
                  "desc": prefix.replace("4242", "4242, ip=10.0.0.2") + "deepdpm fit K=3 stopped: K settled"})
    shown = str(drawn.bar)
    assert shown.startswith("deepdpm fit K=3 stopped: K settled: 100%") and " 33/33 " in shown, shown
    # a worker stopped by Ctrl-C never closes its bar: the driver closes it, so that no
    # later print redraws it below the line that says how to resume
    left_open = tqdm_ray._Bar(dict(state, uuid="b"), 1)
    close_open()
    assert drawn.bar.disable and left_open.bar.disable
    capsys.readouterr()
    left_open.bar.refresh()
    assert capsys.readouterr().err == ""


def test_the_bars_total_is_the_end_the_schedule_expects_not_max_epochs(capsys):
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(c, 0.3, (80, 4)) for c in (0.0, 3.0, 6.0)])
    model = DeepDPM(random_state=0, max_epochs=200).fit(X, progress=True)
    err = capsys.readouterr().err
    totals = [int(t) for t in re.findall(r" \d+/(\d+) \[", err)]
    # from the first epoch on the time left is that of a fit about to settle: each total
    # is an epoch the fit could end with, and the last one is the epoch it did
    assert totals and max(totals) < 200, totals
    assert totals[-1] == len(model.history_)
