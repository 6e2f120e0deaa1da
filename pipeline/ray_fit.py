"""Distributed ``deepdpm fit``: a Ray Train ``TorchTrainer`` of W DDP workers.

Each worker reads only its contiguous slice of the input rows
(:func:`pipeline.distributed.load_rank_rows`) and runs a
:class:`~deepdpm_core.trainer.Trainer` on it with a ``torch.distributed``
communicator: per epoch one all-reduce of the flat float64 statistics, the same
M-step on every rank, moves decided on rank 0 and broadcast as a plan, the nets
wrapped in DDP (docs/design.md, section Distribution). A worker's memory is its
slice plus O(K·D²) and the
k-means sample (``init.max_points`` rows).

The run lives in the output directory:

``OUT/fit_request.json``
    the request (input, config, workers, ...), so ``deepdpm fit --resume OUT`` can
    restart a stopped run;
``OUT/ray_train/``
    Ray Train's storage: a checkpoint every ``checkpoint_every`` epochs and at the
    end (``model.pt`` in the :class:`~deepdpm_core.estimator.DeepDPM` format: nets,
    optimisers, NIW parameters, K, epoch, RNG states, config). A worker failure
    restarts the group from the latest one (``FailureConfig(max_failures)``); a new
    ``TorchTrainer`` on the same storage (``--resume``) restores it too.

When training ends, rank 0 predicts every row (it reads the full table then; the
other ranks never do) and writes the same outputs as the single-process fit
(:func:`pipeline.fitting.write_fit_outputs`) into a staging folder beside ``OUT``; the
driver publishes them in one step once Ray Train is done with ``OUT/ray_train``
(:mod:`pipeline.run_folder`), and removes the checkpoints Ray Train's snapshot does not
list (one written just before the driver was killed is never registered, so never
pruned). Only rank 0 logs to MLflow.

Crash injection for tests: ``DEEPDPM_FAIL_AT_EPOCH=e`` (or ``e1,e2,...``; and
``DEEPDPM_FAIL_RANK=r``, default 1) in the driver's environment make rank r raise once
when it is about to train epoch e (e epochs done); a marker file in the run's storage
keeps the retry from failing there again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core import errors
from deepdpm_core.checkpoints import safe_load
from deepdpm_core.communicator import Communicator
from deepdpm_core.config import Config, from_dict
from deepdpm_core.errors import CheckpointError, ConfigError, DataError, DeepDPMError
from deepdpm_core.estimator import FORMAT, DeepDPM
from deepdpm_core.init import rows_needed
from deepdpm_core.trainer import Trainer
from deepdpm_core.validation import readonly_tensor
from pipeline.io import feature_shape, write_json_atomic
from pipeline.ray_local import connect_ray
from pipeline.run_folder import publish_run, staging_folder
from pipeline.tracking import DEFAULT_MODEL_ALIAS

REQUEST_FILE = "fit_request.json"
#: a user error the workers agreed on (bad rows, a checkpoint of other data), for the driver
ERROR_FILE = "worker_error.json"
TRAIN_DIR = "ray_train"
CHECKPOINT_FILE = "model.pt"
#: epochs between the cross-rank model checksums (one 16-byte all-reduce each)
CONSISTENCY_EVERY = 5
FAIL_EPOCH_ENV = "DEEPDPM_FAIL_AT_EPOCH"
FAIL_RANK_ENV = "DEEPDPM_FAIL_RANK"


@dataclass(frozen=True)
class FitRequest:
    """Everything a fit with checkpoints needs (stored as ``OUT/fit_request.json``): a
    distributed one, or a single-process one (``in_process``) that ``--resume`` continues.

    Paths are absolute: workers may run in other directories or on other nodes.
    """

    input: str
    output: str
    config: dict[str, Any]
    num_workers: int = 2
    use_gpu: bool = False
    checkpoint_every: int = 5
    max_failures: int = 3
    tracking: bool = True
    tracking_uri: str | None = None
    experiment: str = "deepdpm"
    run_name: str | None = None
    register_model: str | None = None
    model_alias: str = DEFAULT_MODEL_ALIAS
    quiet: bool = False
    #: a single-process fit with checkpoints (:mod:`pipeline.resumable_fit`), not a Ray one
    in_process: bool = False

    def __post_init__(self) -> None:
        if self.num_workers < 1:  # Ray Train's 0 (local mode) would drop the checkpoints
            raise ConfigError(f"a Ray fit needs --num-workers >= 1, got {self.num_workers} (without "
                              "--ray-address, 0 or 1 fit in this process)")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.max_failures < -1:
            raise ConfigError(f"--max-failures must be >= -1 (-1: no limit), got {self.max_failures}")

    def save(self) -> None:
        write_json_atomic(dataclasses.asdict(self), Path(self.output) / REQUEST_FILE)

    @classmethod
    def load(cls, run_dir: str | Path) -> FitRequest:
        """The request of the run in ``run_dir`` (``--resume``)."""
        path = Path(run_dir) / REQUEST_FILE
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(
                f"{run_dir} is not the output directory of a fit with checkpoints (no {REQUEST_FILE})"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise CheckpointError(f"{path} is not a valid fit request: {exc}") from exc

    def with_(self, **changes: Any) -> FitRequest:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- driver
def has_checkpoints(out: str | Path) -> bool:
    """True when ``out`` holds the Ray Train checkpoints of a distributed fit."""
    return (Path(out) / TRAIN_DIR / "checkpoint_manager_snapshot.json").exists()


def run_fit(request: FitRequest, *, resume: bool = False, ray_address: str | None = None,
            wait_for_workers_s: float = 120.0, overwrite: bool = False) -> dict[str, Any]:
    """Run (or resume) a distributed fit; returns the summary rank 0 wrote.

    Parameters
    ----------
    request : FitRequest
    resume : bool
        Continue from the latest checkpoint in ``request.output`` (a fresh fit into an
        output directory that holds checkpoints is refused).
    ray_address : str, optional
        Ray cluster to use (``auto``, ``ray://…``, ``host:port``); default
        ``$RAY_ADDRESS``, else a new local cluster. An already connected driver
        (``ray.is_initialized()``) is used as it is.
    wait_for_workers_s : float
        How long to wait for an existing cluster to offer the workers' resources
        (nodes may still be joining) before failing; a local cluster is checked once.
    overwrite : bool
        Start afresh in an output directory that holds an earlier fit: its checkpoints
        (``DIR/ray_train``) are removed once the request has been checked.

    Raises
    ------
    ConfigError
        The cluster lacks the CPUs/GPUs for W workers, or stale checkpoints.
    DataError, CheckpointError
        Raised by a worker for bad rows or a checkpoint of other data (not retried).
    """
    out = Path(request.output)
    config = from_dict(request.config)
    if not resume and not overwrite and has_checkpoints(out):
        raise ConfigError(f"{out} holds checkpoints of an earlier fit: continue it with "
                          f"--resume {out}, start afresh with --overwrite, or choose another "
                          "--output")
    n, _ = feature_shape(request.input)
    need = rows_needed(config.init.n_clusters)
    if n < need:
        raise DataError(f"{request.input} has {n} rows, fewer than the {need} needed (initial clusters)")
    if overwrite and not resume and (out / TRAIN_DIR).is_dir():
        shutil.rmtree(out / TRAIN_DIR)  # a new TorchTrainer would restore its checkpoints

    import ray

    started_here = connect_ray(ray_address)
    staging = staging_folder(out)  # rank 0 writes the outputs here, the driver publishes them
    try:
        check_resources(request.num_workers, request.use_gpu,
                        0.0 if started_here == "local" else wait_for_workers_s)
        out.mkdir(parents=True, exist_ok=True)
        (out / ERROR_FILE).unlink(missing_ok=True)
        if not resume:
            request.save()
        prune_checkpoints(out)
        _trainer(request, staging).fit()
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
    from pipeline.fitting import RUN_OUTPUTS

    publish_run(staging, out, RUN_OUTPUTS)
    prune_checkpoints(out)
    return json.loads((out / "summary.json").read_text())


def prune_checkpoints(out: str | Path) -> list[Path]:
    """Remove the checkpoint folders in ``OUT/ray_train`` that Ray Train's snapshot does
    not list; returns them.

    Ray Train keeps the last ``num_to_keep`` checkpoints it registered. A checkpoint a
    worker uploaded just before the run died is never registered, so never pruned, and
    a resumed run would not use it either. Nothing is removed without a readable
    snapshot.
    """
    train_dir = Path(out) / TRAIN_DIR
    try:
        snapshot = json.loads((train_dir / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):
        return []
    listed = set(_checkpoint_dir_names(snapshot))
    orphans = [path for path in train_dir.glob("checkpoint_*")
               if path.is_dir() and path.name not in listed]
    for path in orphans:
        shutil.rmtree(path)
    return orphans


def _checkpoint_dir_names(node: Any) -> list[str]:
    """Every ``checkpoint_dir_name`` value in a Ray Train checkpoint-manager snapshot."""
    if isinstance(node, dict):
        names = [v for k, v in node.items() if k == "checkpoint_dir_name" and isinstance(v, str)]
        return names + [n for v in node.values() for n in _checkpoint_dir_names(v)]
    if isinstance(node, list):
        return [n for v in node for n in _checkpoint_dir_names(v)]
    return []


def check_resources(num_workers: int, use_gpu: bool, wait_s: float = 0.0) -> None:
    """Fail fast when the cluster cannot host W workers (Ray would wait forever).

    Each worker takes 1 CPU (and 1 GPU with ``use_gpu``). Totals over the cluster are
    compared, waiting up to ``wait_s`` seconds for nodes that are still joining.
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


def _trainer(request: FitRequest, staging: Path):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(request.output).resolve()
    fail_at = os.environ.get(FAIL_EPOCH_ENV, "")
    loop = {
        "request": dataclasses.asdict(request),
        "fail_at_epochs": [int(e) for e in fail_at.split(",") if e.strip()],
        "fail_rank": int(os.environ.get(FAIL_RANK_ENV, "1")),
        "marker_dir": str(out / TRAIN_DIR),
        "staging": str(staging),
    }
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
    from pipeline.tracking import RunTracker, environment_tags, fit_params

    req = FitRequest(**loop["request"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if req.use_gpu else torch.device("cpu")
    comm = communicator(device)
    wrap = ddp_wrapper(device) if comm.world_size > 1 else None
    config = from_dict(req.config).with_overrides({"device": device.type})
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

    tracker = RunTracker(req.tracking_uri, req.experiment, enabled=req.tracking,
                         run_name=req.run_name, rank=rank, register_model=req.register_model,
                         model_alias=req.model_alias)
    with tracker:
        checkpoint = ray.train.get_checkpoint()
        try:
            if checkpoint is not None:
                trainer = Trainer.from_state(_load_state(checkpoint), readonly_tensor(x), comm, wrap,
                                             config=config)
            else:
                trainer = Trainer(config, readonly_tensor(x), comm, wrap)
        except DeepDPMError as exc:  # decided from global quantities: the same on every rank
            _stop_with(f"{type(exc).__name__}: {exc}", req, rank)
            return
        del x  # the trainer holds its own (shifted) copy
        # the trainer's global moments (one all-reduce at set-up) give the diagnostics' scale
        variance = float(np.median(trainer.feature_variance.cpu().numpy()))
        callbacks = _rank0_callbacks(tracker, config, variance, req) if rank == 0 else []
        trainer.callbacks.extend(callbacks)
        resumed_from = trainer.epoch if checkpoint is not None else None
        tracker.log_params(fit_params(config.flat(), trainer.n_total, trainer.dim, num_workers=world))
        tracker.set_tags({**environment_tags(req.input),
                          **({"resumed_from_epoch": resumed_from} if resumed_from is not None else {})})
        t0 = time.perf_counter()
        before = sum(r["seconds"] for r in trainer.history)
        try:
            if checkpoint is None:
                trainer.initialize()
            _train(trainer, req, loop, rank)
        except DeepDPMError as exc:
            # a data error meets every rank alike (all-reduced statistics, rank 0's broadcast
            # plan); Ray Train retries whatever a worker raises, so it ends the run here
            tracker.close("FAILED")
            _stop_with(f"{type(exc).__name__}: {exc}", req, rank)
            return
        for callback in callbacks:
            if isinstance(callback, _EpochBar):
                callback.close()
        trainer.check_consistency()  # the last epoch pruned clusters that own no point
        _report(trainer, rank, final=True)
        if rank == 0:
            _write_outputs(trainer, req, Path(loop["staging"]), before + time.perf_counter() - t0,
                           tracker,
                           {"num_workers": world, "resumed_from_epoch": resumed_from,
                            "median_feature_variance": variance})


def _train(trainer: Trainer, req: FitRequest, loop: dict[str, Any], rank: int) -> None:
    sch = trainer.config.schedule
    while trainer.epoch < sch.max_epochs and not trainer.converged:
        _maybe_fail(loop, trainer.epoch, rank)
        trainer.step_epoch()
        if trainer.epoch >= sch.max_epochs or trainer.converged:
            return
        if trainer.epoch % CONSISTENCY_EVERY == 0:
            trainer.check_consistency()
        if req.checkpoint_every and trainer.epoch % req.checkpoint_every == 0:
            _report(trainer, rank, final=False)


def _report(trainer: Trainer, rank: int, final: bool) -> None:
    """``ray.train.report`` on every rank (it is a barrier); rank 0 attaches the checkpoint."""
    import ray.train

    metrics = {"epoch": trainer.epoch, "n_clusters": trainer.n_clusters, "final": final}
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="deepdpm-ckpt-") as tmp:
        torch.save({"format": FORMAT, **trainer.state_dict()}, Path(tmp) / CHECKPOINT_FILE)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _load_state(checkpoint) -> dict[str, Any]:
    with checkpoint.as_directory() as path:
        try:
            state = safe_load(Path(path) / CHECKPOINT_FILE)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} has no {CHECKPOINT_FILE}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a DeepDPM checkpoint ({FORMAT})")
    return state


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


def _rank0_callbacks(tracker: Any, config: Config, feature_variance: float, req: FitRequest) -> list:
    from pipeline.tracking import epoch_callback

    callbacks = [epoch_callback(tracker, config, feature_variance)]
    if not req.quiet:
        callbacks.append(_EpochBar(config.schedule.max_epochs))
    return callbacks


class _EpochBar:
    """Rank 0's progress bar, drawn by the Ray driver (``ray.experimental.tqdm_ray``)."""

    def __init__(self, total: int) -> None:
        from ray.experimental import tqdm_ray

        self.bar = tqdm_ray.tqdm(total=total, desc="deepdpm fit", unit="epoch")

    def __call__(self, record: dict) -> None:
        self.bar.set_description(f"deepdpm fit K={record['n_clusters']}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _maybe_fail(loop: dict[str, Any], epoch: int, rank: int) -> None:
    """Crash injection (tests): raise once on the chosen rank at the chosen epoch."""
    if epoch not in loop["fail_at_epochs"] or rank != loop["fail_rank"]:
        return
    marker = Path(loop["marker_dir"]) / f".injected_failure_epoch{epoch}_rank{rank}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    raise RuntimeError(f"injected failure on rank {rank} at epoch {epoch} ({FAIL_EPOCH_ENV})")


def _write_outputs(trainer: Trainer, req: FitRequest, staging: Path, fit_seconds: float,
                   tracker: Any, extra: dict[str, Any]) -> None:
    """Rank 0: predict every row (full table read now) and write the fit's outputs into
    ``staging`` (the driver publishes them)."""
    from pipeline.fitting import write_fit_outputs
    from pipeline.io import read_features
    from pipeline.tracking import log_fit_outputs

    table = read_features(req.input)
    shutil.rmtree(staging, ignore_errors=True)  # what an attempt that failed left
    write_fit_outputs(staging, DeepDPM.from_trainer(trainer), table, fit_seconds, req.input,
                      extra=extra, publish=False)
    log_fit_outputs(tracker, staging)  # + final_nmi/ari/acc over all labelled rows
