"""Ctrl-C that stops a fit where it can be resumed.

A search interrupted mid-epoch holds half-updated nets and statistics, which no checkpoint
may keep, so :func:`stop_between_epochs` lets the first SIGINT finish the current epoch: the
fit checks :attr:`StopRequest.requested` at each epoch's end, writes a checkpoint and raises
:class:`FitInterrupted`. A second Ctrl-C stops at once (``KeyboardInterrupt``). A Ray fit's
driver passes the request on to its workers (:mod:`pipeline.fit.ray`); docs/reliability.md,
"A long single-process fit can be stopped and resumed".
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

#: seconds after the first Ctrl-C before a still-running epoch is named on stderr
NOTICE_AFTER_S = 1.0


class FitInterrupted(KeyboardInterrupt):
    """A fit stopped by Ctrl-C; the message says how to continue it (``--resume DIR``)."""


class StopRequest:
    """Whether a Ctrl-C asked the fit to stop (:attr:`requested`), and whether the fit
    has acted on it (:attr:`honoured`: the epoch ended, so no notice is due)."""

    def __init__(self) -> None:
        self.requested = False
        self.honoured = False


@contextlib.contextmanager
def stop_between_epochs(epoch: Any = None) -> Iterator[StopRequest]:
    """While open, the first SIGINT only sets the yielded request's ``requested``.

    Parameters
    ----------
    epoch : callable, optional
        ``epoch()`` -> the epoch under way, named in the notice printed when the epoch
        has not ended :data:`NOTICE_AFTER_S` after the Ctrl-C (None: a notice that names
        none, for a driver that does not know it); without it, no notice.

    Notes
    -----
    Python delivers signals to the main thread only; elsewhere (a fit run from a
    thread) the default Ctrl-C behaviour is kept and the request never set.
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    notice: list[threading.Timer] = []

    def on_sigint(signum: int, frame: Any) -> None:
        if request.requested:  # the second Ctrl-C: now
            raise KeyboardInterrupt
        request.requested = True
        if epoch is not None:
            number = epoch()
            which = "the epoch under way" if number is None else f"epoch {number}"
            text = f"deepdpm fit: stopping once {which} ends (Ctrl-C again to stop now, losing it)"
            stream = sys.stderr  # the progress bar's, while it is drawn

            def tell() -> None:
                if not request.honoured:
                    print(text, file=stream, flush=True)

            notice.append(threading.Timer(NOTICE_AFTER_S, tell))
            notice[-1].daemon = True
            notice[-1].start()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield request
    finally:
        signal.signal(signal.SIGINT, previous)
        for timer in notice:
            timer.cancel()


__all__ = ["NOTICE_AFTER_S", "FitInterrupted", "StopRequest", "stop_between_epochs"]
