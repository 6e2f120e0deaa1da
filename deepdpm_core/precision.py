"""Reduced-precision matmuls for the two nets only.

The nets' GEMMs are a large share of an epoch's arithmetic (≈ 9 of ≈ 25 G multiply-adds
at 200k x 64 x 200, K = 200), and their outputs only need to be as good as the
responsibilities they feed: TF32 (10-bit mantissa) or bf16 (7-bit) inputs with float32
accumulation. The E-step, the statistics and the NIW math never run under
these contexts: they keep float32 GEMMs on centred points and float64 sums.

``model.precision`` picks one of

* ``float32``: IEEE float32 everywhere;
* ``tf32``: CUDA matmuls of both passes take TF32 inputs (no effect off CUDA, where no
  TF32 unit exists);
* ``bf16``: the forward pass runs under :func:`torch.autocast` with bfloat16 (CPU or
  CUDA); the backward pass follows the forward's dtypes, as autocast prescribes;
* ``auto``: ``tf32`` on CUDA, ``float32`` elsewhere.
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
