"""Gaussian-mixture parameters with cached Cholesky factors and the batched E-step.

The E-step (paper Eq. 3) needs ln π_k + ln N(x; μ_k, Σ_k) for every point of every
minibatch, with parameters frozen for the whole epoch. The precision Cholesky factors
are computed once per M-step (as in scikit-learn's ``_estimate_log_gaussian_prob``), so a
batch costs one (B, D) x (D, K·D) matrix product and no factorisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from deepdpm_core.niw import _cholesky

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
    """

    means: Tensor
    covariances: Tensor
    log_weights: Tensor
    compute_dtype: torch.dtype = torch.float64
    _prec_chol: Tensor = field(init=False, repr=False)
    _shifted_means: Tensor = field(init=False, repr=False)
    _log_norm: Tensor = field(init=False, repr=False)

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

    def to(self, device: torch.device | str) -> GaussianMixture:
        return GaussianMixture(
            self.means.to(device), self.covariances.to(device), self.log_weights.to(device),
            self.compute_dtype,
        )


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
