"""Warnings for fits whose K is stuck, and which prior knob moves it.

K still depends on the prior (paper Supmat "The Factors Affecting K"): α, the NIW scale
s (``prior.sigma_scale``) and ν0 (``prior.nu``). :func:`diagnose` reads a fit's epoch
records and says what to turn and which way (:class:`DiagnosticsMonitor`: live, per epoch,
in the CLI; ``DeepDPM.fit``: once at the end). From a largest per-feature variance
:data:`UNITS_RATIO` times the median (features in different units) it names
``data.transform=standard`` instead of the knobs. Measured by ``bench/prior_knobs.py``
(docs/design.md, "Tracking and reports"): a larger ν0 gives fewer clusters; a fixed s
moves K non-monotonically, peaking for s at roughly 0.1–30 % of the median per-feature
variance (:data:`SIGMA_PIVOT`); α barely matters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepdpm_core.config import MovesConfig, ScheduleConfig
from deepdpm_core.moves import MoveSchedule

#: Ψ's diagonal over the median per-feature variance above which a SMALLER
#: ``prior.sigma_scale`` gives more clusters (below it, a larger one does)
SIGMA_PIVOT = 1.0

#: a stalled fit: no split accepted in this many split rounds in a row. With the default
#: schedule (split and merge rounds alternate; the fit stops after ``patience`` = 3
#: rounds without any move, i.e. after 1 or 2 idle split rounds) this fires only while
#: merges are still accepted (K shrinking without splits) or with a larger ``patience``
STALL_SPLIT_ROUNDS = 3
#: a collapsed fit: K at most this
COLLAPSED_K = 2
#: a fit stuck at K <= COLLAPSED_K: this many split rounds in a row accepted no split,
#: or at least one when the fit has converged (stopped for ``patience``). A fit that
#: starts at a small K (``init.n_clusters``) and is still splitting is growing, not stuck
STUCK_SPLIT_ROUNDS = 2
#: largest per-feature variance over the median from which the features are taken to be
#: in different units (digits' pixels: 2.3, iris: 4.9; raw wine: 1.5e5, breast cancer: 6e7)
UNITS_RATIO = 100.0


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


def move_kinds(history: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """The move each epoch ended with, as its record names it: ``"split"``, ``"merge"`` or None."""
    return [record.get("move") for record in history]


def stop_reason(history: Sequence[Mapping[str, Any]], config: Any) -> str | None:
    """Why a finished fit stopped, as its progress bar said: ``"K settled after 33 epochs
    (3 move rounds in a row accepted nothing)"`` or ``"max_epochs (200) reached"``.

    The move rounds are read from the records (:func:`move_kinds`) and fed to the fit's
    :class:`~deepdpm_core.moves.schedule.MoveSchedule`; None when those rounds do not end
    the fit (e.g. records of an interrupted fit).
    """
    if not history:
        return None
    return _schedule_after(history, config).stop_reason(len(history))


def _schedule_after(history: Sequence[Mapping[str, Any]], config: Any) -> MoveSchedule:
    """The fit's :class:`~deepdpm_core.moves.schedule.MoveSchedule` (``config``'s
    ``schedule`` and ``moves`` sections: models, dicts or None) fed the move rounds the
    records name, as the fit fed it."""
    schedule = MoveSchedule(_typed(ScheduleConfig, _section(config, "schedule")),
                            _typed(MovesConfig, _section(config, "moves")))
    for epoch, (kind, record) in enumerate(zip(move_kinds(history), history, strict=True), start=1):
        if kind is not None:
            schedule.moved(epoch, int(record.get("splits_accepted") or 0)
                           + int(record.get("merges_accepted") or 0), int(record["n_clusters"]))
    return schedule


def _typed(cls: type, section: Any) -> Any:
    """A config section as its model (``cls``), from a model, a dict or None."""
    if isinstance(section, cls):
        return section
    return cls(**dict(section or {}))


def _sigma_advice(prior: Any, feature_variance: float | None, fitted_scale: float | None) -> str:
    s = _get(prior, "sigma_scale", "auto")
    if isinstance(s, str):  # auto | evidence: fitted to the clusters
        fitted = "" if fitted_scale is None else f" (last fitted s = {fitted_scale:.3g})"
        return (f"prior.sigma_scale is fitted to the clusters{fitted}: a fixed value moves K "
                "non-monotonically (bench/prior_knobs.py); with many features and few points per "
                "cluster try prior.covariance_type=diag")
    if feature_variance is None or not feature_variance > 0:
        return (
            f"prior.sigma_scale (now {s}) moves K non-monotonically: raise it if it is far "
            "below the per-feature variance of the data, lower it if it is comparable or above"
        )
    # Ψ0 = s·I, or s·diag(std) with psi="data_std"
    diag = s * feature_variance**0.5 if _get(prior, "psi", "identity") == "data_std" else s
    ratio = diag / feature_variance
    verb = "lower" if ratio >= SIGMA_PIVOT else "raise"
    return (f"{verb} prior.sigma_scale (now {s}: Ψ is {ratio:.2g} × the median feature variance; "
            "K peaks around 0.001–0.3 ×)")


def knob_advice(prior: Any, feature_variance: float | None = None,
                fitted_scale: float | None = None) -> str:
    """Which prior knobs give MORE clusters, with their current values.

    Parameters
    ----------
    prior : PriorConfig or dict
    feature_variance : float, optional
        Median per-feature variance of the data; decides the direction for a fixed
        ``prior.sigma_scale`` (see :data:`SIGMA_PIVOT`).
    fitted_scale : float, optional
        The s the last M-step fitted (``prior_scale`` of the epoch record), named when
        ``prior.sigma_scale`` is ``auto``.
    """
    nu = _get(prior, "nu")
    nu_now = {None: "null = D + 2; it must stay > D − 1",
              "auto": "auto: fitted to the clusters, at least D + 2"}.get(nu, nu)
    alpha = _get(prior, "alpha", 10.0)
    return "; ".join([
        _sigma_advice(prior, feature_variance, fitted_scale),
        f"lower prior.nu (now {nu_now}; a larger ν is a heavier prior: fewer clusters)",
        f"raise prior.alpha (now {alpha}; weak: log α per split)",
    ])


def variance_summary(variances: Any) -> dict[str, float]:
    """What the diagnostics need to know of the data, from its per-feature variances.

    Parameters
    ----------
    variances : array-like of shape (D,)
        Per-feature variances of the features being fitted (after ``data.transform``).

    Returns
    -------
    dict
        ``median_feature_variance`` (decides the direction of a fixed
        ``prior.sigma_scale``, see :func:`knob_advice`) and ``feature_variance_ratio``:
        the largest variance over the median of the non-zero ones (constant columns do
        not count; 1.0 when all are constant).
    """
    v = np.asarray(variances, dtype=np.float64).ravel()
    positive = v[v > 0]
    ratio = float(positive.max() / np.median(positive)) if positive.size else 1.0
    return {"median_feature_variance": float(np.median(v)), "feature_variance_ratio": ratio}


def remedy(prior: Any, feature_variance: float | None = None, fitted_scale: float | None = None,
           variance_ratio: float | None = None) -> str:
    """What to change for more clusters: the features' units when one feature's variance
    dwarfs the others' (``variance_ratio`` >= :data:`UNITS_RATIO`), else the prior knobs
    (:func:`knob_advice`)."""
    if variance_ratio is not None and variance_ratio >= UNITS_RATIO:
        return (f"the largest per-feature variance is {variance_ratio:.2g} × the median, so "
                "a few features in large units are nearly all the fit sees: standardise the "
                "features (data.transform=standard)")
    return knob_advice(prior, feature_variance, fitted_scale)


def diagnose(history: Sequence[Mapping[str, Any]], config: Any = None,
             feature_variance: float | None = None,
             variance_ratio: float | None = None) -> list[Diagnostic]:
    """Warnings about a fit's K from its epoch records so far.

    Parameters
    ----------
    history : sequence of epoch records (``epoch``, ``n_clusters``, ``splits_accepted``,
        ``merges_accepted``, ...), oldest first
    config : Config, nested dict or None
        Its ``prior``, ``schedule`` and ``moves`` sections name the current knob values
        and the move schedule (defaults when None).
    feature_variance : float, optional
        Median per-feature variance of the data (see :func:`knob_advice`).
    variance_ratio : float, optional
        Largest per-feature variance over the median (:func:`variance_summary`); from
        :data:`UNITS_RATIO` on, the warnings advise ``data.transform=standard``.

    Returns
    -------
    list of Diagnostic
        ``no_split``: the last :data:`STALL_SPLIT_ROUNDS` (or more) split rounds accepted
        no split. ``collapsed``: K is at most :data:`COLLAPSED_K` after moves started,
        having fallen from a larger K, or with the last :data:`STUCK_SPLIT_ROUNDS` split
        rounds idle, or with the last split round idle and the fit converged.
    """
    if not history:
        return []
    prior = _section(config, "prior")
    k_now = int(history[-1]["n_clusters"])
    fitted = history[-1].get("prior_scale")
    out: list[Diagnostic] = []

    kinds = move_kinds(history)
    stalled = 0  # split rounds since the last accepted split
    for kind, record in zip(kinds, history, strict=True):
        if kind == "split":
            stalled = 0 if int(record.get("splits_accepted") or 0) else stalled + 1
    converged = _schedule_after(history, config).converged(len(history))  # the fit's own stop rule
    if stalled >= STALL_SPLIT_ROUNDS:
        out.append(Diagnostic(
            "no_split", f"no split accepted in the last {stalled} split rounds (K = {k_now}). "
            f"If you expect more clusters: {remedy(prior, feature_variance, fitted, variance_ratio)}"))

    k_max = max(int(r["n_clusters"]) for r in history)
    if k_now <= COLLAPSED_K and any(kind is not None for kind in kinds):
        if k_max > k_now:
            what = f"K collapsed to {k_now} (largest K so far: {k_max})"
        elif stalled >= STUCK_SPLIT_ROUNDS or (stalled and converged):
            rounds = f"{stalled} split rounds" if stalled > 1 else "split round"
            what = f"K stayed at {k_now}: the last {rounds} accepted no split"
        else:
            what = None  # K is still growing from a small initial K
        if what is not None:
            out.append(Diagnostic("collapsed", f"{what}. If the data have more clusters: "
                                  f"{remedy(prior, feature_variance, fitted, variance_ratio)}"))
    return out


class DiagnosticsMonitor:
    """Per-epoch callback that runs :func:`diagnose` and reports each kind once.

    Parameters
    ----------
    config : Config or nested dict
    warn : callable taking a message, e.g. :meth:`pipeline.tracking.run_tracker.RunTracker.warn`
    feature_variance : float, optional
        Median per-feature variance of the data (see :func:`knob_advice`).
    variance_ratio : float, optional
        Largest per-feature variance over the median (see :func:`diagnose`).
    """

    def __init__(self, config: Any, warn: Callable[[str], None],
                 feature_variance: float | None = None,
                 variance_ratio: float | None = None) -> None:
        self.config = config
        self.warn = warn
        self.feature_variance = feature_variance
        self.variance_ratio = variance_ratio
        self.history: list[Mapping[str, Any]] = []
        self.reported: list[Diagnostic] = []

    def __call__(self, record: Mapping[str, Any]) -> None:
        self.history.append(dict(record))
        seen = {d.kind for d in self.reported}
        for diagnostic in diagnose(self.history, self.config, self.feature_variance,
                                   self.variance_ratio):
            if diagnostic.kind not in seen:
                self.reported.append(diagnostic)
                self.warn(diagnostic.message)


__all__ = [
    "COLLAPSED_K", "SIGMA_PIVOT", "STALL_SPLIT_ROUNDS", "STUCK_SPLIT_ROUNDS", "UNITS_RATIO",
    "Diagnostic", "DiagnosticsMonitor", "diagnose", "knob_advice", "move_kinds", "remedy",
    "stop_reason", "variance_summary",
]
