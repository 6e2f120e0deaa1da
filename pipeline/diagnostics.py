"""Warnings for fits whose K is stuck, and which prior knob moves it.

DeepDPM infers K, but K still depends on the prior (paper Supmat "The Factors Affecting
K"): the DP concentration α, and the NIW scale Ψ = s·I (``prior.sigma_scale``) and
pseudo-count ν (``prior.nu``). Users of the reference code get no hint when the
split/merge moves have stalled; :func:`diagnose` looks at the epoch records of
``DeepDPM.history_`` and says what to turn and which way. :class:`DiagnosticsMonitor`
applies it live, once per kind of warning, as a per-epoch callback.

The directions are in :data:`KNOB_EFFECTS` (one place to change them); the README says
how they were measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: How each prior knob moves K: (config key, direction that gives MORE clusters, why).
KNOB_EFFECTS: tuple[tuple[str, str, str], ...] = (
    ("prior.alpha", "raise", "log α is added to every split's log Hastings ratio"),
    ("prior.sigma_scale", "lower", "a smaller Ψ favours tighter clusters"),
    ("prior.nu", "raise", "a larger ν pulls cluster covariances towards Ψ"),
)

#: a stalled fit: no split accepted in this many split rounds in a row
STALL_SPLIT_ROUNDS = 3
#: a collapsed fit: K at most this
COLLAPSED_K = 2


@dataclass(frozen=True)
class Diagnostic:
    """One warning: ``kind`` ("no_split" or "collapsed") and a one-line ``message``."""

    kind: str
    message: str


def _get(section: Any, key: str, default: Any = None) -> Any:
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def _section(config: Any, name: str) -> Any:
    return _get(config, name, {}) if config is not None else {}


def split_rounds(n_epochs: int, schedule: Any, moves: Any) -> int:
    """Split proposals made in the first ``n_epochs`` epochs under ``schedule``.

    Moves start after ``warmup_epochs`` and come every ``move_every`` epochs,
    alternating split / merge when merges are on (paper §3.2).
    """
    warmup = int(_get(schedule, "warmup_epochs", 5))
    every = max(int(_get(schedule, "move_every", 5)), 1)
    move_rounds = max(n_epochs - warmup, 0) // every
    if _get(moves, "merge", True):
        return (move_rounds + 1) // 2
    return move_rounds


def knob_advice(prior: Any, more: bool = True) -> str:
    """``"raise prior.alpha (now 10.0), lower ..."``: the knobs that give more (or fewer)
    clusters, with their current values from ``prior``."""
    opposite = {"raise": "lower", "lower": "raise"}
    parts = []
    for key, direction, why in KNOB_EFFECTS:
        value = _get(prior, key.split(".", 1)[1])
        now = "auto (D + 2)" if value is None and key == "prior.nu" else value
        verb = direction if more else opposite[direction]
        parts.append(f"{verb} {key} (now {now}; {why})")
    return "; ".join(parts)


def diagnose(history: Sequence[Mapping[str, Any]], config: Any = None) -> list[Diagnostic]:
    """Warnings about a fit's K from its epoch records so far.

    Parameters
    ----------
    history : sequence of epoch records (``epoch``, ``n_clusters``, ``splits_accepted``,
        ``merges_accepted``, ...), oldest first
    config : Config, nested dict or None
        Its ``prior``, ``schedule`` and ``moves`` sections name the current knob values
        and the move schedule (defaults when None).

    Returns
    -------
    list of Diagnostic
        ``no_split``: splits are enabled, at least :data:`STALL_SPLIT_ROUNDS` split rounds
        have run and none was accepted in the last ones. ``collapsed``: K is at most
        :data:`COLLAPSED_K` after moves have started.
    """
    if not history:
        return []
    prior = _section(config, "prior")
    schedule = _section(config, "schedule")
    moves = _section(config, "moves")
    k_now = int(history[-1]["n_clusters"])
    out: list[Diagnostic] = []

    if _get(moves, "split", True):
        last_split = max(
            (i for i, r in enumerate(history) if int(r.get("splits_accepted") or 0) > 0),
            default=-1,
        )
        stalled = split_rounds(len(history), schedule, moves) - split_rounds(
            last_split + 1, schedule, moves
        )
        if stalled >= STALL_SPLIT_ROUNDS:
            out.append(
                Diagnostic(
                    "no_split",
                    f"no split accepted in the last {stalled} split rounds (K = {k_now}). "
                    f"If you expect more clusters: {knob_advice(prior, more=True)}",
                )
            )

    if k_now <= COLLAPSED_K and split_rounds(len(history), schedule, moves) >= 1:
        k_max = max(int(r["n_clusters"]) for r in history)
        out.append(
            Diagnostic(
                "collapsed",
                f"K collapsed to {k_now} (largest K so far: {k_max}). "
                f"If the data have more clusters: {knob_advice(prior, more=True)}",
            )
        )
    return out


class DiagnosticsMonitor:
    """Per-epoch callback that runs :func:`diagnose` and reports each kind once.

    Parameters
    ----------
    config : Config or nested dict
    warn : callable taking a message, e.g. :meth:`pipeline.tracking.RunTracker.warn`
    """

    def __init__(self, config: Any, warn: Callable[[str], None]) -> None:
        self.config = config
        self.warn = warn
        self.history: list[Mapping[str, Any]] = []
        self.reported: list[Diagnostic] = []

    def __call__(self, record: Mapping[str, Any]) -> None:
        self.history.append(dict(record))
        seen = {d.kind for d in self.reported}
        for diagnostic in diagnose(self.history, self.config):
            if diagnostic.kind not in seen:
                self.reported.append(diagnostic)
                self.warn(diagnostic.message)


__all__ = [
    "COLLAPSED_K",
    "KNOB_EFFECTS",
    "STALL_SPLIT_ROUNDS",
    "Diagnostic",
    "DiagnosticsMonitor",
    "diagnose",
    "knob_advice",
    "split_rounds",
]
