"""What a fit on this rank holds fixed from its first epoch to its last: its rows in the
fit's coordinates (:mod:`deepdpm_core.data.coordinates`: centred, so the prior mean is 0 and
uncentred float64 sums stay accurate, and scaled to unit mean variance, so nothing depends on
the units), every rank's row count, the communicator, device, precision, batch size and the
wrapper of the nets (e.g. DDP); how a model starts from a partition of those rows, and the
resume format of the model."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from deepdpm_core.bayes import PriorFit, SuffStats, grouped_stats, map_estimate
from deepdpm_core.config import Config
from deepdpm_core.data import FeatureCoordinates, fit_coordinates
from deepdpm_core.errors import CheckpointError
from deepdpm_core.estep import MixtureState, log_weights_from_counts
from deepdpm_core.moves import Nets, initial_cluster_count, initial_clusters, reset_subclusters
from deepdpm_core.nets import ClusterNet, SubclusterNets, new_row_of, widen_hidden
from deepdpm_core.runtime import Communicator, resolve_device, resolve_precision
from deepdpm_core.training.batching import adam, auto_batch_size, epoch_steps, scaled_lr

Tensor = torch.Tensor

#: hidden units of each subclustering net: the paper's 50; a net splits one cluster in two,
#: a smaller task than the clustering net's (whose width is ``model.hidden``)
SUB_HIDDEN = 50


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


def partition_stats(ctx: FitContext, labels: Tensor, n_groups: int) -> tuple[SuffStats, Tensor]:
    """The statistics of the hard partition ``labels`` (this rank's rows, int64 in
    [0, ``n_groups``)) over all ranks (collective), and which groups they are: the
    non-empty ones, shape (K',), in order."""
    # float64 GEMMs: the statistics are the same to round-off on any number of ranks
    local = grouped_stats(ctx.x, torch.arange(labels.shape[0], device=ctx.device), labels,
                          torch.ones_like(labels, dtype=torch.float64), n_groups, dtype=torch.float64)
    stats = SuffStats.from_flat(ctx.comm.all_reduce(local.flat()), n_groups, ctx.dim)
    keep = torch.nonzero(stats.n > 0).squeeze(1)
    return stats.rows(keep), keep


def build_nets(ctx: FitContext, config: Config, k: int, torch_gen: torch.Generator, subnets: bool) -> Nets:
    """Fresh nets for K = ``k`` clusters (from ``torch_gen``) and their optimisers; the
    subclustering nets only if ``subnets``."""
    cluster = ClusterNet(ctx.dim, config.model.hidden, k, torch_gen).to(ctx.device)
    opt_cluster = adam(cluster.parameters(), ctx.learning_rate(config, config.optim.lr_cluster))
    if not subnets:
        return Nets(cluster, None, opt_cluster, None)
    sub = SubclusterNets(ctx.dim, SUB_HIDDEN, k, torch_gen).to(ctx.device)
    return Nets(cluster, sub, opt_cluster, adam(sub.parameters(), ctx.learning_rate(config, config.optim.lr_subcluster)))


def start_model(ctx: FitContext, config: Config, prior_fit: PriorFit, rng: np.random.Generator,
                torch_gen: torch.Generator, subnets: bool, init_labels: Tensor | None = None
                ) -> tuple[MixtureState, Nets, Tensor]:
    """k-means clusters (rank 0, on a sample gathered from all ranks; collective), or the
    hard clusters ``init_labels`` (this rank's rows, int64 (N_local,)), with their MAP
    parameters under ``prior_fit`` fitted to them (``prior_fit`` refitted), fresh nets (the
    subclustering nets only if ``subnets``) and principal-axis subclusters; and each row's
    cluster, the anchors."""
    k = initial_cluster_count(config.init.n_clusters, ctx.n_total, config.small_data.max_rows)
    init = config.init.model_copy(update={"n_clusters": k})
    z, n_init = initial_clusters(ctx.x, init, ctx.n_total, ctx.rank_rows, ctx.comm, rng, init_labels)
    stats, keep = partition_stats(ctx, z, n_init)
    anchors = new_row_of(keep, n_init)[z]
    prior_fit.fit(stats)
    means, covs = map_estimate(prior_fit.prior, stats)
    state = MixtureState.without_subclusters(
        means, covs, log_weights_from_counts(stats.n))
    nets = build_nets(ctx, config, state.n_clusters, torch_gen, subnets)
    reset_subclusters(state, nets, torch.arange(state.n_clusters, device=ctx.device), torch_gen)
    return state, nets, anchors


def model_state(state: MixtureState, nets: Nets, rng: np.random.Generator, torch_gen: torch.Generator
                ) -> dict[str, Any]:
    """The mixture, the nets with their Adam moments, and the generators, as a resume
    state's entries (tensors on the CPU and plain containers; ``sub_nets`` and ``opt_sub``
    only where the search has subclustering nets)."""
    subnets = {} if nets.sub is None else {"sub_nets": {k: v.cpu() for k, v in nets.sub.state_dict().items()},
                                           "opt_sub": nets.opt_sub.state_dict()}
    return {
        **state.state_dict(),
        "cluster_net": {k: v.cpu() for k, v in nets.cluster.state_dict().items()},
        "opt_cluster": nets.opt_cluster.state_dict(),
        **subnets,
        "rng": rng.bit_generator.state,
        "torch_gen": torch_gen.get_state(),
    }


def check_same_data(ctx: FitContext, state: dict[str, Any]) -> None:
    """Raise CheckpointError unless this fit's rows are those ``state`` was trained on:
    the same N over all ranks and, to round-off, the same mean."""
    stored_center = FeatureCoordinates.from_state(state["coordinates"]).center
    if ctx.n_total != int(state["n_total"]) or not torch.allclose(
            ctx.coords.center, stored_center, rtol=0, atol=1e-5 * ctx.coords.unit):
        raise CheckpointError(
            f"the data differ from the checkpoint's: {ctx.n_total} rows here, "
            f"{int(state['n_total'])} when it was written (or another mean)")


def restore_model(ctx: FitContext, config: Config, state: dict[str, Any], rng: np.random.Generator,
                  torch_gen: torch.Generator, subnets: bool) -> tuple[MixtureState, Nets]:
    """The mixture and the nets of :func:`model_state` output, with their Adam moments,
    on ``ctx``'s device (the learning rate follows this run's global batch); the
    subclustering nets only if ``subnets`` (a state that holds them where the search has
    none, as exact EM wrote them once, loads without them); the generators ``rng`` and
    ``torch_gen`` take their stored states."""
    mixture = MixtureState.from_state(state, ctx.device)
    nets = build_nets(ctx, config, mixture.n_clusters, torch_gen, subnets)
    # a net widened for its distillation (exact EM's settling) loads at its own width
    widen_hidden(nets.cluster, state["cluster_net"]["hidden.weight"].shape[0], nets.opt_cluster, torch_gen)
    nets.cluster.load_state_dict(state["cluster_net"])
    optim = config.optim
    optimizers = [(nets.opt_cluster, "opt_cluster", optim.lr_cluster)]
    if subnets:
        nets.sub.load_state_dict(state["sub_nets"])
        optimizers.append((nets.opt_sub, "opt_sub", optim.lr_subcluster))
    for opt, key, base in optimizers:
        # a copy: Adam keeps the given moment/step tensors and updates them in place
        opt.load_state_dict(copy.deepcopy(state[key]))
        for group in opt.param_groups:
            group["lr"] = ctx.learning_rate(config, base)
    rng.bit_generator.state = state["rng"]
    torch_gen.set_state(state["torch_gen"])
    return mixture, nets
