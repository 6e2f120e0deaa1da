"""Diagnostics warn only where something is wrong with K, and say the one thing to try;
tiny clusters are named."""

from __future__ import annotations

import warnings

import pytest
from sklearn.datasets import load_wine, make_blobs
from sklearn.preprocessing import StandardScaler

from deepdpm_core import DeepDPM
from deepdpm_core.config import Config, from_dict
from deepdpm_core.model.diagnostics import (
    UNITS_RATIO,
    DiagnosticsMonitor,
    diagnose,
    move_kinds,
    remedy,
    stop_reason,
    tiny_cluster_rows,
    tiny_clusters,
    variance_summary,
)
from tests.support.histories import named_rounds


def _record(epoch: int, k: int, splits: int = 0, merges: int = 0) -> dict:
    return {
        "epoch": epoch, "n_clusters": k, "loss_cluster": 1.0, "loss_subcluster": 1.0,
        "splits_accepted": splits, "merges_accepted": merges, "seconds": 0.1,
    }  # fmt: skip


def _sched(schedule: dict, moves: dict | None = None) -> Config:
    return from_dict({"schedule": schedule, "moves": moves or {}})


def test_move_kinds_are_the_rounds_the_schedule_ran():
    schedule = {"warmup_epochs": 5, "move_every": 5}
    quiet = [_record(e, 1) for e in range(20)]
    kinds = move_kinds(named_rounds(quiet, _sched(schedule, {"split": True, "merge": True})))
    # the nets are frozen through the warm-up, so the first round ends epoch 10 (index 9)
    assert [(i, k) for i, k in enumerate(kinds) if k] == [
        (9, "split"),
        (14, "merge"),
        (19, "split"),
    ]
    assert [k for k in move_kinds(named_rounds(quiet, _sched(schedule, {"merge": False}))) if k] == ["split"] * 3
    # an accepted move freezes the nets: a round falling in the freeze is skipped and
    # the alternation does not advance
    busy = list(quiet)
    busy[5] = _record(5, 3, splits=2)
    sched = {"warmup_epochs": 5, "move_every": 1}
    kinds = move_kinds(named_rounds(busy[:10], _sched(sched)))
    assert [(i, k) for i, k in enumerate(kinds) if k] == [(5, "split"), (8, "merge"), (9, "split")]


def test_no_warning_for_a_healthy_fit():
    cfg = Config()
    history = [_record(e, 1) for e in range(5)] + [_record(5, 4, splits=3)]
    history += [_record(e, 4) for e in range(6, 20)] + [_record(20, 6, splits=2)]
    assert diagnose(named_rounds(history, cfg), cfg) == []
    # from 10 k-means clusters merged down to 4, no split ever needed: how a fit on few
    # clusters ends, not a stall
    merged = [_record(e, 10) for e in range(6)] + [_record(6, 4, merges=6)]
    merged += [_record(e, 4) for e in range(7, 40)]
    assert diagnose(named_rounds(merged, cfg), cfg) == []


@pytest.mark.parametrize("centers, n_samples, n_features", [
    (4, 2000, 2), (8, 4000, 2), (4, 1000, 5), (8, 2000, 8)])
def test_clean_blobs_that_find_their_k_print_no_warning(centers, n_samples, n_features):
    # what the CLI prints: the monitor over the fit's records (it said "no split accepted
    # in the last 3 split rounds" for every one of these)
    X, _ = make_blobs(n_samples=n_samples, centers=centers, n_features=n_features,
                      random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DeepDPM.fit warns as the CLI does
        model = DeepDPM(random_state=0).fit(X)
    assert model.n_clusters_ == centers
    printed: list[str] = []
    monitor = DiagnosticsMonitor(model.get_config(), printed.append)
    for record in model.history_:
        monitor(record)
    assert printed == []
    assert model.tiny_clusters_ == []
    assert model.cluster_sizes_.sum() == len(X)


def test_the_one_thing_to_try():
    # a fixed prior scale the user set: back to the fitted one
    assert "prior.sigma_scale=auto" in remedy({"sigma_scale": 0.005})
    # features in different units: standardise
    assert "data.transform=standard" in remedy({"sigma_scale": "auto"}, UNITS_RATIO * 10)
    # otherwise no prior setting separates overlapping groups: a learned feature space
    assert "deepdpm embed --method umap" in remedy({"sigma_scale": "auto"}, 2.0)


def test_collapse_to_one_cluster():
    history = [_record(e, 8) for e in range(10)] + [_record(10, 1, merges=7)]
    history += [_record(e, 1) for e in range(11, 40)]
    (warning,) = diagnose(named_rounds(history, Config()), Config().to_dict())
    assert warning.kind == "collapsed"
    assert warning.message.startswith("The fit ended with one cluster (K = 1), down from 8")
    # two clusters may be the two groups the data hold: no warning
    two = [{**r, "n_clusters": max(2, r["n_clusters"])} for r in history]
    assert diagnose(named_rounds(two, Config()), Config()) == []


def test_growing_from_one_cluster_is_not_a_collapse():
    # init.n_clusters = 1: K at 1 while the first split rounds come is growth, not collapse
    cfg = Config().with_overrides({"schedule.move_every": 5})
    growing = [_record(e, 1) for e in range(12)]
    assert diagnose(named_rounds(growing, cfg), cfg) == []
    stuck = [_record(e, 1) for e in range(30)]  # 2 idle split rounds (9 and 19... )
    (warning,) = diagnose(named_rounds(stuck, cfg), cfg)
    assert warning.message.startswith("The fit ended with one cluster (K = 1): no split paid")


def test_monitor_warns_once_when_the_fit_stops():
    messages: list[str] = []
    monitor = DiagnosticsMonitor(Config(), messages.append)
    records = named_rounds([_record(e, 1) for e in range(60)])
    stop = next(i for i in range(1, 61) if stop_reason(records[:i]) is not None)
    for record in records[:stop - 1]:
        monitor(record)
    assert messages == []  # nothing while the fit goes on: its end decides
    for record in records[stop - 1:]:
        monitor(record)
    assert len(messages) == 1 and {d.kind for d in monitor.reported} == {"collapsed"}
    # the report, reading the final records, says the same
    assert [d.message for d in diagnose(records, Config())] == messages


def test_the_records_say_why_the_fit_stopped():
    # each record carries what the live schedule said after its epoch: the diagnostics,
    # the report and the progress bars read it there instead of replaying the schedule
    X, _ = make_blobs(n_samples=600, centers=3, n_features=2, random_state=0)
    *going, last = DeepDPM(random_state=0).fit(X).history_
    assert all(r["stop_reason"] is None and r["converged"] is False for r in going)
    assert last["converged"] is True and last["stop_reason"].startswith(f"K settled after {len(going) + 1} epochs")
    assert stop_reason([*going, last]) == last["stop_reason"] and stop_reason([*going, last]) is not None
    *going, last = DeepDPM(random_state=0, schedule__max_epochs=3).fit(X).history_
    assert (last["stop_reason"], last["converged"]) == ("max_epochs (3) reached", False)
    assert stop_reason([*going, last]) == "max_epochs (3) reached"
    # records written before they carried it read as a fit that goes on: nothing judged
    old = [{k: v for k, v in r.items() if k not in ("stop_reason", "converged")} for r in (*going, last)]
    assert stop_reason(old) is None and stop_reason([]) is None


def test_tiny_clusters():
    assert tiny_cluster_rows(1797, 7) == 13  # a twentieth of the mean, 256.7 rows
    assert tiny_cluster_rows(178, 5) == 10
    assert tiny_clusters([1058, 9, 400, 1, 0, 1]) == [3, 5, 1]  # smallest first, empty not counted
    assert tiny_clusters([50, 50, 50]) == []


def test_features_in_different_units_are_named():
    # wine's proline (variance ~1e5) against its other 12 features (median ~0.7)
    summary = variance_summary([1e5, 0.7, 0.5, 0.0])
    assert summary["feature_variance_ratio"] == pytest.approx(1e5 / 0.7)  # constant column ignored
    assert variance_summary([0.0, 0.0])["feature_variance_ratio"] == 1.0
    history = [_record(e, 8) for e in range(10)] + [_record(10, 1, merges=7)]
    (units,) = diagnose(named_rounds(history), Config(), summary["feature_variance_ratio"])
    assert "data.transform=standard" in units.message
    (other,) = diagnose(named_rounds(history), Config(), UNITS_RATIO / 2)
    assert "data.transform" not in other.message and "learned feature space" in other.message


def test_a_fit_that_collapses_on_raw_units_warns_to_standardise():
    X = load_wine().data  # data.transform: auto would standardise it; none keeps the units
    # under Ψ0 = s·I the feature in the thousands (proline) sets s: one cluster
    with pytest.warns(UserWarning, match=r"data\.transform=standard") as caught:
        model = DeepDPM(random_state=0, data__transform="none", prior__psi="identity").fit(X)
    assert model.n_clusters_ == 1
    (warning,) = caught  # one warning per fit, pointing at the caller's line
    assert warning.filename == __file__
    assert "The fit ended with one cluster (K = 1)" in str(warning.message)
    assert "Try standardised features: data.transform=standard." in str(warning.message)
    # standardised, by hand or by the default transform, the same data find clusters and
    # no warning names the transform
    for data, kwargs in ((StandardScaler().fit_transform(X), {"data__transform": "none"}), (X, {})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = DeepDPM(random_state=0, **kwargs).fit(data)
        assert model.n_clusters_ > 2
        assert not any("data.transform" in str(w.message) for w in caught)
    # the default Ψ0, fitted per feature, follows each feature's units: no collapse either
    assert DeepDPM(random_state=0, data__transform="none").fit(X).n_clusters_ >= 2
