"""The E-step targets r^E of an epoch (paper Eq. 5): dense over all K clusters, or sparse
over each point's top m candidate clusters when K is large (docs/design.md, "E-step")."""

from __future__ import annotations

import torch

from deepdpm_core.config import EStepConfig
from deepdpm_core.gmm import GaussianMixture

Tensor = torch.Tensor


def top_m(config: EStepConfig, n_clusters: int) -> int | None:
    """Most clusters per point of the sparse E-step's support, or None for the dense E-step."""
    return config.top_m if n_clusters > config.dense_max_k and config.top_m < n_clusters else None


def estep_targets(mixture: GaussianMixture, x: Tensor, m: int | None, anchors: Tensor | None,
                  chunk_rows: int = 4096) -> tuple[Tensor | None, Tensor, Tensor]:
    """E-step targets r^E of every local row, once per epoch (the mixture is frozen all
    epoch, and extra training batches re-use rows).

    Parameters
    ----------
    mixture : GaussianMixture
        K clusters, frozen at the last M-step.
    x : Tensor of shape (N_local, D)
    m : int or None
        Candidates per point (:func:`top_m`), None: dense.
    anchors : Tensor of shape (N_local,), int64, or None
        Each row's last best cluster, where the sparse search starts (−1 or None: none).

    Returns
    -------
    candidates : Tensor of shape (N_local, m), int64, or None when dense
    resp : Tensor of shape (N_local, m) or (N_local, K), float32
        Computed in log space; exactly 0 off the sparse E-step's support. K ≤
        ``estep.dense_max_k`` when dense, so memory is O(N) either way.
    anchors : Tensor of shape (N_local,), int64
        Each row's best cluster now.
    """
    if m:
        cand, log_resp = mixture.sparse_log_responsibilities(x, m, anchors=anchors)
        return cand, log_resp.exp().to(torch.float32), cand.gather(1, log_resp.argmax(1, keepdim=True)).squeeze(1)
    out = torch.empty(x.shape[0], mixture.means.shape[0], device=x.device)
    # cache-sized chunks: the (rows, K·D) whitening is memory-bound
    for s in range(0, x.shape[0], chunk_rows):
        out[s : s + chunk_rows] = mixture.log_responsibilities(x[s : s + chunk_rows]).exp()
    return None, out, out.argmax(1)


def slot_targets(candidates: Tensor | None, resp: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """A batch's slots (B, m) and the E-step targets on them (B, m); dense: all K clusters.

    Parameters
    ----------
    candidates, resp
        From :func:`estep_targets`.
    idx : Tensor of shape (B,), int64
        The batch's local rows.
    """
    resp = resp.index_select(0, idx)
    if candidates is None:
        return torch.arange(resp.shape[1], device=resp.device).expand(len(idx), -1), resp
    return candidates.index_select(0, idx), resp
