"""The worker side of a fit on Ray Train (:mod:`pipeline.fit.ray`): each worker's training loop
over its slice of the rows, the driver's Ctrl-C as every rank sees it, rank 0's scores,
checkpoints and progress, and the outputs rank 0 writes at the end."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core.atomic_files import write_json_atomic
from deepdpm_core.errors import DeepDPMError
from deepdpm_core.model import DeepDPM
from deepdpm_core.runtime import Communicator
from deepdpm_core.training import Search
from pipeline.fit.checkpoints import CHECKPOINT_FILE, load_ray_checkpoint, write_search_state
from pipeline.fit.interrupts import FitInterrupted
from pipeline.fit.request import FitRequest
from pipeline.fit.runner import (
    CONSISTENCY_EVERY,
    data_variance_summary,
    every,
    fault_before_next,
    run_epochs,
    start_job,
    stop_on,
)
from pipeline.io.feature_rows import feature_shape

#: a user error the workers agreed on (bad rows, a checkpoint of other data), for the driver
ERROR_FILE = "worker_error.json"


#: the driver's Ctrl-C, for the workers (``{"requested": true}``), and rank 0's answer
#: once every rank has stopped at an epoch's end (``{"stopped_after_epoch": E}``)
STOP_FILE = "stop_requested"


def train_worker(loop: dict[str, Any]) -> None:
    """Ray Train loop of one rank (see the module docstring)."""
    import ray.train
    import ray.train.torch

    from pipeline.fit.distributed import communicator, ddp_wrapper, load_rank_rows

    # Ray Train sets the workers' root logger to INFO, which shows every library's INFO
    # records (and "Reporting training result ..." at each report): back to WARNING
    logging.getLogger().setLevel(logging.WARNING)
    req = FitRequest(**loop["request"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if req.use_gpu else torch.device("cpu")
    comm = communicator(device)
    wrap = ddp_wrapper(device) if comm.world_size > 1 else None
    config = req.fit_config().model_copy(update={"device": device.type})
    n, dim = feature_shape(req.input, req.table_columns)

    # every rank reads and checks its slice; the first bad rank's error ends the run
    error, x = "", np.zeros((0, dim), np.float32)
    try:
        x, _ = load_rank_rows(req.input, n, rank, world, req.table_columns)
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
            search = start_job(config, x, tracker, req.input, shape=(n, dim), num_workers=world,
                                state=None if checkpoint is None else load_ray_checkpoint(checkpoint, req.fit_id),
                                comm=comm, wrap=wrap)
        except DeepDPMError as exc:  # decided from global quantities: the same on every rank
            _stop_with(f"{type(exc).__name__}: {exc}", req, rank)
            return
        del x  # the search holds its own (shifted) copy
        stop_file = Path(req.output) / STOP_FILE
        # rank 0 logs each epoch, with its label scores
        logged = (tracker, _rank0_scores(req, config.seed)) if rank == 0 else (None, None)
        callbacks = [
            stop_on(_DriverStop(comm, stop_file)),
            # once more after the last epoch, which pruned the clusters that own no point
            *every(search, CONSISTENCY_EVERY if world > 1 else 0, Search.check_consistency, last=True),
            *every(search, req.checkpoint_every, lambda t: _report(t, rank, req.fit_id, final=False)),
            *fault_before_next(search, loop.get("fault"), rank),
        ]
        try:
            fit_seconds = run_epochs(search, callbacks, *logged,
                                     progress=_ray_progress if rank == 0 and not req.quiet else None)
        except FitInterrupted:  # the driver's Ctrl-C: every rank stands at this epoch's end
            if rank == 0:
                write_json_atomic({"stopped_after_epoch": search.epoch}, stop_file)
            tracker.close("KILLED")
            # what --resume continues from; once Ray Train has registered it, the driver
            # may end the cluster
            _report(search, rank, req.fit_id, final=False)
            return
        except DeepDPMError as exc:
            # a data error meets every rank alike (all-reduced statistics, rank 0's broadcast
            # plan); Ray Train retries whatever a worker raises, so it ends the run here
            tracker.close("FAILED")
            _stop_with(f"{type(exc).__name__}: {exc}", req, rank)
            return
        _report(search, rank, req.fit_id, final=True)
        if rank == 0:
            _write_outputs(search, req, Path(loop["staging"]), fit_seconds, tracker, world)


class _DriverStop:
    """The driver's Ctrl-C (:data:`STOP_FILE`) as every rank sees it, for
    :func:`pipeline.fit.runner.stop_on`.

    Reading :attr:`requested` is a collective, once per epoch on every rank: rank 0 looks
    for the file and one all-reduce tells every rank, so all stop after the same epoch.
    """

    def __init__(self, comm: Communicator, path: Path) -> None:
        self.comm, self.path = comm, path
        self.honoured = False

    @property
    def requested(self) -> bool:
        asked = self.comm.rank == 0 and self.path.exists()
        flag = torch.tensor([1.0 if asked else 0.0], dtype=torch.float64)
        return bool(self.comm.all_reduce(flag, op="max").item() > 0)


def _rank0_scores(req: FitRequest, seed: int):
    """Per-epoch label scores on the rows a local fit of the same input scores."""
    from pipeline.fit.epoch_scores import EpochLabelScores

    return EpochLabelScores.from_file(req.input, seed=seed, columns=req.table_columns)


def _report(search: Search, rank: int, fit_id: str | None, final: bool) -> None:
    """``ray.train.report`` on every rank (it is a barrier); rank 0 attaches the checkpoint
    (of the fit ``fit_id``)."""
    import ray.train

    metrics = {"epoch": search.epoch, "n_clusters": search.n_clusters, "final": final}
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="deepdpm-ckpt-") as tmp:
        write_search_state(search, Path(tmp) / CHECKPOINT_FILE, fit_id)
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
def _ray_progress(search: Search) -> Iterator[Callable[[dict], None]]:
    """Rank 0's progress bar, drawn by the Ray driver (``ray.experimental.tqdm_ray``, which
    carries a count and a description only: K, and at the end why the fit stopped, go in
    the description)."""
    from ray.experimental import tqdm_ray

    # its total is the end the schedule expects, not max_epochs (as epoch_bar's)
    bar = tqdm_ray.tqdm(total=search.schedule.expected_end(search.epoch), desc="deepdpm fit",
                        unit="epoch")
    bar.n = search.epoch  # a resumed fit goes on counting from its checkpoint

    def show(record: dict) -> None:
        description = f"deepdpm fit K={record['n_clusters']}"
        bar.total = search.schedule.expected_end(record["epoch"])
        if record["stop_reason"] is not None:  # complete at the epochs run
            bar.total = bar.n + 1
            description += f" stopped: {record['stop_reason']}"
        bar.set_description(description)
        bar.update(1)

    try:
        yield show
    finally:
        bar.close()


def _write_outputs(search: Search, req: FitRequest, staging: Path, fit_seconds: float,
                   tracker: Any, world: int) -> None:
    """Rank 0: predict every row (full table read now) with the model ``search`` fitted on
    ``world`` workers and write the fit's outputs into ``staging`` (the driver publishes
    them)."""
    from pipeline.fit.outputs import request_extra, write_fit_outputs
    from pipeline.io.tables import read_features
    from pipeline.tracking.fit_runs import log_fit_outputs

    table = read_features(req.input, req.table_columns)
    shutil.rmtree(staging, ignore_errors=True)  # what an attempt that failed left
    write_fit_outputs(staging, DeepDPM.from_search(search), table, fit_seconds, req.input,
                      extra=request_extra(req.fit_id, req.columns, data_variance_summary(search),
                                          num_workers=world, resumed_from=search.resumed_from), publish=False)
    log_fit_outputs(tracker, staging)  # + final_nmi/ari/acc over all labelled rows
