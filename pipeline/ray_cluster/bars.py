"""Ray's output made plain for a log file or a terminal: no colour codes in the workers' log
prefix, and progress bars drawn by the driver as plain tqdm bars."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any


def plain_log_prefix() -> dict[str, str]:
    """``RAY_COLOR_PREFIX=0`` (worker lines' ``(pid=N)`` prefix without colour codes)
    unless stderr is a terminal."""
    return {} if sys.stderr.isatty() else {"RAY_COLOR_PREFIX": "0"}


#: what Ray's driver puts before a worker's bar: ``(pid=N) `` or ``(pid=N, ip=A) ``,
#: in colour codes
_RAY_BAR_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\(pid=[^)]*\) ?(?:\x1b\[[0-9;]*m)*")


def plain_ray_bars() -> Callable[[], None]:
    """Make this driver draw the workers' progress bars as a fit in one process draws
    its own: whole counts (``7/200``), and the description alone.

    Ray's driver draws a worker's ``tqdm_ray`` bar with ``unit_scale=True`` (``7.00/200``)
    and the worker's ``(pid=N)`` in colour codes even where stderr is a file; its module
    attribute ``real_tqdm`` is the one place to change that.

    Returns
    -------
    Callable[[], None]
        Closes the bars still open: a worker stopped by Ctrl-C never closes its bar, which
        Ray's driver would redraw after every later ``print`` and once more at exit.
    """
    import types
    import weakref

    from ray.experimental import tqdm_ray
    from tqdm import auto

    def plain(desc: Any) -> Any:
        return _RAY_BAR_PREFIX.sub("", desc) if isinstance(desc, str) else desc

    drawn: weakref.WeakSet = weakref.WeakSet()

    class PlainBar(auto.tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if "desc" in kwargs:
                kwargs["desc"] = plain(kwargs["desc"])
            super().__init__(*args, **{**kwargs, "unit_scale": False})
            drawn.add(self)

        def set_description(self, desc: Any = None, refresh: bool = True) -> None:
            super().set_description(plain(desc), refresh)

    def close_open() -> None:
        for bar in list(drawn):
            bar.close()  # a closed tqdm bar draws nothing more

    tqdm_ray.real_tqdm = types.SimpleNamespace(tqdm=PlainBar)
    return close_open
