"""A fit on Ray Train: a ``TorchTrainer`` of W data-parallel (DDP) workers.

Each worker reads only its contiguous slice of the input rows
(:func:`pipeline.distributed.load_rank_rows`) and runs the common epoch loop
(:func:`pipeline.fit.runner.run_epochs`) on a :class:`~deepdpm_core.trainer.Trainer`
with a ``torch.distributed`` communicator: per epoch one all-reduce of the flat float64
statistics, the same M-step on every rank, moves decided on rank 0 and broadcast as a
plan, the nets wrapped in DDP. A worker's memory is its slice plus O(K·D²), the k-means
sample (``init.max_points`` rows) and, on rank 0 of a labelled input, the rows it scores
each epoch (at most 10 000).

The run lives in the output folder: ``OUT/fit_request.json`` (the request, so
``deepdpm fit --resume OUT`` can restart a stopped run) and ``OUT/ray_train/`` (Ray
Train's storage: a checkpoint every ``checkpoint_every`` epochs and at the end, in the
model file format, :mod:`pipeline.fit.checkpoints`). A worker failure restarts the group
from the latest checkpoint (``FailureConfig(max_failures)``); a new ``TorchTrainer`` on
the same storage (``--resume``) restores it too.

When training ends, rank 0 predicts every row (it reads the full table then; the other
ranks never do) and writes the same outputs as a local fit
(:func:`pipeline.fit.outputs.write_fit_outputs`) into a staging folder beside ``OUT``;
the driver publishes them in one step once Ray Train is done with ``OUT/ray_train``
(:mod:`pipeline.run_folder`), and removes the checkpoints Ray Train's snapshot does not
list. Only rank 0 scores, logs to MLflow and draws progress.

Tests inject crashes with ``run_ray_fit(request, fault=...)``: the callable travels to
every worker in the ``train_loop_config`` and is called before each epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core import errors
from deepdpm_core.communicator import Communicator
from deepdpm_core.errors import ConfigError, DataError, DeepDPMError
from deepdpm_core.estimator import DeepDPM
from deepdpm_core.init import rows_needed
from deepdpm_core.trainer import Trainer
from deepdpm_core.validation import readonly_tensor
from pipeline.atomic_files import write_json_atomic
from pipeline.feature_rows import feature_shape
from pipeline.fit.checkpoints import (
    CHECKPOINT_FILE,
    TRAIN_DIR,
    has_ray_checkpoints,
    load_ray_checkpoint,
    prune_checkpoints,
    remove_checkpoints,
    write_trainer_state,
)
from pipeline.fit.outputs import RUN_OUTPUTS, FitResult
from pipeline.fit.request import FitRequest
from pipeline.fit.runner import (
    CONSISTENCY_EVERY,
    FaultHook,
    FitHooks,
    data_variance_summary,
    epoch_callbacks,
    run_epochs,
)
from pipeline.ray_local import connect_ray
from pipeline.run_folder import publish_run, staging_folder

#: a user error the workers agreed on (bad rows, a checkpoint of other data), for the driver
ERROR_FILE = "worker_error.json"


# --------------------------------------------------------------------------- driver
def run_ray_fit(request: FitRequest, *, fault: FaultHook | None = None) -> FitResult:
    """Run (or, with ``request.resume``, resume) a fit on Ray Train workers.

    Parameters
    ----------
    request : FitRequest
        ``mode`` "ray". ``ray_address``: the cluster (``auto``, ``ray://…``,
        ``host:port``; default ``$RAY_ADDRESS``, else a new local cluster; an already
        connected driver is used as it is). ``wait_for_workers_s``: how long an existing
        cluster may take to offer the workers' resources (a local one is checked once).
        ``overwrite``: start afresh in an output folder that holds an earlier fit (its
        checkpoints are removed once the request has been checked); without it, a fresh
        fit into a folder with checkpoints is refused.
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
    if not request.resume and not request.overwrite and has_ray_checkpoints(out):
        raise ConfigError(f"{out} holds checkpoints of an earlier fit: continue it with "
                          f"--resume {out}, start afresh with --overwrite, or choose another "
                          "--output")
    n, _ = feature_shape(request.input)
    need = rows_needed(config.init.n_clusters)
    if n < need:
        raise DataError(f"{request.input} has {n} rows, fewer than the {need} needed (initial clusters)")
    if request.overwrite and not request.resume:
        remove_checkpoints(out)  # a new TorchTrainer would restore them

    import ray

    started_here = connect_ray(request.ray_address)
    staging = staging_folder(out)  # rank 0 writes the outputs here, the driver publishes them
    try:
        check_resources(request.num_workers, request.use_gpu,
                        0.0 if started_here == "local" else request.wait_for_workers_s)
        out.mkdir(parents=True, exist_ok=True)
        (out / ERROR_FILE).unlink(missing_ok=True)
        if not request.resume:
            request.save()
        prune_checkpoints(out)
        whole_counts_in_ray_bars()
        _torch_trainer(request, staging, fault).fit()
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        user_error = _worker_user_error(exc)
        if user_error is not None:
            raise user_error from None
        raise
    finally:
        if started_here:
            ray.shutdown()
    error_file = out / ERROR_FILE
    if error_file.exists():
        shutil.rmtree(staging, ignore_errors=True)
        message = json.loads(error_file.read_text())["error"]
        error_file.unlink()
        raise _rebuild_error(message)
    publish_run(staging, out, RUN_OUTPUTS)
    prune_checkpoints(out)
    return FitResult(json.loads((out / "summary.json").read_text()), str(out))


def whole_counts_in_ray_bars() -> None:
    """Make this driver draw the workers' progress bars with whole counts (``7/200``).

    Ray's driver draws each bar a worker reports (``ray.experimental.tqdm_ray``) as a
    ``tqdm.auto`` bar with ``unit_scale=True``, which shows 7 epochs as ``7.00/200``; its
    module attribute ``real_tqdm`` is the one place to change that.
    """
    import types

    from ray.experimental import tqdm_ray
    from tqdm import auto

    def whole(*args: Any, **kwargs: Any) -> Any:
        return auto.tqdm(*args, **{**kwargs, "unit_scale": False})

    tqdm_ray.real_tqdm = types.SimpleNamespace(tqdm=whole)


def check_resources(num_workers: int, use_gpu: bool, wait_s: float = 0.0) -> None:
    """Fail fast when the cluster cannot host W workers (Ray would wait forever).

    Each worker takes 1 CPU (and 1 GPU with ``use_gpu``). Totals over the cluster are
    compared, waiting up to ``wait_s`` seconds for nodes that are still joining.

    Raises
    ------
    ConfigError
        Too few CPUs or GPUs once ``wait_s`` has passed.
    """
    import ray

    need_cpu, need_gpu = max(num_workers, 1), (max(num_workers, 1) if use_gpu else 0)
    deadline = time.monotonic() + wait_s
    while True:
        have = ray.cluster_resources()
        cpu, gpu = have.get("CPU", 0.0), have.get("GPU", 0.0)
        if cpu >= need_cpu and gpu >= need_gpu:
            return
        if time.monotonic() >= deadline:
            what = f"{need_cpu} CPUs" + (f" and {need_gpu} GPUs" if need_gpu else "")
            raise ConfigError(
                f"--num-workers {num_workers}{' --use-gpu' if use_gpu else ''} needs {what}, but "
                f"the Ray cluster has {cpu:g} CPUs and {gpu:g} GPUs; lower --num-workers or add nodes"
            )
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def _torch_trainer(request: FitRequest, staging: Path, fault: FaultHook | None):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(request.output).resolve()
    loop = {"request": dataclasses.asdict(request), "staging": str(staging), "fault": fault}
    return TorchTrainer(
        _train_worker,
        train_loop_config=loop,
        torch_config=TorchConfig(backend="nccl" if request.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=request.num_workers, use_gpu=request.use_gpu),
        run_config=RunConfig(
            name=TRAIN_DIR,
            storage_path=str(out),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=request.max_failures),
            logging_config=LoggingConfig(log_level="WARNING"),  # no per-report INFO lines
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


# --------------------------------------------------------------------------- workers
def _train_worker(loop: dict[str, Any]) -> None:
    """Ray Train loop of one rank (see the module docstring)."""
    import ray.train
    import ray.train.torch

    from pipeline.distributed import communicator, ddp_wrapper, load_rank_rows
    from pipeline.tracking.environment import environment_tags
    from pipeline.tracking.fit_runs import fit_params

    req = FitRequest(**loop["request"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if req.use_gpu else torch.device("cpu")
    comm = communicator(device)
    wrap = ddp_wrapper(device) if comm.world_size > 1 else None
    config = req.fit_config().with_overrides({"device": device.type})
    n, dim = feature_shape(req.input)

    # every rank reads and checks its slice; the first bad rank's error ends the run
    error, x = "", np.zeros((0, dim), np.float32)
    try:
        x, _ = load_rank_rows(req.input, n, rank, world)
    except DeepDPMError as exc:
        error = f"{type(exc).__name__}: {exc}"
    error = _first_error(comm, error)
    if error:
        _stop_with(error, req, rank)
        return

    tracker = req.tracker(rank)
    with tracker:
        checkpoint = ray.train.get_checkpoint()
        try:
            if checkpoint is not None:
                trainer = Trainer.from_state(load_ray_checkpoint(checkpoint), readonly_tensor(x),
                                             comm, wrap, config=config)
            else:
                trainer = Trainer(config, readonly_tensor(x), comm, wrap)
        except DeepDPMError as exc:  # decided from global quantities: the same on every rank
            _stop_with(f"{type(exc).__name__}: {exc}", req, rank)
            return
        del x  # the trainer holds its own (shifted) copy
        resumed_from = trainer.epoch if checkpoint is not None else None
        tracker.log_params(fit_params(config.flat(), n, dim, num_workers=world))
        tracker.set_tags({**environment_tags(req.input),
                          **({"resumed_from_epoch": resumed_from} if resumed_from is not None else {})})
        hooks = FitHooks(
            on_epoch=epoch_callbacks(trainer, tracker, _rank0_scores(req, config.seed))
            if rank == 0 else [],
            checkpoint=lambda t: _report(t, rank, final=False),
            checkpoint_every=req.checkpoint_every,
            consistency_every=CONSISTENCY_EVERY if world > 1 else 0,
            progress=_ray_progress if rank == 0 and not req.quiet else None,
            fault=loop.get("fault"),
            rank=rank,
        )
        t0 = time.perf_counter()
        before = sum(r["seconds"] for r in trainer.history)
        try:
            run_epochs(trainer, hooks, restored=checkpoint is not None)
        except DeepDPMError as exc:
            # a data error meets every rank alike (all-reduced statistics, rank 0's broadcast
            # plan); Ray Train retries whatever a worker raises, so it ends the run here
            tracker.close("FAILED")
            _stop_with(f"{type(exc).__name__}: {exc}", req, rank)
            return
        _report(trainer, rank, final=True)
        if rank == 0:
            _write_outputs(trainer, req, Path(loop["staging"]), before + time.perf_counter() - t0,
                           tracker,
                           {"num_workers": world, "resumed_from_epoch": resumed_from,
                            **data_variance_summary(trainer)})


def _rank0_scores(req: FitRequest, seed: int):
    """Per-epoch label scores on the rows a local fit of the same input scores."""
    from pipeline.epoch_scores import EpochLabelScores

    return EpochLabelScores.from_file(req.input, seed=seed)


def _report(trainer: Trainer, rank: int, final: bool) -> None:
    """``ray.train.report`` on every rank (it is a barrier); rank 0 attaches the checkpoint."""
    import ray.train

    metrics = {"epoch": trainer.epoch, "n_clusters": trainer.n_clusters, "final": final}
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="deepdpm-ckpt-") as tmp:
        write_trainer_state(trainer, Path(tmp) / CHECKPOINT_FILE)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _stop_with(error: str, req: FitRequest, rank: int) -> None:
    """End the run cleanly on a user error that every rank agrees on: a retry could not
    help, so no rank raises; rank 0 leaves the message for the driver."""
    if rank == 0:
        write_json_atomic({"error": error}, Path(req.output) / ERROR_FILE)


def _first_error(comm: Communicator, error: str) -> str:
    """The error of the lowest rank that has one, on every rank ("" when none)."""
    w = comm.world_size
    flag = torch.tensor([float(w - comm.rank) if error else 0.0], dtype=torch.float64)
    top = int(comm.all_reduce(flag, op="max").item())
    if top == 0:
        return ""
    return comm.broadcast_object(error, src=w - top)


@contextlib.contextmanager
def _ray_progress(trainer: Trainer) -> Iterator[Callable[[dict], None]]:
    """Rank 0's progress bar, drawn by the Ray driver (``ray.experimental.tqdm_ray``, which
    carries a count and a description only: K, and at the end why the fit stopped, go in
    the description)."""
    from ray.experimental import tqdm_ray

    bar = tqdm_ray.tqdm(total=trainer.config.schedule.max_epochs, desc="deepdpm fit", unit="epoch")
    bar.n = trainer.epoch  # a resumed fit goes on counting from its checkpoint

    def show(record: dict) -> None:
        description = f"deepdpm fit K={record['n_clusters']}"
        reason = trainer.schedule.stop_reason(record["epoch"] + 1)  # the record's epoch counts from 0
        if reason is not None:  # complete at the epochs run, not e.g. 33/200
            bar.total = bar.n + 1
            description += f" stopped: {reason}"
        bar.set_description(description)
        bar.update(1)

    try:
        yield show
    finally:
        bar.close()


def _write_outputs(trainer: Trainer, req: FitRequest, staging: Path, fit_seconds: float,
                   tracker: Any, extra: dict[str, Any]) -> None:
    """Rank 0: predict every row (full table read now) and write the fit's outputs into
    ``staging`` (the driver publishes them)."""
    from pipeline.fit.outputs import write_fit_outputs
    from pipeline.io import read_features
    from pipeline.tracking.fit_runs import log_fit_outputs

    table = read_features(req.input)
    shutil.rmtree(staging, ignore_errors=True)  # what an attempt that failed left
    write_fit_outputs(staging, DeepDPM.from_trainer(trainer), table, fit_seconds, req.input,
                      extra=extra, publish=False)
    log_fit_outputs(tracker, staging)  # + final_nmi/ari/acc over all labelled rows


__all__ = ["ERROR_FILE", "check_resources", "run_ray_fit", "whole_counts_in_ray_bars"]
