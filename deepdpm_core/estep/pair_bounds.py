"""Levels 1 and 2 of the sparse E-step's bound (:mod:`deepdpm_core.estep.sparse_support`):
which (anchor j, component k) pairs can matter to some point of the anchor.

1. per anchor j, for all its points (‖x − μ_j‖ ≤ ρ_j):
   Maha_k(x) ≥ (‖μ_j − μ_k‖ − ρ_j)² / λ_max(Σ_k), a K x K table of distances between means;
2. per pair (j, k), Cauchy–Schwarz along v = Σ_k⁻¹(μ_j − μ_k):
   Maha_k(x) ≥ (a_jk + u_jkᵀ(x − μ_j))², hence ≥ (a_jk − ‖u_jk‖ ρ_j)² for every point of
   the anchor.

The pairs kept carry (u_jk, a_jk), which level 3 applies to each point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from deepdpm_core.bayes import blocks
from deepdpm_core.estep.support_bounds import PRUNE_GAP, largest_eigenvalue_bound, rounding

if TYPE_CHECKING:
    from deepdpm_core.estep.gmm import GaussianMixture

Tensor = torch.Tensor


class ReachablePairs(NamedTuple):
    """The (anchor j, component k) pairs levels 1 and 2 keep, by anchor, and their bound's
    vectors (:meth:`PairBounds.pair_directions`) in the work dtype.

    u stays in the order level 2 made it (by component): putting its (P, D) rows in the
    pairs' order would copy them all once more (1,000 clusters on a sphere in 128-D, every
    pair kept: 512 MB, 1.9 of an E-step's 9 s on a CPU thread), while level 3 reads one
    anchor's rows at a time, ``u[u_row[c0:c1]]``.

    Attributes
    ----------
    anchor, comp : Tensor of shape (P,), int64
        Sorted by anchor, then by component.
    a : Tensor of shape (P,)
    u : Tensor of shape (P, D)
    u_row : Tensor of shape (P,), int64
        The row of ``u`` of each pair.
    """

    anchor: Tensor
    comp: Tensor
    a: Tensor
    u: Tensor
    u_row: Tensor


class PairBounds:
    """Levels 1 and 2 of the bound for one :class:`~deepdpm_core.estep.gmm.GaussianMixture`.

    Parameters
    ----------
    mixture : GaussianMixture
    eigen_bound : callable, optional
        Upper bounds (K,) on the largest eigenvalue of covariances (K, D, D), for level 1
        (None: :func:`~deepdpm_core.estep.support_bounds.largest_eigenvalue_bound`).

    Attributes
    ----------
    lam_max : Tensor of shape (K,), float64
        ``eigen_bound`` of the mixture's covariances, computed once (level 3 reads it too).
    """

    def __init__(self, mixture: GaussianMixture, eigen_bound: Callable[[Tensor], Tensor] | None = None) -> None:
        self.mixture = mixture
        self.lam_max = (eigen_bound or largest_eigenvalue_bound)(mixture.covariances)

    def pair_directions(self, anchors: Tensor, comps: Tensor, batched: bool | None = None
                        ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """The Cauchy–Schwarz bound's vectors for pairs (anchor j, component k), a part at
        a time (a chunk of pairs, or one component's), so that a caller that keeps few of
        the pairs never holds all P of the (P, D) float64 u.

        a_jk = ‖P_kᵀ(μ_j − μ_k)‖ (the Mahalanobis distance of μ_j under component k) and
        u_jk = Σ_k⁻¹(μ_j − μ_k) / a_jk = P_k P_kᵀ(μ_j − μ_k) / a_jk, so u_jkᵀΣ_k u_jk = 1 and,
        for any x, Maha_k(x) ≥ (u_jkᵀ(x − μ_k))² = (a_jk + u_jkᵀ(x − μ_j))². Float64, two
        (n_k, D) x (D, D) GEMMs per component; u = 0 where μ_j = μ_k (no bound).

        Parameters
        ----------
        anchors, comps : Tensor of shape (P,), int64
        batched : bool, optional
            Batched GEMMs with P_k gathered per pair (default: on a GPU).

        Yields
        ------
        sel : Tensor of shape (p,), int64
            The part's pairs, indices into ``anchors`` and ``comps``; the parts cover every pair once.
        u : Tensor of shape (p, D), float64
        a : Tensor of shape (p,), float64
        """
        device = self.mixture.means.device
        if blocks.use_blocks(self.mixture.means, batched):  # P_k gathered per pair, in chunks
            step = max(1, self.mixture.layout.chunk_elems // self.mixture.dim**2)
            for s in range(0, len(comps), step):
                j, k = anchors[s : s + step], comps[s : s + step]
                prec = self.mixture.prec_chol[k]
                w = torch.bmm((self.mixture.means[j] - self.mixture.means[k])[:, None], prec)  # (c, 1, D): rows P_kᵀΔ
                norm = w.norm(dim=2, keepdim=True)
                u = (torch.bmm(w, prec.transpose(1, 2)) * torch.where(norm > 0, 1.0 / norm, 0.0))[:, 0]
                yield torch.arange(s, s + len(k), device=device), u, norm[:, 0, 0]
            return
        order = torch.argsort(comps.to(torch.int32), stable=True)
        start = 0
        for k, count in enumerate(torch.bincount(comps, minlength=self.mixture.n_components).tolist()):
            if count:
                sel = order[start : start + count]
                delta = self.mixture.means[anchors[sel]] - self.mixture.means[k]
                prec = self.mixture.prec_chol[k]
                if count >= self.mixture.dim:  # Σ_k⁻¹ = P_k P_kᵀ once (D³), then one GEMM a pair, not two
                    v = delta @ (prec @ prec.T)
                    norm = (v * delta).sum(1).clamp_min(0).sqrt()
                else:
                    w = delta @ prec  # rows P_kᵀΔ
                    norm = w.norm(dim=1)
                    v = w @ prec.T
                yield sel, v * torch.where(norm > 0, 1.0 / norm, 0.0)[:, None], norm
            start += count

    def reachable_pairs(self, anchors: Tensor, radius: Tensor, floor: Tensor, block_elems: int = 1 << 22,
                         batched: bool | None = None) -> ReachablePairs:
        """(anchor, component) pairs that bound levels 1 and 2 (module docstring) keep.

        A pair is dropped when for every point of the anchor, ‖x − μ_j‖ ≤ ``radius`` and
        log-density ≥ ``floor``, the Mahalanobis bound exceeds 2 (L_k − floor + gap).

        Parameters
        ----------
        anchors : Tensor of shape (J,), int64
        radius, floor : Tensor of shape (J,), float64
            Each anchor's largest offset and lowest anchor log-density over its points,
            already widened for float32 rounding.
        block_elems : int
            Bound on the J·K elements of the level-1 tables built at once.
        batched : bool, optional
            Passed to :meth:`pair_directions`.

        Returns
        -------
        ReachablePairs
            u and a in ``work_dtype``.
        """
        log_norm = self.mixture.log_norm.to(torch.float64)
        sq_norms = self.mixture.means.square().sum(1)
        eps_dot = rounding(self.mixture.dim, torch.float64)
        pair_anchor, pair_comp, pair_room, pair_radius = [], [], [], []
        rows = max(1, block_elems // max(1, self.mixture.n_components))
        for s in range(0, len(anchors), rows):
            anc, rad = anchors[s : s + rows], radius[s : s + rows, None]
            room = 2.0 * (log_norm - floor[s : s + rows, None] + PRUNE_GAP)  # (J, K): bound on 2(L_k − lp + gap)
            # squared distances between means as ‖μ_j‖² + ‖μ_k‖² − 2 μ_j·μ_k, less a bound on
            # that formula's rounding: a lower bound even for nearly equal means
            both = sq_norms[anc, None] + sq_norms
            dist2 = torch.addmm(both, self.mixture.means[anc], self.mixture.means.T, alpha=-2.0) - eps_dot * both
            dist = dist2.clamp_min(0).sqrt()
            ok = (room >= 0) & ((dist - rad).clamp_min(0).square() <= self.lam_max * room)
            ok[torch.arange(len(anc), device=ok.device), anc] = False
            j, k = ok.nonzero(as_tuple=True)
            pair_anchor.append(anc[j])
            pair_comp.append(k)
            pair_room.append(room[j, k])
            pair_radius.append(rad[j, 0])
        pair_anchor, pair_comp, room, rad = (torch.cat(t) for t in (pair_anchor, pair_comp, pair_room, pair_radius))
        # level 2 a part at a time: only the kept pairs' u are held, in the work dtype
        work, device = self.mixture.work_dtype, pair_anchor.device
        # (empty parts first: there may be no pair at all)
        kept = [torch.empty(0, dtype=torch.int64, device=device)]
        kept_u = [torch.empty(0, self.mixture.dim, dtype=work, device=device)]
        kept_a = [torch.empty(0, dtype=work, device=device)]
        for sel, u, a in self.pair_directions(pair_anchor, pair_comp, batched):
            ok = torch.nonzero((a - u.norm(dim=1) * rad[sel]).clamp_min(0).square() <= room[sel]).squeeze(1)
            whole = len(ok) == len(sel)  # (every pair of the part kept: no gather)
            kept.append(sel if whole else sel[ok])
            kept_u.append((u if whole else u[ok]).to(work))
            kept_a.append((a if whole else a[ok]).to(work))
        kept, u, a = torch.cat(kept), torch.cat(kept_u), torch.cat(kept_a)
        # by anchor, then in the pairs' order
        order = torch.argsort(kept)
        order = order[torch.argsort(pair_anchor[kept[order]].to(torch.int32), stable=True)]
        kept = kept[order]
        return ReachablePairs(pair_anchor[kept], pair_comp[kept], a[order], u, order)
