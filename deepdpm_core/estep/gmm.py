"""Gaussian-mixture parameters with cached Cholesky factors and the batched E-step (paper
Eq. 5; docs/design.md, "E-step").

The precision Cholesky factors are computed once per M-step (as in scikit-learn's
``_estimate_log_gaussian_prob``), so a batch costs one (B, D) x (D, K·D) matrix product and
no factorisation. The sparse E-step (:class:`~deepdpm_core.estep.sparse_support.SparseEStep`)
works through the per-pair evaluation and the cached factors here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import torch

from deepdpm_core.bayes import blocks, gather_chunk_rows, precision_cholesky
from deepdpm_core.estep.support_bounds import faiss_proxy_keys, proxy_top_m_faiss, proxy_top_m_torch

Tensor = torch.Tensor


@dataclass
class GaussianMixture:
    """Mixture parameters with derived factors.

    Attributes
    ----------
    means : Tensor of shape (K, D), float64
    covariances : Tensor of shape (K, D, D), float64
    log_weights : Tensor of shape (K,), float64
        ln π_k (normalised).
    compute_dtype : torch.dtype
        dtype of the cached factors used for per-batch work.
    work_dtype : torch.dtype
        dtype of the whitening GEMMs of the top-m path (points are centred first, so
        float32 loses only ~1e-7 of each Mahalanobis distance).
    layout : BlockLayout
        The sizes of the batched per-component GEMMs (the GPU path).
    prec_chol : Tensor of shape (K, D, D), float64
        P_k = L_k^{-T} with Σ_k = L_k L_kᵀ, so Σ_k^{-1} = P_k P_kᵀ (cached by :meth:`refresh`).
    log_norm : Tensor of shape (K,), ``compute_dtype``
        L_k = ln π_k − ½ ln|2πΣ_k|.
    means_work, prec_chol_work : Tensor of shape (K, D) and (K, D, D), ``work_dtype``
        The means and factors the per-pair GEMMs use.
    recycled : GaussianMixture, optional
        A mixture no longer read, whose factors' memory this one's overwrite where they fit
        (:func:`~deepdpm_core.bayes.precision_cholesky`'s ``out``); it loses its factors
        (reading them raises AttributeError).
    fill : callable (start, stop), optional
        Writes rows [start, stop) of ``covariances``, not computed yet, as the factors
        are computed (:func:`~deepdpm_core.bayes.precision_cholesky`'s ``fill``).
    """

    means: Tensor
    covariances: Tensor
    log_weights: Tensor
    compute_dtype: torch.dtype = torch.float64
    work_dtype: torch.dtype = torch.float32
    layout: blocks.BlockLayout = blocks.DEFAULT_LAYOUT
    prec_chol: Tensor = field(init=False, repr=False)
    log_norm: Tensor = field(init=False, repr=False)
    means_work: Tensor = field(init=False, repr=False)
    prec_chol_work: Tensor = field(init=False, repr=False)
    _dense: tuple[Tensor, Tensor] | None = field(init=False, repr=False)
    _proxy: tuple[Tensor, Tensor, Tensor] = field(init=False, repr=False)
    recycled: InitVar[GaussianMixture | None] = None
    fill: InitVar[Callable[[int, int], None] | None] = None

    def __post_init__(self, recycled: GaussianMixture | None, fill: Callable[[int, int], None] | None) -> None:
        out = None
        if recycled is not None and hasattr(recycled, "prec_chol"):
            out = recycled.prec_chol, recycled.prec_chol_work
            del recycled.prec_chol, recycled.prec_chol_work
        self.refresh(out, fill)

    @property
    def n_components(self) -> int:
        return self.means.shape[0]

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    def refresh(self, out: tuple[Tensor, Tensor] | None = None, fill: Callable[[int, int], None] | None = None) -> None:
        """Recompute the cached factors (call after changing the parameters), into ``out``
        (P and its ``work_dtype`` copy, :func:`~deepdpm_core.bayes.precision_cholesky`) when
        given, with the covariances written by ``fill`` as they are read when given."""
        # P = L^{-T} of Σ = L Lᵀ: Σ^{-1} = P Pᵀ and ||(x − μ)ᵀ P||² is the Mahalanobis distance
        # per-component factors for the grouped top-m path, (K, D) and (K, D, D), in the
        # dtype of the data (float32: its GEMMs are ~8x faster than float64 on CPU)
        factors = precision_cholesky(self.covariances, self.work_dtype, out=out, fill=fill)
        self.prec_chol, self.prec_chol_work, log_det = factors
        self.log_norm = (
            self.log_weights - 0.5 * (self.dim * math.log(2 * math.pi) + log_det)
        ).to(self.compute_dtype)
        self._dense = None  # weighted_log_prob's all-components layout, built on first use
        self.means_work = self.means.to(self.work_dtype)
        # candidate proxy: each component replaced by the isotropic Gaussian with the same
        # mean variance v_k = tr Σ_k / D, so the score is one (B, D) x (D, K) float32 GEMM:
        # ln π_k − D/2 ln 2πv_k − ‖x − μ_k‖²/(2 v_k) = x·μ_k/v_k − ‖x‖²/(2 v_k) + c_k
        var = self.covariances.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300)
        const = (self.log_weights - 0.5 * self.dim * torch.log(2 * math.pi * var)
                 - 0.5 * self.means.square().sum(-1) / var)
        self._proxy = (
            (self.means / var[:, None]).T.contiguous().to(torch.float32),
            (0.5 / var).to(torch.float32),
            const.to(torch.float32),
        )

    def weighted_log_prob(self, x: Tensor) -> Tensor:
        """ln π_k + ln N(x_i; μ_k, Σ_k).

        Parameters
        ----------
        x : Tensor of shape (B, D)

        Returns
        -------
        Tensor of shape (B, K), in ``compute_dtype``.
        """
        if self._dense is None:
            # (D, K·D) so one matmul projects a batch into every component's whitened frame,
            # less the whitened means Pᵀμ (K·D,): only this all-components path reads them
            whitened_means = torch.einsum("kd,kde->ke", self.means, self.prec_chol)
            self._dense = (self.prec_chol.permute(1, 0, 2).reshape(self.dim, -1).to(self.compute_dtype),
                           whitened_means.reshape(-1).to(self.compute_dtype))
        prec_chol, shifted_means = self._dense
        y = x.to(self.compute_dtype) @ prec_chol - shifted_means
        maha = y.view(x.shape[0], self.n_components, self.dim).square().sum(-1)
        return self.log_norm - 0.5 * maha

    def candidates(self, x: Tensor, m: int, chunk_elems: int = 1 << 22) -> Tensor:
        """The m most likely components of each point under the isotropic proxy.

        The proxy score is an inner product of [x, ‖x‖², 1] with [μ_k/v_k, −1/(2v_k), c_k],
        so on the CPU FAISS's inner-product k-NN search (a GEMM with a fused heap top-m)
        ranks it, about twice as fast as a score matrix and :func:`torch.topk`; on a GPU
        the torch path is used.

        Parameters
        ----------
        x : Tensor of shape (N, D)
        m : int
            Candidates per point (at most K).
        chunk_elems : int
            Bound on the (rows, K) score buffer, so memory is O(chunk + K·D), never N × K.

        Returns
        -------
        Tensor of shape (N, m), int64
        """
        k = self.n_components
        m = min(m, k)
        out = torch.empty(x.shape[0], m, dtype=torch.long, device=x.device)
        rows = max(1, chunk_elems // max(1, k))
        keys = faiss_proxy_keys(*self._proxy) if x.device.type == "cpu" else None  # once, not per chunk
        for s in range(0, x.shape[0], rows):
            xs = x[s : s + rows].to(torch.float32)
            out[s : s + rows] = (proxy_top_m_faiss(xs, keys, m) if keys is not None
                                 else proxy_top_m_torch(xs, *self._proxy, m))
        return out

    def weighted_log_prob_pairs(self, x: Tensor, points: Tensor, comps: Tensor,
                                chunk_rows: int | None = None, batched: bool | None = None) -> Tensor:
        """ln π_k + ln N(x_p; μ_k, Σ_k) for pairs p = (points[p], comps[p]) only.

        Pairs are grouped by component, and each component's points are whitened with one
        (n_k, D) x (D, D) GEMM (in ``work_dtype``): O(P·D²) flops, O(P + chunk·D) memory.

        Parameters
        ----------
        x : Tensor of shape (N, D)
        points, comps : Tensor of shape (P,), int64
        chunk_rows : int, optional
            Most pairs per GEMM (default :func:`~deepdpm_core.bayes.stats.gather_chunk_rows`).
        batched : bool, optional
            Batched GEMMs over blocks (:mod:`deepdpm_core.bayes.blocks`) instead of a loop over
            the components (default: on a GPU).

        Returns
        -------
        Tensor of shape (P,), in ``compute_dtype``
        """
        if blocks.use_blocks(x, batched):
            return self.log_prob_blocked(x, points, comps)[0]
        chunk_rows = chunk_rows or gather_chunk_rows(self.dim, x.device)
        order = torch.argsort(comps.to(torch.int32), stable=True)  # same order, 2x faster than int64
        counts = torch.bincount(comps, minlength=self.n_components).tolist()
        out = torch.empty(comps.shape[0], dtype=self.compute_dtype, device=x.device)
        start = 0
        for k, count in enumerate(counts):
            for s in range(start, start + count, chunk_rows):
                pairs = order[s : min(s + chunk_rows, start + count)]
                xs = x.index_select(0, points.index_select(0, pairs))
                out[pairs] = self.log_prob_centred(self.centre(xs, k), k)
            start += count
        return out

    def centre(self, xs: Tensor, k: int | Tensor) -> Tensor:
        """x − μ_k in ``work_dtype`` (k: one component, or one per row): centred before the
        (float32) GEMMs, so their rounding is relative to the component's spread, not to
        its offset."""
        return xs.to(self.work_dtype) - self.means_work[k]

    def log_prob_centred(self, delta: Tensor, k: int) -> Tensor:
        """ln π_k + ln N(μ_k + delta; μ_k, Σ_k) for rows delta (n, D); (n,) in ``compute_dtype``."""
        return self.log_prob_whitened(delta @ self.prec_chol_work[k], k)

    def log_prob_whitened(self, y: Tensor, k: int | Tensor) -> Tensor:
        """ln π_k − ½ ln|2πΣ_k| − ½‖y‖² for whitened rows y = P_kᵀ(x − μ_k) (n, D); k: one
        component, or one per row. (n,) in ``compute_dtype``."""
        return self.log_norm[k] - 0.5 * y.square().sum(1).to(self.compute_dtype)

    def log_prob_blocked(self, x: Tensor, points: Tensor, comps: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`weighted_log_prob_pairs` as batched GEMMs over blocks of same-component
        pairs, and the offsets ‖x_p − μ_k‖ (both (P,), ``compute_dtype`` and ``work_dtype``)."""
        order = torch.argsort(comps, stable=True)
        points, comps = points.index_select(0, order), comps.index_select(0, order)
        layout = self.layout
        block, slot, segment, _ = layout.segment(torch.bincount(comps, minlength=self.n_components))
        lp = torch.empty(len(comps), dtype=self.compute_dtype, device=x.device)
        offset = torch.empty(len(comps), dtype=self.work_dtype, device=x.device)
        d = self.dim
        for b0, b1, t0, t1 in layout.chunks(block, len(segment), 2 * layout.rows * d + d * d):
            at, k, dest = (block[t0:t1] - b0, slot[t0:t1]), comps[t0:t1], order[t0:t1]
            delta = self.centre(x.index_select(0, points[t0:t1]), k)
            y = torch.bmm(layout.pack(delta, at, b1 - b0), self.prec_chol_work[segment[b0:b1]])[at]
            lp[dest] = self.log_prob_whitened(y, k)
            offset[dest] = delta.norm(dim=1)
        return lp, offset

    def to(self, device: torch.device | str) -> GaussianMixture:
        return GaussianMixture(
            self.means.to(device), self.covariances.to(device), self.log_weights.to(device),
            self.compute_dtype, self.work_dtype, self.layout,
        )



#: the Dirichlet pseudo-count c of the mixing weights: one row's worth, so that a cluster
#: (or subcluster) left empty keeps a weight to win rows back, and a cluster of thousands of
#: rows keeps its empirical weight
WEIGHT_PSEUDOCOUNT = 1.0


def log_weights_from_counts(counts: Tensor, pseudocount: float = WEIGHT_PSEUDOCOUNT) -> Tensor:
    """ln π from (soft) counts with a Dirichlet pseudo-count added to each count.

    π_k = (N_k + c) / Σ_k' (N_k' + c). Adding c to the counts (not to the fractions, as
    the reference code does) keeps large clusters' weights at their empirical values.

    Parameters
    ----------
    counts : Tensor of shape (..., K)
        Normalised over the last axis (e.g. (K, 2) for every cluster's two subclusters).

    Returns
    -------
    Tensor of shape (..., K), float64
    """
    c = counts.to(torch.float64) + pseudocount
    c = c.clamp_min(1e-300)
    return torch.log(c) - torch.log(c.sum(-1, keepdim=True))
