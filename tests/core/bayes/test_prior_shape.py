"""Ψ0's shape fitted per feature (``prior.psi: fitted``) against a brute-force search of each
feature's evidence, its units, and the raw-pixel table it was made for."""

import math

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.metrics import normalized_mutual_info_score

from deepdpm_core import DeepDPM
from deepdpm_core.bayes import (
    NIWPrior,
    SuffStats,
    empirical_bayes_shape,
    log_marginal_likelihood,
    sparse_stats,
)


def _clusters(seed, spreads, sizes):
    """Gaussian clusters whose per-feature spreads are ``spreads`` (K, D)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(size=(n, len(sd))) * sd + rng.normal(size=len(sd)) * 5
                        for n, sd in zip(sizes, spreads, strict=True)])
    z = np.repeat(np.arange(len(sizes)), sizes)
    return torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(z)


def _stats(x, z, k):
    return sparse_stats(x, z, torch.ones(len(x), dtype=torch.float64), k)


def test_each_feature_gets_the_scale_that_maximises_its_own_evidence():
    """The bisected shape against a grid search of Σ_k ln f(X_kd; Λ0 = λ) for every feature d
    alone (a one-dimensional NIW model, ν0 = 3), up to the common factor."""
    spreads = np.array([[0.1, 1.0, 3.0, 0.02], [0.2, 0.7, 5.0, 0.01], [0.15, 1.5, 2.0, 0.03]])
    x, z = _clusters(0, spreads, [50, 9, 200])
    stats = _stats(x, z, 3)
    base = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    prior = NIWPrior.from_shape(torch.zeros(4), base, 0.03, None, 1.0, diagonal=True)
    shape = empirical_bayes_shape(prior, stats, base)
    assert float(shape.mean()) == pytest.approx(float(base.mean()), rel=1e-12)
    best = []
    for d in range(4):
        one = SuffStats(stats.n, stats.s1[:, d : d + 1], stats.s2[:, d : d + 1, d : d + 1])

        def total(log_lam, d=d, one=one):
            lam = torch.tensor([[math.exp(log_lam)]], dtype=torch.float64)
            return float(log_marginal_likelihood(NIWPrior(prior.m0[d : d + 1], prior.kappa, 3.0, lam), one).sum())

        grid = np.linspace(-15, 10, 2501)
        top = grid[int(np.argmax([total(g) for g in grid]))]
        fine = np.linspace(top - 0.01, top + 0.01, 201)
        best.append(fine[int(np.argmax([total(g) for g in fine]))])
    # Λ0,d = t_d·P_d is proportional to the returned shape: compare the logs' differences
    assert np.log(shape.numpy() / shape[0].item()) == pytest.approx(np.array(best) - best[0], abs=1e-3)
    # the tight features get the small scales: 0.01–0.03 against 2–5
    assert float(shape[3] / base[3]) < 1e-3 * float(shape[2] / base[2])


def test_shape_follows_each_features_units():
    x, z = _clusters(1, np.array([[1.0, 0.5, 2.0]] * 4), [80, 120, 60, 100])
    prior = NIWPrior.from_shape(torch.zeros(3), torch.ones(3), 1e-3, None, 1.0, diagonal=True)
    ones = torch.ones(3, dtype=torch.float64)
    shape = empirical_bayes_shape(prior, _stats(x, z, 4), ones)
    factor = torch.tensor([1e-3, 1.0, 1e2], dtype=torch.float64)
    scaled = empirical_bayes_shape(prior, _stats(x * factor, z, 4), ones)
    # relative to feature 1, each feature's scale moves by its factor squared
    assert (scaled / scaled[1]).numpy() == pytest.approx((shape / shape[1] * factor**2).numpy(), rel=1e-6)


def test_raw_pixels_keep_their_digits():
    """Under Ψ0 = s·I the pixels that every digit leaves blank set s near the covariance
    floor, every cluster pays ~16,000 nats for it, and the fit ends at 3 clusters; with
    Ψ0 fitted per feature it finds the digits (docs/design.md, "The prior")."""
    X, y = load_digits(return_X_y=True)
    fitted = DeepDPM(random_state=0).fit(X)
    identity = DeepDPM(random_state=0, prior__psi="identity").fit(X)
    assert identity.n_clusters_ <= 4
    assert 9 <= fitted.n_clusters_ <= 12
    assert normalized_mutual_info_score(y, fitted.labels_) > 0.7
