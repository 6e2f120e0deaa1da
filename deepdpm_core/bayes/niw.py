"""Normal-Inverse-Wishart prior: posterior, marginal likelihood, MAP, Hastings ratios.

Parameterisation (paper Supmat, "The NIW Prior"): (μ, Σ) ~ NIW(m0, κ0, ν0, Λ0) with
Σ ~ W⁻¹(ν0, Λ0) and μ | Σ ~ N(m0, Σ/κ0). The paper writes the inverse-Wishart scale as
ν·Ψ; here Λ0 = ν0·Ψ0 with Ψ0 = s·I (``psi="identity"``) or s·diag(std(X))
(``psi="data_std"``), s = ``prior.sigma_scale``.

Posterior from the statistics (n, s1 = Σ x, s2 = Σ x xᵀ) of the points (Supmat
Eqs. NIWposteriorUpdates 1–4, also with soft weights)::

    κn = κ0 + n
    mn = (κ0 m0 + s1) / κn
    νn = ν0 + n
    Λn = Λ0 + κ0 m0 m0ᵀ + s2 + n·diag(δ) − κn mn mnᵀ

δ is the prior's covariance floor: every value is taken as known only to a variance δ_j
(the expected statistics of the points plus independent N(0, diag(δ)) noise), so a
cluster whose points share a value, or lie on a line, still has a positive-definite Λn
and a finite evidence. δ = 0 is the paper's model.

Log marginal likelihood (Supmat Eq. LL_post)::

    ln f(X) = −(n D / 2) ln π + ln Γ_D(νn/2) − ln Γ_D(ν0/2)
              + (ν0/2) ln|Λ0| − (νn/2) ln|Λn| + (D/2)(ln κ0 − ln κn)

MAP estimate = mode of the joint NIW posterior::

    μ̂ = mn,    Σ̂ = Λn / (νn + D + 2)

Diagonal covariances (``diagonal=True``, the reference code's Normal-Inverse-Gamma prior)
are D independent one-dimensional NIW models, one per feature: the same formulas with
D = 1 on the diagonal of Λ0 and Λn, summed over features, and Σ̂ = diag(Λn) / (νn + 3).

The prior's scale can be fitted to the clusters (:func:`empirical_bayes_scale`): with
Λ0 = ν0·s·P for a fixed diagonal shape P, the s that maximises Σ_k ln f(X_k) (type-II
maximum likelihood, or empirical Bayes, of the inverse-Wishart scale) solves a
one-dimensional monotone equation in the eigenvalues of each cluster's Λn − Λ0; given s,
the degrees of freedom ν0 too (:func:`empirical_bayes_nu`): how tightly the clusters'
covariances are held to the prior's shape.

All math is float64; log-determinants come from Cholesky factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepdpm_core.bayes.linalg import cholesky_jittered
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
    m0 = prior.m0.to(stats.s1)
    kn = prior.kappa + stats.n
    mn = (prior.kappa * m0 + stats.s1) / kn[:, None]
    nun = prior.nu + stats.n
    # one (R, D, D) buffer (at R = 3000, D = 128 it is 0.4 GB). Symmetric when s2 is: the
    # outer product is a_i a_j with a = √κn mn on both sides, so no symmetrising pass
    scale = stats.s2 + (prior.scale.to(stats.s2) + prior.kappa * torch.outer(m0, m0))
    if prior.floor is not None:  # + n·diag(δ)
        scale.diagonal(dim1=-2, dim2=-1).add_(stats.n[:, None] * prior.floor.to(stats.s2)[None, :])
    a = kn.sqrt()[:, None] * mn
    scale.baddbmm_(a[:, :, None], a[:, None, :], alpha=-1.0)  # − κn mn mnᵀ
    return NIWPosterior(kn, mn, nun, scale)


def logdet_spd(mat: Tensor) -> Tensor:
    """ln|A| of symmetric positive-definite matrices (..., D, D) via Cholesky."""
    chol = cholesky_jittered(mat)
    return 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)


def log_marginal_likelihood(prior: NIWPrior, stats: SuffStats) -> Tensor:
    """ln f(X_r; λ) for every row r of ``stats`` (module docstring).

    Returns
    -------
    Tensor of shape (R,), float64
    """
    post = posterior(prior, stats)
    d = prior.dim
    if prior.diagonal:  # D one-dimensional models (D = 1 in every term), summed
        lam0 = prior.scale.diagonal().to(stats.s2)
        lamn = post.scale.diagonal(dim1=-2, dim2=-1)
        return (
            -0.5 * stats.n * d * math.log(math.pi)
            + d * (torch.lgamma(post.nu / 2.0) - math.lgamma(prior.nu / 2.0))
            + 0.5 * prior.nu * torch.log(lam0).sum()
            - 0.5 * post.nu * torch.log(lamn).sum(-1)
            + 0.5 * d * (math.log(prior.kappa) - torch.log(post.kappa))
        )
    logdet0 = logdet_spd(prior.scale.to(stats.s2))
    return (
        -0.5 * stats.n * d * math.log(math.pi)
        + torch.special.multigammaln(post.nu / 2.0, d)
        - torch.special.multigammaln(torch.tensor(prior.nu / 2.0, dtype=torch.float64), d)
        + 0.5 * prior.nu * logdet0
        - 0.5 * post.nu * logdet_spd(post.scale)
        + 0.5 * d * (math.log(prior.kappa) - torch.log(post.kappa))
    )


def map_estimate(prior: NIWPrior, stats: SuffStats) -> tuple[Tensor, Tensor]:
    """Posterior mode (μ̂, Σ̂) = (mn, Λn / (νn + D + 2)) for every row.

    Returns
    -------
    means : Tensor of shape (R, D)
    covariances : Tensor of shape (R, D, D)
    """
    post = posterior(prior, stats)
    if prior.diagonal:  # per feature: λn / (νn + 1 + 2)
        var = post.scale.diagonal(dim1=-2, dim2=-1) / (post.nu + 3.0)[:, None]
        return post.mean, torch.diag_embed(var)
    return post.mean, post.scale.div_((post.nu + prior.dim + 2.0)[:, None, None])


def _scale_spectrum(prior: NIWPrior, stats: SuffStats, shape: Tensor, diagonal: bool) -> Tensor:
    """What the evidence's dependence on the prior's scale s sees of each row.

    With Λ0 = ν0·s·P and t = ν0·s, Λn = t·P + B with B = s2 + n·diag(δ) + κ0 m0 m0ᵀ −
    κn mn mnᵀ independent of s. The terms of ln f(X_r) that depend on s are
    (ν0 D/2) ln t − (νn,r/2) Σ_i ln(t + β_ri), β_r the eigenvalues of P^(−1/2) B_r P^(−1/2)
    (its diagonal entries when ``diagonal``: each feature a model of dimension 1).

    Returns
    -------
    Tensor of shape (R, D), float64, CPU: β.
    """
    post = posterior(prior, stats)
    p = shape.to(post.scale)
    bmat = (post.scale - prior.scale.to(post.scale)) / torch.sqrt(p[:, None] * p[None, :])
    beta = bmat.diagonal(dim1=-2, dim2=-1) if diagonal else torch.linalg.eigvalsh(bmat)
    return beta.clamp_min(0.0).cpu()


def empirical_bayes_scale(prior: NIWPrior, stats: SuffStats, shape: Tensor,
                          per_feature: bool = False, iters: int = 100) -> float:
    """Type-II maximum likelihood of the prior's scale s, Λ0 = ν0·s·P, given cluster stats.

    Maximises Σ_k ln f(X_k; m0, κ0, ν0, ν0·s·P) over s with m0, κ0, ν0 and P fixed. Only
    Λ0 depends on s (:func:`_scale_spectrum`); the objective is concave in ln t, with
    derivative ½ Σ_k [ν0 D − νn,k Σ_i t / (t + β_ki)] falling from ½ Σ_k (ν0 D − νn,k ·
    #{β_ki = 0}) to −½ Σ_k n_k D, so bisection in ln t finds its root. A set whose
    derivative is negative everywhere (degenerate rows, e.g. single points) gets the lower
    end of the bracket, 1e-12 of the mean β. For isotropic clusters of variance σ² it is
    s = σ²: the prior's scale is the clusters' own spread. Sees only the (all-reduced)
    statistics, so every rank gets the same s.

    Parameters
    ----------
    prior : NIWPrior
        m0, κ0, ν0 and diagonal-ness; its current Λ0 only enters through B_k = Λn − Λ0.
    stats : SuffStats with K rows
    shape : Tensor of shape (D,)
        diag(P), positive.
    per_feature : bool
        Fit s to the clusters' per-feature variances: the evidence of the diagonal model
        of the same clusters (one Normal-Inverse-Gamma model per feature, ν0 = 3 unless
        the prior is diagonal already), whatever ``prior.diagonal``.

    Returns
    -------
    float
        s, in the units of the data squared.
    """
    diagonal = prior.diagonal or per_feature
    nu0, d = (prior.nu if prior.diagonal or not per_feature else 3.0), prior.dim
    keep = stats.n > 0
    beta = _scale_spectrum(prior, stats.rows(torch.nonzero(keep).squeeze(1)), shape, diagonal)
    nun = nu0 + stats.n[keep].cpu()
    ref = float(beta.mean()) if beta.numel() else 0.0
    if not ref > 0:
        return 1.0
    lo, hi = math.log(ref * 1e-12), math.log(ref) + 40.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        t = math.exp(mid)
        if float((nu0 * d - nun * (t / (t + beta)).sum(-1)).sum()) > 0:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi)) / nu0


def empirical_bayes_nu(prior: NIWPrior, stats: SuffStats, shape: Tensor, sigma_scale: float,
                       floor: float | None = None, ceiling: float | None = None, iters: int = 60) -> float:
    """Type-II maximum likelihood of the prior's degrees of freedom ν0, given s.

    Maximises Σ_k ln f(X_k; m0, κ0, ν0, ν0·s·P) over ν0 with m0, κ0, s and P fixed. The
    prior's mode Σ̂0 = ν0·s·P / (ν0 + D + 1) barely moves with ν0; what ν0 sets is how
    tightly the clusters' covariances are held to it. Clusters of one common shape (e.g.
    isotropic blobs of one spread) drive ν0 up, so that a cluster's covariance costs
    little evidence even when it has few points per dimension (D = 128, 600 points a
    cluster); clusters of varied shapes keep it at the weak end. With t = ν0·s the ν0-terms
    of ln f(X_k) are (:func:`_scale_spectrum`, G = ln Γ_D for full covariances, D·ln Γ
    for diagonal ones)::

        G(νn,k/2) − G(ν0/2) + (ν0 D/2) ln t − (νn,k/2) Σ_i ln(t + β_ki),  νn,k = ν0 + n_k

    maximised by golden-section search over ln(ν0 − D + 1) (ln ν0 when diagonal) within
    [``floor``, ``ceiling``]. Sees only the (all-reduced) statistics.

    Parameters
    ----------
    prior : NIWPrior
        m0, κ0 and diagonal-ness; its Λ0 only enters through B_k = Λn − Λ0.
    stats : SuffStats with K rows
    shape : Tensor of shape (D,)
        diag(P), positive.
    sigma_scale : float
        s, in the units of the data squared.
    floor, ceiling : float, optional
        The search interval of ν0; default [D + 2, 10⁴ (D + 2)] ([3, 3·10⁴] when diagonal):
        never weaker than the paper's prior.

    Returns
    -------
    float
        ν0.
    """
    d = prior.dim
    weakest = 3.0 if prior.diagonal else d + 2.0
    floor = weakest if floor is None else float(floor)
    ceiling = 1e4 * weakest if ceiling is None else float(ceiling)
    keep = stats.n > 0
    if not bool(keep.any()):
        return floor
    beta = _scale_spectrum(prior, stats.rows(torch.nonzero(keep).squeeze(1)), shape, prior.diagonal)
    n = stats.n[keep].cpu().to(torch.float64)
    offset = 0.0 if prior.diagonal else d - 1.0  # ν0 must exceed it

    def log_gamma(a: Tensor) -> Tensor:  # G(a) of the module docstring, for every row
        return d * torch.lgamma(a) if prior.diagonal else torch.special.multigammaln(a, d)

    def evidence(u: float) -> float:
        nu0 = offset + math.exp(u)
        t = nu0 * sigma_scale
        nun = nu0 + n
        terms = (log_gamma(nun / 2.0) - log_gamma(torch.tensor(nu0 / 2.0, dtype=torch.float64))
                 + 0.5 * nu0 * d * math.log(t) - 0.5 * nun * torch.log(t + beta).sum(-1))
        return float(terms.sum())

    lo, hi = math.log(floor - offset), math.log(ceiling - offset)
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = evidence(a), evidence(b)
    for _ in range(iters):
        if fa >= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = evidence(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = evidence(b)
    return offset + math.exp(0.5 * (lo + hi))


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
