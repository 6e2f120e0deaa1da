"""Checks that every rank holds the same model (they must never diverge: every rank runs
the same M-steps and surgeries on all-reduced statistics and gradients)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deepdpm_core.runtime import Communicator

Tensor = torch.Tensor


def position_checksum(tensors: Iterable[Tensor], device: torch.device) -> float:
    """A float64 sum over ``tensors``, each element weighted by its position in its tensor
    (1 to 2), so that swapped values change it; NaNs count as 0."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        flat = torch.nan_to_num(t.detach().to(device, torch.float64).reshape(-1))
        total += (flat * torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=device)).sum()
    return float(total)


def check_ranks_agree(comm: Communicator, checksum: float, device: torch.device, rtol: float, when: str,
                      detail: str) -> None:
    """Raise RuntimeError if the ranks' checksums differ by more than ``rtol`` (relative).

    One all-reduce (op max) of (c, −c) gives the largest and the smallest checksum.

    Parameters
    ----------
    comm : Communicator
    checksum : float
        This rank's :func:`position_checksum`.
    device : torch.device
        Where the communicator reduces.
    rtol : float
    when, detail : str
        Name the moment (``at epoch 7``) and this rank's state in the message.
    """
    both = comm.all_reduce(torch.tensor([checksum, -checksum], dtype=torch.float64, device=device),
                           op="max").cpu()
    hi, lo = float(both[0]), -float(both[1])
    if hi - lo > rtol * max(abs(hi), abs(lo), 1.0):
        raise RuntimeError(f"ranks diverged {when}: model checksums range from {lo!r} to {hi!r} over "
                           f"{comm.world_size} ranks ({detail})")
