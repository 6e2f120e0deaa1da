"""The sparse E-step: exact log-densities only for the components that can matter
(docs/design.md, "E-step").

Each point's *anchor* (its best component under the previous E-step, or under a cheap
isotropic proxy) is evaluated exactly; any other component k is ruled out when an upper
bound on its log-density, L_k − ½ Maha_k(x) with L_k = ln π_k − ½ ln|2πΣ_k|, falls
:data:`~deepdpm_core.estep.support_bounds.SUPPORT_LOG_GAP` below the anchor's (its
responsibility then provably below float32's resolution of 1). The lower bounds on the
Mahalanobis distance come in three levels, each applied only to what the previous one kept
(levels 1 and 2: :class:`~deepdpm_core.estep.pair_bounds.PairBounds`):

1. per anchor j, for all its points (‖x − μ_j‖ ≤ ρ_j):
   Maha_k(x) ≥ (‖μ_j − μ_k‖ − ρ_j)² / λ_max(Σ_k), a K x K table of distances between means;
2. per pair (j, k), Cauchy–Schwarz along v = Σ_k⁻¹(μ_j − μ_k):
   Maha_k(x) ≥ (a_jk + u_jkᵀ(x − μ_j))², hence ≥ (a_jk − ‖u_jk‖ ρ_j)² for every point of
   the anchor;
3. per point, the same bound with its own x: one (n_j, D) x (D, C_j) GEMM, plus a lower
   bound on the rest of Maha_k(x), ‖x − μ_j‖²/λ_max(Σ_k) − (u_jkᵀ(x − μ_j))²
   (:meth:`SparseEStep._off_axis`).

The survivors are evaluated exactly, grouped by component, so the targets are the dense
E-step's to float32 resolution whatever the anchors; a point keeps its anchor and at most
m − 1 other components (``estep.top_m`` = m), its most likely ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from deepdpm_core.bayes import blocks, gather_chunk_rows
from deepdpm_core.estep.pair_bounds import PairBounds, ReachablePairs
from deepdpm_core.estep.support_bounds import PRUNE_GAP, SUPPORT_LOG_GAP, rounding

if TYPE_CHECKING:
    from deepdpm_core.estep.gmm import GaussianMixture

Tensor = torch.Tensor


class SparseEStep:
    """The sparse E-step of one :class:`~deepdpm_core.estep.gmm.GaussianMixture`.

    Composed with the mixture, whose parameters, cached factors, block layout and exact
    per-pair evaluation it reads.

    Parameters
    ----------
    mixture : GaussianMixture
    eigen_bound : callable, optional
        Level 1's bounds on the covariances' largest eigenvalues, passed to
        :class:`~deepdpm_core.estep.pair_bounds.PairBounds` (None: its default).
    """

    def __init__(self, mixture: GaussianMixture, eigen_bound: Callable[[Tensor], Tensor] | None = None) -> None:
        self.mixture = mixture
        self.eigen_bound = eigen_bound

    def _survival_limit(self, lp_anchor: Tensor, j: int | Tensor, rho: float | Tensor) -> Tensor:
        """Level 3's threshold on ẑ²/(1 + ρ) − 2 L_k (:meth:`_bound_survivors`), (n,) in
        ``work_dtype``: 2 (gap − lp_low) + ρ, lp_low the anchor's log-density lowered by its
        own float32 rounding allowance. j: the anchor, or one per row; ρ likewise."""
        lp_low = lp_anchor - rounding(self.mixture.dim, self.mixture.work_dtype) * (self.mixture.log_norm[j] - lp_anchor).clamp_min(0)
        return (2.0 * (PRUNE_GAP - lp_low) + rho).to(self.mixture.work_dtype)

    def _off_axis(self, along: Tensor, scale: float | Tensor, rho: float | Tensor, length: Tensor,
                  mean_length: Tensor, lam: Tensor) -> Tensor:
        """A lower bound on ‖P_kᵀδ‖² − (u_jkᵀδ)², the part of Maha_k(x) that level 3's
        z² leaves out (δ = x − μ_j; with w = P_kᵀ(μ_j − μ_k), Maha_k(x) = ‖P_kᵀδ + w‖² =
        (a_jk + u_jkᵀδ)² + ‖P_kᵀδ‖² − (u_jkᵀδ)², and the difference is ≥ 0 by Cauchy–Schwarz).
        ‖P_kᵀδ‖² ≥ ‖δ‖²/λ_max(Σ_k); ‖δ‖ is lowered by the rounding of δ and of its norm, and
        |u_jkᵀδ| raised by ρ, the bound on the error of ẑ (:meth:`_bound_survivors`).

        Parameters
        ----------
        along : Tensor
            t̂·s, the computed u_jkᵀδ times ``scale``, of shape (..., n, C).
        scale, rho : float or Tensor broadcastable to ``along``
            1/√(1 + ρ) and ρ of :meth:`_bound_survivors`.
        length : Tensor of shape (..., n, 1)
            The computed ‖δ‖ of each row.
        mean_length : Tensor broadcastable to ``along``
            ‖μ_j‖ (δ is rounded relative to it).
        lam : Tensor of shape (..., 1, C) or (C,)
            Upper bounds on λ_max(Σ_k) of the columns' components (level 1's).
        """
        eps_dot = rounding(self.mixture.dim, along.dtype)
        low = (length - eps_dot * (length + mean_length)).clamp_min(0)
        tiny = torch.finfo(along.dtype).tiny
        return (low.square() / (lam.clamp_min(tiny) * (1.0 + eps_dot))
                - (along.abs() / scale + rho).square()).clamp_min(0)

    def _bound_survivors(self, delta: Tensor, lp_anchor: Tensor, j: int, comps: Tensor, u: Tensor,
                         a: Tensor, lam: Tensor, cap: int) -> tuple[Tensor, Tensor]:
        """Level 3 of the bound (module docstring) for the points of anchor j.

        The bound is L_k − ½ z² with z = a_jk + u_jkᵀ delta; it reaches the threshold iff
        z² ≤ R = 2 (L_k − lp_anchor + gap). The float32 ẑ is off by at most ρ = (D + 2)·ε·
        (‖u_jk‖·(‖delta‖ + ‖μ_j‖) + a_jk) (delta is itself rounded relative to ‖μ_j‖), and
        |ẑ| ≤ √R + ρ implies ẑ²/(1 + ρ) ≤ R + ρ (as 2√R ≤ R + 1), so testing the latter
        never drops a component that can reach. With ρ the chunk's largest, 1/√(1 + ρ)
        scales u and a before the GEMM. lp_anchor, from float32 whitening, is lowered by
        its own rounding allowance, (D + 2)·ε·(L_j − lp_anchor). Maha_k(x) exceeds z² by
        ‖P_kᵀdelta‖² − (u_jkᵀdelta)² ≥ 0, of which :meth:`_off_axis` adds a lower bound: with
        that, one direction no longer stands for all D (1,000 clusters on a sphere in 128-D,
        200,000 rows: 24.5 -> 13.4 components a point evaluated exactly).

        Parameters
        ----------
        delta : Tensor of shape (n, D)
            Points minus μ_j, ``work_dtype``.
        lp_anchor : Tensor of shape (n,)
            Their exact log-density under component j.
        j : int
        comps : Tensor of shape (C,), int64
            Components left for anchor j by :meth:`~deepdpm_core.estep.pair_bounds.PairBounds.reachable_pairs`.
        u, a : Tensor of shape (C, D) and (C,)
            Their :meth:`~deepdpm_core.estep.pair_bounds.PairBounds.pair_directions`, in the work dtype.
        lam : Tensor of shape (C,)
            Upper bounds on their λ_max(Σ_k) (:attr:`~deepdpm_core.estep.pair_bounds.PairBounds.lam_max`).
        cap : int
            Most survivors per point (those with the highest bounds are kept): a bound on
            memory where many components overlap, set well above the support's cap.

        Returns
        -------
        row, comp : Tensor of shape (S,), int64
            Row of ``delta`` and component of each survivor.
        """
        eps_dot, work = rounding(self.mixture.dim, self.mixture.work_dtype), self.mixture.work_dtype
        length, mean_length = delta.norm(dim=1), self.mixture.means_work[j].norm()
        rho = eps_dot * float(u.norm(dim=1).max() * (length.max() + mean_length) + a.max())
        scale = (1.0 + rho) ** -0.5
        along = delta @ (u.T * scale)  # t̂·s, (n, C)
        score = (along + a * scale).square_()  # ẑ²/(1 + ρ)
        score += self._off_axis(along, scale, rho, length[:, None], mean_length, lam.to(work))
        score -= 2.0 * self.mixture.log_norm[comps].to(work)
        limit = self._survival_limit(lp_anchor, j, rho)[:, None]
        reach = score <= limit
        over = torch.nonzero(reach.sum(1) > cap).squeeze(1)
        if len(over):  # keep the cap components with the highest upper bounds (lowest score)
            keep = score[over].masked_fill(~reach[over], math.inf).topk(cap, dim=1, largest=False).indices
            reach[over] = torch.zeros_like(reach[over]).scatter_(1, keep, True) & reach[over]
        row, col = reach.nonzero(as_tuple=True)
        return row, comps[col]

    def _bound_survivors_blocked(self, x: Tensor, anchor: Tensor, lp_anchor: Tensor, offset: Tensor,
                                 pairs: ReachablePairs, lam_max: Tensor,
                                 cap: int) -> tuple[Tensor, Tensor]:
        """:meth:`_bound_survivors` for every anchor at once: blocks of same-anchor points,
        each against its anchor's pairs (padded to the most any anchor has) in one batched
        GEMM per chunk. ρ uses each anchor's largest ‖u‖, a and point offset (at least the
        loop's per-chunk ones, so the test is as safe).

        Parameters
        ----------
        x : Tensor of shape (N, D)
        anchor : Tensor of shape (N,), int64
        lp_anchor : Tensor of shape (N,)
            Each point's exact log-density under its anchor.
        offset : Tensor of shape (K,), float64
            Each anchor's largest ‖x − μ_j‖ over its points (unwidened).
        pairs : ReachablePairs
            Of :meth:`~deepdpm_core.estep.pair_bounds.PairBounds.reachable_pairs`.
        lam_max : Tensor of shape (K,), float64
            Upper bounds on each component's λ_max(Σ_k).
        cap : int

        Returns
        -------
        point, comp : Tensor of shape (S,), int64
        """
        pair_anchor, pair_comp, a = pairs.anchor, pairs.comp, pairs.a
        u = pairs.u.index_select(0, pairs.u_row)
        k, d, dev, work = self.mixture.n_components, self.mixture.dim, x.device, self.mixture.work_dtype
        per_anchor = torch.bincount(pair_anchor, minlength=k)
        width = int(per_anchor.max())
        # each anchor's pairs as a row of (K, width) tables; unused places never reach
        at = (pair_anchor, torch.arange(len(pair_anchor), device=dev) - (torch.cumsum(per_anchor, 0) - per_anchor)[pair_anchor])
        comp_of = torch.zeros(k, width, dtype=torch.long, device=dev).index_put_(at, pair_comp)
        used = torch.zeros(k, width, dtype=torch.bool, device=dev).index_put_(at, torch.ones_like(pair_comp, dtype=torch.bool))
        eps_dot = rounding(self.mixture.dim, work)
        zeros = torch.zeros(k, dtype=torch.float64, device=dev)
        rho = eps_dot * (zeros.scatter_reduce(0, pair_anchor, u.norm(dim=1).double(), "amax")
                          * (offset + self.mixture.means_work.norm(dim=1).double())
                          + zeros.scatter_reduce(0, pair_anchor, a.double(), "amax"))
        scale = ((1.0 + rho) ** -0.5).to(work)
        u_of = torch.zeros(k, width, d, dtype=work, device=dev).index_put_(at, u * scale[pair_anchor, None])
        a_of = torch.zeros(k, width, dtype=work, device=dev).index_put_(at, a * scale[pair_anchor])
        log_norm_of = self.mixture.log_norm.to(work)[comp_of]
        lam_of = lam_max.to(work)[comp_of]
        mean_length = self.mixture.means_work.norm(dim=1)
        order = torch.argsort(anchor, stable=True)
        layout = self.mixture.layout
        block, slot, segment, _ = layout.segment(torch.bincount(anchor, minlength=k))
        found_points, found_comps = [], []
        for b0, b1, t0, t1 in layout.chunks(block, len(segment), layout.rows * (d + width) + width * d):
            at, pts, seg = (block[t0:t1] - b0, slot[t0:t1]), order[t0:t1], segment[b0:b1]
            j = anchor[pts]
            delta = layout.pack(self.mixture.centre(x.index_select(0, pts), j), at, b1 - b0)
            along = torch.bmm(delta, u_of[seg].transpose(1, 2))  # t̂·s
            score = (along + a_of[seg, None, :]).square_()  # ẑ²/(1 + ρ)
            score += self._off_axis(along, scale[seg, None, None], rho[seg, None, None].to(work),
                                    delta.norm(dim=2, keepdim=True), mean_length[seg, None, None], lam_of[seg, None, :])
            score -= 2.0 * log_norm_of[seg, None, :]
            limit = layout.pack(self._survival_limit(lp_anchor[pts], j, rho[j]), at, b1 - b0, fill=-math.inf)
            reach = (score <= limit[:, :, None]) & used[seg, None, :]
            over = torch.nonzero(reach.sum(2) > cap, as_tuple=True)
            if len(over[0]):  # keep the cap components with the highest upper bounds (lowest score)
                keep = score[over].masked_fill(~reach[over], math.inf).topk(cap, dim=1, largest=False).indices
                reach[over] = torch.zeros_like(reach[over]).scatter_(1, keep, True) & reach[over]
            blk, row, col = reach.nonzero(as_tuple=True)
            found_points.append(layout.pack(pts, at, b1 - b0)[blk, row])
            found_comps.append(comp_of[seg[blk], col])
        return torch.cat(found_points), torch.cat(found_comps)

    def log_responsibilities(self, x: Tensor, max_support: int, chunk_rows: int | None = None,
                                    anchors: Tensor | None = None, batched: bool | None = None,
                                    ) -> tuple[Tensor, Tensor]:
        """E-step ln r^E restricted to the components that can matter (module docstring).

        Parameters
        ----------
        x : Tensor of shape (N, D)
        max_support : int
            m, the most components kept per point (memory O(N·m)).
        chunk_rows : int, optional
            Most points per GEMM (default :func:`~deepdpm_core.bayes.stats.gather_chunk_rows`).
        anchors : Tensor of shape (N,), int64, optional
            Each point's anchor, e.g. its best component under the previous E-step; −1 (or
            no tensor) takes the isotropic proxy's best. Any component gives the same
            result: a poor anchor only leaves more components for the bound to rule out.
        batched : bool, optional
            All anchors' and components' GEMMs batched over blocks
            (:mod:`deepdpm_core.bayes.blocks`) instead of loops over them (default: on a GPU).

        Returns
        -------
        index : Tensor of shape (N, m), int64
            Column 0 is the point's anchor; unused columns repeat it (with r^E = 0).
        log_resp : Tensor of shape (N, m), ``compute_dtype``
            ln r^E, −inf off the support (responsibility below float32 ε).
        """
        n, k = x.shape[0], self.mixture.n_components
        m = max(1, min(max_support, k))
        chunk_rows = chunk_rows or gather_chunk_rows(self.mixture.dim, x.device)
        anchor = (torch.full((n,), -1, dtype=torch.long, device=x.device) if anchors is None
                  else anchors.to(device=x.device, dtype=torch.long, copy=True))
        missing = torch.nonzero(anchor < 0).squeeze(1)
        if len(missing):
            anchor[missing] = self.mixture.candidates(x.index_select(0, missing), 1)[:, 0]
        index = anchor[:, None].repeat(1, m)
        lp = torch.full((n, m), -math.inf, dtype=self.mixture.compute_dtype, device=x.device)
        counts = torch.bincount(anchor, minlength=k)
        present = torch.nonzero(counts).squeeze(1)
        batched = blocks.use_blocks(x, batched)
        if not batched:
            by_anchor = torch.argsort(anchor.to(torch.int32), stable=True)
            ends = torch.cumsum(counts, 0)
            starts, ends = (ends - counts).tolist(), ends.tolist()

            def anchor_chunks(j: int) -> Iterator[tuple[Tensor, Tensor]]:
                for s in range(starts[j], ends[j], chunk_rows):
                    rows = by_anchor[s : min(s + chunk_rows, ends[j])]
                    yield rows, self.mixture.centre(x.index_select(0, rows), j)

        # the anchors, exactly; their points' largest offset and lowest log-density
        slack = rounding(self.mixture.dim, self.mixture.work_dtype)  # of delta and of the anchor's log-density
        if batched:
            lp[:, 0], offset = self.mixture.log_prob_blocked(x, torch.arange(n, device=x.device), anchor)
            init = torch.zeros(k, dtype=torch.float64, device=x.device)
            offset = init.scatter_reduce(0, anchor, offset.double(), "amax")
            low = init.scatter_reduce(0, anchor, lp[:, 0].double(), "amin", include_self=False)
            radius, floor = offset[present], low[present]
        else:
            radius, floor = [], []
            for j in present.tolist():
                r, f = 0.0, math.inf
                for rows, delta in anchor_chunks(j):
                    lp_anchor = self.mixture.log_prob_centred(delta, j)
                    lp[rows, 0] = lp_anchor
                    r, f = max(r, float(delta.norm(dim=1).max())), min(f, float(lp_anchor.min()))
                radius.append(r)
                floor.append(f)
            radius, floor = (torch.tensor(v, dtype=torch.float64, device=x.device) for v in (radius, floor))
        widened = (radius + slack * (radius + self.mixture.means_work[present].norm(dim=1).double()),
                   floor - slack * (self.mixture.log_norm[present].double() - floor))
        if m > 1 and len(present):
            pair_bounds = PairBounds(self.mixture, self.eigen_bound)
            pairs = pair_bounds.reachable_pairs(present, *widened, batched=batched)
            if batched:
                points, comps = (self._bound_survivors_blocked(x, anchor, lp[:, 0], offset, pairs, pair_bounds.lam_max,
                                                               4 * (m - 1))
                                 if len(pairs.anchor) else (anchor[:0], anchor[:0]))
            else:
                found = [(anchor[:0], anchor[:0])]
                bounds = torch.searchsorted(pairs.anchor, present, right=False).tolist() + [len(pairs.anchor)]
                for i, j in enumerate(present.tolist()):
                    c0, c1 = bounds[i], bounds[i + 1]
                    if c1 == c0:
                        continue
                    comps, u = pairs.comp[c0:c1], pairs.u.index_select(0, pairs.u_row[c0:c1])
                    for rows, delta in anchor_chunks(j):
                        row, comp = self._bound_survivors(delta, lp[rows, 0], j, comps, u, pairs.a[c0:c1],
                                                          pair_bounds.lam_max[comps], 4 * (m - 1))
                        found.append((rows[row], comp))
                points, comps = (torch.cat(t) for t in zip(*found, strict=True))
            if len(points):
                values = self.mixture.weighted_log_prob_pairs(x, points, comps, chunk_rows, batched)
                # each point's m − 1 most likely survivors, in slots 1..m−1
                by_value = torch.argsort(values, descending=True, stable=True)
                by_point = by_value[torch.argsort(points[by_value], stable=True)]
                points, comps, values = points[by_point], comps[by_point], values[by_point]
                count = torch.bincount(points, minlength=n)
                rank = torch.arange(len(points), device=x.device) - (torch.cumsum(count, 0) - count)[points]
                keep = rank < m - 1
                index[points[keep], rank[keep] + 1] = comps[keep]
                lp[points[keep], rank[keep] + 1] = values[keep]
        lp = lp.masked_fill(lp < lp.max(1, keepdim=True).values - SUPPORT_LOG_GAP, -math.inf)
        return index, lp - torch.logsumexp(lp, dim=1, keepdim=True)
