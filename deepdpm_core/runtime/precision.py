"""Reduced-precision matmuls for the two nets only, and subnormal floats flushed to zero.

The nets' GEMMs are a large share of an epoch's arithmetic (≈ 9 of ≈ 25 G multiply-adds at
200k x 64 x 200, K = 200), and their outputs need only be as good as the responsibilities
they feed. ``model.precision``: ``float32``; ``tf32``, TF32 inputs for CUDA matmuls of both
passes (no effect off CUDA); ``bf16``, the forward pass under :func:`torch.autocast` with
bfloat16 (the backward follows its dtypes); ``auto``, ``tf32`` on CUDA, else ``float32``.
Accumulation stays float32; the E-step, statistics and NIW math never run under these
contexts (docs/design.md, "Math conventions").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto`` -> ``tf32`` on CUDA, ``float32`` elsewhere; other names unchanged."""
    if name == "auto":
        return "tf32" if device.type == "cuda" else "float32"
    return name


@contextlib.contextmanager
def _cuda_tf32() -> Iterator[None]:
    """TF32 inputs for CUDA float32 matmuls inside the block, restored after it."""
    mm = torch.backends.cuda.matmul
    # newer torch: fp32_precision (not to be mixed with the legacy allow_tf32); older: allow_tf32
    name, value = ("fp32_precision", "tf32") if hasattr(mm, "fp32_precision") else ("allow_tf32", True)
    old = getattr(mm, name)
    setattr(mm, name, value)
    try:
        yield
    finally:
        setattr(mm, name, old)


def net_precision(precision: str, device: torch.device, backward: bool = False) -> contextlib.AbstractContextManager:
    """Context for the nets' forward pass (or, with ``backward=True``, their backward pass).

    Parameters
    ----------
    precision : {"float32", "tf32", "bf16"}
        A resolved ``model.precision`` (see :func:`resolve_precision`).
    device : torch.device
        Where the nets run.
    backward : bool
        The context of ``loss.backward()``: TF32 applies there too; autocast does not
        (gradients take the dtypes of the autocast forward).
    """
    if precision == "tf32" and device.type == "cuda":
        return _cuda_tf32()
    if precision == "bf16" and not backward:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Subnormal floats (|x| < 1.2e-38 in float32) flushed to zero on the CPU inside the
    block; the previous mode is restored after it. The mode is a thread's own: threads
    started before the block (a BLAS pool) keep theirs, so the clustering loss makes no
    subnormal gradient itself (:data:`~deepdpm_core.nets.losses.SOFTMAX_ZERO`).

    Adam's moments of weights whose gradient stays 0 (dead ReLU units) decay into the
    subnormal range, where x86 arithmetic is many times slower (docs/benchmarks.md,
    "Scale"); values that small are far below Adam's eps (1e-8). No effect on GPUs.
    """
    before = bool((torch.tensor([1e-39]) * 1.0)[0] == 0)  # the mode now: a subnormal times 1 gives 0
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)
