"""The per-cluster state of a fit: the mixture (paper Eq. 5) and each cluster's two
subclusters (paper §3.2), six tensors with a leading cluster axis. Every change of K
(surgery, pruning) or of device, and every checkpoint, goes through this object, so the
six are listed here and nowhere else.

The subclusters' covariances are read only by split rounds (the split axes), accepted
splits and checkpoints, so the M-step leaves them as their statistics and the prior
(:class:`SubclusterMAP`), and they are computed, to the same bits, where they are read: at
K = 1,000 in 128-D their 2K MAP matrices take about 0.15 s of one CPU thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepdpm_core.bayes import NIWPrior, SuffStats, map_estimate
from deepdpm_core.estep.gmm import GaussianMixture

Tensor = torch.Tensor

#: the six tensors, in the order of the constructor's arguments
FIELDS = ("means", "covariances", "log_weights", "sub_means", "sub_covariances", "sub_log_weights")


@dataclass(frozen=True, eq=False)
class SubclusterMAP:
    """Subcluster covariances not computed yet: the MAP covariances of subcluster
    statistics under a prior (:func:`~deepdpm_core.bayes.map_estimate`).

    Attributes
    ----------
    prior : NIWPrior
    stats : SuffStats with 2K' rows
        Subcluster j of statistics' cluster c at row 2c + j.
    source : Tensor of shape (K,), int64, or None
        The statistics' cluster of each of the state's K clusters; None: cluster k is c = k.
    given : dict of int to Tensor of shape (2, D, D)
        Clusters whose pair is set outright (restarted or merged subclusters) instead.
    """

    prior: NIWPrior
    stats: SuffStats
    source: Tensor | None = None
    given: dict[int, Tensor] | None = None

    @property
    def n_clusters(self) -> int:
        return self.stats.n_rows // 2 if self.source is None else int(self.source.shape[0])

    def rows(self, ks: Tensor | None = None) -> Tensor:
        """The covariances of clusters ``ks`` ((n,) int64; None: all), (n, 2, D, D) float64."""
        d = self.stats.dim
        if ks is None and self.source is None:  # every cluster, from the statistics as they are
            covs = map_estimate(self.prior, self.stats)[1]
        else:
            dev = self.stats.n.device
            src = self.source if ks is None else ks.to(dev) if self.source is None else self.source[ks.to(dev)]
            covs = map_estimate(self.prior, self.stats.rows(torch.stack([2 * src, 2 * src + 1], 1).view(-1)))[1]
        covs = covs.view(-1, 2, d, d)
        if self.given:
            wanted = range(self.n_clusters) if ks is None else ks.tolist()
            for i, k in enumerate(wanted):
                if k in self.given:
                    covs[i] = self.given[k]
        return covs

    def picked(self, src: Tensor) -> SubclusterMAP:
        """The covariances of the state whose cluster k is this one's cluster ``src[k]``."""
        picks = src.tolist()
        given = {row: self.given[k] for row, k in enumerate(picks) if k in self.given} if self.given else None
        return SubclusterMAP(self.prior, self.stats, src.to(self.stats.n.device) if self.source is None
                             else self.source[src.to(self.source.device)], given)

    def with_rows(self, ks: Tensor, covs: Tensor) -> SubclusterMAP:
        """These covariances with those of clusters ``ks`` ((n,) int64) set to ``covs`` (n, 2, D, D)."""
        given = dict(self.given or {})
        given.update({k: c.clone() for k, c in zip(ks.tolist(), covs, strict=True)})
        return SubclusterMAP(self.prior, self.stats, self.source, given)


class MixtureState:
    """Cluster and subcluster parameters in the fit's coordinates, all float64.

    Attributes
    ----------
    means : Tensor of shape (K, D)
    covariances : Tensor of shape (K, D, D)
    log_weights : Tensor of shape (K,)
        Normalised: logsumexp is 0.
    sub_means : Tensor of shape (K, 2, D)
    sub_covariances : Tensor of shape (K, 2, D, D)
        Computed on first read when the state was given a :class:`SubclusterMAP`;
        :meth:`sub_covariance_rows` computes only the clusters asked for.
    sub_log_weights : Tensor of shape (K, 2)
        Each cluster's pair normalised on its own.
    """

    def __init__(self, means: Tensor, covariances: Tensor, log_weights: Tensor, sub_means: Tensor,
                 sub_covariances: Tensor | SubclusterMAP, sub_log_weights: Tensor) -> None:
        self.means, self.covariances, self.log_weights = means, covariances, log_weights
        self.sub_means, self.sub_log_weights = sub_means, sub_log_weights
        self._sub_covariances = sub_covariances

    @classmethod
    def without_subclusters(cls, means: Tensor, covariances: Tensor, log_weights: Tensor) -> MixtureState:
        """A state whose subclusters are still to be drawn (zeros, equal weights)."""
        k, d = means.shape
        f64 = {"dtype": torch.float64, "device": means.device}
        return cls(means, covariances, log_weights, torch.zeros(k, 2, d, **f64),
                   torch.zeros(k, 2, d, d, **f64), torch.full((k, 2), -math.log(2), **f64))

    @property
    def sub_covariances(self) -> Tensor:
        """(K, 2, D, D): computed here, once, when the state holds a :class:`SubclusterMAP`."""
        if isinstance(self._sub_covariances, SubclusterMAP):
            self._sub_covariances = self._sub_covariances.rows()
        return self._sub_covariances

    @sub_covariances.setter
    def sub_covariances(self, value: Tensor | SubclusterMAP) -> None:
        self._sub_covariances = value

    def sub_covariance_rows(self, ks: Tensor) -> Tensor:
        """The subcluster covariances of clusters ``ks`` ((n,) int64), (n, 2, D, D), without
        computing the others'."""
        lazy = self._sub_covariances
        return lazy.rows(ks) if isinstance(lazy, SubclusterMAP) else lazy[ks]

    def set_sub_covariances(self, ks: Tensor, covs: Tensor) -> None:
        """Set the subcluster covariances of clusters ``ks`` ((n,) int64) to ``covs`` (n, 2, D, D)."""
        lazy = self._sub_covariances
        if isinstance(lazy, SubclusterMAP):
            self._sub_covariances = lazy.with_rows(ks, covs)
        else:
            lazy[ks] = covs

    @property
    def n_clusters(self) -> int:
        """K."""
        return int(self.means.shape[0])

    @property
    def dim(self) -> int:
        """D."""
        return int(self.means.shape[1])

    def tensors(self) -> list[Tensor]:
        """The six tensors, in the order of :data:`FIELDS`."""
        return [getattr(self, name) for name in FIELDS]

    def rows(self, src: Tensor) -> MixtureState:
        """A new state whose cluster k is this state's cluster ``src[k]`` (copies).

        Parameters
        ----------
        src : Tensor of shape (K_new,), int64
            Source cluster of every new cluster (repeats allowed).
        """
        lazy = self._sub_covariances
        sub_covs = lazy.picked(src) if isinstance(lazy, SubclusterMAP) else lazy[src].clone()
        return MixtureState(self.means[src].clone(), self.covariances[src].clone(), self.log_weights[src].clone(),
                            self.sub_means[src].clone(), sub_covs, self.sub_log_weights[src].clone())

    def to(self, device: torch.device | str) -> MixtureState:
        """The state on ``device``."""
        return MixtureState(*(t.to(device) for t in self.tensors()))

    def mixture(self, recycled: GaussianMixture | None = None,
                fill: Callable[[int, int], None] | None = None) -> GaussianMixture:
        """The Gaussian mixture of the clusters (what the E-step evaluates); its factors
        overwrite those of ``recycled``, a mixture no longer read, where they fit, and
        ``fill`` writes the covariances, not computed yet, as they are factored
        (:class:`~deepdpm_core.estep.gmm.GaussianMixture`)."""
        return GaussianMixture(self.means, self.covariances, self.log_weights, recycled=recycled, fill=fill)

    def state_dict(self) -> dict[str, Tensor]:
        """Copies of the six tensors on the CPU, keyed by field name: a snapshot, as the
        next M-step writes its covariances into the memory of the last ones."""
        return {name: getattr(self, name).to("cpu", copy=True) for name in FIELDS}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device | str = "cpu") -> MixtureState:
        """The state saved by :meth:`state_dict` (other keys of ``state`` are ignored),
        copied: the fit writes into its tensors, and ``state`` may be read again (a second
        resume, or ranks that share its memory)."""
        return cls(*(state[name].to(device, copy=True) for name in FIELDS))
