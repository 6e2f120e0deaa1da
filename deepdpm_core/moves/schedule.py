"""When a fit moves and when it stops: the one schedule every fit mode follows; each
epoch record carries what it says (docs/design.md, "Schedule").

Epochs count from 1. A move round ends epoch e when e ≥ ``warmup_epochs``, (e − warmup) is
a multiple of ``move_every`` and the parameters are not frozen; rounds alternate over the
enabled kinds (split, merge), and an accepted move freezes the M-step and the moves for
:data:`FREEZE_EPOCHS` epochs, so the nets learn the new clusters first (paper §3.2). The fit
stops after ``max_epochs``, or once K has settled: :data:`PATIENCE`
move rounds in a row accepted nothing; or, read at the end of a cycle (a split round and a
merge round) only, so that a split round's cuts stand once a merge round has judged them:
K after each of the last 2·:data:`PATIENCE` + 1 rounds stayed within one value, K after each
of the last :data:`PATIENCE` + 1 cycles stayed within :data:`SETTLED_SPREAD` of itself (rounded
down: below 100 clusters the same K), K after each cycle repeated a pattern of 2 to
:data:`MAX_CYCLE_PERIOD` values over the last max(2·period, 2·:data:`PATIENCE`) cycles and
stands at the pattern's smallest K (11, 10, 11, 10, 11, 10 or 11, 12, 11, 10, 11, 12, 11,
10: the merge rounds undo what the split rounds cut), or K swings about a level
(:func:`swings_without_trend`).

A swing about a level. At a thousand clusters the split rounds cut tens of clusters and
the next merge rounds join most of them again, a few more or fewer each time: K after each
cycle wanders within a few percent (964 to 1,025 for 45 epochs on ImageNet-like data)
without repeating itself exactly, so neither :data:`SETTLED_SPREAD` nor a pattern stops it.
Such a fit has settled when K after its last max(3, :data:`PATIENCE`) cycles, e_0 … e_{W−1},

* stays within :data:`SETTLED_BAND` of itself, max − min ≤ ⌊:data:`SETTLED_BAND`·max⌋ (±3.5 %
  of K by default; below 15 clusters no swing passes, the rules above decide), and
* shows no trend: the least-squares line through (i, e_i) changes by d = |slope|·(W − 1)
  over the window, and the ends scatter about it by s, the root mean square of the
  residuals; the fit stops when 0 < s and d ≤ s, a drift no larger than the swings
  about it. A fit still moving drifts by more than it swings (2 % of K a cycle in one
  direction is d ≈ 4 % of K over three cycles against s ≈ 0 for a steady drift), and so
  does one that turned and climbs back (1,001, 967, 977: d = 24, s = 10); K that wanders
  about a level has d ≈ 0 (975, 1,025, 964: d = 11, s = 26).

A level approached. At a thousand clusters K may also climb towards its level by less each
cycle (931, 963, 979, 990 on a 1,000-class sphere at 200k rows), each cycle costing a
minute, with no swing for the rule above to see. Such a fit has settled when the last three
cycle ends e_0, e_1, e_2 move the same way by steps that shrink, r = |e_2 − e_1| / |e_1 − e_0|
< 1, and the ends together with the level the steps head for, e_2 ± |e_2 − e_1|·r / (1 − r)
(the sum of the geometric series), stay within :data:`SETTLED_BAND` of themselves
(:func:`approaches_level`): 931, 963, 979 head for 995 and stop the fit, where a steady
drift (r ≈ 1) heads for no level within the band and goes on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deepdpm_core.config import MovesConfig, ScheduleConfig

#: epochs without M-step or moves after a round that accepted a move: the nets learn the
#: new clusters before the next round judges them (paper §3.2: 2); exact EM, with no nets
#: to wait for, freezes none (:class:`MoveSchedule`'s ``freeze_epochs``)
FREEZE_EPOCHS = 2
#: move rounds in a row that accept nothing before the fit stops; 3 lets a split round, a
#: merge round and a split round again all find nothing, and sets the windows of the other
#: stop rules (module docstring)
PATIENCE = 3
#: K after each of the last PATIENCE + 1 move cycles within this fraction of K (rounded
#: down) has settled: 1 % lets a fit of a thousand clusters stop while a few clusters come
#: and go; below 100 clusters K must repeat exactly
SETTLED_SPREAD = 0.01
#: K that swings about a level, or approaches one, within this fraction of K (rounded down)
#: has settled: 7 % holds the swings of 964 to 1,025 clusters seen on ImageNet-like data at
#: a thousand classes (±3.5 %), and below 15 clusters no swing passes
SETTLED_BAND = 0.07
#: the longest pattern of K at the ends of move cycles that stops a fit once repeated
MAX_CYCLE_PERIOD = 4
#: the fewest move cycles whose ends :func:`swings_without_trend` judges (a line and its
#: residuals need three)
MIN_SWING_CYCLES = 3


def swings_without_trend(ends: list[int], band: float) -> bool:
    """Whether K after each of these move cycles swings about a level (module docstring).

    Parameters
    ----------
    ends : list of int
        K after each cycle of the window, oldest first; at least 3.
    band : float
        :data:`SETTLED_BAND` in a fit: the most max − min may be, as a fraction of max
        (rounded down).

    Returns
    -------
    bool
        The ends stay within the band, scatter about their least-squares line (residual
        root mean square s > 0), and the line changes by no more than s over the window.
    """
    w = len(ends)
    if max(ends) - min(ends) > int(band * max(ends)):
        return False
    mean = sum(ends) / w
    offsets = [i - (w - 1) / 2 for i in range(w)]
    slope = sum(u * e for u, e in zip(offsets, ends, strict=True)) / sum(u * u for u in offsets)
    scatter = math.sqrt(sum((e - mean - slope * u) ** 2 for u, e in zip(offsets, ends, strict=True)) / w)
    return 0 < scatter and abs(slope) * (w - 1) <= scatter


def approaches_level(ends: list[int], band: float) -> bool:
    """Whether K after the last three move cycles approaches a level (module docstring).

    Parameters
    ----------
    ends : list of int
        K after each cycle, oldest first; the last three are read.
    band : float
        :data:`SETTLED_BAND` in a fit: the most the ends and their level may span, as a
        fraction of the largest (rounded down).

    Returns
    -------
    bool
        The steps between the last three ends have one sign and shrink, and the ends with
        the sum of the geometric series they start stay within the band.
    """
    if len(ends) < 3:
        return False
    first, second, third = ends[-3:]
    step, last_step = second - first, third - second
    if step * last_step <= 0 or abs(last_step) >= abs(step):
        return False
    ratio = last_step / step
    level = third + last_step * ratio / (1 - ratio)
    top, bottom = max(first, level), min(first, level)  # the ends are monotone: first and level bound them
    return top - bottom <= int(band * top)


@dataclass
class MoveSchedule:
    """Move rounds, freezes and the stop rule, with the counters they need.

    Parameters
    ----------
    schedule : ScheduleConfig
    moves : MovesConfig
        Which kinds of move are enabled.
    freeze_epochs : int
        Epochs without M-step or moves after a round that accepted a move
        (:data:`FREEZE_EPOCHS`; exact EM, with no nets to wait for: 0).
    move_round : int
        Move rounds run so far.
    rounds_without_move : int
        Move rounds in a row that accepted nothing.
    frozen_until : int
        The M-step and moves wait until after this epoch (1-based).
    round_k : list of int
        K after each move round so far.
    growths : int
        Times the search started again from a grown partition (:meth:`restart`).
    """

    schedule: ScheduleConfig
    moves: MovesConfig
    freeze_epochs: int = FREEZE_EPOCHS
    move_round: int = 0
    rounds_without_move: int = 0
    frozen_until: int | None = None
    round_k: list[int] = field(default_factory=list)
    growths: int = 0

    def __post_init__(self) -> None:
        if self.frozen_until is None:  # the warm-up: the nets first learn the initial clusters
            self.frozen_until = self.schedule.warmup_epochs

    def frozen(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (1-based) keeps the parameters as they are (no M-step)."""
        return epoch <= self.frozen_until

    def move_at(self, epoch: int) -> str | None:
        """``"split"`` or ``"merge"`` when epoch ``epoch`` (1-based) ends a move round, else None."""
        sch = self.schedule
        if epoch < sch.warmup_epochs or (epoch - sch.warmup_epochs) % sch.move_every or self.frozen(epoch):
            return None
        kinds = self._kinds()
        return kinds[self.move_round % len(kinds)] if kinds else None

    def _kinds(self) -> list[str]:
        """The enabled kinds of move, in the order their rounds take turns (one cycle)."""
        return [k for k, on in (("split", self.moves.split), ("merge", self.moves.merge)) if on]

    def moved(self, epoch: int, accepted: int, n_clusters: int) -> None:
        """Record the round that ended epoch ``epoch`` (1-based): ``accepted`` moves, after
        which the fit has ``n_clusters`` clusters."""
        self.move_round += 1
        self.round_k.append(int(n_clusters))
        if accepted:
            self.rounds_without_move = 0
            self.frozen_until = epoch + self.freeze_epochs
        else:
            self.rounds_without_move += 1

    def converged(self) -> bool:
        """K has settled (module docstring)."""
        return self._settled() is not None

    def _settled(self) -> str | None:
        """How K has settled (module docstring), or None while it has not."""
        if self.rounds_without_move >= PATIENCE:
            return f"{PATIENCE} move rounds in a row accepted nothing"
        cycle = len(self._kinds())
        if not cycle or self.move_round % cycle:  # a split round's cuts stand only once a merge round judged them
            return None
        window = self.round_k[-(2 * PATIENCE + 1):]
        if len(window) == 2 * PATIENCE + 1 and max(window) - min(window) <= 1:
            return f"K alternated between {min(window)} and {max(window)} over {len(window)} move rounds"
        ends = self.round_k[cycle - 1::cycle]  # K after each cycle
        last = ends[-(PATIENCE + 1):]
        if len(last) == PATIENCE + 1 and max(last) - min(last) <= int(SETTLED_SPREAD * max(last)):
            return f"K was {min(last)} to {max(last)} after each of the last {len(last)} move cycles"
        for period in range(2, MAX_CYCLE_PERIOD + 1):  # a limit cycle, left at its fewest clusters
            need = max(2 * period, 2 * PATIENCE)
            turns = ends[-need:]
            if len(turns) == need and turns[period:] == turns[:-period] and turns[-1] == min(turns) < max(turns):
                pattern = ", ".join(map(str, turns[-period:]))
                return f"K after each of the last {len(turns)} move cycles repeated {pattern}"
        swing = ends[-max(MIN_SWING_CYCLES, PATIENCE):]
        if len(swing) >= MIN_SWING_CYCLES and swings_without_trend(swing, SETTLED_BAND):
            return (f"K after each of the last {len(swing)} move cycles swung between {min(swing)} and "
                    f"{max(swing)} without a trend")
        if approaches_level(ends, SETTLED_BAND):
            return (f"K after each of the last 3 move cycles went from {ends[-3]} to {ends[-1]} by shrinking "
                    f"steps, within {SETTLED_BAND:.0%} of the level they head for")
        return None

    def expected_end(self, epochs_done: int) -> int:
        """The epoch the fit ends with if no move is accepted from now on: :data:`PATIENCE`
        rounds without a move (the first way K settles), at most ``max_epochs``. A progress bar's total: it grows with every accepted move.

        Parameters
        ----------
        epochs_done : int
            Epochs finished so far.
        """
        sch = self.schedule
        if not self._kinds():  # no move rounds: nothing settles before max_epochs
            return sch.max_epochs
        # the first epoch that can end a round: past the warm-up and any freeze, on the grid
        first = max(epochs_done + 1, self.frozen_until + 1, sch.warmup_epochs)
        first += -(first - sch.warmup_epochs) % sch.move_every
        rounds = max(1, PATIENCE - self.rounds_without_move)
        end = first + (rounds - 1) * sch.move_every
        return max(epochs_done + 1, min(sch.max_epochs, end))

    def finished(self, epochs_done: int) -> bool:
        """Whether the fit stops after ``epochs_done`` epochs."""
        return self.stop_reason(epochs_done) is not None

    def stop_reason(self, epochs_done: int) -> str | None:
        """Why the fit stops after ``epochs_done`` epochs, in words; None when it goes on.

        Returns
        -------
        str or None
            ``"K settled after 33 epochs (3 move rounds in a row accepted nothing)"``,
            ``"K settled after 57 epochs (K alternated between 4 and 5 over 7 move
            rounds)"`` or ``"max_epochs (200) reached"``.
        """
        if self.converged():
            return f"K settled after {epochs_done} epochs ({self._settled()})"
        if epochs_done >= self.schedule.max_epochs:
            return f"max_epochs ({self.schedule.max_epochs}) reached"
        return None

    def restart(self, epoch: int) -> None:
        """Search again after epoch ``epoch`` (1-based), from a new partition: the warm-up,
        then move rounds, with the counters that decide when K has settled cleared."""
        self.move_round = self.rounds_without_move = 0
        self.round_k = []
        self.frozen_until = epoch + self.schedule.warmup_epochs
        self.growths += 1

    def counters(self) -> dict[str, int]:
        """The counters, for a checkpoint."""
        return {"move_round": self.move_round, "rounds_without_move": self.rounds_without_move,
                "frozen_until": int(self.frozen_until), "round_k": list(self.round_k),
                "growths": self.growths}

    def restore(self, state: dict[str, Any]) -> None:
        """Set the counters from :meth:`counters` output (other keys are ignored)."""
        self.move_round = int(state["move_round"])
        self.rounds_without_move = int(state["rounds_without_move"])
        self.frozen_until = int(state["frozen_until"])
        self.round_k = [int(k) for k in state["round_k"]]
        self.growths = int(state.get("growths", 0))  # a state from before growth had none
