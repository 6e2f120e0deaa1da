"""Growth: a small-data search that settled far below the model's answer starts again from
a k-means partition of several times as many clusters (docs/design.md, "Growth").

When each initial cluster holds several true clusters of few points in many dimensions,
the prior fitted to these wide, odd-shaped clusters keeps ν0 at its weakest (D + 2), no cut
pays, and the fit settles far too low. Once K has settled, k-means partitions of 2K, 4K and
8K clusters (at most N/10; doubled on past 8K while the score still rises) are each scored
by the coarsened joint the moves climb: ln p(X, z) with the likelihood raised to
ζ = c/(c + N) (:func:`~deepdpm_core.moves.coarsened`, c of the fit's moves) and the prior
fitted to the partition. The best one that scores ``small_data.growth_gain`` (1) nats a row
above the settled partition (3–17 where growth was needed; elsewhere negative, or 0.03)
becomes the mixture, and the search starts again from it, at most :data:`MAX_GROWTHS`
times a fit and only while ν0 is within :data:`WEAK_NU` times its weakest. The coarsening
keeps clusters that are merely not Gaussian whole. The k-means partitions are those of the
initialisation and the scores come from all-reduced statistics, so every rank makes the
same choice.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deepdpm_core.bayes import log_crp, log_marginal_likelihood
from deepdpm_core.moves import coarsening_constant, initial_clusters
from deepdpm_core.training.polish import fitted_prior

if TYPE_CHECKING:
    from deepdpm_core.training.trainer import Trainer

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


def coarsened_score(trainer: Trainer, labels: Tensor, n_groups: int) -> float:
    """ln p(X, z) of the partition ``labels`` (this rank's rows, int64 in [0, n_groups))
    with every group's statistics (and the labels' counts) scaled by ζ = c/(c + N), and the
    prior fitted to the unscaled statistics (collective)."""
    stats, prior_fit, _ = fitted_prior(trainer, labels, n_groups, PRIOR_RTOL)
    p, prior = trainer.config.prior, prior_fit.prior
    c = coarsening_constant(p.coarsening, p.coarsening_per_parameter, prior.dim, prior.diagonal)
    if c is not None:
        stats = stats.scaled(torch.full_like(stats.n, c / (c + trainer.n_total)))
    return log_crp(stats.n.cpu().numpy(), p.alpha) + float(log_marginal_likelihood(prior, stats).sum())


def grow(trainer: Trainer) -> bool:
    """Restart ``trainer``'s mixture from the best-scoring k-means partition of 2K, 4K or
    8K clusters if it scores above the settled partition, its anchors (each row's best
    cluster under the settled mixture), at most :data:`MAX_GROWTHS` times a fit
    (collective; the caller restarts the schedule); returns whether it did."""
    k = trainer.n_clusters
    gain, prior = trainer.config.small_data.growth_gain, trainer.prior_fit.prior
    weakest = 3.0 if prior.diagonal else prior.dim + 2.0
    if gain is None or trainer.schedule.growths >= MAX_GROWTHS:
        return False
    if prior.nu > WEAK_NU * weakest:
        return False  # the clusters agree on one shape: none of them holds several
    best, chosen = coarsened_score(trainer, trainer.anchors, k) + gain * trainer.n_total, None
    size, last = k, -math.inf
    while size * 2 <= trainer.n_total // MIN_ROWS_PER_CLUSTER:
        size *= 2
        init = trainer.config.init.model_copy(update={"n_clusters": size})
        labels, n_groups = initial_clusters(trainer.x, init, trainer.n_total, trainer.rank_rows,
                                            trainer.comm, trainer.rng)
        score = coarsened_score(trainer, labels, n_groups)
        if score > best:
            best, chosen = score, labels
        if size >= GROWTH_FACTORS_TRIED * k and score <= last:
            break  # past the sizes always tried, and no longer rising
        last = score
    if chosen is None:
        return False
    trainer.initialize(chosen)
    return True
