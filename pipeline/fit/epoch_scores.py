"""NMI/ARI/ACC after every epoch of a fit on labelled data, at a fixed small cost.

:class:`EpochLabelScores` adds ``nmi``, ``ari`` and ``acc`` of the fit's current hard
assignment (:class:`pipeline.fit.runner.SearchPredictor`) on a fixed subsample of at most
``max_rows`` labelled rows (milliseconds, independent of N) to the epoch record, so that,
run before the tracker's callback, they reach MLflow, ``history_``, ``summary.json`` and the
report. It draws no random numbers and leaves the nets' mode alone, so a scored fit trains
exactly like an unscored one (docs/tracking.md, "Tracking runs in MLflow").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core import DeepDPM
from deepdpm_core.data import clustering_scores

#: labelled rows scored per epoch (a uniform random subsample when there are more)
DEFAULT_MAX_ROWS = 10_000


def scored_rows(labels: np.ndarray, max_rows: int = DEFAULT_MAX_ROWS, seed: int = 0) -> np.ndarray:
    """Indices of the labelled rows (label >= 0) that are scored, ascending: all of them,
    or a uniform random ``max_rows`` of them drawn with ``seed``."""
    rows = np.flatnonzero(np.asarray(labels) >= 0)
    if rows.size > max_rows:
        rng = np.random.default_rng(seed)
        rows = np.sort(rng.choice(rows, size=max_rows, replace=False))
    return rows


class EpochLabelScores:
    """Per-epoch callback adding ``nmi``, ``ari``, ``acc`` to the epoch record.

    Parameters
    ----------
    X : ndarray of shape (N, D)
        The features being fitted.
    labels : ndarray of shape (N,)
        Ground-truth classes; rows with a negative label are unlabelled and not scored.
    max_rows : int
        At most this many labelled rows are scored (chosen once, with ``seed``).
    seed : int

    Attributes
    ----------
    rows : ndarray of shape (M,)
        Indices of the scored rows into ``X``, M <= ``max_rows``.
    """

    def __init__(
        self, X: np.ndarray, labels: np.ndarray, max_rows: int = DEFAULT_MAX_ROWS, seed: int = 0
    ) -> None:
        labels = np.asarray(labels)
        rows = scored_rows(labels, max_rows, seed)
        self.rows = rows
        self._x = torch.from_numpy(np.ascontiguousarray(X[rows]))
        self._y = labels[rows]
        self._model: DeepDPM | None = None

    @classmethod
    def for_labels(
        cls, X: np.ndarray, labels: np.ndarray | None, max_rows: int = DEFAULT_MAX_ROWS,
        seed: int = 0,
    ) -> EpochLabelScores | None:
        """The callback for ``labels``, or None when there is no labelled row."""
        if labels is None or not (np.asarray(labels) >= 0).any():
            return None
        return cls(X, labels, max_rows, seed)

    @classmethod
    def from_file(
        cls, path: str | Path, max_rows: int = DEFAULT_MAX_ROWS, seed: int = 0,
        batch_size: int = 65_536, columns: Any = None,
    ) -> EpochLabelScores | None:
        """The callback for the labelled rows of a feature file, without holding the file.

        Scores exactly the rows :meth:`for_labels` would score on the whole table (a Ray
        fit's rank 0, which holds only its slice, scores what a local fit scores): one
        pass reads the labels, a second keeps the chosen rows, each ``batch_size`` rows
        at a time.
        """
        from pipeline.io.parquet_batches import feature_batches

        labels = [batch.labels for batch in feature_batches(path, batch_size, columns)]
        if not labels or labels[0] is None:
            return None
        every = np.concatenate(labels)
        rows = scored_rows(every, max_rows, seed)
        if rows.size == 0:
            return None
        kept, start = [], 0
        for batch in feature_batches(path, batch_size, columns):
            stop = start + len(batch.X)
            local = rows[(rows >= start) & (rows < stop)] - start
            kept.append(batch.X[local])
            start = stop
        # every row is labelled and they are <= max_rows: the same rows, in the same order
        scores = cls(np.concatenate(kept), every[rows], max_rows, seed)
        scores.rows = rows
        return scores

    def bind(self, model: DeepDPM) -> None:
        """Score the clustering net of ``model`` (anything with ``predict(X)``) while it
        is being fitted."""
        self._model = model

    def __call__(self, record: dict[str, Any]) -> None:
        if self._model is None:
            return
        predicted = self._model.predict(self._x)
        record.update(clustering_scores(self._y, predicted))


__all__ = ["DEFAULT_MAX_ROWS", "EpochLabelScores", "scored_rows"]
