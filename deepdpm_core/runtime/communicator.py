"""The one seam between the search and the distributed world (docs/design.md, "Distribution").

The search only all-reduces flat tensors and broadcasts small Python objects through a
:class:`Communicator`; ``pipeline`` provides the ``torch.distributed`` one.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch


@runtime_checkable
class Communicator(Protocol):
    """Collective operations the search needs."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks and return the result (same shape and dtype)."""
        ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank."""
        ...


class LocalCommunicator:
    """Single process: reductions are identities."""

    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj
