"""A fit on Ray Train: a ``TorchTrainer`` of W data-parallel (DDP) workers.

Each worker reads its slice of the rows (:func:`pipeline.fit.distributed.load_rank_rows`)
and runs the common epoch loop (:func:`pipeline.fit.runner.run_epochs`); checkpoints live in
``OUT/ray_train/`` (:mod:`pipeline.fit.checkpoints`). Rank 0 scores, logs and writes the
outputs into a staging folder that the driver publishes (:mod:`pipeline.io.run_folder`).
Ctrl-C writes :data:`STOP_FILE` and every worker stops at the same epoch's end, resumably.
Details: docs/distributed.md, "Distributed training (Ray Train + DDP)"; docs/reliability.md,
"A Ray fit stops at an epoch's end on Ctrl-C and resumes".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deepdpm_core import errors
from deepdpm_core.atomic_files import write_json_atomic
from deepdpm_core.config import check_row_count
from deepdpm_core.errors import ConfigError, DeepDPMError
from pipeline.fit.checkpoints import (
    TRAIN_DIR,
    latest_ray_epoch,
    prune_checkpoints,
    refuse_earlier_checkpoints,
    remove_checkpoints,
)
from pipeline.fit.interrupts import FitInterrupted, stop_between_epochs
from pipeline.fit.outputs import FitResult, replaced_entries
from pipeline.fit.ray_worker import ERROR_FILE, STOP_FILE, train_worker
from pipeline.fit.request import REQUEST_FILE, FitRequest
from pipeline.fit.runner import FaultHook
from pipeline.io.feature_rows import feature_shape
from pipeline.io.run_folder import publish_run, staging_folder
from pipeline.ray_cluster.bars import plain_log_prefix, plain_ray_bars
from pipeline.ray_cluster.local import connect_ray, missing_resources

#: Ray Train settings of every Ray fit, passed on to its controller and workers (a value
#: set in the environment wins): a worker's ``print`` stays Python's own (Ray Train's
#: INFO log record of it ends each update of the progress bar with an empty line); the
#: controller looks at the workers every 0.5 s, not 2 s, as each checkpoint's report and
#: a Ctrl-C wait for it.
RAY_TRAIN_SETTINGS = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
                      "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
#: Ray Train settings of a fit on a local cluster the command started itself: one node,
#: which no autoscaler drains, so no preemption watcher (whose creation the controller
#: announces with a ``core_worker.cc ... E ... max_restarts > 0`` line)
LOCAL_RAY_TRAIN_SETTINGS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def run_ray_fit(request: FitRequest, *, fault: FaultHook | None = None) -> FitResult:
    """Run (or, with ``request.resume``, resume) a fit on Ray Train workers.

    Parameters
    ----------
    request : FitRequest
        ``mode`` "ray". ``ray_address``: the cluster (``auto``, ``ray://…``,
        ``host:port``; default ``$RAY_ADDRESS``, else a new local cluster; an already
        connected driver is used as it is). ``overwrite``: start afresh in a folder that
        holds an earlier fit (its checkpoints are removed once the request has been
        checked); without it, a fresh fit into a folder with checkpoints is refused.
    fault : callable, optional
        Test-only crash injection, ``fault(epoch, rank)`` on every worker before each
        epoch; it must pickle (it travels in the ``train_loop_config``).

    Returns
    -------
    FitResult
        The summary rank 0 wrote.

    Raises
    ------
    ConfigError
        The cluster lacks the CPUs/GPUs for W workers, or stale checkpoints.
    DataError, CheckpointError
        Raised by a worker for bad rows or a checkpoint of other data (not retried).
    """
    out = Path(request.output)
    config = request.fit_config()
    if not request.resume and not request.overwrite:
        refuse_earlier_checkpoints(out)
    check_row_count(feature_shape(request.input, request.table_columns)[0], config.init.rows_needed,
                    str(request.input))
    if request.overwrite and not request.resume:
        remove_checkpoints(out)  # a new TorchTrainer would restore them

    if _winding_down is not None:  # a cluster an earlier Ctrl-C left: gone before a new one
        _winding_down.join()
    started_here, staging, fit, close_bars = None, None, None, None
    with _env_defaults({**RAY_TRAIN_SETTINGS, **plain_log_prefix()}):
        try:
            started_here = connect_ray(request.ray_address)
            # rank 0 writes the outputs here, the driver publishes them
            staging = staging_folder(out)
            check_resources(request.num_workers, request.use_gpu,
                            0.0 if started_here == "local" else request.wait_for_workers_s)
            out.mkdir(parents=True, exist_ok=True)
            (out / ERROR_FILE).unlink(missing_ok=True)
            (out / STOP_FILE).unlink(missing_ok=True)  # a killed driver's
            if not request.resume:
                request.save()
            prune_checkpoints(out)
            close_bars = plain_ray_bars()
            fit = _StoppableFit(_torch_trainer(request, staging, fault), out,
                                leave_once_saved=started_here == "local")
            with _env_defaults(LOCAL_RAY_TRAIN_SETTINGS if started_here == "local" else {}):
                stopped_after = fit.run()
        except BaseException as exc:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, KeyboardInterrupt):  # a second Ctrl-C, or one before training
                raise _interrupted(out, training=fit is not None) from None
            user_error = _worker_user_error(exc)
            if user_error is not None:
                raise user_error from None
            raise
        finally:
            if started_here:
                _shut_down_ray(fit)
            if close_bars is not None:
                close_bars()
            # left for the workers of a cluster this driver was attached to, which go on
            # until they see it (at the end of the epoch under way)
            if started_here or fit is None or not fit.running:
                (out / STOP_FILE).unlink(missing_ok=True)
    if stopped_after is not None:
        shutil.rmtree(staging, ignore_errors=True)
        prune_checkpoints(out)
        raise FitInterrupted(f"after epoch {stopped_after}: deepdpm fit --resume {out} "
                             "continues it")
    error_file = out / ERROR_FILE
    if error_file.exists():
        shutil.rmtree(staging, ignore_errors=True)
        message = json.loads(error_file.read_text())["error"]
        error_file.unlink()
        raise _rebuild_error(message)
    publish_run(staging, out, replaced_entries(request.resumable))  # a Ray fit is resumable: its outputs
    prune_checkpoints(out)
    from pipeline.tracking.client_settings import shown_tracking_uri

    # rank 0 tracked the run: its id is in the store, not known here
    return FitResult(json.loads((out / "summary.json").read_text()), str(out),
                     tracking_uri=shown_tracking_uri(request.tracking_uri) if request.tracking
                     else None)


class _StoppableFit:
    """``search.fit()`` in a second thread, while this (main) thread holds Ctrl-C.

    Ray Train's own SIGINT handler, installed only when ``fit`` runs in the main thread,
    aborts the run a few epochs later. Here the first Ctrl-C writes :data:`STOP_FILE` for
    the workers (the notice of :func:`~pipeline.fit.interrupts.stop_between_epochs` is due
    until rank 0 answers there); a second raises ``KeyboardInterrupt`` at once.

    With ``leave_once_saved`` (a cluster the driver shuts down itself), the driver returns
    once Ray Train has registered the stopped epoch's checkpoint: a terminal's Ctrl-C also
    kills the cluster's dashboard (same process group), and Ray Train's winding down then
    waits about 8 s on its state API.
    """

    def __init__(self, search: Any, out: Path, leave_once_saved: bool = False) -> None:
        self.search = search
        self.out = out
        self.stop_file = out / STOP_FILE
        self.leave_once_saved = leave_once_saved
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether the run goes on (a second Ctrl-C left it)."""
        return self._thread is not None and self._thread.is_alive()

    def run(self) -> int | None:
        """Fit; returns None, or the epoch after which a Ctrl-C stopped every worker."""
        self._thread = threading.Thread(target=self._fit, name="deepdpm-ray-fit", daemon=True)
        asked = False
        with stop_between_epochs(lambda: None) as stop:
            self._thread.start()
            while self._thread.is_alive():
                self._thread.join(0.1)  # Ctrl-C is handled between the waits
                if stop.requested and not asked:
                    write_json_atomic({"requested": True}, self.stop_file)
                    asked = True
                if asked and not stop.honoured:
                    stop.honoured = self._answer() is not None
                if stop.honoured and self.leave_once_saved \
                        and latest_ray_epoch(self.out) == self._answer():
                    return self._answer()
        if self._error is not None:
            raise self._error
        return self._answer() if asked else None

    def wait(self) -> None:
        """Return once the run has ended (Ray Train's winding down included)."""
        if self._thread is not None:
            self._thread.join()

    def _fit(self) -> None:
        try:
            self.search.fit()
        except BaseException as exc:  # raised again in the driver's thread
            self._error = exc

    def _answer(self) -> int | None:
        """The epoch rank 0 said every worker stopped after; None before it has."""
        try:
            return int(json.loads(self.stop_file.read_text())["stopped_after_epoch"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


#: the thread that shuts down the cluster a Ctrl-C left while Ray Train wound down
#: (:func:`_shut_down_ray`); the next fit waits for it
_winding_down: threading.Thread | None = None


def _shut_down_ray(fit: _StoppableFit | None) -> None:
    """``ray.shutdown()`` of the cluster this driver started, once no thread of this process
    waits inside Ray.

    ``ray.shutdown()`` frees the driver's core worker; a thread still blocked in ``ray.get``
    (the fit's, left to Ray Train's winding down by a Ctrl-C) then crashes the process with
    SIGSEGV (ray-project/ray#31145). So a fit still running is shut down by a thread that
    waits for it, and Ray's own exit handler, which would free the core worker under it at
    the interpreter's exit, is dropped until then: the command leaves by ``os._exit`` first
    and the cluster's guard ends the cluster (:mod:`pipeline.ray_cluster.guard`).
    """
    global _winding_down
    import atexit

    import ray

    if fit is None or not fit.running:
        ray.shutdown()
        return
    atexit.unregister(ray.shutdown)

    def shut_down_once_done() -> None:
        fit.wait()
        ray.shutdown()
        atexit.register(ray.shutdown)  # back, for a Ray session this process starts later

    _winding_down = threading.Thread(target=shut_down_once_done, name="deepdpm-ray-shutdown",
                                     daemon=True)
    _winding_down.start()


def _interrupted(out: Path, training: bool) -> FitInterrupted:
    """The error of a fit stopped other than at an epoch's end (``training``: in an epoch,
    else before training began): what ``--resume`` does then."""
    when = "mid-epoch" if training else "before training"
    epoch = latest_ray_epoch(out)
    if epoch is not None:
        return FitInterrupted(f"{when}: deepdpm fit --resume {out} continues from epoch {epoch}")
    if (out / REQUEST_FILE).exists():
        return FitInterrupted(f"{when}{', before any checkpoint' if training else ''}: "
                              f"deepdpm fit --resume {out} starts it again")
    return FitInterrupted(f"{when}: nothing to resume")


@contextlib.contextmanager
def _env_defaults(values: dict[str, str]) -> Iterator[None]:
    """Set the environment variables in ``values`` that are not set, while the block runs."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def check_resources(num_workers: int, use_gpu: bool, wait_s: float = 0.0) -> None:
    """Fail fast when the cluster cannot host W workers (Ray would wait forever).

    Each worker takes 1 CPU (and 1 GPU with ``use_gpu``). Totals over the cluster are
    compared, waiting up to ``wait_s`` seconds for nodes that are still joining.

    Raises
    ------
    ConfigError
        Too few CPUs or GPUs once ``wait_s`` has passed.
    """
    need_cpu, need_gpu = max(num_workers, 1), (max(num_workers, 1) if use_gpu else 0)
    have = missing_resources({"CPU": need_cpu, "GPU": need_gpu}, wait_s)
    if have is not None:
        what = f"{need_cpu} CPUs" + (f" and {need_gpu} GPUs" if need_gpu else "")
        raise ConfigError(
            f"--num-workers {num_workers}{' --use-gpu' if use_gpu else ''} needs {what}, but the Ray "
            f"cluster has {have.get('CPU', 0.0):g} CPUs and {have.get('GPU', 0.0):g} GPUs; lower "
            "--num-workers or add nodes")


def _torch_trainer(request: FitRequest, staging: Path, fault: FaultHook | None):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(request.output).resolve()
    loop = {"request": dataclasses.asdict(request), "staging": str(staging), "fault": fault}
    return TorchTrainer(
        train_worker,
        train_loop_config=loop,
        torch_config=TorchConfig(backend="nccl" if request.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=request.num_workers, use_gpu=request.use_gpu),
        run_config=RunConfig(
            name=TRAIN_DIR,
            storage_path=str(out),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=request.max_failures),
            # no per-report INFO lines, nor the warnings Ray Train itself calls safe to
            # ignore (a resource request to its autoscaling coordinator that timed out on a
            # busy machine, with its traceback): those stay in the Ray session's log files
            logging_config=LoggingConfig(log_level="ERROR"),
        ),
    )


def _worker_user_error(exc: BaseException) -> DeepDPMError | None:
    """The DeepDPMError a worker raised, if that is what failed the run."""
    for failure in (getattr(exc, "worker_failures", None) or {}).values():
        cause = failure
        while cause is not None:
            if isinstance(cause, DeepDPMError):
                return cause
            cause = cause.__cause__
    return None


def _rebuild_error(message: str) -> DeepDPMError:
    name, _, text = message.partition(": ")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, DeepDPMError):
        return cls(text)
    return DeepDPMError(message)


__all__ = ["LOCAL_RAY_TRAIN_SETTINGS", "RAY_TRAIN_SETTINGS", "check_resources", "run_ray_fit"]
