"""The guard of a local Ray cluster: it ends the cluster when the command that started it dies.

The head processes of ``ray.init(address="local")`` die with the command, but the raylet's
children (dashboard and runtime-env agents) kept running about a minute after ``kill -9``
of it. :func:`pipeline.ray_cluster.local.init_local_ray` therefore starts this guard
(``python -m pipeline.ray_cluster.guard PID:START ...``) on the read end of a pipe whose
write end only the command holds; it notes the head processes' descendants every second
and terminates them all once the pipe reaches end-of-file, however the command ended.
Processes are known by pid and start time (psutil's ``create_time``), so a reused pid is
never hit (docs/reliability.md, "Clean up after failures").
"""

from __future__ import annotations

import select
import signal
import sys

import psutil

#: seconds between SIGTERM and SIGKILL
GRACE_S = 2.0
#: seconds between two looks at the cluster's processes
WATCH_EVERY_S = 1.0


def start_time(pid: int) -> float | None:
    """The start time of process ``pid`` (seconds since the epoch), None if it is gone."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.Error:
        return None


def descendants(roots: dict[int, float]) -> dict[int, float]:
    """The live processes of ``roots`` (pid -> start time) and all their descendants."""
    found: dict[int, float] = {}
    for pid, start in roots.items():
        if start_time(pid) != start:
            continue
        found[pid] = start
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:  # gone meanwhile
            continue
        for child in children:
            child_start = start_time(child.pid)
            if child_start is not None:
                found[child.pid] = child_start
    return found


def end_processes(known: dict[int, float]) -> None:
    """SIGTERM the live processes of ``known`` (pid -> start time), SIGKILL those still
    alive after :data:`GRACE_S`."""
    targets = []
    for pid, start in known.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == start:
                process.terminate()
                targets.append(process)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(targets, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            continue


def main(argv: list[str]) -> int:
    head = {int(pid): float(start) for pid, start in (arg.split(":") for arg in argv)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the command's to handle
    known = dict(head)
    # stdin turns readable at end-of-file, when the command has ended
    while not select.select([sys.stdin], [], [], WATCH_EVERY_S)[0]:
        known.update(descendants(head))
    known.update(descendants(head))
    end_processes(known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
