"""Progress bars on the terminal that other output cannot break: while a bar made by
:func:`progress_bar` is open, every line written to ``sys.stderr`` (prints, warnings,
console log handlers) goes through ``tqdm.write``, printed on its own line above the bar,
not on the end of the bar's line (``...sub=9.32]deepdpm: warning: K stayed at 1``). Fits
(:func:`epoch_bar`), predicting a folder and training an autoencoder draw theirs with it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any


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


@contextlib.contextmanager
def epoch_bar(search: Any, enabled: bool = True) -> Iterator[Callable[[dict], None] | None]:
    """The progress bar of the fit ``search`` on stderr, open while the context lasts; yields
    the per-epoch callback that advances it (None when not ``enabled``).

    The bar counts from the epochs done already (a resumed fit's start) to the epoch the
    schedule expects the fit to end with
    (:meth:`~deepdpm_core.moves.schedule.MoveSchedule.expected_end`), not ``max_epochs``,
    so that its time left is that of the fit; after the last epoch it shows as complete at
    the epochs run, and why the fit stopped, rather than at e.g. ``16% 33/200``, as if it
    had been cut short. While it is open, lines written to stderr (warnings) go above it.

    Parameters
    ----------
    search : Search
        The fit, at the epoch it starts from (its ``epoch`` and ``schedule`` are read).
    enabled : bool
        False yields None and draws nothing.
    """
    schedule = search.schedule
    with progress_bar(enabled, total=schedule.expected_end(search.epoch), initial=search.epoch,
                      desc="deepdpm fit", unit="epoch") as bar:
        if bar is None:
            yield None
            return

        def show(record: dict[str, Any]) -> None:
            bar.total = schedule.expected_end(record["epoch"])
            bar.update(1)
            losses = {"cl": record["loss_cluster"], "sub": record["loss_subcluster"]}  # cl: None in exact EM
            bar.set_postfix(K=record["n_clusters"], **{name: f"{value:.3g}" for name, value in losses.items()
                                                       if value is not None})
            if record["stop_reason"] is not None:
                bar.total = bar.n
                bar.set_postfix_str(f"{bar.postfix}, stopped: {record['stop_reason']}", refresh=True)

        yield show


__all__ = ["epoch_bar", "progress_bar"]
