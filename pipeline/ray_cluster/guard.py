"""The guard of a local Ray cluster: it ends the cluster when the command that started it dies.

The head processes of ``ray.init(address="local")`` die with the command, but the raylet's
children (dashboard and runtime-env agents) kept running about a minute after ``kill -9``
of it. :func:`pipeline.ray_cluster.local.init_local_ray` therefore starts this guard
(``python -m pipeline.ray_cluster.guard PID:START ...``) on the read end of a pipe whose
write end only the command holds; it notes the head processes' descendants every second
and terminates them all once the pipe reaches end-of-file, however the command ended.
Processes are known by pid and start time, so a reused pid is never hit. Linux only
(``/proc``); docs/reliability.md, "Clean up after failures".
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

#: seconds between SIGTERM and SIGKILL
GRACE_S = 2.0
#: seconds between two looks at the cluster's processes
WATCH_EVERY_S = 1.0


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot), None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def descendants(roots: dict[int, int]) -> dict[int, int]:
    """The live processes of ``roots`` (pid -> start time) and all their descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found = {pid: start for pid, start in roots.items() if start_time(pid) == start}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            start = start_time(child)
            if start is not None and child not in found:
                found[child] = start
                todo.append(child)
    return found


def end_processes(known: dict[int, int]) -> None:
    """SIGTERM the live processes of ``known`` (pid -> start time), SIGKILL those still
    alive after :data:`GRACE_S`."""
    targets = [pid for pid, start in known.items() if start_time(pid) == start]
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while targets and time.monotonic() < deadline:
        time.sleep(0.05)
        targets = [pid for pid in targets if start_time(pid) == known[pid]]
    for pid in targets:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    head = {int(pid): int(start) for pid, start in (arg.split(":") for arg in argv)}
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
