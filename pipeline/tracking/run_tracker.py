"""MLflow run tracking that can never break a training run.

:class:`RunTracker` is what ``deepdpm fit`` (one process or Ray rank 0) and
``deepdpm extract`` log through. Every MLflow call runs on one background thread fed by a
bounded queue, so a slow or dead tracking server never stalls an epoch, and its client
gives up on a dead server within seconds (:mod:`pipeline.tracking.client_settings`). The
first failure of any call prints ONE warning and switches tracking off for the rest of
the run; training and its local outputs are unaffected.

Every run ends FINISHED, FAILED (also when its tracking failed) or KILLED, tagged
``deepdpm.end_reason`` (why) and ``deepdpm.output`` (its local outputs). When the server
does not answer at the end, :meth:`RunTracker.close` waits at most
:data:`~pipeline.tracking.pending_closes.CLOSE_GRACE_S` plus one health probe (2 s) and
records the run in :mod:`pipeline.tracking.pending_closes`; the next tracked command to
that server ends it.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pipeline.tracking.client_settings import (
    HTTP_ENV_DEFAULTS,
    QUIET_ENV_DEFAULTS,
    import_ipython,
    redacted,
    run_page_url,
    shown_tracking_uri,
)
from pipeline.tracking.environment import (
    make_store_folder,
    resolve_tracking_uri,
    sqlite_artifact_location,
)
from pipeline.tracking.epoch_metrics import epoch_metrics
from pipeline.tracking.experiments import find_or_create_experiment
from pipeline.tracking.log_batches import log_batch, metric_batches, text_batches
from pipeline.tracking.options import DEFAULT_EXPERIMENT, DEFAULT_MODEL_ALIAS
from pipeline.tracking.pending_closes import (
    END_REASON_TAG,
    OUTPUT_TAG,
    close_pending,
    close_pending_now,
    forget_pending,
    record_pending,
    server_answers,
    wait_for_calls,
)

logger = logging.getLogger(__name__)


class RunTracker:
    """One MLflow run, logged from a background thread; a no-op when disabled.

    Parameters
    ----------
    tracking_uri : str or None
        Passed to :func:`resolve_tracking_uri` (flag > ``MLFLOW_TRACKING_URI`` > sqlite
        file in the working directory).
    experiment : str
        Experiment name; created when missing.
    enabled : bool
        False (``--no-tracking``) makes every method a no-op except :meth:`warn`.
    run_name : str or None
        MLflow run name (MLflow picks one when None; the commands pass
        :func:`~pipeline.tracking.options.default_run_name`).
    rank : int
        Distributed rank of the caller; only rank 0 logs or prints.
    queue_size : int
        Calls that may wait for the server. When the queue is full the server is too
        slow to keep up and tracking is switched off (with the one warning).
    close_timeout : float
        Seconds :meth:`close` waits for pending calls before giving up on them.
    artifact_location : str or None
        Artifact root of the experiment when this run creates it (default: for a SQLite
        store the folder ``mlartifacts`` beside the database, else the server's choice).
    register_model : str or None
        :func:`log_fit_outputs` registers the fit's MLflow model under this name.
    model_alias : str
        Alias of the registered model that is moved to the new version.
    output : str or None
        The local folder (or file) the command writes, tagged ``deepdpm.output``.
    hold_s : float
        Seconds the calls wait before the first goes out, unless :meth:`release` or
        :meth:`close` comes first: a fit shorter than that is tracked once its outputs
        are published, a longer one live from then on.

    Attributes
    ----------
    failed : bool
        True once a call has failed and tracking has been switched off.
    warnings : list of str
        Messages passed to :meth:`warn`.
    """

    def __init__(self, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT,
                 enabled: bool = True, run_name: str | None = None, rank: int = 0, *,
                 queue_size: int = 10_000, close_timeout: float = 60.0,
                 artifact_location: str | None = None, register_model: str | None = None,
                 model_alias: str = DEFAULT_MODEL_ALIAS, output: str | Path | None = None,
                 hold_s: float = 0.0) -> None:
        self.is_logger = rank == 0
        self.active = bool(enabled) and self.is_logger
        self.tracking_uri = resolve_tracking_uri(tracking_uri) if self.active else None
        self.experiment = experiment
        self.run_name = run_name
        self.close_timeout = close_timeout
        self.artifact_location = artifact_location or sqlite_artifact_location(self.tracking_uri)
        self.register_model = register_model
        self.model_alias = model_alias
        self.output = None if output is None else str(Path(output).resolve())
        self.failed = False
        self._failure = ""
        self._silent = False  # the server did not answer a health probe at the end
        self.warnings: list[str] = []
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._started = threading.Event()
        self._closing = threading.Event()
        self._queue: queue.Queue[Callable[[Any], None]] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._fail_lock = threading.Lock()
        self.hold_s = hold_s
        self._released = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> RunTracker:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("KILLED", f"interrupted{f' {exc}' if str(exc) else ''}")
        else:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            self.close("FAILED", f"{exc_type.__name__}: {first}" if first else exc_type.__name__)

    def start(self) -> None:
        """Start the logging thread and create the run (asynchronously)."""
        if not self.active or self._thread is not None:
            return
        for key, value in {**HTTP_ENV_DEFAULTS, **QUIET_ENV_DEFAULTS}.items():
            os.environ.setdefault(key, value)
        make_store_folder(self.tracking_uri)
        if self.tracking_uri.startswith(("http://", "https://")):
            import_ipython()
        self._thread = threading.Thread(target=self._work, name="deepdpm-mlflow", daemon=True)
        self._thread.start()
        self._submit(self._start_run)

    def close(self, status: str = "FINISHED", reason: str | None = None) -> None:
        """End the run with ``status`` (FINISHED, FAILED, KILLED) and stop the thread.

        The run gets the tag ``deepdpm.end_reason``: ``reason`` (default: the status in
        words) and where the outputs are. Waits for the pending calls at most
        ``close_timeout`` seconds, and at most ``CLOSE_GRACE_S`` + ``PROBE_TIMEOUT_S`` when
        the server does not answer a health probe; a run that could not be ended so (or
        whose tracking failed earlier: it ends FAILED) is recorded for the next tracked
        command to end (:mod:`pipeline.tracking.pending_closes`, which holds both times).
        Never raises.
        """
        if self._thread is None:
            return
        ended_ms = int(time.time() * 1000)
        why = reason or {"FINISHED": "finished", "KILLED": "interrupted"}.get(status, "failed")
        if self.output:
            why += f"; outputs in {self.output}"
        self._submit(lambda client: client.set_tag(self._run_id, END_REASON_TAG, why))
        self._submit(lambda client: client.set_terminated(self._run_id, status=status,
                                                          end_time=ended_ms))
        self._closing.set()
        self._released.set()
        if not wait_for_calls(self._thread, self.close_timeout, self._answers):
            self._fail(TimeoutError("the tracking server did not answer at the end of the run"
                                    if self._answers() is False else
                                    f"pending calls did not finish within {self.close_timeout:.0f} s"))
        self._thread = None
        self._started.set()
        if not self.failed and self._run_id is not None:
            forget_pending(self._run_id)
        if self.failed and self._run_id is not None:
            # the run's record stops where tracking failed: it ends FAILED, saying why
            self._end_later(f"tracking failed ({self._failure}); the command itself ended {status}: "
                            f"{why}", ended_ms)
        url = self.run_url
        if url and not self.failed:
            print(f"deepdpm: MLflow run {self.run_name or self._run_id}: {url}", file=sys.stderr,
                  flush=True)  # fmt: skip

    def _answers(self) -> bool | None:
        """:func:`~pipeline.tracking.pending_closes.server_answers`, not asked again once
        the server has not answered."""
        if self._silent:
            return False
        answers = server_answers(self.tracking_uri or "")
        self._silent = answers is False
        return answers

    def _end_later(self, reason: str, ended_ms: int) -> None:
        """Record the run to be ended FAILED with ``reason``; end it now if the server
        answers again already."""
        try:
            record_pending(self.tracking_uri, self._run_id, "FAILED", reason, ended_ms)
        except OSError as exc:
            print(f"deepdpm: warning: cannot record MLflow run {self._run_id} to be ended later "
                  f"({exc})", file=sys.stderr, flush=True)
            return
        if self._answers() is not False:
            close_pending_now(self.tracking_uri)

    @property
    def run_url(self) -> str | None:
        """The run's page in the MLflow UI of an ``http(s)://`` tracking server (else None);
        see :meth:`run_page`."""
        base = redacted(self.tracking_uri)
        return self.run_page(base) if base.startswith(("http://", "https://")) else None

    def run_page(self, ui: str) -> str | None:
        """The run's page in the MLflow UI served at ``ui`` (:func:`run_page_url`; None
        before the run exists)."""
        if self._run_id is None or self._experiment_id is None:
            return None
        return run_page_url(ui, self._experiment_id, self._run_id)

    @property
    def shown_uri(self) -> str | None:
        """Where the run goes: the tracking URI without credentials (None untracked)."""
        return shown_tracking_uri(self.tracking_uri) if self.active else None

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once the run exists (waits for its creation); None when
        tracking is disabled or failed."""
        if not self.active:
            return None
        self._started.wait(self.close_timeout)
        return self._run_id

    # -- logging -----------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log flat ``{name: value}`` params (``None`` becomes ``"null"``)."""
        for chunk in text_batches(params):
            self._submit(lambda client, chunk=chunk: log_batch(client, self._run_id, params=chunk))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags."""
        for chunk in text_batches(tags):
            self._submit(lambda client, chunk=chunk: log_batch(client, self._run_id, tags=chunk))

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Log ``{name: value}`` metrics at ``step`` (timestamped now, not when sent)."""
        for chunk in metric_batches(metrics, step):
            self._submit(lambda client, chunk=chunk: log_batch(client, self._run_id, metrics=chunk))

    def log_epoch(self, record: Mapping[str, Any]) -> None:
        """Log one epoch record of ``DeepDPM.history_`` at step ``record["epoch"]``.

        Usable directly as one of ``DeepDPM.fit``'s ``callbacks``.
        """
        self.log_metrics(epoch_metrics(record), step=int(record["epoch"]))

    def log_artifacts(self, paths: Iterable[str | Path], artifact_path: str | None = None) -> None:
        """Upload files (and directories, under their own name); missing paths are skipped.

        The files are read by the logging thread: keep them until :meth:`close`.
        """
        for path in paths:
            path = Path(path)
            if not path.exists():
                logger.warning("not logging missing artifact %s", path)
                continue
            if path.is_dir():
                dest = f"{artifact_path}/{path.name}" if artifact_path else path.name
                self._submit(lambda client, p=path, d=dest: client.log_artifacts(self._run_id, str(p), d))
            else:
                self._submit(lambda client, p=path: client.log_artifact(self._run_id, str(p), artifact_path))

    def log_with(self, fn: Callable[[Any, str], None]) -> None:
        """Run ``fn(client, run_id)`` on the logging thread (an MLflow call this class has
        no method for); its failure switches tracking off like any other."""
        self._submit(lambda client: fn(client, self._run_id))

    def warn(self, message: str) -> None:
        """Print a warning (rank 0 only) and keep it in the run as ``warnings.txt``."""
        if not self.is_logger:
            return
        print(f"deepdpm: warning: {message}", file=sys.stderr, flush=True)
        self.warnings.append(message)
        text = "\n".join(self.warnings) + "\n"
        self._submit(lambda client: client.log_text(self._run_id, text, "warnings.txt"))

    # -- the logging thread ------------------------------------------------------------

    def _submit(self, op: Callable[[Any], None]) -> None:
        if not self.active or self.failed or self._thread is None:
            return
        try:
            self._queue.put_nowait(op)
        except queue.Full:
            self._fail(RuntimeError(f"{self._queue.maxsize} calls waiting for the server"))

    def release(self) -> None:
        """Let a held tracker (``hold_s``) send its calls now."""
        self._released.set()

    def _work(self) -> None:
        # held: MLflow (seconds of imports and a store to open) does not compete with a
        # short fit for the CPU; its calls wait in the queue until released or hold_s passed
        self._released.wait(self.hold_s)
        client = None
        while True:
            try:
                op = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            if self.failed:
                continue  # drain: keep the queue from filling, send nothing
            try:
                if client is None:
                    from mlflow import MlflowClient  # ~1 s import, paid off the training thread

                    client = MlflowClient(tracking_uri=self.tracking_uri)
                op(client)
            except Exception as exc:  # any failure of tracking must not reach training
                self._fail(exc)

    def _start_run(self, client: Any) -> None:
        try:  # runs that earlier commands could not end at this server
            close_pending(client, self.tracking_uri)
        except Exception:
            logger.debug("ending recorded MLflow runs failed", exc_info=True)
        experiment_id = find_or_create_experiment(client, self.experiment, self.artifact_location)
        run = client.create_run(experiment_id, run_name=self.run_name,
                                tags={OUTPUT_TAG: self.output} if self.output else None)
        self._experiment_id = experiment_id
        self._run_id = run.info.run_id
        try:  # ended KILLED by a later command should this one be killed before it ends the run
            record_pending(self.tracking_uri, self._run_id, "KILLED",
                           f"the command (pid {os.getpid()}) was killed before it ended its run"
                           + (f"; outputs, if any, in {self.output}" if self.output else ""),
                           None, owner=os.getpid())
        except OSError:
            logger.debug("cannot record the MLflow run", exc_info=True)
        self._started.set()

    def _fail(self, exc: BaseException) -> None:
        with self._fail_lock:
            if self.failed:
                return
            self.failed = True
        self._started.set()  # nobody waits for a run id that will never come
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        first_line = first_line.replace(self.tracking_uri or "", redacted(self.tracking_uri))
        self._failure = f"{type(exc).__name__}: {first_line[:300]}"
        then = ("its outputs are written locally, and the next command tracked to this server "
                "ends its run" if self._closing.is_set() else "training continues without "
                "tracking and all outputs are still written locally")
        print(f"deepdpm: warning: MLflow tracking at {redacted(self.tracking_uri)} failed "
              f"({type(exc).__name__}: {first_line[:300]}); {then}", file=sys.stderr, flush=True)
