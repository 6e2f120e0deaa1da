"""MLflow runs that could not be ended because their tracking server did not answer.

A run :class:`~pipeline.tracking.run_tracker.RunTracker` starts is recorded here at once (one
JSON file in a per-user state folder, :func:`pending_dir`) as KILLED, owned by the command's
process, and forgotten when it ends; a run it cannot end is recorded with its final status
and reason. The next tracked command to that server ends these runs first
(:func:`close_pending`), those of live owners excepted (docs/reliability.md, "Every tracked
run ends"). An unreadable record is set aside as ``NAME.bad`` with one warning; a state
folder that cannot be written never fails the command.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepdpm_core.atomic_files import write_json_atomic
from pipeline.ray_cluster.guard import start_time

#: run tags: why the run ended, and the local folder (or file) holding the outputs
END_REASON_TAG = "deepdpm.end_reason"
OUTPUT_TAG = "deepdpm.output"
#: MLflow's final run states
FINAL_STATES = ("FINISHED", "FAILED", "KILLED")
#: seconds a health probe of the tracking server, and an attempt to end the recorded runs
#: at the end of a command, may take
PROBE_TIMEOUT_S = 2.0
#: seconds :meth:`~pipeline.tracking.run_tracker.RunTracker.close` waits for the pending
#: calls before it asks whether the server answers at all (a health probe of
#: :data:`PROBE_TIMEOUT_S`); an ``http(s)://`` server that does not answer it is given up
#: on, and the run is ended by a later command
CLOSE_GRACE_S = 2.0
#: the largest record read (a record is about 400 bytes)
MAX_RECORD_BYTES = 64 * 1024
#: what a run id looks like (MLflow's are 32 hex digits)
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

logger = logging.getLogger(__name__)


def server_answers(tracking_uri: str) -> bool | None:
    """Whether the ``http(s)://`` tracking server answers ``GET /health`` within
    :data:`PROBE_TIMEOUT_S` (any HTTP answer counts); None for other stores."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for_calls(thread: threading.Thread, timeout: float,
                   answers: Callable[[], bool | None]) -> bool:
    """Join a tracker's logging ``thread``: True once it has sent every call; False after
    ``timeout`` seconds or as soon as the server, asked (``answers``, a health probe of an
    ``http(s)://`` server) after :data:`CLOSE_GRACE_S`, does not answer."""
    start = time.monotonic()
    probe_at = start + CLOSE_GRACE_S
    while thread.is_alive() and time.monotonic() - start < timeout:
        thread.join(0.1)
        if thread.is_alive() and time.monotonic() >= probe_at:
            if answers() is False:
                return False
            probe_at = time.monotonic() + CLOSE_GRACE_S
    return not thread.is_alive()


def close_pending_now(tracking_uri: str) -> None:
    """:func:`close_pending` for ``tracking_uri`` on a thread given
    :data:`PROBE_TIMEOUT_S`; what it does not end stays recorded (never raises)."""

    def end() -> None:
        try:
            from mlflow import MlflowClient

            close_pending(MlflowClient(tracking_uri=tracking_uri), tracking_uri)
        except Exception:  # left for the next command
            logger.debug("ending recorded MLflow runs failed", exc_info=True)

    closer = threading.Thread(target=end, name="deepdpm-mlflow-close", daemon=True)
    closer.start()
    closer.join(PROBE_TIMEOUT_S)


def pending_dir() -> Path:
    """``$XDG_STATE_HOME/deepdpm/pending_closes`` (default ``~/.local/state/...``)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "deepdpm" / "pending_closes"


def record_pending(tracking_uri: str, run_id: str, status: str, reason: str,
                   end_time_ms: int | None, owner: int | None = None) -> Path:
    """Remember that the run ``run_id`` at ``tracking_uri`` must still be ended with
    ``status`` (the tag :data:`END_REASON_TAG` = ``reason``, end time ``end_time_ms``, or
    the time it is ended when None), unless the process ``owner`` (a pid) still runs."""
    path = pending_dir() / f"{run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"tracking_uri": tracking_uri, "run_id": run_id, "status": status, "reason": reason,
              "end_time_ms": end_time_ms}
    if owner is not None:
        record["owner"] = [owner, start_time(owner)]
    write_json_atomic(record, path)
    return path


def forget_pending(run_id: str) -> None:
    """Drop the record of the run ``run_id``, which its command has ended (never raises:
    a record that cannot be removed is ended again, harmlessly, by a later command)."""
    try:
        (pending_dir() / f"{run_id}.json").unlink(missing_ok=True)
    except OSError:  # the state path is not a folder, or a loop of links
        logger.debug("cannot forget the MLflow run record", exc_info=True)


def _owner_runs(record: dict[str, Any]) -> bool:
    """Whether the process that owns ``record`` (pid and start time) still runs."""
    if "owner" not in record:
        return False
    pid, started = record["owner"]
    return start_time(pid) == started


def read_record(path: Path) -> dict[str, Any]:
    """The record in ``path``, read without following a link or waiting on a pipe, at
    most :data:`MAX_RECORD_BYTES`, and checked field by field.

    Raises
    ------
    ValueError
        ``path`` is not a small regular file holding a record (said in words).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(f"cannot be opened ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("is not a regular file")
        if info.st_size > MAX_RECORD_BYTES:
            raise ValueError(f"is {info.st_size} bytes, more than a record's {MAX_RECORD_BYTES}")
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("is not JSON") from None
    if not isinstance(record, dict):
        raise ValueError("is not a JSON object")
    problems = [
        name for name, ok in (
            ("tracking_uri", isinstance(record.get("tracking_uri"), str)),
            ("run_id", isinstance(record.get("run_id"), str) and _RUN_ID.fullmatch(record["run_id"])),
            ("status", record.get("status") in FINAL_STATES),
            ("reason", isinstance(record.get("reason"), str)),
            ("end_time_ms", record.get("end_time_ms") is None
             or type(record.get("end_time_ms")) is int),
            ("owner", "owner" not in record or _valid_owner(record["owner"])),
        ) if not ok]  # fmt: skip
    if problems:
        raise ValueError(f"has no valid {', '.join(problems)}")
    return record


def _valid_owner(owner: Any) -> bool:
    """``[pid, start time]``: a positive int and a number (None: the owner was gone)."""
    return (isinstance(owner, list) and len(owner) == 2 and type(owner[0]) is int and owner[0] > 0
            and (owner[1] is None or type(owner[1]) in (int, float)))


def _set_aside(path: Path, why: str) -> None:
    """Rename the unreadable record ``path`` to ``NAME.bad`` (out of the next commands'
    way), saying so once."""
    try:
        os.replace(path, path.with_name(path.name + ".bad"))
    except OSError:
        return  # another command set it aside, or the folder is read-only: said by it
    print(f"deepdpm: warning: set aside the unreadable MLflow run record {path} (it {why}) "
          f"as {path.name}.bad", file=sys.stderr, flush=True)


def pending_runs(tracking_uri: str) -> list[tuple[Path, dict[str, Any]]]:
    """The recorded runs of ``tracking_uri`` whose commands have ended; records that
    cannot be read are set aside (:func:`read_record`), and a state path that is not a
    folder gives none."""
    folder = pending_dir()
    try:
        paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
    except OSError:
        return []
    found = []
    for path in paths:
        try:
            record = read_record(path)
        except ValueError as exc:
            _set_aside(path, str(exc))
            continue
        if record["tracking_uri"] == tracking_uri and not _owner_runs(record):
            found.append((path, record))
    return found


def close_pending(client: Any, tracking_uri: str) -> list[str]:
    """End every recorded run of ``tracking_uri`` that is still RUNNING, with its recorded
    status, reason and end time, and forget the records; returns the run ids ended.

    A call that fails (the server is still away) raises, and the records stay for the
    next command.
    """
    ended = []
    for path, record in pending_runs(tracking_uri):
        run_id = record["run_id"]
        try:
            status = client.get_run(run_id).info.status
        except Exception as exc:  # the run was deleted: nothing left to end
            if "RESOURCE_DOES_NOT_EXIST" not in str(exc):
                raise
            status = "DELETED"
        if status not in FINAL_STATES and status != "DELETED":
            client.set_tag(run_id, END_REASON_TAG, record["reason"])
            client.set_terminated(run_id, status=record["status"],
                                  end_time=record["end_time_ms"] or int(time.time() * 1000))
            ended.append(run_id)
        path.unlink(missing_ok=True)
    return ended


__all__ = ["END_REASON_TAG", "FINAL_STATES", "MAX_RECORD_BYTES", "OUTPUT_TAG", "PROBE_TIMEOUT_S",
           "close_pending", "close_pending_now", "forget_pending", "pending_dir", "pending_runs",
           "read_record", "record_pending", "server_answers"]
