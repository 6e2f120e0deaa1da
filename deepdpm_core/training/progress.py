"""A fit's progress bar: one step per epoch, K and the two losses, and the end the schedule
expects; the bar itself is :func:`deepdpm_core.progress_bars.progress_bar`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepdpm_core.moves import MoveSchedule


def epoch_updater(bar: Any, schedule: MoveSchedule) -> Callable[[dict], None]:
    """A fit callback that advances ``bar`` one epoch and shows K and the two losses of
    the epoch record; after the last epoch it finishes the bar (:func:`finish_bar`). The
    bar's total is the epoch the schedule expects the fit to end with
    (:meth:`~deepdpm_core.moves.schedule.MoveSchedule.expected_end`), not ``max_epochs``,
    so that its time left is that of the fit.

    Parameters
    ----------
    bar : tqdm.tqdm
        Its count is the epochs done already (a resumed fit's start).
    schedule : MoveSchedule
        The fit's schedule, asked after each epoch for the end it expects; the record
        says whether (and why) the fit stopped.
    """
    bar.total = schedule.expected_end(bar.n)

    def show(record: dict) -> None:
        bar.total = schedule.expected_end(record["epoch"] + 1)  # the record's epoch counts from 0
        bar.update(1)
        bar.set_postfix(K=record["n_clusters"], cl=f"{record['loss_cluster']:.3f}",
                        sub=f"{record['loss_subcluster']:.3g}")
        if record["stop_reason"] is not None:
            finish_bar(bar, record["stop_reason"])

    return show


def finish_bar(bar: Any, reason: str) -> None:
    """Show a fit's bar as complete at the epochs it ran, and why it stopped, rather than
    at e.g. ``16% 33/200``, as if it had been cut short.

    Parameters
    ----------
    bar : tqdm.tqdm
    reason : str
        :meth:`~deepdpm_core.moves.schedule.MoveSchedule.stop_reason`, shown after the postfix.
    """
    bar.total = bar.n
    bar.set_postfix_str(f"{bar.postfix}, stopped: {reason}" if bar.postfix else f"stopped: {reason}",
                        refresh=True)


__all__ = ["epoch_updater", "finish_bar"]
