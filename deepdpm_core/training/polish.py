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

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepdpm_core.bayes import PriorFit, SuffStats, fitted_log_joint
from deepdpm_core.moves import initial_clusters

if TYPE_CHECKING:
    from deepdpm_core.training.trainer import Trainer

#: k-means partitions tried per size (k-means++ seeds from the fit's generator)
RESTARTS = 2
#: how much higher ln p(X, z) a k-means partition must score to replace the fit's: "positive"
#: evidence (Kass & Raftery 1995, 2 ln B > 2); a tie, the same partition found again, keeps
#: the fit's own parameters rather than those of its hard assignments
MARGIN_NATS = 1.0
#: the prior fitted to a partition is refitted until s and ν0 change by less than this
PRIOR_RTOL = 1e-3


def fitted_prior(trainer: Trainer, labels: Tensor, n_groups: int, rtol: float = PRIOR_RTOL
                 ) -> tuple[SuffStats, PriorFit, float]:
    """The statistics of the partition ``labels`` (this rank's rows, int64 in [0, n_groups))
    over all ranks, the prior fitted to them (until s and ν0 move by less than ``rtol``)
    and ln p(X, z) under it (collective). The prior's fit starts from the fit's own prior:
    fewer rounds to the same fixed point."""
    stats, _ = trainer.partition_stats(labels, n_groups)
    prior_fit = PriorFit(trainer.config.prior, trainer.coords, trainer.device)
    prior_fit.restore(trainer.prior_fit.state_dict())
    log_joint = fitted_log_joint(stats, prior_fit, trainer.config.prior.alpha, rtol=rtol).log_joint
    return stats, prior_fit, log_joint


def partition_score(trainer: Trainer, labels: Tensor, n_groups: int) -> float:
    """ln p(X, z) of the partition ``labels`` with the prior fitted to it (:func:`fitted_prior`)."""
    return fitted_prior(trainer, labels, n_groups)[2]


def same_partition(trainer: Trainer, a: tuple[Tensor, int], b: tuple[Tensor, int]) -> bool:
    """Whether two partitions of the rows (labels of this rank's rows and their number of
    groups) group the rows alike, whatever the groups' names (collective): every non-empty
    cell of their contingency table is the only one of its row and of its column."""
    (la, na), (lb, nb) = a, b
    table = trainer.comm.all_reduce(torch.bincount(la * nb + lb, minlength=na * nb).to(torch.float64))
    cells = table.view(na, nb) > 0
    return bool((cells.sum(0) <= 1).all() and (cells.sum(1) <= 1).all())


def polish(trainer: Trainer) -> bool:
    """Restart ``trainer`` from the best-scoring k-means partition of K or K − 1 clusters
    if it scores above the fit's own hard partition (collective); returns whether it did.
    Either way the anchors end as each row's best cluster under the mixture."""
    k = trainer.n_clusters
    trainer.estep_targets()  # the anchors: each row's best cluster under the final mixture
    best, chosen = partition_score(trainer, trainer.anchors, k), None
    scored = [(trainer.anchors, k)]
    for size in (k - 1, k) if k > 1 else ():
        init = trainer.config.init.model_copy(update={"n_clusters": size})
        for _ in range(RESTARTS):
            labels, n_groups = initial_clusters(trainer.x, init, trainer.n_total, trainer.rank_rows,
                                                trainer.comm, trainer.rng)
            if any(same_partition(trainer, (labels, n_groups), other) for other in scored):
                continue  # k-means found a partition already scored (often the fit's own)
            scored.append((labels, n_groups))
            score = partition_score(trainer, labels, n_groups)
            if score > best + (MARGIN_NATS if chosen is None else 0.0):
                best, chosen = score, labels
    if chosen is None:
        return False
    trainer.initialize(chosen)
    trainer.estep_targets()
    return True
