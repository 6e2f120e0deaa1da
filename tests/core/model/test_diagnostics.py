"""Diagnostics name the prior knobs when splits stall or K collapses."""

from __future__ import annotations

import warnings

import pytest
from sklearn.datasets import load_wine
from sklearn.preprocessing import StandardScaler

from deepdpm_core import DeepDPM
from deepdpm_core.config import Config, from_dict
from deepdpm_core.model.diagnostics import (
    UNITS_RATIO,
    DiagnosticsMonitor,
    diagnose,
    knob_advice,
    move_kinds,
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
    schedule = {"warmup_epochs": 5, "move_every": 5, "freeze_epochs": 2}
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
    sched = {"warmup_epochs": 5, "move_every": 1, "freeze_epochs": 2}
    kinds = move_kinds(named_rounds(busy[:10], _sched(sched)))
    assert [(i, k) for i, k in enumerate(kinds) if k] == [(5, "split"), (8, "merge"), (9, "split")]


def test_no_warning_for_a_healthy_fit():
    cfg = Config()
    history = [_record(e, 1) for e in range(5)] + [_record(5, 4, splits=3)]
    history += [_record(e, 4) for e in range(6, 20)] + [_record(20, 6, splits=2)]
    assert diagnose(named_rounds(history, cfg), cfg) == []


def test_stalled_splits_name_every_knob_with_its_value():
    cfg = Config().with_overrides({"prior.alpha": 3.0, "prior.sigma_scale": 0.005})
    history = [_record(e, 5) for e in range(30)]  # K_init = 5, no move in 5 rounds
    (warning,) = diagnose(named_rounds(history, cfg), cfg)
    assert warning.kind == "no_split"
    assert "no split accepted in the last 3 split rounds" in warning.message
    assert "raise prior.alpha (now 3.0" in warning.message
    assert "lower prior.nu (now auto: fitted to the clusters, at least D + 2" in warning.message
    assert "prior.sigma_scale (now 0.005) moves K non-monotonically" in warning.message


def test_sigma_scale_direction_follows_the_data_variance():
    # measured (module docstring): K peaks for Ψ ~ 0.001-0.3 x the feature variance
    assert knob_advice({"sigma_scale": 0.005}, 0.16).startswith("raise prior.sigma_scale")
    assert knob_advice({"sigma_scale": 0.5}, 0.16).startswith("lower prior.sigma_scale")
    # psi="data_std": Ψ = s·std, so s = 1 on unit-variance data is at the pivot
    assert knob_advice({"sigma_scale": 1.0, "psi": "data_std"}, 1.0).startswith("lower")
    assert knob_advice({"sigma_scale": 1.0, "psi": "data_std"}, 100.0).startswith("raise")
    assert "(now 0.5: Ψ is 3.1 × the median feature variance" in knob_advice(
        {"sigma_scale": 0.5}, 0.16
    )


def test_collapse_to_one_or_two_clusters():
    history = [_record(e, 8) for e in range(10)] + [_record(10, 2, merges=6)]
    kinds = {d.kind for d in diagnose(named_rounds(history, Config().to_dict()), Config().to_dict())}
    assert kinds == {"collapsed"}
    (warning,) = [d for d in diagnose(named_rounds(history, None), None) if d.kind == "collapsed"]
    assert "K collapsed to 2 (largest K so far: 8)" in warning.message


def test_growing_from_one_cluster_is_not_a_collapse():
    # init.n_clusters = 1 (the default): the first split round (epoch 9) takes K to 2,
    # which is growth, not collapse (schedule pinned: moves every 5 epochs, patience 3)
    cfg = Config().with_overrides({"schedule.move_every": 5, "schedule.patience": 3,
                                   "prior.sigma_scale": 0.005})
    growing = [_record(e, 1) for e in range(9)] + [_record(9, 2, splits=1)]
    growing += [_record(e, 2) for e in range(10, 19)]
    assert diagnose(named_rounds(growing, cfg), cfg) == []
    # K stays at 2 through the merge (14), split (19) and merge (24) rounds: 3 idle
    # rounds = patience, the fit stops there, after one idle split round
    ended = growing + [_record(e, 2) for e in range(19, 25)]
    assert diagnose(named_rounds(ended[:-1], cfg), cfg) == []
    (warning,) = diagnose(named_rounds(ended, cfg), cfg, feature_variance=36.0)
    assert warning.kind == "collapsed"
    assert warning.message.startswith("K stayed at 2: the last split round accepted no split.")
    assert "raise prior.sigma_scale (now 0.005" in warning.message
    # a fit that goes on needs 2 idle split rounds (19 and 29) before K counts as stuck
    patient = cfg.with_overrides({"schedule.patience": 10})
    stuck = growing + [_record(e, 2) for e in range(19, 30)]
    assert diagnose(named_rounds(ended, patient), patient) == []
    assert diagnose(named_rounds(stuck[:-1], patient), patient) == []
    (warning,) = diagnose(named_rounds(stuck, patient), patient)
    assert warning.message.startswith("K stayed at 2: the last 2 split rounds accepted no split.")


def test_monitor_reports_each_kind_once():
    messages: list[str] = []
    monitor = DiagnosticsMonitor(Config(), messages.append)
    for record in named_rounds([_record(e, 1) for e in range(60)]):
        monitor(record)
    assert len(messages) == 2
    assert {d.kind for d in monitor.reported} == {"no_split", "collapsed"}


def test_fitted_prior_scale_is_named_when_it_is_fitted():
    history = [{**_record(e, 5), "prior_scale": 0.0123} for e in range(30)]
    (warning,) = diagnose(named_rounds(history), Config().with_overrides({"prior.sigma_scale": "evidence"}))
    assert "prior.sigma_scale is fitted to the clusters (last fitted s = 0.0123)" in warning.message
    assert "prior.covariance_type=diag" in warning.message


def test_features_in_different_units_are_named_before_the_prior_knobs():
    # wine's proline (variance ~1e5) against its other 12 features (median ~0.7)
    summary = variance_summary([1e5, 0.7, 0.5, 0.0])
    assert summary["feature_variance_ratio"] == pytest.approx(1e5 / 0.7)  # constant column ignored
    assert variance_summary([0.0, 0.0])["feature_variance_ratio"] == 1.0
    history = [_record(e, 8) for e in range(10)] + [_record(10, 1, merges=7)]
    (units,) = diagnose(named_rounds(history), Config(), 0.6, summary["feature_variance_ratio"])
    assert units.message.startswith("K collapsed to 1 (largest K so far: 8).")
    assert "data.transform=standard" in units.message and "prior.nu" not in units.message
    # one unit: the prior knobs
    (knobs,) = diagnose(named_rounds(history), Config(), 1.0, UNITS_RATIO / 2)
    assert "data.transform" not in knobs.message and "lower prior.nu" in knobs.message


def test_a_fit_that_collapses_on_raw_units_warns_to_standardise():
    X = load_wine().data  # data.transform: auto would standardise it; none keeps the units
    # under Ψ0 = s·I the feature in the thousands (proline) sets s: one cluster
    with pytest.warns(UserWarning, match=r"data\.transform=standard") as caught:
        model = DeepDPM(random_state=0, data__transform="none", prior__psi="identity").fit(X)
    assert model.n_clusters_ == 1
    (warning,) = caught  # one warning per fit, pointing at the caller's line
    assert warning.filename == __file__
    assert "K collapsed to 1" in str(warning.message)
    assert "standardise the features (data.transform=standard)" in str(warning.message)
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
