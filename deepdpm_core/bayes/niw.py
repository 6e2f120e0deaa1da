"""Normal-Inverse-Wishart prior: posterior, marginal likelihood, MAP, Hastings ratios.

(μ, Σ) ~ NIW(m0, κ0, ν0, Λ0): Σ ~ W⁻¹(ν0, Λ0), μ | Σ ~ N(m0, Σ/κ0), with Λ0 = ν0·Ψ0 (paper
Supmat, "The NIW Prior"; docs/design.md, "The prior"). From the statistics (n, s1 = Σ x,
s2 = Σ x xᵀ) of the points, hard or soft (Supmat Eqs. NIWposteriorUpdates 1–4, LL_post)::

    κn = κ0 + n,  mn = (κ0 m0 + s1) / κn,  νn = ν0 + n
    Λn = Λ0 + κ0 m0 m0ᵀ + s2 + n·diag(δ) − κn mn mnᵀ
    ln f(X) = −(n D / 2) ln π + ln Γ_D(νn/2) − ln Γ_D(ν0/2)
              + (ν0/2) ln|Λ0| − (νn/2) ln|Λn| + (D/2)(ln κ0 − ln κn)
    MAP (mode of the joint posterior):  μ̂ = mn,  Σ̂ = Λn / (νn + D + 2)

δ is the covariance floor: each value known only to a variance δ_j, so a cluster whose
points share a value or lie on a line keeps a positive-definite Λn; δ = 0 is the paper's
model. Diagonal covariances (``diagonal=True``) are D one-dimensional NIW models (the same
formulas with D = 1 per feature, summed), with Σ̂ = diag(Λn) / (νn + 3). All math is
float64; log-determinants come from Cholesky factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepdpm_core.bayes.linalg import cholesky_jittered, row_blocks
from deepdpm_core.bayes.stats import SuffStats
from deepdpm_core.errors import ConfigError

Tensor = torch.Tensor


@dataclass(frozen=True)
class NIWPrior:
    """NIW hyperparameters λ = (m0, κ0, ν0, Λ0).

    Attributes
    ----------
    m0 : Tensor of shape (D,), float64
    kappa : float
    nu : float
        Must exceed D − 1 (full) or 0 (diagonal).
    scale : Tensor of shape (D, D), float64
        Λ0 = ν0 Ψ0, symmetric positive definite (diagonal when ``diagonal``).
    diagonal : bool
        Diagonal covariances: D independent one-dimensional NIW models (module docstring).
    floor : Tensor of shape (D,), float64, optional
        δ, the covariance floor (module docstring); None is δ = 0.
    """

    m0: Tensor
    kappa: float
    nu: float
    scale: Tensor
    diagonal: bool = False
    floor: Tensor | None = None

    @property
    def dim(self) -> int:
        return self.m0.shape[0]

    @staticmethod
    def from_shape(
        mean: Tensor,
        shape: Tensor,
        kappa: float,
        nu: float | None,
        sigma_scale: float,
        diagonal: bool = False,
        floor: Tensor | None = None,
    ) -> NIWPrior:
        """The paper's weak prior Λ0 = ν0·s·P for a diagonal shape P.

        Parameters
        ----------
        mean : Tensor of shape (D,)
            m0 (the data mean).
        shape : Tensor of shape (D,)
            diag(P), positive: ones for Ψ0 = s·I.
        nu : float or None
            ν0; None means D + 2 (paper default), or 3 (= 1 + 2) per feature when diagonal.
        sigma_scale : float
            s, in the units of the data squared.
        floor : Tensor of shape (D,), optional
            δ, the covariance floor.
        """
        d = mean.shape[0]
        nu0 = float((1 if diagonal else d) + 2) if nu is None else float(nu)
        nu_floor = 0 if diagonal else d - 1
        if nu0 <= nu_floor:
            kind = "0 for diagonal covariances" if diagonal else f"D - 1 = {d - 1} for {d}-dimensional data"
            raise ConfigError(f"prior.nu must exceed {kind}, got {nu0}")
        scale = torch.diag(shape.to(torch.float64) * sigma_scale * nu0)
        floor = None if floor is None else floor.to(torch.float64)
        return NIWPrior(mean.to(torch.float64), float(kappa), nu0, scale, diagonal, floor)

    def with_scale(self, shape: Tensor, sigma_scale: float, kappa: float, nu: float | None = None) -> NIWPrior:
        """The same m0 and kind with Λ0 = ν0·s·diag(``shape``), κ0 = ``kappa`` and ν0 =
        ``nu`` (None: this prior's)."""
        nu0 = self.nu if nu is None else float(nu)
        scale = torch.diag(shape.to(self.scale) * (sigma_scale * nu0))
        return NIWPrior(self.m0, float(kappa), nu0, scale, self.diagonal, self.floor)

    def to(self, device: torch.device | str) -> NIWPrior:
        floor = None if self.floor is None else self.floor.to(device)
        return NIWPrior(self.m0.to(device), self.kappa, self.nu, self.scale.to(device), self.diagonal, floor)


@dataclass(frozen=True)
class NIWPosterior:
    """Posterior hyperparameters per row: κn (R,), mn (R, D), νn (R,), Λn (R, D, D)."""

    kappa: Tensor
    mean: Tensor
    nu: Tensor
    scale: Tensor


def posterior(prior: NIWPrior, stats: SuffStats) -> NIWPosterior:
    """NIW posterior for every row of ``stats`` (module docstring, updates 1–4)."""
    kn = prior.kappa + stats.n
    mn = posterior_mean(prior, stats)
    return NIWPosterior(kn, mn, prior.nu + stats.n, _posterior_scale(prior, stats, kn, mn))


def _posterior_scale(prior: NIWPrior, stats: SuffStats, kn: Tensor, mn: Tensor, out: Tensor | None = None) -> Tensor:
    """Λn of every row (module docstring, update 4), (R, D, D), in ``out`` when given, else
    in one new buffer (at R = 3000, D = 128 it is 0.4 GB), which :func:`map_estimate`
    divides in place."""
    m0 = prior.m0.to(stats.s1)
    # symmetric when s2 is: the outer product is a_i a_j with a = √κn mn on both sides, so
    # no symmetrising pass
    scale = torch.add(stats.s2, prior.scale.to(stats.s2) + prior.kappa * torch.outer(m0, m0), out=out)
    if prior.floor is not None:  # + n·diag(δ)
        scale.diagonal(dim1=-2, dim2=-1).add_(stats.n[:, None] * prior.floor.to(stats.s2)[None, :])
    a = kn.sqrt()[:, None] * mn
    return scale.baddbmm_(a[:, :, None], a[:, None, :], alpha=-1.0)  # − κn mn mnᵀ


def _posterior_scale_diagonal(prior: NIWPrior, stats: SuffStats, kn: Tensor, mn: Tensor) -> Tensor:
    """The diagonal of :func:`_posterior_scale` from the statistics' diagonals, (R, D):
    the same arithmetic per element, without the (R, D, D) matrices (a diagonal prior
    reads nothing else)."""
    m0 = prior.m0.to(stats.s1)
    diag = stats.s2.diagonal(dim1=-2, dim2=-1) + (prior.scale.diagonal().to(m0) + prior.kappa * (m0 * m0))
    if prior.floor is not None:
        diag = diag + stats.n[:, None] * prior.floor.to(m0)[None, :]
    a = kn.sqrt()[:, None] * mn
    return diag - a * a


def posterior_mean(prior: NIWPrior, stats: SuffStats) -> Tensor:
    """mn = (κ0 m0 + s1) / κn for every row of ``stats``, (R, D): the MAP mean, without the
    (R, D, D) scale."""
    return (prior.kappa * prior.m0.to(stats.s1) + stats.s1) / (prior.kappa + stats.n)[:, None]


def logdet_spd(mat: Tensor) -> Tensor:
    """ln|A| of symmetric positive-definite matrices (..., D, D) via Cholesky."""
    chol = cholesky_jittered(mat)
    return 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)


#: elements of the posterior scales built and factored at a time on the CPU by
#: :func:`_posterior_logdet`
LOGDET_BLOCK_ELEMS = 1 << 18


def _posterior_logdet(prior: NIWPrior, stats: SuffStats, kn: Tensor, mn: Tensor) -> Tensor:
    """ln|Λn| of every row, (R,), to the bits of :func:`logdet_spd` of :func:`_posterior_scale`.

    Only the factors' diagonals are read, so on the CPU each block of rows
    (:data:`LOGDET_BLOCK_ELEMS`) is built and factored in memory that is reused, not in two
    new (R, D, D) buffers: at the 3K rows of a split round at K = 1,000, D = 128 those were
    0.8 GB of fresh pages. A block that is numerically singular falls back to the whole
    batch, whose retry jitters every matrix (:func:`~deepdpm_core.bayes.linalg.cholesky_jittered`).
    """
    r, d = stats.n.shape[0], stats.dim
    if stats.s2.device.type != "cpu" or r * d * d <= LOGDET_BLOCK_ELEMS:
        return logdet_spd(_posterior_scale(prior, stats, kn, mn))
    out = torch.empty(r, dtype=stats.s2.dtype)
    for s, e in row_blocks(r, max(1, LOGDET_BLOCK_ELEMS // (d * d))):
        block = SuffStats(stats.n[s:e], stats.s1[s:e], stats.s2[s:e])
        chol, info = torch.linalg.cholesky_ex(_posterior_scale(prior, block, kn[s:e], mn[s:e]))
        if bool((info > 0).any()):
            return logdet_spd(_posterior_scale(prior, stats, kn, mn))
        out[s:e] = 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)
    return out


def log_marginal_likelihood(prior: NIWPrior, stats: SuffStats) -> Tensor:
    """ln f(X_r; λ) for every row r of ``stats`` (module docstring).

    Returns
    -------
    Tensor of shape (R,), float64
    """
    d = prior.dim
    kn, nun = prior.kappa + stats.n, prior.nu + stats.n
    mn = posterior_mean(prior, stats)
    if prior.diagonal:  # D one-dimensional models (D = 1 in every term), summed
        lam0 = prior.scale.diagonal().to(stats.s2)
        lamn = _posterior_scale_diagonal(prior, stats, kn, mn)
        return (
            -0.5 * stats.n * d * math.log(math.pi)
            + d * (torch.lgamma(nun / 2.0) - math.lgamma(prior.nu / 2.0))
            + 0.5 * prior.nu * torch.log(lam0).sum()
            - 0.5 * nun * torch.log(lamn).sum(-1)
            + 0.5 * d * (math.log(prior.kappa) - torch.log(kn))
        )
    logdet0 = logdet_spd(prior.scale.to(stats.s2))
    return (
        -0.5 * stats.n * d * math.log(math.pi)
        + torch.special.multigammaln(nun / 2.0, d)
        - torch.special.multigammaln(torch.tensor(prior.nu / 2.0, dtype=torch.float64), d)
        + 0.5 * prior.nu * logdet0
        - 0.5 * nun * _posterior_logdet(prior, stats, kn, mn)
        + 0.5 * d * (math.log(prior.kappa) - torch.log(kn))
    )


#: rows of the MAP covariances built at a time on the CPU by :func:`map_estimate`: the
#: passes over a block (the statistics plus the prior's constant, the floor, the outer
#: product, the division) run while it is in cache, not each over the whole (R, D, D) array
#: (131 MB at K = 1,000, D = 128)
MAP_BLOCK_ROWS = 16


def map_estimate(prior: NIWPrior, stats: SuffStats, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Posterior mode (μ̂, Σ̂) = (mn, Λn / (νn + D + 2)) for every row.

    On the CPU the covariances are built :data:`MAP_BLOCK_ROWS` rows at a time, to the bits
    of the whole batch (:func:`map_covariance_writer`).

    Parameters
    ----------
    out : Tensor of shape (R, D, D), float64, optional
        On the CPU, memory the full covariances overwrite where it fits (contiguous, of
        their shape and dtype, not the statistics' own) instead of fresh memory: at
        K = 1,000, D = 128 the first writes to 131 MB of new pages cost about as much as
        building the covariances.

    Returns
    -------
    means : Tensor of shape (R, D)
    covariances : Tensor of shape (R, D, D)
        ``out`` when it was used.
    """
    covs, write = map_covariance_writer(prior, stats, out)
    if write is not None:
        write(0, stats.n_rows)
    return posterior_mean(prior, stats), covs


def map_covariance_writer(prior: NIWPrior, stats: SuffStats, out: Tensor | None = None
                          ) -> tuple[Tensor, Callable[[int, int], None] | None]:
    """The MAP covariances of :func:`map_estimate` and, on the CPU with full covariances,
    not computed yet: their memory (``out`` where it fits, as there) and the function that
    writes rows [start, stop) of it, block by block. A caller that reads each block right
    after it is written reads it from cache (the mixture's factors,
    :func:`~deepdpm_core.bayes.linalg.precision_cholesky`'s ``fill``).

    Returns
    -------
    covariances : Tensor of shape (R, D, D)
        Written by the function, or already (the function is then None).
    write : callable (start, stop) or None
        Writes rows [start, stop); a range of one row only when R is 1, else it does
        not give the bits of the whole batch (:func:`row_blocks`).
    """
    kn, nun = prior.kappa + stats.n, prior.nu + stats.n
    mn = posterior_mean(prior, stats)
    if prior.diagonal:  # per feature: λn / (νn + 1 + 2)
        return torch.diag_embed(_posterior_scale_diagonal(prior, stats, kn, mn) / (nun + 3.0)[:, None]), None
    divisor = (nun + prior.dim + 2.0)[:, None, None]
    s2 = stats.s2
    if s2.device.type != "cpu":
        return _posterior_scale(prior, stats, kn, mn).div_(divisor), None
    if not (out is not None and out.device.type == "cpu" and out.shape == s2.shape and out.dtype == s2.dtype
            and out.is_contiguous() and out.untyped_storage().data_ptr() != s2.untyped_storage().data_ptr()):
        out = torch.empty_like(s2, memory_format=torch.contiguous_format)

    def write(start: int, stop: int) -> None:
        for s, e in row_blocks(stop - start, MAP_BLOCK_ROWS):
            s, e = start + s, start + e
            block = SuffStats(stats.n[s:e], stats.s1[s:e], s2[s:e])
            _posterior_scale(prior, block, kn[s:e], mn[s:e], out=out[s:e]).div_(divisor[s:e])

    return out, write


def log_split_hastings(
    prior: NIWPrior, alpha: float, sub_stats: SuffStats, log_marginals: Tensor | None = None
) -> Tensor:
    """ln H_s of splitting each cluster into its two subclusters (paper Eq. 2).

    ln H_s = ln α + ln Γ(N1) + ln f(X1) + ln Γ(N2) + ln f(X2) − ln Γ(N1+N2) − ln f(X1 ∪ X2)

    Parameters
    ----------
    sub_stats : SuffStats with 2K rows
        Hard statistics of subcluster (k, 1) at row 2k and (k, 2) at row 2k + 1.
    log_marginals : Tensor of shape (2K,), optional
        Precomputed ln f of the subcluster rows.

    Returns
    -------
    Tensor of shape (K,); −inf where a subcluster is empty.
    """
    lm_sub = log_marginal_likelihood(prior, sub_stats) if log_marginals is None else log_marginals
    merged = sub_stats.pair_sums()
    lm_all = log_marginal_likelihood(prior, merged)
    n = sub_stats.n.view(-1, 2)
    lm_sub = lm_sub.view(-1, 2)
    with torch.no_grad():
        gam = torch.lgamma(n.clamp_min(1e-300))
    log_h = (
        math.log(alpha)
        + gam.sum(1)
        + lm_sub.sum(1)
        - torch.lgamma(merged.n.clamp_min(1e-300))
        - lm_all
    )
    return torch.where((n > 0).all(1), log_h, torch.full_like(log_h, -math.inf))


def log_merge_hastings(prior: NIWPrior, alpha: float, stats_a: SuffStats, stats_b: SuffStats) -> Tensor:
    """ln H_m = −ln H_s of merging cluster pairs (a_p, b_p) (Supmat "Merge Proposals").

    Parameters
    ----------
    stats_a, stats_b : SuffStats with P rows each
        Hard statistics of the two clusters of each candidate pair.

    Returns
    -------
    Tensor of shape (P,)
    """
    p = stats_a.n_rows
    inter = torch.stack([torch.arange(p), torch.arange(p) + p], 1).reshape(-1)
    both = SuffStats(
        torch.cat([stats_a.n, stats_b.n]),
        torch.cat([stats_a.s1, stats_b.s1]),
        torch.cat([stats_a.s2, stats_b.s2]),
    ).rows(inter)
    return -log_split_hastings(prior, alpha, both)
