"""The E-step of a fit: the targets r^E of an epoch (paper Eq. 5) on each point's support,
the clusters whose responsibility is not provably below float32 resolution, at most m of
them (docs/design.md, "E-step")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepdpm_core.config import EStepConfig
from deepdpm_core.estep.gmm import GaussianMixture
from deepdpm_core.estep.sparse_support import SparseEStep
from deepdpm_core.estep.support_bounds import largest_eigenvalue_bound

Tensor = torch.Tensor


@dataclass(frozen=True)
class EStep:
    """The E-step targets of every local row, once per epoch (the mixture is frozen all
    epoch, and extra training batches re-use rows).

    While K ≤ ``config.dense_max_k`` a point may keep every cluster, above it its
    ``config.top_m`` most likely; either way exact log-densities are computed only where the
    bound cannot rule a cluster out (:class:`~deepdpm_core.estep.sparse_support.SparseEStep`).

    Attributes
    ----------
    config : EStepConfig
    eigen_bound : callable
        The level-1 bound on each covariance's largest eigenvalue
        (:func:`~deepdpm_core.estep.support_bounds.largest_eigenvalue_bound`).
    """

    config: EStepConfig
    eigen_bound: Callable[[Tensor], Tensor] = largest_eigenvalue_bound

    def support(self, n_clusters: int) -> int:
        """m, the most clusters in a point's support: all K while K ≤ ``dense_max_k``,
        ``top_m`` above."""
        c = self.config
        return n_clusters if n_clusters <= c.dense_max_k else min(c.top_m, n_clusters)

    def targets(self, mixture: GaussianMixture, x: Tensor, anchors: Tensor | None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """The targets of rows ``x`` under ``mixture``.

        Parameters
        ----------
        mixture : GaussianMixture
            K clusters, frozen at the last M-step.
        x : Tensor of shape (N_local, D)
        anchors : Tensor of shape (N_local,), int64, or None
            Each row's last best cluster, where the search starts (−1 or None: none).

        Returns
        -------
        candidates : Tensor of shape (N_local, m), int64
        resp : Tensor of shape (N_local, m), float32
            Computed in log space; exactly 0 off the point's support. Memory is O(N·m),
            whatever K is.
        anchors : Tensor of shape (N_local,), int64
            Each row's best cluster now.
        """
        m = self.support(mixture.n_components)
        cand, log_resp = SparseEStep(mixture, self.eigen_bound).log_responsibilities(x, m, anchors=anchors)
        return cand, log_resp.exp().to(torch.float32), cand.gather(1, log_resp.argmax(1, keepdim=True)).squeeze(1)


def slot_targets(candidates: Tensor, resp: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """A batch's slots (B, m) and the E-step targets on them (B, m).

    Parameters
    ----------
    candidates, resp
        From :meth:`EStep.targets`.
    idx : Tensor of shape (B,), int64
        The batch's local rows.
    """
    return candidates.index_select(0, idx), resp.index_select(0, idx)
