"""Growth: a small-data search that settled far below the model's answer starts again from
a k-means partition of several times as many clusters (docs/design.md, "Growth").

When each initial cluster holds several true clusters of few points in many dimensions,
the prior fitted to these wide, odd-shaped clusters keeps ν0 at its weakest (D + 2), no cut
pays, and the fit settles far too low. Once K has settled, k-means partitions of 2K, 4K and
8K clusters (at most N/10; doubled on past 8K while the score still rises) are each scored
by the coarsened joint the moves climb: ln p(X, z) with the likelihood raised to
ζ = c/(c + N) (:func:`~deepdpm_core.moves.proposals.coarsened`, c of the fit's moves) and the prior
fitted to the partition. The best one that scores ``small_data.growth_gain`` (1) nats a row
above the settled partition (3–17 where growth was needed; elsewhere negative, or 0.03)
becomes the mixture, and the search starts again from it, at most :data:`MAX_GROWTHS`
times a fit and only while ν0 is within :data:`WEAK_NU` times its weakest. The coarsening
keeps clusters that are merely not Gaussian whole. The k-means partitions are those of the
initialisation and the scores come from all-reduced statistics, so every rank makes the
same choice.

A search that collapsed to one cluster is judged by the exact joint instead
(:func:`~deepdpm_core.training.polish.partition_score`, with :data:`COLLAPSED_GAIN` nats a
row), whatever ν0: the prior fitted to one cluster is that cluster's own shape, known
exactly (ν0 at its ceiling), so no cut pays and the coarsened joint prefers the one cluster
to any partition; 100 grid blobs merge down to it from 10 or 20 clusters.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from deepdpm_core.bayes import PriorFit, log_crp, log_marginal_likelihood
from deepdpm_core.config import Config
from deepdpm_core.moves import coarsening_constant, initial_clusters
from deepdpm_core.training.fit_context import FitContext
from deepdpm_core.training.polish import fitted_prior, partition_score

#: the partition sizes tried: 2K, 4K, ... up to this multiple of the settled K (one k-means
#: run each), then doubled on while the score still rises
GROWTH_FACTORS_TRIED = 8
#: how many times a fit may start again from a grown partition
MAX_GROWTHS = 2
#: the prior fitted to a partition is refitted until s and ν0 change by less than this: the
#: sizes tried differ by thousands of nats where growth matters
PRIOR_RTOL = 1e-2
#: growth is tried only while the fitted ν0 is within this factor of the weakest (D + 2; 3
#: when diagonal): 1.0–1.5 times it where growth was needed, 300 times and more for
#: clusters of one common shape (blobs in 16–512-D, the sphere family), where scoring 2K–8K
#: clusters would cost 10 s in 512-D
WEAK_NU = 10.0
#: a partition tried has at least this many rows a cluster on average
MIN_ROWS_PER_CLUSTER = 10
#: the gain in nats a row of the exact joint that grows a search that collapsed to one
#: cluster: 128 k-means clusters of 100 grid blobs gain 0.27; two overlapping Gaussians
#: settled at one cluster, and breast cancer's, gain nothing
COLLAPSED_GAIN = 0.05
#: after a collapse, doubling stops past 8 clusters once this many sizes in a row score no
#: higher than the one before: the grid's 2 to 8 wide pieces dip and score below the one
#: cluster, 16 to 128 climb far above it
COLLAPSED_FALLS = 2


def coarsened_score(ctx: FitContext, config: Config, prior_fit: PriorFit, labels: Tensor, n_groups: int
                    ) -> float:
    """ln p(X, z) of the partition ``labels`` (this rank's rows, int64 in [0, n_groups))
    with every group's statistics (and the labels' counts) scaled by ζ = c/(c + N), and the
    prior fitted to the unscaled statistics, starting from ``prior_fit`` (collective)."""
    stats, fitted, _ = fitted_prior(ctx, config, prior_fit, labels, n_groups, PRIOR_RTOL)
    p, prior = config.prior, fitted.prior
    c = coarsening_constant(p.coarsening, p.coarsening_per_parameter, prior.dim, prior.diagonal)
    if c is not None:
        stats = stats.scaled(torch.full_like(stats.n, c / (c + ctx.n_total)))
    return log_crp(stats.n.cpu().numpy(), p.alpha) + float(log_marginal_likelihood(prior, stats).sum())


def grow(ctx: FitContext, config: Config, prior_fit: PriorFit, anchors: Tensor, k: int, growths: int,
         rng: np.random.Generator) -> Tensor | None:
    """The best-scoring k-means partition of 2K, 4K, 8K, ... clusters (K = ``k``; this
    rank's rows' labels, int64 (N_local,)) if it scores enough above the settled partition
    ``anchors`` (each row's best cluster under the settled mixture), else None; None too
    once the fit has grown ``growths`` = :data:`MAX_GROWTHS` times (collective; the k-means
    seeds come from ``rng``). Scored by the coarsened joint, or by the exact one after a
    search that collapsed to one cluster (module docstring)."""
    gain, prior = config.small_data.growth_gain, prior_fit.prior
    weakest = 3.0 if prior.diagonal else prior.dim + 2.0
    if gain is None or growths >= MAX_GROWTHS:
        return None
    if k == 1:  # the prior fitted to one cluster is its shape: the coarsened joint keeps it
        score_of, gain, falls_to_stop = partition_score, COLLAPSED_GAIN, COLLAPSED_FALLS
    elif prior.nu > WEAK_NU * weakest:
        return None  # the clusters agree on one shape: none of them holds several
    else:
        score_of, falls_to_stop = coarsened_score, 1
    best, chosen = score_of(ctx, config, prior_fit, anchors, k) + gain * ctx.n_total, None
    size, last, falls = k, -math.inf, 0
    while size * 2 <= ctx.n_total // MIN_ROWS_PER_CLUSTER:
        size *= 2
        init = config.init.model_copy(update={"n_clusters": size})
        labels, n_groups = initial_clusters(ctx.x, init, ctx.n_total, ctx.rank_rows, ctx.comm, rng)
        score = score_of(ctx, config, prior_fit, labels, n_groups)
        if score > best:
            best, chosen = score, labels
        falls = falls + 1 if score <= last else 0
        if size >= GROWTH_FACTORS_TRIED * k and falls >= falls_to_stop:
            break  # past the sizes always tried, and no longer rising
        last = score
    return chosen
