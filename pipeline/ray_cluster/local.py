"""The local Ray cluster a command starts for itself when it is given no cluster address.

Ray (2.52+) turns token authentication on for every local cluster and announces it on
stderr on each run ("Token authentication is enabled for this Ray cluster ...").
:func:`init_local_ray` drops those lines and Ray's other INFO lines of this process
("Started a local Ray instance ...") for a cluster that is the command's own, and changes
nothing else (token auth stays on; Ray's warnings still show). Connecting to a cluster (an
address, ``$RAY_ADDRESS``) is a plain ``ray.init`` and keeps every message. A cluster
started here ends with the command, even after ``kill -9``, through a guard process
(:mod:`pipeline.ray_cluster.guard`; docs/reliability.md, "Clean up after failures").
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deepdpm_core.idle_threads import NUMBA_PASSIVE, OPENMP_PASSIVE, set_defaults

#: the module whose log lines announce token auth on a new local cluster (Ray 2.60)
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
#: the guard of the cluster this process started and the write end of its pipe (see
#: :func:`_guard_cluster`), which the kernel closes when this process ends
_guard: tuple[subprocess.Popen, int] | None = None


def tree_pythonpath() -> str:
    """``$PYTHONPATH`` with this tree first, so a child process imports this package from it."""
    return os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p)


def init_local_ray(**kwargs: Any) -> None:
    """``ray.init(address="local", **kwargs)`` without Ray's token-auth announcements.

    The workers share this machine with the command, so their idle OpenMP and numba threads
    sleep (:mod:`deepdpm_core.idle_threads`; this process's values, a user's own included).
    Each worker finds its own cluster by ``$RAY_ADDRESS`` (:func:`_own_cluster_address_hook`),
    even where other Ray clusters run on the machine.
    """
    import ray

    runtime_env = dict(kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**set_defaults({**OPENMP_PASSIVE, **NUMBA_PASSIVE}),
                               **runtime_env.get("env_vars", {})}
    runtime_env.setdefault("worker_process_setup_hook", _own_cluster_address_hook())
    announcer = logging.getLogger(AUTH_LOGGER)
    level = announcer.level
    announcer.setLevel(logging.ERROR)  # errors (e.g. an unwritable token file) still show
    # the "ray" logger of this process at WARNING: no "Started a local Ray instance. View
    # the dashboard at ..." (at INFO, in colour codes) for a cluster that is the command's own
    kwargs.setdefault("logging_level", logging.WARNING)
    try:
        ray.init(address="local", runtime_env=runtime_env, **kwargs)
    finally:
        announcer.setLevel(level)
    if sys.platform.startswith("linux"):
        _guard_cluster()


def _own_cluster_address_hook() -> Any:
    """A ``worker_process_setup_hook`` that sets ``$RAY_ADDRESS`` in each worker of the
    cluster to that cluster's address.

    Ray's state API (which Ray Train's placement-group cleaner calls every second) otherwise
    looks for Ray's processes on the machine and, with a second cluster there, fails with a
    traceback. Defined here so that Ray pickles it by value: a worker need not import this
    package to run it.
    """

    def find_own_cluster() -> None:
        import os

        import ray

        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address

    return find_own_cluster


def missing_resources(need: dict[str, float], wait_s: float) -> dict[str, float] | None:
    """None once the Ray cluster holds ``need`` (``{"CPU": 4.0}``) in all, waiting up to
    ``wait_s`` seconds for nodes that are still joining; else what it holds then."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        have = ray.cluster_resources()
        if all(have.get(name, 0.0) >= amount for name, amount in need.items()):
            return None
        if time.monotonic() >= deadline:
            return have
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def connect_ray(address: str | None, **local_kwargs: Any) -> str | None:
    """Connect this driver to Ray: ``address``, else ``$RAY_ADDRESS``, else a new local
    cluster (:func:`init_local_ray` with ``local_kwargs``) whose workers import this
    package from the same tree as the driver.

    Returns
    -------
    ``"local"`` or ``"remote"`` when it connected (the caller shuts Ray down), None when
    this process was connected already.
    """
    import ray

    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        init_local_ray(runtime_env={"env_vars": {"PYTHONPATH": tree_pythonpath()}}, **local_kwargs)
        return "local"
    ray.init(address=address)
    return "remote"


def _guard_cluster() -> None:
    """Start the guard (:mod:`pipeline.ray_cluster.guard`) of the cluster ``ray.init`` just started."""
    global _guard
    from ray._private import worker

    from pipeline.ray_cluster.guard import start_time

    processes = worker._global_node.all_processes  # type -> [ProcessInfo]
    head = [f"{info.process.pid}:{start_time(info.process.pid)}"
            for infos in processes.values() for info in infos
            if start_time(info.process.pid) is not None]
    read_end, write_end = os.pipe()  # not inherited by what this process starts later
    env = {**os.environ, "PYTHONPATH": tree_pythonpath()}
    guard = subprocess.Popen([sys.executable, "-m", "pipeline.ray_cluster.guard", *head],
                             stdin=read_end, env=env, start_new_session=True)
    os.close(read_end)
    if _guard is not None:  # the guard of an earlier cluster of this process: let it end
        os.close(_guard[1])
        _guard[0].wait()
    _guard = (guard, write_end)


__all__ = ["AUTH_LOGGER", "connect_ray", "init_local_ray", "missing_resources", "tree_pythonpath"]
