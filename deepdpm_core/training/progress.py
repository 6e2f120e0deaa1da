"""Progress bars that other output cannot break: while a bar made by :func:`progress_bar`
is open, every line written to ``sys.stderr`` (prints, warnings, console log handlers) goes
through ``tqdm.write``, printed on its own line above the bar, not on the end of the bar's
line (``...sub=9.32]deepdpm: warning: K stayed at 1``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepdpm_core.moves import MoveSchedule


def _stderr_handlers(stream: Any) -> list[logging.StreamHandler]:
    """Log handlers (any logger's: root, MLflow, Ray, ...) that write to ``stream``."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return [
        handler
        for logger in loggers
        if isinstance(logger, logging.Logger)
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream
    ]


@contextlib.contextmanager
def progress_bar(enabled: bool = True, **kwargs: Any) -> Iterator[Any]:
    """A tqdm bar on stderr (``tqdm.auto``), closed on exit; None when not ``enabled``.

    Parameters
    ----------
    enabled : bool
        False yields None and changes nothing.
    **kwargs
        Passed to ``tqdm`` (``total``, ``desc``, ``unit``, ...).
    """
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm
    from tqdm.contrib import DummyTqdmFile

    real = sys.stderr
    bar = tqdm(file=real, **kwargs)
    above = DummyTqdmFile(real)  # writes each complete line with tqdm.write
    handlers = _stderr_handlers(real)  # hold sys.stderr as it was when they were made
    for handler in handlers:
        handler.setStream(above)
    try:
        with contextlib.redirect_stderr(above):
            yield bar
    finally:
        for handler in handlers:
            handler.setStream(real)
        if any(above._buf):  # a last line without its newline
            above.write("\n")
        bar.close()


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
        The fit's schedule, asked after each epoch whether (and why) the fit stops.
    """
    bar.total = schedule.expected_end(bar.n)

    def show(record: dict) -> None:
        bar.total = schedule.expected_end(record["epoch"] + 1)  # the record's epoch counts from 0
        bar.update(1)
        bar.set_postfix(K=record["n_clusters"], cl=f"{record['loss_cluster']:.3f}",
                        sub=f"{record['loss_subcluster']:.3g}")
        reason = schedule.stop_reason(record["epoch"] + 1)  # the record's epoch counts from 0
        if reason is not None:
            finish_bar(bar, reason)

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


__all__ = ["epoch_updater", "finish_bar", "progress_bar"]
