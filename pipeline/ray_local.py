"""The local Ray cluster a command starts for itself when it is given no cluster address.

Ray (2.52+) turns token authentication on for every local cluster that ``ray.init``
starts and announces it on each run, on stderr: "Token authentication is enabled for
this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ..." and, where
``~/.ray/auth_token`` does not exist yet, "Generated new authentication token and saved
to ...". For a cluster the command starts and shuts down itself these lines are noise:
:func:`init_local_ray` drops them and changes nothing else (token auth stays on, with
the token Ray reads or writes). Connecting to a cluster (an address, ``$RAY_ADDRESS``)
goes through plain ``ray.init`` and keeps every message Ray prints.
"""

from __future__ import annotations

import logging
from typing import Any

#: the module whose log lines announce token auth on a new local cluster (Ray 2.60)
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def init_local_ray(**kwargs: Any) -> None:
    """``ray.init(address="local", **kwargs)`` without Ray's token-auth announcements."""
    import ray

    announcer = logging.getLogger(AUTH_LOGGER)
    level = announcer.level
    announcer.setLevel(logging.ERROR)  # errors (e.g. an unwritable token file) still show
    try:
        ray.init(address="local", **kwargs)
    finally:
        announcer.setLevel(level)


__all__ = ["AUTH_LOGGER", "init_local_ray"]
