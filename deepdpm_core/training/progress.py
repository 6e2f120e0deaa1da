"""A fit's progress bar: one step per epoch, K and the two losses, and the end the schedule
expects; the bar itself is :func:`deepdpm_core.progress_bars.progress_bar`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from deepdpm_core.progress_bars import progress_bar


@contextlib.contextmanager
def epoch_bar(trainer: Any, enabled: bool = True) -> Iterator[Callable[[dict], None] | None]:
    """The progress bar of ``trainer``'s fit on stderr, open while the context lasts; yields
    the per-epoch callback that advances it (None when not ``enabled``).

    The bar counts from the epochs done already (a resumed fit's start) to the epoch the
    schedule expects the fit to end with
    (:meth:`~deepdpm_core.moves.schedule.MoveSchedule.expected_end`), not ``max_epochs``,
    so that its time left is that of the fit; after the last epoch it shows as complete at
    the epochs run, and why the fit stopped, rather than at e.g. ``16% 33/200``, as if it
    had been cut short. While it is open, lines written to stderr (warnings) go above it.

    Parameters
    ----------
    trainer : Trainer
        The fit, at the epoch it starts from (its ``epoch`` and ``schedule`` are read).
    enabled : bool
        False yields None and draws nothing.
    """
    schedule = trainer.schedule
    with progress_bar(enabled, total=schedule.expected_end(trainer.epoch), initial=trainer.epoch,
                      desc="deepdpm fit", unit="epoch") as bar:
        if bar is None:
            yield None
            return

        def show(record: dict[str, Any]) -> None:
            bar.total = schedule.expected_end(record["epoch"] + 1)  # the record's epoch counts from 0
            bar.update(1)
            bar.set_postfix(K=record["n_clusters"], cl=f"{record['loss_cluster']:.3f}",
                            sub=f"{record['loss_subcluster']:.3g}")
            if record["stop_reason"] is not None:
                bar.total = bar.n
                bar.set_postfix_str(f"{bar.postfix}, stopped: {record['stop_reason']}", refresh=True)

        yield show


__all__ = ["epoch_bar"]
