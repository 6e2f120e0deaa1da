"""The last move of a small-data fit: the settled partition against k-means partitions of
the same size and one cluster fewer, judged by the model's own evidence (docs/design.md,
"Polish").

A coarse partition picks a wide prior under which no cut pays. Once K has settled, the
fit's hard partition and k-means partitions with K and K − 1 clusters (those of the
initialisation, :func:`~deepdpm_core.moves.initial_clusters`) are each scored by ln p(X, z)
with the prior fitted to that partition
(:func:`~deepdpm_core.bayes.partition_evidence.fitted_log_joint`); where a k-means partition
scores :data:`MARGIN_NATS` higher, the mixture becomes its MAP parameters and the net learns
them, as after any small-data search. No EM epoch follows (it drifts back to a wide cluster
beside a narrow one), and K never grows here (on clusters that are not Gaussian the
Gaussian evidence prefers more clusters than there are). The scores come from all-reduced
statistics, so every rank makes the same choice.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from deepdpm_core.bayes import PriorFit, SuffStats, fitted_log_joint
from deepdpm_core.config import Config
from deepdpm_core.moves import initial_clusters
from deepdpm_core.training.fit_context import FitContext
from deepdpm_core.training.search_model import partition_stats

#: k-means partitions tried per size (k-means++ seeds from the fit's generator)
RESTARTS = 2
#: how much higher ln p(X, z) a k-means partition must score to replace the fit's: "positive"
#: evidence (Kass & Raftery 1995, 2 ln B > 2); a tie, the same partition found again, keeps
#: the fit's own parameters rather than those of its hard assignments
MARGIN_NATS = 1.0
#: the prior fitted to a partition is refitted until s and ν0 change by less than this
PRIOR_RTOL = 1e-3


def fitted_prior(ctx: FitContext, config: Config, prior_fit: PriorFit, labels: Tensor, n_groups: int,
                 rtol: float = PRIOR_RTOL) -> tuple[SuffStats, PriorFit, float]:
    """The statistics of the partition ``labels`` (this rank's rows, int64 in [0, n_groups))
    over all ranks, the prior fitted to them (until s and ν0 move by less than ``rtol``)
    and ln p(X, z) under it (collective). The prior's fit starts from the fit's own prior
    ``prior_fit`` (left as it is): fewer rounds to the same fixed point."""
    stats, _ = partition_stats(ctx, labels, n_groups)
    fitted = PriorFit(config.prior, ctx.coords, ctx.device)
    fitted.restore(prior_fit.state_dict())
    log_joint = fitted_log_joint(stats, fitted, config.prior.alpha, rtol=rtol).log_joint
    return stats, fitted, log_joint


def partition_score(ctx: FitContext, config: Config, prior_fit: PriorFit, labels: Tensor, n_groups: int) -> float:
    """ln p(X, z) of the partition ``labels`` with the prior fitted to it (:func:`fitted_prior`)."""
    return fitted_prior(ctx, config, prior_fit, labels, n_groups)[2]


def same_partition(ctx: FitContext, a: tuple[Tensor, int], b: tuple[Tensor, int]) -> bool:
    """Whether two partitions of the rows (labels of this rank's rows and their number of
    groups) group the rows alike, whatever the groups' names (collective): every non-empty
    cell of their contingency table is the only one of its row and of its column."""
    (la, na), (lb, nb) = a, b
    table = ctx.comm.all_reduce(torch.bincount(la * nb + lb, minlength=na * nb).to(torch.float64))
    cells = table.view(na, nb) > 0
    return bool((cells.sum(0) <= 1).all() and (cells.sum(1) <= 1).all())


def polish(ctx: FitContext, config: Config, prior_fit: PriorFit, anchors: Tensor, k: int,
           rng: np.random.Generator) -> Tensor | None:
    """The best-scoring k-means partition of K = ``k`` or K − 1 clusters (this rank's rows'
    labels, int64 (N_local,)) if it scores above the fit's own hard partition ``anchors``
    (each row's best cluster under the settled mixture), else None (collective; the
    k-means seeds come from ``rng``)."""
    best, chosen = partition_score(ctx, config, prior_fit, anchors, k), None
    scored = [(anchors, k)]
    for size in (k - 1, k) if k > 1 else ():
        init = config.init.model_copy(update={"n_clusters": size})
        for _ in range(RESTARTS):
            labels, n_groups = initial_clusters(ctx.x, init, ctx.n_total, ctx.rank_rows, ctx.comm, rng)
            if any(same_partition(ctx, (labels, n_groups), other) for other in scored):
                continue  # k-means found a partition already scored (often the fit's own)
            scored.append((labels, n_groups))
            score = partition_score(ctx, config, prior_fit, labels, n_groups)
            if score > best + (MARGIN_NATS if chosen is None else 0.0):
                best, chosen = score, labels
    return chosen
