"""Gaussian-mixture parameters with cached Cholesky factors and the batched E-step.

The E-step (paper Eq. 3) needs ln π_k + ln N(x; μ_k, Σ_k) for every point of every
minibatch, with parameters frozen for the whole epoch. The precision Cholesky factors
are computed once per M-step (as in scikit-learn's ``_estimate_log_gaussian_prob``), so a
batch costs one (B, D) x (D, K·D) matrix product and no factorisation.

At large K that dense product, O(B·K·D²), dominates an epoch. The top-m E-step
(:meth:`GaussianMixture.top_m_log_responsibilities`) ranks the components of each point
by a cheap O(K·D) isotropic proxy, keeps the best m, and evaluates the exact Gaussian
log-densities only for those m, grouped by component so each component costs one GEMM
(O(N·m·D²) in all). Points' responsibilities outside their m candidates are taken as 0;
for separated clusters that mass is below float precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import faiss
import torch

from deepdpm_core.niw import _cholesky
from deepdpm_core.stats import gather_chunk_rows

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
    """

    means: Tensor
    covariances: Tensor
    log_weights: Tensor
    compute_dtype: torch.dtype = torch.float64
    _prec_chol: Tensor = field(init=False, repr=False)
    _shifted_means: Tensor = field(init=False, repr=False)
    _log_norm: Tensor = field(init=False, repr=False)
    work_dtype: torch.dtype = torch.float32
    _means_work: Tensor = field(init=False, repr=False)
    _prec_chol_work: Tensor = field(init=False, repr=False)
    _proxy: tuple[Tensor, Tensor, Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.refresh()

    @property
    def n_components(self) -> int:
        return self.means.shape[0]

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    def refresh(self) -> None:
        """Recompute the cached factors (call after changing the parameters)."""
        chol = _cholesky(self.covariances)  # Σ = L Lᵀ
        eye = torch.eye(self.dim, dtype=chol.dtype, device=chol.device).expand_as(chol)
        # P = L^{-T}: Σ^{-1} = P Pᵀ and ||(x − μ)ᵀ P||² is the Mahalanobis distance
        prec_chol = torch.linalg.solve_triangular(chol, eye, upper=False).transpose(-1, -2)
        log_det = 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)
        self._log_norm = (
            self.log_weights - 0.5 * (self.dim * math.log(2 * math.pi) + log_det)
        ).to(self.compute_dtype)
        # (D, K·D) so one matmul projects a batch into every component's whitened frame
        self._prec_chol = prec_chol.permute(1, 0, 2).reshape(self.dim, -1).to(self.compute_dtype)
        self._shifted_means = torch.einsum("kd,kde->ke", self.means, prec_chol).reshape(-1).to(
            self.compute_dtype
        )
        # per-component factors for the grouped top-m path, (K, D) and (K, D, D), in the
        # dtype of the data (float32: its GEMMs are ~8x faster than float64 on CPU)
        self._means_work = self.means.to(self.work_dtype)
        self._prec_chol_work = prec_chol.to(self.work_dtype)
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
        y = x.to(self.compute_dtype) @ self._prec_chol - self._shifted_means
        maha = y.view(x.shape[0], self.n_components, self.dim).square().sum(-1)
        return self._log_norm - 0.5 * maha

    def log_responsibilities(self, x: Tensor) -> Tensor:
        """ln r^E_ik, the E-step posterior (paper Eq. 3), shape (B, K)."""
        lp = self.weighted_log_prob(x)
        return lp - torch.logsumexp(lp, dim=1, keepdim=True)

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

    def weighted_log_prob_at(self, x: Tensor, index: Tensor, chunk_rows: int | None = None) -> Tensor:
        """ln π_k + ln N(x_i; μ_k, Σ_k) for the given (point, component) pairs only.

        Pairs are sorted by component, and each component's points are whitened with one
        (n_k, D) x (D, D) GEMM: O(N·m·D²) flops and O(N·m + chunk·D) memory.

        Parameters
        ----------
        x : Tensor of shape (N, D)
        index : Tensor of shape (N, m), int64
            Components to evaluate for each point.
        chunk_rows : int, optional
            Most pairs per GEMM (default :func:`~deepdpm_core.stats.gather_chunk_rows`).

        Returns
        -------
        Tensor of shape (N, m), in ``compute_dtype`` (GEMMs in ``work_dtype``); entry
        (i, j) is for component index[i, j].
        """
        m = index.shape[1]
        chunk_rows = chunk_rows or gather_chunk_rows(self.dim, x.device)
        flat = index.reshape(-1)
        order = torch.argsort(flat.to(torch.int32), stable=True)  # same order, 2x faster than int64
        counts = torch.bincount(flat, minlength=self.n_components).tolist()
        out = torch.empty(flat.shape[0], dtype=self.compute_dtype, device=x.device)
        start = 0
        for k, count in enumerate(counts):
            for s in range(start, start + count, chunk_rows):
                pairs = order[s : min(s + chunk_rows, start + count)]
                # centred before the (float32) GEMM, so rounding is relative to the spread
                xs = x.index_select(0, pairs // m).to(self.work_dtype)
                y = (xs - self._means_work[k]) @ self._prec_chol_work[k]
                out[pairs] = self._log_norm[k] - 0.5 * y.square().sum(1).to(self.compute_dtype)
            start += count
        return out.view(index.shape)

    def top_m_log_responsibilities(self, x: Tensor, m: int) -> tuple[Tensor, Tensor]:
        """Sparse E-step: ln r^E over each point's m candidate components.

        Exact log-densities, normalised over the candidates (the mass of the other K − m
        components is dropped). With m = K this is :meth:`log_responsibilities`, permuted.

        Parameters
        ----------
        x : Tensor of shape (N, D)
        m : int

        Returns
        -------
        index : Tensor of shape (N, m), int64
        log_resp : Tensor of shape (N, m), in ``compute_dtype``
        """
        index = self.candidates(x, m)
        lp = self.weighted_log_prob_at(x, index)
        return index, lp - torch.logsumexp(lp, dim=1, keepdim=True)

    def to(self, device: torch.device | str) -> GaussianMixture:
        return GaussianMixture(
            self.means.to(device), self.covariances.to(device), self.log_weights.to(device),
            self.compute_dtype, self.work_dtype,
        )


def proxy_top_m_torch(x: Tensor, w: Tensor, a: Tensor, c: Tensor, m: int) -> Tensor:
    """Indices (B, m) of the m largest proxy scores x·w_k − ‖x‖² a_k + c_k of each row of x (B, D)."""
    score = x @ w - x.square().sum(1, keepdim=True) * a + c
    return score.topk(m, dim=1).indices


def faiss_proxy_keys(w: Tensor, a: Tensor, c: Tensor) -> Tensor:
    """The proxy as K key vectors [w_k, −a_k, c_k], shape (K, D + 2), float32, contiguous."""
    return torch.cat([w, -a[None, :], c[None, :]]).T.contiguous()


def proxy_top_m_faiss(x: Tensor, keys: Tensor, m: int) -> Tensor:
    """:func:`proxy_top_m_torch` as a FAISS inner-product search of [x, ‖x‖², 1] against
    :func:`faiss_proxy_keys` (CPU tensors)."""
    query = torch.cat([x, x.square().sum(1, keepdim=True), torch.ones(len(x), 1)], 1)
    _, index = faiss.knn(query.numpy(), keys.numpy(), m, metric=faiss.METRIC_INNER_PRODUCT)
    return torch.from_numpy(index)


def log_weights_from_counts(counts: Tensor, pseudocount: float) -> Tensor:
    """ln π from (soft) counts with a Dirichlet pseudo-count added to each count.

    π_k = (N_k + c) / Σ_k' (N_k' + c). Adding c to the counts (not to the fractions, as
    the reference code does) keeps large clusters' weights at their empirical values.

    Parameters
    ----------
    counts : Tensor of shape (K,)

    Returns
    -------
    Tensor of shape (K,), float64
    """
    c = counts.to(torch.float64) + pseudocount
    c = c.clamp_min(1e-300)
    return torch.log(c) - torch.log(c.sum())
