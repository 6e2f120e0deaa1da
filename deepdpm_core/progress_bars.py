"""Progress bars on the terminal that other output cannot break: while a bar made by
:func:`progress_bar` is open, every line written to ``sys.stderr`` (prints, warnings,
console log handlers) goes through ``tqdm.write``, printed on its own line above the bar,
not on the end of the bar's line (``...sub=9.32]deepdpm: warning: K stayed at 1``). Fits,
predicting a folder and training an autoencoder draw theirs with it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
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


__all__ = ["progress_bar"]
