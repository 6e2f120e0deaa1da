"""The model's own score of a hard partition: ln p(X, z) under the DP–NIW mixture.

For groups of sizes n_k, with the prior fitted to them as a fit fits it
(:class:`~deepdpm_core.bayes.prior_fit.PriorFit`) and f the NIW marginal likelihood::

    ln p(X, z) = ln p(z | α) + Σ_k ln f(X_k)
    ln p(z | α) = K ln α + ln Γ(α) − ln Γ(α + N) + Σ_k ln Γ(n_k)     (Chinese restaurant)

The Hastings ratios compare it one move at a time (paper Eq. 2). A fit's partition that
scores below the true classes means the search stopped short; one that scores above them,
that the model prefers it (the classes are not Gaussian clusters). Rows are scored in the
fit's coordinates, so partitions compare whatever the features' units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from deepdpm_core.bayes.niw import log_marginal_likelihood
from deepdpm_core.bayes.prior_fit import PriorFit
from deepdpm_core.bayes.stats import SuffStats, grouped_stats
from deepdpm_core.config import Config
from deepdpm_core.data import check_features, fit_coordinates
from deepdpm_core.errors import DataError
from deepdpm_core.runtime import LocalCommunicator

#: most rounds of refitting the prior to the same groups (each round refits s, then ν0)
MAX_PRIOR_ROUNDS = 50


@dataclass(frozen=True)
class PartitionEvidence:
    """ln p(X, z) of one partition and its parts.

    Attributes
    ----------
    log_joint : float
        ln p(z | α) + Σ_k ln f(X_k), in the fit's coordinates.
    log_partition : float
        ln p(z | α), the Chinese-restaurant term.
    log_marginals : ndarray of shape (K,)
        ln f(X_k) per group, in the order of the sorted distinct labels.
    sigma_scale : float
        s of the prior fitted to the groups (in the features' units squared).
    nu : float
        ν0 of that prior.
    """

    log_joint: float
    log_partition: float
    log_marginals: np.ndarray
    sigma_scale: float
    nu: float


def log_crp(counts: np.ndarray, alpha: float) -> float:
    """ln p(z | α) of a partition with group sizes ``counts`` (K,) under the Chinese
    restaurant process: K ln α + ln Γ(α) − ln Γ(α + N) + Σ_k ln Γ(n_k)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = float(counts.sum())
    return (len(counts) * math.log(alpha) + math.lgamma(alpha) - math.lgamma(alpha + n)
            + sum(math.lgamma(c) for c in counts))


def partition_evidence(X: np.ndarray, labels: np.ndarray, config: Config | None = None) -> PartitionEvidence:
    """Score a hard partition of ``X`` by the DP–NIW joint ln p(X, z) (module docstring).

    Parameters
    ----------
    X : array of shape (N, D)
        The rows, in the features' units.
    labels : array of shape (N,)
        Any hashable group labels, e.g. a fit's ``predict(X)`` or the true classes.
    config : Config, optional
        Its ``prior`` and ``data.transform`` are used (default: the defaults).

    Returns
    -------
    PartitionEvidence

    Raises
    ------
    DataError
        ``X`` is not a finite (N, D) array (:func:`~deepdpm_core.data.validation.check_features`),
        or ``labels`` is not one label per row.
    """
    config = config or Config()
    check_features(X)  # the fit's checks; the score itself is taken in float64
    x = torch.as_tensor(np.asarray(X), dtype=torch.float64)
    labels = np.asarray(labels)
    if labels.shape != (x.shape[0],):
        raise DataError(f"labels has shape {labels.shape}; expected one per row of X, ({x.shape[0]},)")
    _, group = np.unique(labels, return_inverse=True)
    return weighted_evidence(x, np.arange(len(group)), group, np.ones(len(group)), config)


def weighted_evidence(x: torch.Tensor, points: np.ndarray, groups: np.ndarray, weights: np.ndarray,
                      config: Config) -> PartitionEvidence:
    """ln p(X, z) of groups given as (point, group, weight) triples (every group holding some
    weight): hard labels are weights of 1, responsibilities their own weights. The rows
    ``x`` (N, D), float64, are scored in the fit's coordinates under ``config``'s prior, fitted
    to the groups' statistics."""
    cpu = torch.device("cpu")
    coords, _, _ = fit_coordinates(x, config.data, LocalCommunicator(), cpu)
    stats = grouped_stats(coords.apply(x), torch.as_tensor(points, dtype=torch.long),
                          torch.as_tensor(groups, dtype=torch.long),
                          torch.as_tensor(weights, dtype=torch.float64), int(groups.max()) + 1)
    return fitted_log_joint(stats, PriorFit(config.prior, coords, cpu), config.prior.alpha)


def fitted_log_joint(stats: SuffStats, prior_fit: PriorFit, alpha: float,
                     rtol: float = 1e-10) -> PartitionEvidence:
    """ln p(X, z) of the groups whose statistics are ``stats`` (K groups, none empty), with
    ``prior_fit`` fitted to them (it is refitted in place until s and ν0 change by less
    than ``rtol``, relative)."""
    for _ in range(MAX_PRIOR_ROUNDS):  # the fitted s and ν0 depend on each other: a fixed point
        before = (prior_fit.sigma_scale, prior_fit.prior.nu)
        prior_fit.fit(stats)
        if math.isclose(before[0], prior_fit.sigma_scale, rel_tol=rtol) and \
                math.isclose(before[1], prior_fit.prior.nu, rel_tol=rtol):
            break
    marginals = log_marginal_likelihood(prior_fit.prior, stats).cpu().numpy()
    partition = log_crp(stats.n.cpu().numpy(), alpha)
    return PartitionEvidence(partition + float(marginals.sum()), partition, marginals,
                             prior_fit.sigma_scale, float(prior_fit.prior.nu))
