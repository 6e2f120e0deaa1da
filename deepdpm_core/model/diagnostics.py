"""Warnings about a fit's K, only where something is wrong, and how many clusters are tiny.

A fit that found its clusters says nothing. :func:`diagnose` reads a finished fit's epoch
records and warns when K ended at 1 having fallen from more or with its split rounds
idle, saying what it means and the one thing to try (:func:`remedy`; for groups that
overlap as Gaussians in these features no prior setting helps). The CLI
(:class:`DiagnosticsMonitor`), ``DeepDPM.fit`` and the report all judge the fit's final
records, so they say the same.

:func:`tiny_clusters` names the clusters that hold too few rows to be a group
(:func:`tiny_cluster_rows`): outliers or splinters that K counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: a collapsed fit: K at most this (two clusters may be the two groups the data hold)
COLLAPSED_K = 1
#: a fit stuck at K <= COLLAPSED_K: this many split rounds in a row accepted no split,
#: or at least one when the fit has converged (stopped after
#: :data:`~deepdpm_core.moves.schedule.PATIENCE` idle rounds). A fit that starts at a small K
#: (``init.n_clusters``) and is still splitting is growing, not stuck
STUCK_SPLIT_ROUNDS = 2
#: largest per-feature variance over the median from which the features are taken to be
#: in different units (digits' pixels: 2.3, iris: 4.9; raw wine: 1.5e5, breast cancer: 6e7)
UNITS_RATIO = 100.0
#: a cluster is tiny below this many rows, or below :data:`TINY_SHARE` of the mean
#: cluster size where that is more (:func:`tiny_cluster_rows`)
TINY_ROWS = 10
#: ... a twentieth of the mean cluster size: digits' K = 7 with clusters of 9, 1 and 1
#: rows in 1,797 (13 rows); 1,000 clusters of ~1,280 rows (64 rows)
TINY_SHARE = 0.05


@dataclass(frozen=True)
class Diagnostic:
    """One warning: ``kind`` (``"collapsed"``, the one kind :func:`diagnose` gives) and a
    one-line ``message``."""

    kind: str
    message: str


def _get(section: Any, key: str, default: Any = None) -> Any:
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def move_kinds(history: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """The move each epoch ended with, as its record names it: ``"split"``, ``"merge"`` or None."""
    return [record.get("move") for record in history]


def stop_reason(history: Sequence[Mapping[str, Any]]) -> str | None:
    """Why a finished fit stopped, as its last record says (``"max_epochs (200) reached"``);
    None when the records do not end the fit (an interrupted fit's, or records written
    before they carried it: nothing is judged)."""
    return history[-1].get("stop_reason") if history else None


def variance_summary(variances: Any) -> dict[str, float]:
    """What the diagnostics need to know of the data, from its per-feature variances.

    Parameters
    ----------
    variances : array-like of shape (D,)
        Per-feature variances of the features being fitted (after ``data.transform``).

    Returns
    -------
    dict
        ``median_feature_variance`` and ``feature_variance_ratio``:
        the largest variance over the median of the non-zero ones (constant columns do
        not count; 1.0 when all are constant).
    """
    v = np.asarray(variances, dtype=np.float64).ravel()
    positive = v[v > 0]
    ratio = float(positive.max() / np.median(positive)) if positive.size else 1.0
    return {"median_feature_variance": float(np.median(v)), "feature_variance_ratio": ratio}


def remedy(prior: Any, variance_ratio: float | None = None) -> str:
    """The one thing to try for more clusters: the default ``prior.sigma_scale`` where a
    fixed one was set; standardised features when one feature's variance dwarfs the
    others' (``variance_ratio`` >= :data:`UNITS_RATIO`); else a learned feature space."""
    s = _get(prior, "sigma_scale", "auto")
    if not isinstance(s, str):
        return (f"Try the default prior.sigma_scale=auto (fitted to the data) instead of "
                f"the fixed {s}.")
    if variance_ratio is not None and variance_ratio >= UNITS_RATIO:
        return (f"One feature's variance is {variance_ratio:.2g} times the median, so features "
                "in large units are nearly all the fit sees. Try standardised features: "
                "data.transform=standard.")
    return ("Try clustering a learned feature space (deepdpm embed --method umap, then fit "
            "its output).")


def tiny_cluster_rows(n_rows: int, n_clusters: int) -> int:
    """Rows below which a cluster is tiny: :data:`TINY_ROWS`, or :data:`TINY_SHARE` of
    the mean cluster size (``n_rows / n_clusters``) where that is more."""
    return max(TINY_ROWS, math.ceil(TINY_SHARE * n_rows / max(int(n_clusters), 1)))


def tiny_clusters(sizes: Sequence[int] | np.ndarray, min_rows: int | None = None) -> list[int]:
    """The clusters that hold some rows but fewer than ``min_rows``.

    Parameters
    ----------
    sizes : array-like of shape (K,)
        Rows per cluster (empty clusters are not counted).
    min_rows : int, optional
        Default :func:`tiny_cluster_rows` of the rows and the non-empty clusters.

    Returns
    -------
    list of int
        Cluster ids, smallest cluster first.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    used = np.flatnonzero(sizes > 0)
    if min_rows is None:
        min_rows = tiny_cluster_rows(int(sizes.sum()), len(used))
    tiny = used[sizes[used] < min_rows]
    return [int(k) for k in tiny[np.argsort(sizes[tiny], kind="stable")]]


def diagnose(history: Sequence[Mapping[str, Any]], config: Any = None,
             variance_ratio: float | None = None) -> list[Diagnostic]:
    """Warnings about a fit's K from its epoch records (judged as a finished fit).

    Parameters
    ----------
    history : sequence of epoch records (``epoch``, ``n_clusters``, ``splits_accepted``,
        ``merges_accepted``, ``move``, ``converged``, ...), oldest first
    config : Config, nested dict or None
        Its ``prior`` section: the knob values the remedy names (defaults when None).
    variance_ratio : float, optional
        Largest per-feature variance over the median (:func:`variance_summary`); from
        :data:`UNITS_RATIO` on, a collapse advises ``data.transform=standard``.

    Returns
    -------
    list of Diagnostic
        ``collapsed``: K is at most :data:`COLLAPSED_K` after moves started, having
        fallen from a larger K, or with the last :data:`STUCK_SPLIT_ROUNDS` split rounds
        idle, or with the last split round idle and the fit converged. A fit that found
        its clusters, whether by splits or by merging its initial clusters, gets none.
    """
    if not history:
        return []
    prior = _get(config, "prior", {})
    k_now = int(history[-1]["n_clusters"])
    out: list[Diagnostic] = []

    kinds = move_kinds(history)
    stalled = 0  # split rounds since the last accepted split
    for kind, record in zip(kinds, history, strict=True):
        if kind == "split":
            stalled = 0 if int(record.get("splits_accepted") or 0) else stalled + 1
    converged = bool(history[-1].get("converged"))  # the fit's own stop rule, as its record says

    k_max = max(int(r["n_clusters"]) for r in history)
    if k_now <= COLLAPSED_K and any(kind is not None for kind in kinds):
        if k_max > k_now:
            what = (f"The fit ended with one cluster (K = {k_now}), down from {k_max}: it "
                    "merged them all, so no groups in these features are apart enough to be "
                    "separate Gaussian clusters.")
        elif stalled >= STUCK_SPLIT_ROUNDS or (stalled and converged):
            what = (f"The fit ended with one cluster (K = {k_now}): no split paid, so no "
                    "groups in these features are apart enough to be separate Gaussian "
                    "clusters.")
        else:
            what = None  # K is still growing from a small initial K
        if what is not None:
            out.append(Diagnostic("collapsed", f"{what} {remedy(prior, variance_ratio)}"))
    return out


class DiagnosticsMonitor:
    """Per-epoch callback that runs :func:`diagnose` once the fit stops and reports its
    warnings, so a fit's warnings are those its report shows.

    Parameters
    ----------
    config : Config or nested dict
    warn : callable taking a message, e.g. :meth:`pipeline.tracking.run_tracker.RunTracker.warn`
    variance_ratio : float, optional
        Largest per-feature variance over the median (see :func:`diagnose`).
    """

    def __init__(self, config: Any, warn: Callable[[str], None],
                 variance_ratio: float | None = None) -> None:
        self.config = config
        self.warn = warn
        self.variance_ratio = variance_ratio
        self.history: list[Mapping[str, Any]] = []
        self.reported: list[Diagnostic] = []

    def __call__(self, record: Mapping[str, Any]) -> None:
        self.history.append(dict(record))
        if stop_reason(self.history) is None:  # the fit goes on
            return
        seen = {d.kind for d in self.reported}
        for diagnostic in diagnose(self.history, self.config, self.variance_ratio):
            if diagnostic.kind not in seen:
                self.reported.append(diagnostic)
                self.warn(diagnostic.message)


__all__ = [
    "COLLAPSED_K", "STUCK_SPLIT_ROUNDS", "TINY_ROWS", "TINY_SHARE", "UNITS_RATIO", "Diagnostic",
    "DiagnosticsMonitor", "diagnose", "move_kinds", "remedy", "stop_reason",
    "tiny_cluster_rows", "tiny_clusters", "variance_summary",
]
