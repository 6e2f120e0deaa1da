"""Which device a fit runs on, timing work queued on it, and the phases an epoch's time is
split into."""

from __future__ import annotations

import time

import torch

from deepdpm_core.errors import ConfigError

#: the parts of an epoch's ``seconds`` in its history record (key ``seconds_<phase>``), in
#: order, each timed with :func:`device_clock`
EPOCH_PHASES: tuple[tuple[str, str], ...] = (
    ("estep", "E-step targets"),
    ("train", "minibatch steps"),
    ("stats", "statistics + all-reduce"),
    ("mstep", "M-step"),
    ("moves", "split / merge round"),
)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a CUDA device is a
    :class:`~deepdpm_core.errors.ConfigError`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config device='cuda' but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def device_clock(device: torch.device) -> float:
    """perf_counter once the device's queued work is done (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
