"""The move schedule: when rounds run, what they alternate, when the fit stops; and that
a fit's epoch records name the move the schedule ran."""

from __future__ import annotations

import torch

from deepdpm_core.config import Config, MovesConfig, ScheduleConfig
from deepdpm_core.data import make_mixture
from deepdpm_core.moves import MoveSchedule
from deepdpm_core.moves.schedule import (
    FREEZE_EPOCHS,
    PATIENCE,
    SETTLED_BAND,
    approaches_level,
    swings_without_trend,
)
from deepdpm_core.training import start_fit


def test_rounds_start_after_the_warm_up_and_alternate():
    sched = MoveSchedule(ScheduleConfig(warmup_epochs=5, move_every=5), MovesConfig())
    kinds = {}
    for epoch in range(1, 21):
        kind = sched.move_at(epoch)
        if kind:
            kinds[epoch] = kind
            sched.moved(epoch, 0, 3)
    # the parameters are frozen through the warm-up, so the first round ends epoch 10
    assert kinds == {10: "split", 15: "merge", 20: "split"}
    assert sched.frozen(5) and not sched.frozen(6)


def test_an_accepted_move_freezes_and_the_alternation_waits():
    sched = MoveSchedule(ScheduleConfig(warmup_epochs=5, move_every=1), MovesConfig())
    ran = []
    for epoch in range(6, 11):
        kind = sched.move_at(epoch)
        if kind:
            ran.append((epoch, kind))
            sched.moved(epoch, 2 if epoch == 6 else 0, 5)
    # the split at epoch 6 was accepted: epochs 7 and 8 (FREEZE_EPOCHS) are frozen, then merge, split
    assert FREEZE_EPOCHS == 2 and ran == [(6, "split"), (9, "merge"), (10, "split")]
    # exact EM, with no nets to wait for, freezes nothing
    exact = MoveSchedule(ScheduleConfig(warmup_epochs=1, move_every=1), MovesConfig(), freeze_epochs=0)
    exact.moved(2, 1, 5)
    assert exact.move_at(3) == "merge"
    only_split = MoveSchedule(ScheduleConfig(warmup_epochs=0, move_every=1), MovesConfig(merge=False))
    assert {only_split.move_at(e) for e in range(1, 5)} == {"split"}
    assert MoveSchedule(ScheduleConfig(), MovesConfig(split=False, merge=False)).move_at(9) is None


def test_the_stop_rule():
    sched = MoveSchedule(ScheduleConfig(max_epochs=50), MovesConfig())
    sched.moved(10, 0, 4)
    assert sched.rounds_without_move == 1 and not sched.finished(11) and sched.stop_reason(11) is None
    sched.moved(14, 0, 4)
    assert sched.rounds_without_move == 2 and not sched.finished(14)
    sched.moved(18, 0, 4)
    assert sched.rounds_without_move == PATIENCE == 3 and sched.finished(18) and sched.converged()
    assert sched.stop_reason(18) == "K settled after 18 epochs (3 move rounds in a row accepted nothing)"
    sched.moved(22, 1, 5)  # an accepted move resets the count
    assert not sched.finished(30) and sched.finished(50)
    assert sched.stop_reason(30) is None and sched.stop_reason(50) == "max_epochs (50) reached"
    again = MoveSchedule(ScheduleConfig(), MovesConfig())
    again.restore({**sched.counters(), "epoch": 3})
    assert again.counters() == sched.counters()


def test_a_split_and_a_merge_taking_turns_stop_the_fit():
    sched = MoveSchedule(ScheduleConfig(max_epochs=200), MovesConfig())
    for epoch, k in zip(range(10, 50, 4), [8, 10, 11, 12, 11, 12, 11, 12, 11, 11], strict=True):
        assert not sched.finished(epoch - 1)
        sched.moved(epoch, 1, k)  # every round accepts a move
        # the last 2·PATIENCE + 1 = 7 rounds left K at 11 or 12 after the split round of
        # epoch 42; its cuts stand only once the merge round after it has judged them
        assert sched.finished(epoch) is (epoch == 46), epoch
    assert sched.converged()
    assert sched.stop_reason(46) == ("K settled after 46 epochs (K alternated between 11 and 12 "
                                     "over 7 move rounds)")
    climbing = MoveSchedule(ScheduleConfig(max_epochs=200), MovesConfig())
    for epoch, k in zip(range(10, 30, 4), [10, 11, 11, 12, 12], strict=True):
        climbing.moved(epoch, 1, k)
    assert not climbing.finished(30)  # K still grows: 10 -> 12 over the window


def test_a_cycle_that_returns_to_its_k_stops_the_fit_at_a_thousand_clusters():
    """K after each round of a 1.28M x 128 fit of 1,000 classes (one H100, epochs 9-93): past
    epoch 61 every split round takes 25-35 clusters apart and the next merge round joins
    most of them again; K after each cycle is 977, 987, 992, 993, 994, never within one of
    itself, and the fit ran to max_epochs (200) before :data:`SETTLED_SPREAD`. The ends 977,
    987, 992 head for 997 by shrinking steps: the fit stops at epoch 77; without that rule,
    :data:`SETTLED_SPREAD` would stop it at epoch 93 (987 to 994)."""
    rounds = [203, 203, 392, 392, 686, 663, 995, 939, 1113, 1001, 1077, 967, 1012, 977, 1012,
              987, 1018, 992, 1017, 993, 1020, 994]
    sched = MoveSchedule(ScheduleConfig(), MovesConfig())
    stopped = None
    for index, k in enumerate(rounds):
        epoch = 9 + 4 * index
        assert sched.move_at(epoch) == ("split", "merge")[index % 2]
        sched.moved(epoch, int(index not in (1, 3)), k)  # the first two merge rounds took none
        if sched.finished(epoch):
            stopped = epoch
            break
    assert stopped == 77 and sched.stop_reason(77) == (
        "K settled after 77 epochs (K after each of the last 3 move cycles went from 977 to 992 by shrinking "
        "steps, within 7% of the level they head for)")
    # cycles that end within 1 % of K with no level for the steps to head for (they turn) and
    # no swing about a line: SETTLED_SPREAD stops the fit
    sched, stopped = _replay_default([1030, 1000, 1020, 992, 1025, 995, 1020, 993])
    assert stopped == 37 and sched.stop_reason(37) == (
        "K settled after 37 epochs (K was 992 to 1000 after each of the last 4 move cycles)")
    assert not swings_without_trend([1000, 992, 995], SETTLED_BAND)  # the three ends before
    # below 100 clusters a cycle must return to the same K: 6, 6, 5, 5 is a search still
    # merging (four curved clusters at 24k rows went on to 4)
    for ends, stops in (([11, 11, 11, 11], True), ([6, 6, 5, 5], False), ([10, 11, 10, 11], False)):
        small = MoveSchedule(ScheduleConfig(), MovesConfig())
        for index, k in enumerate(ends):
            small.moved(9 + 8 * index, 1, k + 2)  # the split round: 2 more (not the window rule)
            assert not small.finished(9 + 8 * index)
            small.moved(13 + 8 * index, 1, k)
        assert small.finished(37) is stops, ends


def test_a_fit_names_the_moves_its_schedule_ran_and_stops_by_its_rule():
    x, _ = make_mixture(900, 4, 4, random_state=0)
    cfg = Config().with_overrides({"seed": 0, "init.n_clusters": 1, "schedule.warmup_epochs": 2,
                                   "schedule.move_every": 2, "schedule.max_epochs": 40,
                                   "optim.min_steps_per_epoch": 8, "small_data.max_rows": 0})
    search = start_fit(cfg, torch.from_numpy(x))
    search.fit()
    history = search.history
    moves = [r["move"] for r in history]
    assert "split" in moves and set(moves) <= {None, "split", "merge"}
    replayed = _replayed(cfg, history)
    assert replayed.counters() == search.schedule.counters()
    # it stopped at the first epoch after which the schedule says stop
    assert _finished_after(cfg, history)
    assert not any(_finished_after(cfg, history[:n]) for n in range(1, len(history)))
    assert search.n_clusters == 4


def _replayed(cfg: Config, history: list[dict]) -> MoveSchedule:
    """A schedule fed the move rounds of ``history`` as the fit fed its own."""
    sched = MoveSchedule(cfg.schedule, cfg.moves)
    for epoch, record in enumerate(history, start=1):
        assert record["move"] == sched.move_at(epoch)
        if record["move"]:
            sched.moved(epoch, record["splits_accepted"] + record["merges_accepted"], record["n_clusters"])
    return sched


def _finished_after(cfg: Config, history: list[dict]) -> bool:
    return _replayed(cfg, history).finished(len(history))


def _replay_rounds(rounds: list[int], start: int) -> tuple[MoveSchedule, int | None]:
    """Feed an exact-EM fit's K after each move round (rounds every 2 epochs from epoch 2,
    a round accepted a move when K changed) to a schedule; it and the epoch it stopped at."""
    sched = MoveSchedule(ScheduleConfig(warmup_epochs=1, move_every=2), MovesConfig(), freeze_epochs=0)
    before = start
    for index, k in enumerate(rounds):
        epoch = 2 + 2 * index
        sched.moved(epoch, int(k != before), k)
        before = k
        if sched.finished(epoch):
            return sched, epoch
    return sched, None


def test_cycles_whose_ends_take_turns_between_two_values_stop_the_fit():
    """K after each round of an exact-EM fit of 10 curved clusters (20,000 rows, seed 1;
    rounds every 2 epochs): from epoch 32 on the cycles end at 10, 11, 10, 11, ... (two
    splits, a merge, nothing, a merge) and the fit ran to max_epochs (200)."""
    sched, stopped = _replay_rounds([14, 12, 12, 10, 13, 12, 14, 11, 14, 12, 13, 11, 13, 11, 11, 10, 12,
                                     11, 11, 10, 12, 11, 11, 10, 12, 11, 11, 10, 12, 11, 11, 10], 14)
    # the ends of the last 6 cycles (epochs 28-48): 11, 10, 11, 10, 11, 10
    assert stopped == 48 and sched.stop_reason(48) == (
        "K settled after 48 epochs (K after each of the last 6 move cycles repeated 11, 10)")
    # ends that repeat no pattern, or one not at its smallest K, are a search still moving
    for ends in ([11, 10, 12, 11, 12, 10], [11, 11, 10, 10, 11, 11], [12, 11, 12, 11, 12, 10],
                 [11, 10, 12, 11, 10, 12]):
        moving = MoveSchedule(ScheduleConfig(), MovesConfig())
        for index, k in enumerate(ends):
            moving.moved(9 + 8 * index, 1, k + 3)
            moving.moved(13 + 8 * index, 1, k)
        assert not moving.finished(13 + 8 * 5), ends


def test_cycles_whose_ends_repeat_a_longer_pattern_stop_the_fit_at_its_fewest_clusters():
    """K after each round of the same fit under the per-feature prior: from epoch 28 on the
    cycles end at 10, 11, 12, 11, 10, ... and the fit ran to max_epochs (200)."""
    sched, stopped = _replay_rounds([16, 15, 15, 12, 13, 11, 14, 13, 15, 13, 13, 11, 11, 10, 12, 11, 13,
                                     12, 12, 11, 11, 10, 12, 11, 13, 12, 12, 11, 11, 10, 12, 11, 13, 12,
                                     12, 11, 11, 10], 10)
    # the ends of the last 8 cycles (epochs 32-60): 11, 12, 11, 10, 11, 12, 11, 10
    assert stopped == 60 and sched.round_k[-1] == 10 and sched.stop_reason(60) == (
        "K settled after 60 epochs (K after each of the last 8 move cycles repeated 11, 12, 11, 10)")


def test_k_swinging_about_a_level_at_a_thousand_clusters_stops_the_fit():
    """1.28M x 128, 1,000 classes, one H100: K rose to 1,025 by epoch 40, then
    swung between 964 and 1,025 for 45 epochs without repeating itself, within 6 % (no
    :data:`SETTLED_SPREAD`), and the fit stopped at epoch 85 only when 3 rounds in a row took
    nothing. Here every round accepts moves: the swing rule stops it at epoch 45 (without it,
    no rule stops it before 85: the ends never settle within :data:`SETTLED_SPREAD`)."""
    cycles = [(260, 250), (560, 540), (1010, 975), (1040, 1025), (1030, 964), (1020, 1001), (1045, 968),
              (1050, 1012), (1035, 971), (1044, 995)]
    rounds = [k for cycle in cycles for k in cycle]
    sched, stopped = _replay_default(rounds)
    # the ends of the last 3 cycles (epochs 29, 37, 45): 975, 1,025, 964
    assert stopped == 45 and sched.stop_reason(45) == (
        "K settled after 45 epochs (K after each of the last 3 move cycles swung between 964 and 1025 "
        "without a trend)")


def test_k_still_drifting_by_two_percent_a_cycle_does_not_stop_the_fit():
    # steadily, and with swings of ±1 % about the drift: the drift exceeds the swings
    for swing in (0.0, 0.01):
        ends = [round(800 * 1.02**c * (1 + swing * (-1) ** c)) for c in range(20)]
        rounds = [k for end in ends for k in (round(end * 1.03), end)]
        sched, stopped = _replay_default(rounds)
        assert stopped is None, (swing, ends)
        # falling as steadily: no stop either
        assert _replay_default([k for end in ends[::-1] for k in (end + 20, end)])[1] is None, swing


def test_k_climbing_to_its_level_by_shrinking_steps_stops_the_fit():
    """A 1,000-class sphere at 200k rows, one thread: K after each merge round 345, 553,
    777, 931, 963, 979, 990, the split rounds cutting up to 1,123, each cycle about a
    minute; a rise of 1-2 % a cycle is no swing, and the fit ran on. The rounds' steps
    shrink towards a level: the fit stops once the last three ends and that level lie
    within :data:`SETTLED_BAND`."""
    cycles = [(400, 345), (700, 553), (900, 777), (1050, 931), (1080, 963), (1100, 979), (1123, 990)]
    rounds = [k for cycle in cycles for k in cycle]
    sched, stopped = _replay_default(rounds)
    # the ends of cycles 4-6 (epochs 37, 45, 53): 931, 963, 979, heading for 995
    assert stopped == 53 and sched.round_k[-1] == 979 and sched.stop_reason(53) == (
        "K settled after 53 epochs (K after each of the last 3 move cycles went from 931 to 979 by "
        "shrinking steps, within 7% of the level they head for)")


def test_approaches_level():
    assert approaches_level([931, 963, 979], 0.07)  # steps 32, 16: level 995, span 64 <= 69
    assert approaches_level([1060, 1020, 1005], 0.07)  # from above: steps -40, -15, level 996
    assert not approaches_level([777, 931, 963], 0.07)  # steps shrink but span 186 > 67
    assert not approaches_level([816, 832, 849], 0.07)  # a steady drift: steps do not shrink
    assert not approaches_level([849, 832, 816], 0.07)  # falling steadily: level 560, far out of the band
    assert not approaches_level([1001, 967, 977], 0.07)  # turned: the steps change sign
    assert not approaches_level([990, 990, 991], 0.07) and not approaches_level([963, 979], 0.07)
    assert not approaches_level([30, 34, 35], 0.07)  # below 100 clusters the band is a few clusters


def test_swings_without_trend():
    assert swings_without_trend([975, 1025, 964], 0.07)  # d = 11, s = 26
    assert not swings_without_trend([975, 1025, 964], 0.05)  # spread 61 > 51
    assert not swings_without_trend([1001, 967, 977], 0.07)  # turned and climbs back: d = 24, s = 10
    assert not swings_without_trend([967, 977, 987], 0.07)  # a line: s = 0
    assert not swings_without_trend([1000, 1000, 1000], 0.07)  # no swing (SETTLED_SPREAD's case)
    assert not swings_without_trend([11, 12, 11], 0.07)  # below 15 clusters the band is 0
    assert swings_without_trend([30, 31, 31, 30], 0.07) and not swings_without_trend([30, 31, 31, 32], 0.07)


def _replay_default(rounds: list[int]) -> tuple[MoveSchedule, int | None]:
    """Feed K after each round (every round accepting moves) to a schedule at the defaults
    (rounds every 4 epochs from epoch 9); it and the epoch it stopped at."""
    sched = MoveSchedule(ScheduleConfig(), MovesConfig())
    for index, k in enumerate(rounds):
        epoch = 9 + 4 * index
        assert sched.move_at(epoch) == ("split", "merge")[index % 2]
        sched.moved(epoch, 1, k)
        if sched.finished(epoch):
            return sched, epoch
    return sched, None
