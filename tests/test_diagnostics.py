"""Diagnostics name the prior knobs when splits stall or K collapses."""

from __future__ import annotations

from deepdpm_core.config import Config
from pipeline.diagnostics import KNOB_EFFECTS, DiagnosticsMonitor, diagnose, split_rounds


def _record(epoch: int, k: int, splits: int = 0, merges: int = 0) -> dict:
    return {
        "epoch": epoch, "n_clusters": k, "loss_cluster": 1.0, "loss_subcluster": 1.0,
        "splits_accepted": splits, "merges_accepted": merges, "seconds": 0.1,
    }  # fmt: skip


def test_split_rounds_follow_the_schedule():
    schedule = {"warmup_epochs": 5, "move_every": 5}
    assert split_rounds(5, schedule, {"merge": True}) == 0
    # moves at epochs 5 (split), 10 (merge), 15 (split): 2 split rounds in 20 epochs
    assert split_rounds(20, schedule, {"merge": True}) == 2
    assert split_rounds(20, schedule, {"merge": False}) == 3


def test_no_warning_for_a_healthy_fit():
    cfg = Config()
    history = [_record(e, 1) for e in range(5)] + [_record(5, 4, splits=3)]
    history += [_record(e, 4) for e in range(6, 20)] + [_record(20, 6, splits=2)]
    assert diagnose(history, cfg) == []


def test_stalled_splits_name_every_knob_with_its_value():
    cfg = Config().with_overrides({"prior.alpha": 3.0})
    history = [_record(e, 5) for e in range(30)]  # K_init = 5, no move in 5 rounds
    (warning,) = diagnose(history, cfg)
    assert warning.kind == "no_split"
    assert "no split accepted in the last 3 split rounds" in warning.message
    for key, direction, _ in KNOB_EFFECTS:
        assert f"{direction} {key}" in warning.message
    assert "prior.alpha (now 3.0" in warning.message
    assert "prior.nu (now auto (D + 2)" in warning.message


def test_collapse_to_one_or_two_clusters():
    history = [_record(e, 8) for e in range(10)] + [_record(10, 2, merges=6)]
    kinds = {d.kind for d in diagnose(history, Config().to_dict())}
    assert kinds == {"collapsed"}
    (warning,) = [d for d in diagnose(history, None) if d.kind == "collapsed"]
    assert "K collapsed to 2 (largest K so far: 8)" in warning.message


def test_monitor_reports_each_kind_once():
    messages: list[str] = []
    monitor = DiagnosticsMonitor(Config(), messages.append)
    for e in range(60):
        monitor(_record(e, 1))
    assert len(messages) == 2
    assert {d.kind for d in monitor.reported} == {"no_split", "collapsed"}
