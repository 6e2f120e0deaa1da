"""``torch.distributed`` pieces of a data-parallel fit: the communicator, DDP, row slices.

One :class:`~deepdpm_core.training.search.Search` per rank fits that rank's rows
(:func:`load_rank_rows`); its only collectives are those of :class:`TorchDistCommunicator`
(statistics all-reduce, move-plan broadcast) and of the DDP around its nets
(:func:`ddp_wrapper`). Any initialised default process group works: gloo on CPU, NCCL on
GPU (docs/distributed.md, "Distributed training (Ray Train + DDP)").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from deepdpm_core.errors import DataError
from deepdpm_core.runtime import Communicator, LocalCommunicator
from pipeline.io.feature_rows import rank_rows, read_feature_rows

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TorchDistCommunicator:
    """:class:`~deepdpm_core.runtime.communicator.Communicator` over the default process group.

    Parameters
    ----------
    device : torch.device
        Where collectives run: NCCL needs CUDA tensors, gloo takes CPU ones. Tensors are
        moved there and the result is returned on the caller's device.

    Attributes
    ----------
    all_reduce_calls, all_reduce_bytes : int
        Calls and payload bytes of :meth:`all_reduce` so far (what a benchmark reports).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (no process group)")
        self.device = torch.device(device)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self.all_reduce_calls = 0
        self.all_reduce_bytes = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        """Sum (or max) of ``tensor`` over all ranks; the input is left untouched."""
        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out, op=_OPS[op])
        self.all_reduce_calls += 1
        self.all_reduce_bytes += out.numel() * out.element_size()
        return out.to(tensor.device)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank."""
        box = [obj if self._rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        return box[0]


def communicator(device: torch.device | str = "cpu") -> Communicator:
    """:class:`TorchDistCommunicator` when a process group exists, else single-process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistCommunicator(device)
    return LocalCommunicator()


def ddp_wrapper(device: torch.device | str = "cpu") -> Callable[[nn.Module], nn.Module]:
    """The search's ``wrap``: a fresh DDP around a net after every build or surgery.

    Each net type gets its own process group, made on first use (every rank wraps the
    same nets in the same order, so group creation is collective as it must be). The
    clustering and subclustering nets are back-propagated by one ``backward()``; with
    separate groups their bucketed gradient all-reduces can never pair up wrongly.
    Constructing DDP broadcasts rank 0's parameters, which are the same on every rank
    after an identical surgery; the old wrapper is dropped, and the optimiser keeps the
    (unchanged) parameter objects with their state. Every parameter gets a gradient in
    every step (an empty batch gives zeros), so ``find_unused_parameters`` stays off.
    """
    device = torch.device(device)
    groups: dict[str, Any] = {}

    def wrap(net: nn.Module) -> nn.Module:
        key = type(net).__name__
        if key not in groups:
            groups[key] = dist.new_group()
        return DistributedDataParallel(
            net,
            device_ids=[device.index if device.index is not None else torch.cuda.current_device()]
            if device.type == "cuda" else None,
            process_group=groups[key],
        )

    return wrap


def load_rank_rows(path: str | Path, n_rows: int, rank: int, world_size: int,
                   columns: Any = None) -> tuple[np.ndarray, int]:
    """This rank's contiguous slice of a feature input (``columns``: of a wide table,
    :class:`pipeline.io.columns.TableColumns`), checked for NaN/inf.

    Returns
    -------
    x : ndarray of shape (N_rank, D), float32 — may be empty
    start : int
        Global index of its first row.

    Raises
    ------
    DataError
        Rows with NaN or inf (named by their global index).
    """
    start, stop = rank_rows(n_rows, rank, world_size)
    x = read_feature_rows(path, start, stop, columns)
    finite = np.isfinite(x).all(1)
    if not finite.all():
        bad = np.flatnonzero(~finite) + start
        head = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise DataError(f"{path} has rows with NaN or inf values (rows {head})")
    return x, start
