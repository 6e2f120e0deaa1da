"""The model a search moves (the mixture, the nets and each row's anchor), how it starts
from a partition, and the E-step targets under it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepdpm_core.bayes import PriorFit, SuffStats, grouped_stats, map_estimate
from deepdpm_core.config import Config
from deepdpm_core.estep import EStep, GaussianMixture, MixtureState, log_weights_from_counts
from deepdpm_core.moves import Nets, initial_clusters, reset_subclusters
from deepdpm_core.nets import ClusterNet, SubclusterNets, new_row_of
from deepdpm_core.training.batching import adam
from deepdpm_core.training.fit_context import FitContext

Tensor = torch.Tensor

#: hidden units of each subclustering net: the paper's 50; a net splits one cluster in two,
#: a smaller task than the clustering net's (whose width is ``model.hidden``)
SUB_HIDDEN = 50


@dataclass(frozen=True)
class SearchModel:
    """The clusters of a search at one moment.

    Attributes
    ----------
    state : MixtureState
        K clusters and their subclusters.
    nets : Nets
        The clustering and subclustering nets and their optimisers.
    anchors : Tensor of shape (N_local,), int64, or None
        Each local row's best cluster (its initial cluster, then the last E-step's best),
        the sparse E-step's anchors; None: not known (a resumed fit).
    cluster_model, sub_model : nn.Module
        The nets as the ranks run them (``FitContext.wrap``).
    mixture : GaussianMixture
        ``state.mixture()``.
    """

    state: MixtureState
    nets: Nets
    anchors: Tensor | None
    cluster_model: nn.Module
    sub_model: nn.Module
    mixture: GaussianMixture


def wrapped(ctx: FitContext, state: MixtureState, nets: Nets, anchors: Tensor | None) -> SearchModel:
    """The model after its nets were built or surgery changed the clusters: the nets
    wrapped (``ctx.wrap``), the mixture refreshed."""
    return SearchModel(state, nets, anchors, ctx.wrap(nets.cluster), ctx.wrap(nets.sub), state.mixture())


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


def build_nets(ctx: FitContext, config: Config, k: int, torch_gen: torch.Generator) -> Nets:
    """Fresh nets for K = ``k`` clusters (from ``torch_gen``) and their optimisers."""
    cluster = ClusterNet(ctx.dim, config.model.hidden, k, torch_gen).to(ctx.device)
    sub = SubclusterNets(ctx.dim, SUB_HIDDEN, k, torch_gen).to(ctx.device)
    return Nets(cluster, sub, adam(cluster.parameters(), ctx.learning_rate(config, config.optim.lr_cluster)),
                adam(sub.parameters(), ctx.learning_rate(config, config.optim.lr_subcluster)))


def start_model(ctx: FitContext, config: Config, prior_fit: PriorFit, rng: np.random.Generator,
                torch_gen: torch.Generator, init_labels: Tensor | None = None) -> SearchModel:
    """k-means clusters (rank 0, on a sample gathered from all ranks; collective), or the
    hard clusters ``init_labels`` (this rank's rows, int64 (N_local,)), with their MAP
    parameters under ``prior_fit`` fitted to them, fresh nets and principal-axis subclusters."""
    z, n_init = initial_clusters(ctx.x, config.init, ctx.n_total, ctx.rank_rows, ctx.comm, rng, init_labels)
    stats, keep = partition_stats(ctx, z, n_init)
    anchors = new_row_of(keep, n_init)[z]
    prior_fit.fit(stats)
    means, covs = map_estimate(prior_fit.prior, stats)
    state = MixtureState.without_subclusters(
        means, covs, log_weights_from_counts(stats.n))
    nets = build_nets(ctx, config, state.n_clusters, torch_gen)
    reset_subclusters(state, nets, torch.arange(state.n_clusters, device=ctx.device), torch_gen)
    return wrapped(ctx, state, nets, anchors)


def estep_targets(estep: EStep, mixture: GaussianMixture, x: Tensor, anchors: Tensor | None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """:meth:`~deepdpm_core.estep.EStep.targets` of rows ``x`` (N_local, D) under ``mixture``:
    candidates and r^E, (N_local, m) each, and each row's best cluster, the new anchors."""
    k = mixture.n_components
    # with every cluster allowed (m = K) the search starts from the mixture alone, so the
    # targets are a function of the checkpointed state and a resumed fit repeats them
    return estep.targets(mixture, x, anchors if estep.support(k) < k else None)
