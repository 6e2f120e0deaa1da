"""NMI/ARI/ACC after every epoch of a fit on labelled data, at a fixed small cost.

The estimator's epoch records carry K, the losses and the accepted moves. When the
input has labels, :class:`EpochLabelScores` adds ``nmi``, ``ari`` and ``acc`` of the
clustering net's current hard assignment on a fixed random subsample of at most
``max_rows`` labelled rows (one forward pass of the net and one contingency table: a
few milliseconds for 10 000 rows, independent of N). It writes into the record itself,
so when it runs before the tracker's callback the scores reach MLflow, ``history_``,
``summary.json`` and the report. Scoring uses no random numbers and leaves the nets'
mode to the next epoch, so a scored fit trains exactly like an unscored one (tested).

The per-epoch callbacks of ``DeepDPM.fit`` see only the record, not the model being
trained, so :func:`fit_estimator` runs the estimator's fit with access to its trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deepdpm_core import Config, DeepDPM
from deepdpm_core.metrics import clustering_scores
from deepdpm_core.trainer import Trainer
from deepdpm_core.validation import check_features, check_init_labels

#: labelled rows scored per epoch (a uniform random subsample when there are more)
DEFAULT_MAX_ROWS = 10_000


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
        rows = np.flatnonzero(labels >= 0)
        if rows.size > max_rows:
            rng = np.random.default_rng(seed)
            rows = np.sort(rng.choice(rows, size=max_rows, replace=False))
        self.rows = rows
        self._x = torch.from_numpy(np.ascontiguousarray(X[rows]))
        self._y = labels[rows]
        self._trainer: Trainer | None = None

    @classmethod
    def for_labels(
        cls, X: np.ndarray, labels: np.ndarray | None, max_rows: int = DEFAULT_MAX_ROWS,
        seed: int = 0,
    ) -> EpochLabelScores | None:
        """The callback for ``labels``, or None when there is no labelled row."""
        if labels is None or not (np.asarray(labels) >= 0).any():
            return None
        return cls(X, labels, max_rows, seed)

    def bind(self, trainer: Trainer) -> None:
        """Score the nets of ``trainer`` (the one being fitted)."""
        self._trainer = trainer

    def __call__(self, record: dict[str, Any]) -> None:
        if self._trainer is None:
            return
        predicted = self._trainer.predict_log_proba(self._x).argmax(1).numpy()
        record.update(clustering_scores(self._y, predicted))


def fit_estimator(
    config: Config,
    X: np.ndarray,
    callbacks: list[Callable[[dict], None]] | None = None,
    scores: EpochLabelScores | None = None,
    progress: bool = False,
    init_labels: np.ndarray | None = None,
) -> DeepDPM:
    """``DeepDPM(config).fit(X, callbacks=callbacks, progress=progress,
    init_labels=init_labels)``, with ``scores`` (when given) bound to the trainer and run
    first in every epoch.

    Mirrors :meth:`deepdpm_core.DeepDPM.fit` step for step; a test checks that both give
    the same history and labels.

    Parameters
    ----------
    X : ndarray of shape (N, D)
    callbacks : per-epoch callbacks, called after ``scores`` with the same record
    init_labels : ndarray of shape (N,), optional
        Warm start from these hard clusters instead of k-means (as ``DeepDPM.fit``).

    Returns
    -------
    DeepDPM
        Fitted, as ``DeepDPM.fit`` leaves it (empty clusters pruned, ``labels_`` set).
    """
    model = DeepDPM(config)
    X = check_features(X, min_rows=max(2, config.init.n_clusters))
    start_labels = None
    if init_labels is not None:
        start_labels = torch.from_numpy(check_init_labels(init_labels, len(X)))
    cbs: list[Callable[[dict], None]] = ([scores] if scores is not None else []) + list(callbacks or [])
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.schedule.max_epochs, desc="deepdpm fit", unit="epoch")

        def show(rec: dict) -> None:
            bar.update(1)
            bar.set_postfix(K=rec["n_clusters"], cl=f"{rec['loss_cluster']:.3f}",
                            sub=f"{rec['loss_subcluster']:.3g}")

        cbs.append(show)
    trainer = Trainer(config, torch.from_numpy(X), callbacks=cbs)
    if scores is not None:
        scores.bind(trainer)
    try:
        trainer.fit(start_labels)
    finally:
        if bar is not None:
            bar.close()
    labels = trainer.predict_log_proba(torch.from_numpy(X)).argmax(1)
    trainer.prune_unused(torch.bincount(labels, minlength=trainer.n_clusters).to(torch.float64))
    model._trainer = trainer  # what DeepDPM.fit and DeepDPM.load set
    model.labels_ = model.predict(X)
    return model


__all__ = ["DEFAULT_MAX_ROWS", "EpochLabelScores", "fit_estimator"]
