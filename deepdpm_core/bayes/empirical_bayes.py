"""Type-II maximum likelihood of the NIW prior's scale s and degrees of freedom ν0 given the
current clusters (docs/design.md, section Self-calibration): the prior that makes the
clusters' own statistics most probable."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from scipy.optimize import brentq

from deepdpm_core.bayes.niw import NIWPrior, posterior
from deepdpm_core.bayes.stats import SuffStats

Tensor = torch.Tensor

#: width of the final bracket of the searches below in ln t (s) or ln(ν0 − D + 1): a
#: relative error of 1e-10 in s or ν0
SEARCH_TOL = 1e-10
#: the most clusters whose covariance shapes (the eigenvalues of each one's scatter) the fit
#: of ν0 reads, evenly spaced among the clusters. ν0 is one number, how closely the
#: clusters' covariances follow one shape: 128 clusters of D eigenvalues each pin it down,
#: and the eigendecompositions of every cluster were most of an M-step at K = 1,000 in
#: 128-D (0.65 s of CPU on one thread, against 0.05 s for 128 of them). Fits of up to this
#: many clusters read every one. The spectra are needed: the search for ν0 evaluates its
#: slope about 17 times, each an O(D) sum per cluster given the spectra, but a log-determinant
#: and a trace of an inverse (a Cholesky factorisation and a triangular inverse) without them:
#: 0.05 s an evaluation for 128 clusters of 128-D, 0.9 s in all, against 0.1 s for the spectra.
NU_FIT_CLUSTERS = 128


def _falling_root(slope: Callable[[float], float], lo: float, hi: float) -> float:
    """Where ``slope``, which falls through zero at most once on [``lo``, ``hi``] (the
    derivative of a unimodal objective), crosses zero, to :data:`SEARCH_TOL` (Brent's
    method); ``lo`` where it is already ≤ 0 there, ``hi`` where it is still ≥ 0 there."""
    if slope(lo) <= 0.0:
        return lo
    if slope(hi) >= 0.0:
        return hi
    return float(brentq(slope, lo, hi, xtol=SEARCH_TOL))


def _spread(prior: NIWPrior, stats: SuffStats, shape: Tensor) -> tuple[Tensor, Tensor]:
    """The diagonal of B / P per row, and the rows that hold points.

    With Λ0 = ν0·s·P and t = ν0·s, Λn = t·P + B with B = s2 + n·diag(δ) + κ0 m0 m0ᵀ −
    κn mn mnᵀ independent of s. Read from the statistics' diagonals only: O(R·D), no
    (R, D, D) work.

    Returns
    -------
    Tensor of shape (R', D), float64, CPU: diag(B_r) / P of the R' rows with n > 0, ≥ 0.
    Tensor of shape (R',), long: those rows.
    """
    keep = torch.nonzero(stats.n > 0).squeeze(1)
    n, s1 = stats.n[keep], stats.s1[keep]
    s2 = stats.s2.diagonal(dim1=-2, dim2=-1)[keep]
    m0 = prior.m0.to(s1)
    kn = prior.kappa + n
    mn = (prior.kappa * m0 + s1) / kn[:, None]
    diag = s2 + prior.kappa * m0.square() - kn[:, None] * mn.square()
    if prior.floor is not None:
        diag = diag + n[:, None] * prior.floor.to(s1)
    return (diag / shape.to(diag)).clamp_min(0.0).cpu(), keep.cpu()


def _eigen_spectrum(prior: NIWPrior, stats: SuffStats, shape: Tensor, rows: Tensor) -> Tensor:
    """The eigenvalues of P^(−1/2) B_r P^(−1/2) (:func:`_spread`'s B = Λn − Λ0) of the rows ``rows``.

    Returns
    -------
    Tensor of shape (len(rows), D), float64, CPU, ≥ 0.
    """
    post = posterior(prior, stats.rows(rows))
    b = post.scale.sub_(prior.scale.to(post.scale))
    r = shape.to(b).rsqrt()
    b.mul_(r[:, None] * r[None, :])
    return torch.linalg.eigvalsh(b).clamp_min(0.0).cpu()


def _spectrum(prior: NIWPrior, stats: SuffStats, shape: Tensor, diagonal: bool) -> tuple[Tensor, Tensor]:
    """What the evidence's dependence on t = ν0·s sees of each row with points: the terms
    of ln f(X_r) that depend on s or ν0 are (ν0 D/2) ln t − (νn,r/2) Σ_i ln(t + β_ri), β_r
    the eigenvalues of P^(−1/2) B_r P^(−1/2) (:func:`_spread`), or its diagonal entries when
    ``diagonal`` (each feature a model of dimension 1). Eigenvalues are taken of at most
    :data:`NU_FIT_CLUSTERS` rows, evenly spaced.

    Returns
    -------
    Tensor of shape (R', D), float64, CPU: β of the rows read.
    Tensor of shape (R',), float64, CPU: their n.
    """
    spread, keep = _spread(prior, stats, shape)
    if diagonal:
        return spread, stats.n.cpu()[keep]
    if len(keep) > NU_FIT_CLUSTERS:
        keep = keep[torch.linspace(0, len(keep) - 1, NU_FIT_CLUSTERS, dtype=torch.float64).round().long()]
    rows = keep.to(stats.n.device)
    return _eigen_spectrum(prior, stats, shape, rows), stats.n.cpu()[keep]


def empirical_bayes_scale(prior: NIWPrior, stats: SuffStats, shape: Tensor,
                          per_feature: bool = False) -> float:
    """Type-II maximum likelihood of the prior's scale s, Λ0 = ν0·s·P, given cluster stats.

    Maximises Σ_k ln f(X_k; m0, κ0, ν0, ν0·s·P) over s with m0, κ0, ν0 and P fixed. Only
    Λ0 depends on s (:func:`_spectrum`); the objective is concave in ln t, with
    derivative ½ Σ_k [ν0 D − νn,k Σ_i t / (t + β_ki)] falling from ½ Σ_k (ν0 D − νn,k ·
    #{β_ki = 0}) to −½ Σ_k n_k D, so Brent's method finds its root in ln t. A set whose
    derivative is negative everywhere (degenerate rows, e.g. single points) gets the lower
    end of the bracket, 1e-12 of the mean β. Isotropic clusters of variance σ² give s = σ².
    Sees only the (all-reduced) statistics, so every rank gets the same s.

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
    beta, n = _spectrum(prior, stats, shape, diagonal)
    nun = nu0 + n
    ref = float(beta.mean()) if beta.numel() else 0.0
    if not ref > 0:
        return 1.0

    def slope(u: float) -> float:  # twice the derivative in ln t, at ln t = u
        t = math.exp(u)
        return float((nu0 * d - nun * (t / (t + beta)).sum(-1)).sum())

    return math.exp(_falling_root(slope, math.log(ref * 1e-12), math.log(ref) + 40.0)) / nu0


def empirical_bayes_shape(prior: NIWPrior, stats: SuffStats, shape: Tensor) -> Tensor:
    """Type-II maximum likelihood of Ψ0's shape, one scale per feature.

    Each feature alone is a Normal-Inverse-Gamma model of the clusters (ν0 = 3, Λ0,d =
    t_d·P_d), and t_d maximises its evidence: the derivative ½ Σ_k [ν0 − νn,k t_d /
    (t_d + β_kd)] (:func:`empirical_bayes_scale` for one feature) falls monotonically in
    ln t_d, so every feature's root is bisected at once, to :data:`SEARCH_TOL`. Sees only
    the (all-reduced) statistics.

    Parameters
    ----------
    prior : NIWPrior
        m0 and κ0; its Λ0 only enters through B_k = Λn − Λ0.
    stats : SuffStats with K rows
    shape : Tensor of shape (D,)
        The prior's base shape P, positive.

    Returns
    -------
    Tensor of shape (D,), float64, CPU
        t_d·P_d, scaled to the mean of P: Ψ0 = s·diag(it) with s fitted as before.
    """
    nu0 = 3.0
    beta, n = _spectrum(prior, stats, shape, True)  # (K, D)
    nun = (nu0 + n)[:, None]
    ref = beta.mean(0)
    ref = torch.where(ref > 0, ref, torch.ones_like(ref))
    lo, hi = ref.log() + math.log(1e-12), ref.log() + 40.0  # the bracket of empirical_bayes_scale
    # the (K, D) terms of every step in two buffers, not four new arrays a step
    terms, scratch = torch.empty_like(beta), torch.empty_like(beta)
    while float((hi - lo).max()) > SEARCH_TOL:
        mid = 0.5 * (lo + hi)
        t = mid.exp()
        # ν0 − νn·t / (t + β): (−x) + ν0 is ν0 − x to the bit
        torch.mul(nun, t, out=terms).div_(torch.add(t, beta, out=scratch)).neg_().add_(nu0)
        rising = terms.sum(0) > 0
        lo, hi = torch.where(rising, mid, lo), torch.where(rising, hi, mid)
    base = shape.cpu().to(torch.float64)
    fitted = (0.5 * (lo + hi)).exp() * base
    return fitted * (base.mean() / fitted.mean())


def empirical_bayes_nu(prior: NIWPrior, stats: SuffStats, shape: Tensor, sigma_scale: float,
                       floor: float | None = None, ceiling: float | None = None) -> float:
    """Type-II maximum likelihood of the prior's degrees of freedom ν0, given s.

    Maximises Σ_k ln f(X_k; m0, κ0, ν0, ν0·s·P) over ν0 with m0, κ0, s and P fixed: how
    tightly the clusters' covariances are held to the prior's mode ν0·s·P / (ν0 + D + 1),
    which barely moves with ν0 (docs/design.md, "Self-calibration"). With t = ν0·s the ν0-terms
    of ln f(X_k) are (:func:`_spectrum`, G = ln Γ_D for full covariances, D·ln Γ
    for diagonal ones)::

        G(νn,k/2) − G(ν0/2) + (ν0 D/2) ln t − (νn,k/2) Σ_i ln(t + β_ki),  νn,k = ν0 + n_k

    maximised (it is unimodal) where its derivative in ν0, with G' the sum of digammas,

        ½ [G'(νn,k/2) − G'(ν0/2) + D (ln t + 1) − Σ_i ln(t + β_ki) − νn,k s Σ_i 1/(t + β_ki)],

    summed over k, crosses zero (Brent's method over ln(ν0 − D + 1), ln ν0 when diagonal),
    within [``floor``, ``ceiling``]. Sees only the (all-reduced) statistics.

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
    beta, n = _spectrum(prior, stats, shape, prior.diagonal)
    if not len(n):
        return floor
    offset = 0.0 if prior.diagonal else d - 1.0  # ν0 must exceed it

    halves = torch.arange(1 if prior.diagonal else d, dtype=torch.float64) / 2.0

    def log_gamma_slope(a: Tensor) -> Tensor:  # G'(a) of the docstring above, for every row
        digamma = torch.special.digamma(a[..., None] - halves).sum(-1)
        return d * digamma if prior.diagonal else digamma

    def slope(u: float) -> float:  # twice dh/dν0 at ν0 = offset + exp(u), the same sign as dh/du
        nu0 = offset + math.exp(u)
        t = nu0 * sigma_scale
        nun = nu0 + n
        terms = (log_gamma_slope(nun / 2.0) - log_gamma_slope(torch.tensor(nu0 / 2.0, dtype=torch.float64))
                 + d * (math.log(t) + 1.0) - torch.log(t + beta).sum(-1) - nun * sigma_scale * (1.0 / (t + beta)).sum(-1))
        return float(terms.sum())

    return offset + math.exp(_falling_root(slope, math.log(floor - offset), math.log(ceiling - offset)))
