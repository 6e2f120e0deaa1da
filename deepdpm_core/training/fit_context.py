"""What a fit on this rank holds fixed from its first epoch to its last: its rows in the
fit's coordinates (:mod:`deepdpm_core.data.coordinates`: centred, so the prior mean is 0 and
uncentred float64 sums stay accurate, and scaled to unit mean variance, so nothing depends on
the units), every rank's row count, the communicator, device, precision, batch size and the
wrapper of the nets (e.g. DDP)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deepdpm_core.config import Config
from deepdpm_core.data import FeatureCoordinates, fit_coordinates
from deepdpm_core.runtime import Communicator, resolve_device, resolve_precision
from deepdpm_core.training.batching import auto_batch_size, epoch_steps, scaled_lr

Tensor = torch.Tensor


@dataclass(frozen=True)
class FitContext:
    """A fit's fixed context on this rank.

    Attributes
    ----------
    x : Tensor of shape (N_local, D')
        This rank's rows in the fit's coordinates, float32, on ``device``.
    coords : FeatureCoordinates
        The fit's coordinates (D' = ``coords.dim`` of the D features).
    n_total : int
        Rows over all ranks.
    rank_rows : list of int
        Rows held by each rank, in rank order.
    comm : Communicator
    device : torch.device
    precision : str
        The nets' precision (:func:`~deepdpm_core.runtime.resolve_precision`).
    batch_size : int
        Rows of one minibatch on this rank.
    wrap : callable
        Applied to each net after it is built or reshaped.
    """

    x: Tensor
    coords: FeatureCoordinates
    n_total: int
    rank_rows: list[int]
    comm: Communicator
    device: torch.device
    precision: str
    batch_size: int
    wrap: Callable[[nn.Module], nn.Module]

    @property
    def dim(self) -> int:
        """The coordinates of x̃: D, fewer where features are left out (``coords.dim``)."""
        return self.coords.dim

    def learning_rate(self, config: Config, base: float) -> float:
        """Learning rate at the global batch W·B (``optim.batch_size`` is per rank)."""
        return scaled_lr(base, self.batch_size * self.comm.world_size, config.optim.lr_scaling)

    def n_steps(self, config: Config) -> tuple[int, int]:
        """:func:`~deepdpm_core.training.batching.epoch_steps` of this fit (collective)."""
        return epoch_steps(self.x.shape[0], self.batch_size, config.optim.min_steps_per_epoch, self.comm,
                           self.device)


def fit_context(config: Config, x: Tensor, comm: Communicator,
                wrap: Callable[[nn.Module], nn.Module]) -> FitContext:
    """The fit's coordinates and this rank's rows ``x`` (N_local, D) in them, converted by
    chunks (a float64 copy of all rows would double their memory; collective)."""
    device = resolve_device(config.device)
    coords, n_total, rank_rows = fit_coordinates(x, config.data, comm, device)
    n_local, chunk = x.shape[0], 1 << 16
    x_fit = torch.empty(n_local, coords.dim, dtype=torch.float32, device=device)
    for s in range(0, n_local, chunk):  # x̃ in float64, then stored as float32
        x_fit[s : s + chunk] = coords.apply(x[s : s + chunk]).to(device)
    # per rank; "auto" aims at STEPS_PER_EPOCH steps over this rank's share of the rows,
    # so W ranks step as often as one process would, on a W times larger global batch
    batch = config.optim.batch_size
    share = -(-n_total // comm.world_size)
    batch_size = auto_batch_size(share) if batch == "auto" else int(batch)
    return FitContext(x_fit, coords, n_total, rank_rows, comm, device,
                      resolve_precision(config.model.precision, device), batch_size, wrap)
