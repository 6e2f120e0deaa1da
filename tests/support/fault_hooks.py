"""Test-only crash injection through the fit runner's ``fault`` hook.

:class:`FailOnce` (a crash) and :class:`DataErrorAt` (a user error every rank meets) are
what a test passes as ``fault`` to a fit (:func:`pipeline.fit.run_fit`); the runner calls it
before each epoch with (epochs done, rank). Each is a plain class in an importable module so that it pickles by reference into a
Ray fit's ``train_loop_config`` (the workers import this checkout, ``tests/support/ray_cluster.py``).
"""

from __future__ import annotations

from pathlib import Path

from deepdpm_core.errors import DataError


class FailOnce:
    """Raise once on ``rank`` when it is about to train one of ``epochs``.

    A marker file in ``marker_dir`` (``.injected_failure_epoch{e}_rank{r}``) keeps the
    retry that Ray Train starts from the last checkpoint from failing there again.

    Parameters
    ----------
    epochs : iterable of int
        Epochs done when the failure fires.
    rank : int
    marker_dir : path
    """

    def __init__(self, epochs, rank: int, marker_dir: str | Path) -> None:
        self.epochs = frozenset(int(e) for e in epochs)
        self.rank = int(rank)
        self.marker_dir = str(marker_dir)

    def __call__(self, epoch: int, rank: int) -> None:
        if epoch not in self.epochs or rank != self.rank:
            return
        marker = Path(self.marker_dir) / f".injected_failure_epoch{epoch}_rank{rank}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        raise RuntimeError(f"injected failure on rank {rank} at epoch {epoch} (fault hook)")


class DataErrorAt:
    """Raise on every rank, about to train epoch ``epoch``, the one-line DataError a fit
    meets when a covariance factorisation fails on its data
    (:meth:`deepdpm_core.bayes.PriorFit.numerical_failure`): every rank alike, as the
    all-reduced statistics make it. The covariance floor keeps that from data a test can
    write down (``tests/core/data/test_degenerate_data.py`` meets it without the floor).

    Parameters
    ----------
    epoch : int
        Epochs done when the error fires.
    """

    def __init__(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __call__(self, epoch: int, rank: int) -> None:
        if epoch == self.epoch:
            raise DataError(f"the fit failed numerically at epoch {epoch}: a cluster covariance is not "
                            "positive-definite; standardise the features (data.transform=standard)")
