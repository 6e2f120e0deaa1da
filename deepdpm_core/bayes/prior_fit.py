"""The fit's NIW prior and its refit to the clusters (type-II maximum likelihood).

Ψ0 = s·P, P the prior's shape (fitted per feature, I or diag of the features' standard
deviations, on x̃), s ``prior.sigma_scale`` (a number, or fitted at every M-step), ν0
fitted given s with ``prior.nu: auto``, and with ``covariance_type: auto`` the full or
diagonal prior of larger evidence (docs/design.md, "The prior" and "Self-calibration").
"""

from __future__ import annotations

from typing import Any

import torch

from deepdpm_core.bayes.empirical_bayes import (
    empirical_bayes_nu,
    empirical_bayes_scale,
    empirical_bayes_shape,
)
from deepdpm_core.bayes.niw import NIWPrior, log_marginal_likelihood
from deepdpm_core.bayes.stats import SuffStats
from deepdpm_core.config import PriorConfig
from deepdpm_core.data import FeatureCoordinates
from deepdpm_core.errors import ConfigError, DataError

#: how ``prior.sigma_scale`` fits s to the clusters (per feature or not)
PER_FEATURE = {"auto": True, "evidence": False}
#: coordinate-ascent rounds of (s, ν0) when s maximises the prior's own evidence
EB_ROUNDS = 4
#: ε of the covariance floor δ = ε·v (docs/design.md, "The prior"): every value is known only
#: to ε times its feature's variance v over the data, so constant, duplicated, binary or
#: collinear features and clusters of a few rows keep a positive-definite posterior; at
#: 1e-4 of a feature's spread it is far below any cluster's own
COVARIANCE_FLOOR = 1.0e-4
#: a fixed s may be at most this many times the features' mean variance, or at least its
#: reciprocal: beyond it Λ0 and the clusters' posterior scales overflow or underflow float64
#: (a prior 1e300 times the data's spread fails inside an eigendecomposition, not here)
SIGMA_SCALE_RANGE = 1.0e100


class PriorFit:
    """The candidate NIW priors of a fit and the one in use.

    Parameters
    ----------
    config : PriorConfig
    coords : FeatureCoordinates
        The fit's coordinates (their ``unit`` and ``axis_std`` give P).
    device : torch.device

    Attributes
    ----------
    shape : Tensor of shape (D,), float64
        P on x̃: Ψ0 = s·diag(shape); with ``psi: fitted`` refitted by every :meth:`fit`
        (:func:`~deepdpm_core.bayes.empirical_bayes.empirical_bayes_shape`), of the mean of
        ``base_shape``.
    base_shape : Tensor of shape (D,), float64
        P before any fit: I or diag(std), on x̃.
    floor : Tensor of shape (D,), float64
        δ on x̃ (:class:`~deepdpm_core.bayes.niw.NIWPrior`): :data:`COVARIANCE_FLOOR` times
        each feature's variance over the data, or times the mean one (1 on x̃) for a
        constant feature.
    sigma_scale : float
        s, in the features' units squared; a fitted one starts at the data's mean
        per-feature variance (the first fit, at initialisation, replaces it).
    priors : list of NIWPrior
        The candidates (full and/or diagonal covariances).
    scales : list of float
        Each candidate's s, kept as fitted: recovering it from Ψ0 rounds, and a resumed
        fit's ν0 refit reads Λ0, so it would not go on exactly as the uninterrupted one.
    prior : NIWPrior
        The one in use.
    """

    def __init__(self, config: PriorConfig, coords: FeatureCoordinates, device: torch.device) -> None:
        self.config = config
        d = coords.dim
        f64 = {"dtype": torch.float64}
        unit2 = coords.unit**2
        # Ψ0 = s·I or s·diag(std) in the features' units is s·shape on x̃
        std = coords.axis_std.to(torch.float64)
        self.shape = torch.full((d,), 1.0 / unit2, **f64) if config.psi != "data_std" else \
            torch.where(std > 0, std, torch.ones(d, **f64)) / unit2
        self.base_shape = self.shape
        self.sigma_scale = float(config.sigma_scale) if isinstance(config.sigma_scale, float) else unit2
        relative = self.sigma_scale / unit2
        if not 1.0 / SIGMA_SCALE_RANGE <= relative <= SIGMA_SCALE_RANGE:
            raise ConfigError(
                f"prior.sigma_scale={self.sigma_scale:g} is {relative:.3g} times the features' mean variance "
                f"({unit2:.3g}): no cluster can be fitted at that scale; set a value near the clusters' "
                "variance, or prior.sigma_scale=auto")
        # δ = ε·v on x̃, v the per-feature variance (mean 1 on x̃; 1 for a constant feature)
        variance = (std / coords.unit).square()
        self.floor = COVARIANCE_FLOOR * torch.where(variance > 0, variance, torch.ones(d, **f64))
        kinds = ("full", "diag") if config.covariance_type == "auto" else (config.covariance_type,)
        self.priors = [
            NIWPrior.from_shape(torch.zeros(d, **f64), self.shape, self.kappa(self.sigma_scale),
                                None if config.nu == "auto" else config.nu,
                                self.sigma_scale, diagonal=kind == "diag", floor=self.floor).to(device)
            for kind in kinds
        ]
        self.prior = self.priors[0]
        self.scales = [self.sigma_scale] * len(self.priors)

    def kappa(self, sigma_scale: float) -> float:
        """κ0: the configured number, or (``auto``) s·mean(P) on x̃, whose mean per-feature
        variance is 1: the prior spread of the cluster means, Σ/κ0, is the data's."""
        k = self.config.kappa
        return float(k) if k != "auto" else sigma_scale * float(self.shape.mean())

    def fit(self, stats: SuffStats) -> None:
        """Fit the prior to the clusters' statistics (type-II maximum likelihood).

        With ``prior.sigma_scale: auto`` each candidate prior's s is refitted
        (:func:`~deepdpm_core.bayes.empirical_bayes.empirical_bayes_scale`), then with ``prior.nu: auto`` its
        ν0 given s (:func:`~deepdpm_core.bayes.empirical_bayes.empirical_bayes_nu`; ``evidence``, whose s
        depends on ν0, alternates the two); with ``covariance_type: auto`` the candidate
        (full or diagonal covariances) with the larger evidence Σ_k ln f(X_k) is kept. Sees
        only all-reduced statistics: the same on every rank.
        """
        p = self.config
        fitted = []
        if p.psi == "fitted":
            self.shape = empirical_bayes_shape(self.priors[0], stats, self.base_shape)
        for prior in self.priors:
            s = self.sigma_scale
            for _ in range(EB_ROUNDS if p.sigma_scale == "evidence" and p.nu == "auto" else 1):
                if p.sigma_scale in PER_FEATURE:
                    s = empirical_bayes_scale(prior, stats, self.shape, PER_FEATURE[p.sigma_scale])
                nu = empirical_bayes_nu(prior, stats, self.shape, s) if p.nu == "auto" else None
                prior = prior.with_scale(self.shape, s, self.kappa(s), nu)
            fitted.append((prior, s))
        if len(fitted) > 1:
            evidence = [float(log_marginal_likelihood(prior, stats).sum()) for prior, _ in fitted]
            best = max(range(len(fitted)), key=evidence.__getitem__)
        else:
            best = 0
        self.priors = [prior for prior, _ in fitted]
        self.scales = [s for _, s in fitted]
        self.prior, self.sigma_scale = fitted[best]

    def state_dict(self) -> dict[str, Any]:
        """The fitted values (s of the prior in use and of each candidate, their ν0)."""
        return {
            "sigma_scale": self.sigma_scale,
            "prior_shape": self.shape.tolist(),
            "prior_scales": list(self.scales),
            "prior_nus": [p.nu for p in self.priors],
            "prior_diagonal": self.prior.diagonal,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """The priors as :meth:`state_dict` saved them (states without them keep the initial ones)."""
        if "sigma_scale" not in state:
            return
        self.sigma_scale = float(state["sigma_scale"])
        if "prior_shape" in state:
            self.shape = torch.tensor(state["prior_shape"], dtype=torch.float64)
        nus = state.get("prior_nus", [None] * len(self.priors))
        self.scales = [float(s) for s in state["prior_scales"]]
        self.priors = [p.with_scale(self.shape, s, self.kappa(s), nu)
                       for p, s, nu in zip(self.priors, self.scales, nus, strict=True)]
        self.prior = next(p for p in self.priors if p.diagonal == bool(state["prior_diagonal"]))

    def numerical_failure(self, epoch: int) -> DataError:
        """The one-line error for a factorisation that failed on the data's statistics at
        ``epoch``, e.g. clusters of duplicate rows in features far larger than a fixed
        ``prior.sigma_scale`` assumes, and what to change."""
        sigma_scale = self.config.sigma_scale
        fixes = "standardise the features (data.transform=standard)"
        if isinstance(sigma_scale, float):
            fixes += f" or let the prior follow the data (prior.sigma_scale=auto, not {sigma_scale:g})"
        return DataError(
            f"the fit failed numerically at epoch {epoch}: a cluster covariance is not "
            "positive-definite, the clusters are degenerate at the prior's scale (duplicate "
            f"rows, or features on another scale than the prior assumes); {fixes}")
