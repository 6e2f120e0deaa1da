"""Test-only crash injection through the fit runner's ``fault`` hook.

:class:`FailOnce` is what a test passes as ``fault`` to a fit
(:func:`pipeline.fit.run_fit`); the runner calls it before each epoch with (epochs done,
rank). It is a plain class in an importable module so that it pickles by reference into a
Ray fit's ``train_loop_config`` (the workers import this checkout, ``tests/support/ray_cluster.py``).
"""

from __future__ import annotations

from pathlib import Path


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
