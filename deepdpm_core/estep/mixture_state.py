"""The per-cluster state of a fit: the mixture (paper Eq. 5) and each cluster's two
subclusters (paper §3.2), six tensors with a leading cluster axis. Every change of K
(surgery, pruning) or of device, and every checkpoint, goes through this object, so the
six are listed here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from deepdpm_core.estep.gmm import GaussianMixture

Tensor = torch.Tensor


@dataclass(eq=False)
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
    sub_log_weights : Tensor of shape (K, 2)
        Each cluster's pair normalised on its own.
    """

    means: Tensor
    covariances: Tensor
    log_weights: Tensor
    sub_means: Tensor
    sub_covariances: Tensor
    sub_log_weights: Tensor

    @classmethod
    def without_subclusters(cls, means: Tensor, covariances: Tensor, log_weights: Tensor) -> MixtureState:
        """A state whose subclusters are still to be drawn (zeros, equal weights)."""
        k, d = means.shape
        f64 = {"dtype": torch.float64, "device": means.device}
        return cls(means, covariances, log_weights, torch.zeros(k, 2, d, **f64),
                   torch.zeros(k, 2, d, d, **f64), torch.full((k, 2), -math.log(2), **f64))

    @property
    def n_clusters(self) -> int:
        """K."""
        return int(self.means.shape[0])

    @property
    def dim(self) -> int:
        """D."""
        return int(self.means.shape[1])

    def tensors(self) -> list[Tensor]:
        """The six tensors, in the order of the fields."""
        return [getattr(self, f.name) for f in fields(self)]

    def rows(self, src: Tensor) -> MixtureState:
        """A new state whose cluster k is this state's cluster ``src[k]`` (copies).

        Parameters
        ----------
        src : Tensor of shape (K_new,), int64
            Source cluster of every new cluster (repeats allowed).
        """
        return MixtureState(*(t[src].clone() for t in self.tensors()))

    def to(self, device: torch.device | str) -> MixtureState:
        """The state on ``device``."""
        return MixtureState(*(t.to(device) for t in self.tensors()))

    def mixture(self) -> GaussianMixture:
        """The Gaussian mixture of the clusters (what the E-step evaluates)."""
        return GaussianMixture(self.means, self.covariances, self.log_weights)

    def state_dict(self) -> dict[str, Tensor]:
        """The six tensors on the CPU, keyed by field name."""
        return {f.name: getattr(self, f.name).cpu() for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device | str = "cpu") -> MixtureState:
        """The state saved by :meth:`state_dict` (other keys of ``state`` are ignored)."""
        return cls(*(state[f.name].to(device) for f in fields(cls)))
