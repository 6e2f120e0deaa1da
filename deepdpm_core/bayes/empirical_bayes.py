"""Type-II maximum likelihood of the NIW prior's scale s and degrees of freedom ν0 given the
current clusters (docs/design.md, section Self-calibration): the prior that makes the
clusters' own statistics most probable."""

from __future__ import annotations

import math

import torch

from deepdpm_core.bayes.niw import NIWPrior, posterior
from deepdpm_core.bayes.stats import SuffStats

Tensor = torch.Tensor

#: points of each grid of the searches below: one batched evaluation narrows the bracket of
#: ln t (s) or ln(ν0 − D + 1) to 2 of its 16 cells, so ~12 evaluations reach SEARCH_TOL
GRID_POINTS = 17
#: width of the final bracket in those logarithms: a relative error of 1e-10 in s or ν0
SEARCH_TOL = 1e-10


def _narrowed(lo: float, hi: float, bracket) -> float:
    """The middle of [``lo``, ``hi``] narrowed to :data:`SEARCH_TOL`: each round evaluates a
    grid of :data:`GRID_POINTS` at once and ``bracket(grid)`` names the two grid points (their
    indices) that hold the answer."""
    while hi - lo > SEARCH_TOL:
        grid = torch.linspace(lo, hi, GRID_POINTS, dtype=torch.float64)
        first, last = bracket(grid)
        lo, hi = float(grid[first]), float(grid[last])
    return 0.5 * (lo + hi)


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
                          per_feature: bool = False) -> float:
    """Type-II maximum likelihood of the prior's scale s, Λ0 = ν0·s·P, given cluster stats.

    Maximises Σ_k ln f(X_k; m0, κ0, ν0, ν0·s·P) over s with m0, κ0, ν0 and P fixed. Only
    Λ0 depends on s (:func:`_scale_spectrum`); the objective is concave in ln t, with
    derivative ½ Σ_k [ν0 D − νn,k Σ_i t / (t + β_ki)] falling from ½ Σ_k (ν0 D − νn,k ·
    #{β_ki = 0}) to −½ Σ_k n_k D, so a search of ln t's grid for its sign change finds the root. A set whose
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
    keep = stats.n > 0
    beta = _scale_spectrum(prior, stats.rows(torch.nonzero(keep).squeeze(1)), shape, diagonal)
    nun = nu0 + stats.n[keep].cpu()
    ref = float(beta.mean()) if beta.numel() else 0.0
    if not ref > 0:
        return 1.0

    def rising(u: Tensor) -> Tensor:  # the derivative's sign at ln t = u, (M,)
        t = u.exp()[:, None, None]
        return (nu0 * d - nun * (t / (t + beta)).sum(-1)).sum(-1) > 0

    def root(grid: Tensor) -> tuple[int, int]:  # falling: it rises at the first `last` points
        last = int(rising(grid[1:-1]).sum())
        return last, last + 1

    return math.exp(_narrowed(math.log(ref * 1e-12), math.log(ref) + 40.0, root)) / nu0


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
    keep = stats.n > 0
    beta = _scale_spectrum(prior, stats.rows(torch.nonzero(keep).squeeze(1)), shape, True)  # (K, D)
    nun = (nu0 + stats.n[keep].cpu())[:, None]
    ref = beta.mean(0)
    ref = torch.where(ref > 0, ref, torch.ones_like(ref))
    lo, hi = ref.log() + math.log(1e-12), ref.log() + 40.0  # the bracket of empirical_bayes_scale
    while float((hi - lo).max()) > SEARCH_TOL:
        mid = 0.5 * (lo + hi)
        t = mid.exp()
        rising = (nu0 - nun * t / (t + beta)).sum(0) > 0
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
    of ln f(X_k) are (:func:`_scale_spectrum`, G = ln Γ_D for full covariances, D·ln Γ
    for diagonal ones)::

        G(νn,k/2) − G(ν0/2) + (ν0 D/2) ln t − (νn,k/2) Σ_i ln(t + β_ki),  νn,k = ν0 + n_k

    maximised by narrowing grids (it is unimodal) over ln(ν0 − D + 1) (ln ν0 when diagonal) within
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

    def log_gamma(a: Tensor) -> Tensor:  # G(a) of the docstring above, for every row
        return d * torch.lgamma(a) if prior.diagonal else torch.special.multigammaln(a, d)

    def evidence(u: Tensor) -> Tensor:  # at ν0 = offset + exp(u), (M,)
        nu0 = offset + u.exp()
        t = (nu0 * sigma_scale)[:, None]
        nun = nu0[:, None] + n
        terms = (log_gamma(nun / 2.0) - log_gamma(nu0 / 2.0)[:, None] + 0.5 * nu0[:, None] * d * t.log()
                 - 0.5 * nun * torch.log(t[:, :, None] + beta).sum(-1))
        return terms.sum(-1)

    def peak(grid: Tensor) -> tuple[int, int]:  # unimodal: the maximum is beside the best point
        best = int(evidence(grid).argmax())
        return max(best - 1, 0), min(best + 1, GRID_POINTS - 1)

    return offset + math.exp(_narrowed(math.log(floor - offset), math.log(ceiling - offset), peak))
