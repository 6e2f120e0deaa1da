"""The E-step targets r^E of an epoch (paper Eq. 5) on each point's support: the clusters
whose responsibility is not provably below float32 resolution, at most m of them
(docs/design.md, "E-step")."""

from __future__ import annotations

import torch

from deepdpm_core.config import EStepConfig
from deepdpm_core.estep.gmm import GaussianMixture

Tensor = torch.Tensor


def top_m(config: EStepConfig, n_clusters: int) -> int:
    """m, the most clusters in a point's E-step support: all K while K ≤
    ``estep.dense_max_k`` (the support then drops only what float32 cannot resolve),
    ``estep.top_m`` above."""
    return n_clusters if n_clusters <= config.dense_max_k else min(config.top_m, n_clusters)


def estep_targets(mixture: GaussianMixture, x: Tensor, m: int, anchors: Tensor | None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """E-step targets r^E of every local row, once per epoch (the mixture is frozen all
    epoch, and extra training batches re-use rows).

    Parameters
    ----------
    mixture : GaussianMixture
        K clusters, frozen at the last M-step.
    x : Tensor of shape (N_local, D)
    m : int
        Most clusters per point (:func:`top_m`).
    anchors : Tensor of shape (N_local,), int64, or None
        Each row's last best cluster, where the search starts (−1 or None: none).

    Returns
    -------
    candidates : Tensor of shape (N_local, m), int64
    resp : Tensor of shape (N_local, m), float32
        Computed in log space; exactly 0 off the point's support. With m ≤
        ``estep.dense_max_k`` or ``estep.top_m``, memory is O(N) whatever K is.
    anchors : Tensor of shape (N_local,), int64
        Each row's best cluster now.
    """
    # exact log-densities only where the bound cannot rule a cluster out: about one per
    # point, against all K of a dense E-step (K times the O(D²) work)
    cand, log_resp = mixture.sparse_log_responsibilities(x, m, anchors=anchors)
    return cand, log_resp.exp().to(torch.float32), cand.gather(1, log_resp.argmax(1, keepdim=True)).squeeze(1)


def slot_targets(candidates: Tensor, resp: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """A batch's slots (B, m) and the E-step targets on them (B, m).

    Parameters
    ----------
    candidates, resp
        From :func:`estep_targets`.
    idx : Tensor of shape (B,), int64
        The batch's local rows.
    """
    return candidates.index_select(0, idx), resp.index_select(0, idx)
