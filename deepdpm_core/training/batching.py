"""Batch size, learning rate and optimiser of the nets' training steps."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from deepdpm_core.nets import Adam
from deepdpm_core.runtime import Communicator

#: the batch the paper tuned its learning rates at (5e-4 and 5e-3): small data keep it, and
#: larger batches scale the rates from it
BASE_BATCH_SIZE = 128
#: the largest auto batch: larger data take more steps an epoch rather than larger batches,
#: whose scaled learning rates would leave the range the paper's were tuned in
MAX_BATCH_SIZE = 4096
#: optimizer steps of one pass with an auto batch: per-step work, not arithmetic, is what an
#: epoch of these small nets costs, so the epoch costs about this many steps whatever N
STEPS_PER_EPOCH = 64


def auto_batch_size(n_total: int) -> int:
    """Batch size making one pass over ``n_total`` rows in :data:`STEPS_PER_EPOCH` steps,
    clamped to [:data:`BASE_BATCH_SIZE`, :data:`MAX_BATCH_SIZE`].

    Small data keep the paper's batch of 128; large data get large batches, so an epoch
    costs a fixed number of optimizer steps instead of N/128 (per-step work, not
    arithmetic, dominates an epoch of these small nets).
    """
    return int(min(MAX_BATCH_SIZE, max(BASE_BATCH_SIZE, -(-n_total // STEPS_PER_EPOCH))))


def scaled_lr(base_lr: float, batch_size: int, rule: str) -> float:
    """Learning rate for ``batch_size`` from one tuned at :data:`BASE_BATCH_SIZE`
    (``rule``: ``linear``, ``sqrt`` or ``none``)."""
    ratio = batch_size / BASE_BATCH_SIZE
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def adam(params: Iterable[torch.Tensor], lr: float) -> Adam:
    """Adam as one fused kernel per step (CPU and CUDA): with small nets the per-tensor
    update loop, not the arithmetic, is what a step costs."""
    return Adam(params, lr, fused=True)


def epoch_steps(n_local: int, batch_size: int, min_steps: int, comm: Communicator,
                device: torch.device) -> tuple[int, int]:
    """(steps of one pass over the largest rank's rows, optimizer steps this epoch).

    Small data get extra training steps on re-drawn batches up to ``min_steps``
    (``optim.min_steps_per_epoch``), so the nets can follow the parameters after a move;
    statistics always come from exactly one pass. Collective: every rank calls it.
    """
    local = math.ceil(n_local / batch_size)
    t = torch.tensor([float(local)], dtype=torch.float64, device=device)
    one_pass = int(comm.all_reduce(t, op="max").item())
    return one_pass, max(one_pass, min_steps)


def global_batch(step: int, one_pass: int, batch_size: int, rank_rows: list[int]) -> int:
    """Points in minibatch ``step`` summed over all ranks (no communication needed);
    ``rank_rows`` are the rows each rank holds."""
    if step >= one_pass:  # extra training batches: batch_size re-drawn rows on every rank with rows
        return sum(batch_size for n in rank_rows if n)
    return sum(min(batch_size, max(0, n - step * batch_size)) for n in rank_rows)
