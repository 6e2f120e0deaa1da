"""NIW math against independent references (Student-t chain rule, numerical integral)."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from deepdpm_core.bayes import (
    NIWPrior,
    SuffStats,
    empirical_bayes,
    empirical_bayes_nu,
    empirical_bayes_scale,
    grouped_stats,
    log_marginal_likelihood,
    log_merge_hastings,
    log_split_hastings,
    map_estimate,
    niw,
    posterior,
    sparse_stats,
)
from deepdpm_core.errors import ConfigError


def _prior(d, kappa=0.5, nu=None, s=0.7, seed=0):
    rng = np.random.default_rng(seed)
    m0 = torch.tensor(rng.normal(size=d))
    a = rng.normal(size=(d, d))
    nu = d + 2.0 if nu is None else nu
    scale = torch.tensor(a @ a.T + s * np.eye(d))
    return NIWPrior(m0, kappa, nu, scale)


def _stats(x):
    x = torch.as_tensor(x, dtype=torch.float64)
    return sparse_stats(x, torch.zeros(len(x), dtype=torch.long), torch.ones(len(x)), 1)


def _chain_rule(prior, x):
    """ln p(x_1..x_n) = Σ ln p(x_i | x_<i), each a Student-t posterior predictive."""
    d = prior.dim
    total = 0.0
    for i in range(len(x)):
        st = _stats(x[:i]) if i else SuffStats.zeros(1, d)
        post = posterior(prior, st)
        dof = float(post.nu[0]) - d + 1
        shape = post.scale[0].numpy() * (float(post.kappa[0]) + 1) / (float(post.kappa[0]) * dof)
        total += stats.multivariate_t(loc=post.mean[0].numpy(), shape=shape, df=dof).logpdf(x[i])
    return total


@pytest.mark.parametrize("d", [1, 3])
def test_marginal_likelihood_matches_student_t_chain_rule(d):
    x = np.random.default_rng(1).normal(size=(7, d)) * 1.5 + 0.3
    prior = _prior(d)
    ours = float(log_marginal_likelihood(prior, _stats(x))[0])
    assert ours == pytest.approx(_chain_rule(prior, x), rel=1e-9, abs=1e-9)


@pytest.mark.slow
def test_marginal_likelihood_matches_numerical_integral_1d():
    """1-D: ∫∫ Π N(x_i; μ, σ²) NIW(μ, σ²) dμ dσ² on a fine grid (σ² = e^t)."""
    x = np.array([0.3, -1.1, 0.8, 1.9])
    m0, k0, nu0, lam0 = 0.2, 0.8, 3.0, 2.0
    prior = NIWPrior(torch.tensor([m0]), k0, nu0, torch.tensor([[lam0]]))
    mu = np.linspace(-12.0, 12.0, 2401)[:, None]
    t = np.linspace(-8.0, 6.0, 2801)[None, :]
    var = np.exp(t)
    log_f = (
        stats.invgamma(a=nu0 / 2, scale=lam0 / 2).logpdf(var) + t  # dσ² = e^t dt
        + stats.norm(m0, np.sqrt(var / k0)).logpdf(mu)
        + stats.norm(mu[..., None], np.sqrt(var)[..., None]).logpdf(x).sum(-1)
    )
    peak = log_f.max()
    val = integrate.trapezoid(integrate.trapezoid(np.exp(log_f - peak), t[0], axis=1), mu[:, 0])
    ours = float(log_marginal_likelihood(prior, _stats(x[:, None]))[0])
    assert ours == pytest.approx(peak + math.log(val), abs=1e-6)


def test_map_is_posterior_mode_formula():
    x = np.random.default_rng(2).normal(size=(50, 3))
    prior = _prior(3)
    mean, cov = map_estimate(prior, _stats(x))
    kn = prior.kappa + 50
    mn = (prior.kappa * prior.m0.numpy() + x.sum(0)) / kn
    lam = (prior.scale.numpy() + prior.kappa * np.outer(prior.m0, prior.m0) + x.T @ x - kn * np.outer(mn, mn))
    np.testing.assert_allclose(mean[0].numpy(), mn, rtol=1e-12)
    np.testing.assert_allclose(cov[0].numpy(), lam / (prior.nu + 50 + 3 + 2), rtol=1e-10)
    # weak prior: MAP ~ the sample moments
    weak = NIWPrior(torch.zeros(3, dtype=torch.float64), 1e-6, 5.0, torch.eye(3, dtype=torch.float64) * 1e-8)
    big = np.random.default_rng(3).normal(size=(20000, 3)) @ np.diag([1.0, 2.0, 0.5]) + 4
    m, c = map_estimate(weak, _stats(big))
    np.testing.assert_allclose(m[0].numpy(), big.mean(0), rtol=1e-6)
    np.testing.assert_allclose(c[0].numpy(), np.cov(big.T, bias=True), rtol=2e-3, atol=2e-3)


def test_map_covariances_in_blocks_are_the_formula_and_the_whole_batch_bits():
    # 33 rows of 24-D: blocks of 16 leave one row at the end, which must not be a block of
    # its own (a single (D, 1) x (1, D) product rounds differently from a batch of them)
    rng = np.random.default_rng(5)
    r, d = 33, 24
    x = torch.tensor(rng.normal(size=(3000, d)) * 2 + 3)
    stats = sparse_stats(x, torch.tensor(rng.integers(0, r, size=3000)), torch.tensor(rng.random(3000)), r)
    prior = NIWPrior.from_shape(torch.zeros(d, dtype=torch.float64), torch.ones(d), 0.5, None, 1.3,
                                floor=torch.full((d,), 1e-3, dtype=torch.float64))
    out = torch.full((r, d, d), math.nan, dtype=torch.float64)
    mean, cov = map_estimate(prior, stats, out=out)
    assert cov.data_ptr() == out.data_ptr()  # written over the memory given
    fresh = map_estimate(prior, stats)[1]
    kn, nun = prior.kappa + stats.n, prior.nu + stats.n
    whole = niw._posterior_scale(prior, stats, kn, mean).div_((nun + d + 2.0)[:, None, None])
    assert torch.equal(cov, whole) and torch.equal(fresh, whole)
    for k in (0, 15, 16, 32):  # the brute-force formula, row by row
        n, s1, s2 = (float(stats.n[k]), stats.s1[k].numpy(), stats.s2[k].numpy())
        mn = s1 / (prior.kappa + n)
        lam = prior.scale.numpy() + n * np.diag(prior.floor.numpy()) + s2 - (prior.kappa + n) * np.outer(mn, mn)
        np.testing.assert_allclose(cov[k].numpy(), lam / (prior.nu + n + d + 2), rtol=1e-10, atol=1e-12)


def test_grouped_statistics_and_map_covariances_are_exactly_symmetric():
    # the posterior has no symmetrising pass: symmetric statistics must give exactly
    # symmetric covariances (the float32 GEMM's scatter block is symmetrised at the source)
    rng = np.random.default_rng(4)
    x = torch.tensor(rng.normal(size=(3000, 17)) * 5 + 40, dtype=torch.float32)
    rows = torch.tensor(rng.integers(0, 5, size=3000))
    stats = grouped_stats(x, torch.arange(3000), rows, torch.tensor(rng.random(3000)), 5, chunk_rows=300)
    assert torch.equal(stats.s2, stats.s2.transpose(-1, -2))
    prior = NIWPrior(torch.zeros(17, dtype=torch.float64), 1e-4, 19.0, torch.eye(17, dtype=torch.float64) * 0.1)
    _, cov = map_estimate(prior, stats)
    assert torch.equal(cov, cov.transpose(-1, -2))
    torch.linalg.cholesky(cov)  # and positive definite


def _two_way(x, z):
    xt = torch.as_tensor(x, dtype=torch.float64)
    return sparse_stats(xt, torch.as_tensor(z), torch.ones(len(x)), 2)


def test_split_accepts_two_blobs_rejects_one_gaussian():
    rng = np.random.default_rng(4)
    prior = NIWPrior.from_shape(torch.zeros(2), torch.ones(2), 1e-4, None, 0.005)
    blobs = np.concatenate([rng.normal(size=(300, 2)) - 4, rng.normal(size=(300, 2)) + 4])
    z = np.repeat([0, 1], 300)
    assert float(log_split_hastings(prior, 10.0, _two_way(blobs, z))[0]) > 50
    one = rng.normal(size=(600, 2))
    z = (one[:, 0] > 0).astype(int)  # the best 2-way cut of a single Gaussian
    assert float(log_split_hastings(prior, 10.0, _two_way(one, z))[0]) < -5


@pytest.mark.parametrize("alpha", [0.5, 10.0])
def test_split_and_merge_hastings_ratios_are_eq_2_with_chain_rule_marginals(alpha):
    """ln H_s = ln α + ln Γ(N1) f(X1) + ln Γ(N2) f(X2) − ln Γ(N) f(X) (paper Eq. 2), each
    f written out by the Student-t chain rule; ln H_m of the same pair is its negative."""
    rng = np.random.default_rng(8)
    x = np.concatenate([rng.normal(size=(9, 2)) - 1.0, rng.normal(size=(14, 2)) * 0.7 + 1.5])
    z = np.repeat([0, 1], [9, 14])
    prior = _prior(2, kappa=0.3, s=0.4, seed=3)
    expected = (math.log(alpha) + math.lgamma(9) + _chain_rule(prior, x[:9]) + math.lgamma(14)
                + _chain_rule(prior, x[9:]) - math.lgamma(23) - _chain_rule(prior, x))
    sub = _two_way(x, z)
    assert float(log_split_hastings(prior, alpha, sub)[0]) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    merge = log_merge_hastings(prior, alpha, sub.rows([0]), sub.rows([1]))
    assert float(merge[0]) == pytest.approx(-expected, rel=1e-9, abs=1e-9)
    # an empty side proposes nothing
    lone = _two_way(x, np.zeros(23, dtype=int))
    assert float(log_split_hastings(prior, alpha, lone)[0]) == -math.inf


def test_nu_at_or_below_d_minus_1_is_a_config_error():
    # the inverse-Wishart needs nu > D - 1; the CLI prints ConfigErrors as one line
    with pytest.raises(ConfigError, match="prior.nu must exceed D - 1 = 3 for 4-dimensional data, got 3.0"):
        NIWPrior.from_shape(torch.zeros(4), torch.ones(4), 1e-4, 3.0, 0.005)
    assert NIWPrior.from_shape(torch.zeros(4), torch.ones(4), 1e-4, 3.5, 0.005).nu == 3.5


def test_split_then_merge_restores_stats_and_negates_ratio():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(200, 3))
    z = rng.integers(0, 2, 200)
    sub = _two_way(x, z)
    whole = _stats(x)
    merged = sub.rows([0]) + sub.rows([1])
    for a, b in ((merged.n, whole.n), (merged.s1, whole.s1), (merged.s2, whole.s2)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-10)
    prior = _prior(3)
    ls = log_split_hastings(prior, 10.0, sub)
    lm = log_merge_hastings(prior, 10.0, sub.rows([0]), sub.rows([1]))
    torch.testing.assert_close(lm, -ls)


def test_proposals_in_row_chunks_equal_one_batch(monkeypatch):
    """Hastings ratios are computed a bounded number of rows at a time: same decisions."""
    from deepdpm_core.moves import proposals as moves

    rng = np.random.default_rng(6)
    k, d = 23, 3
    x = torch.tensor(rng.normal(size=(2000, d)) + rng.integers(0, 6, size=(2000, 1)) * 3.0)
    z = torch.tensor(rng.integers(0, 2 * k, 2000))
    sub = sparse_stats(x, z[:, None], torch.ones(2000, 1, dtype=torch.float64), 2 * k)
    hard = sub.pair_sums()
    means = hard.s1 / hard.n[:, None]
    prior = _prior(d)
    whole = log_split_hastings(prior, 10.0, sub).numpy()
    ref = (moves.propose_splits(prior, 10.0, sub, np.random.default_rng(0), 5.0),
           moves.propose_merges(prior, 10.0, hard, means, np.random.default_rng(0), 3))
    monkeypatch.setattr(moves, "_CHUNK_ELEMS", 4 * d * d)  # 4 rows per chunk
    assert len(moves.hastings_chunks(k, d)) == 6
    splits, log_h = moves.propose_splits(prior, 10.0, sub, np.random.default_rng(0), 5.0)
    np.testing.assert_allclose(log_h[np.isfinite(log_h)], whole[np.isfinite(log_h)], rtol=1e-12)
    assert splits == ref[0][0]
    assert moves.propose_merges(prior, 10.0, hard, means, np.random.default_rng(0), 3) == ref[1]
    assert ref[1], "the fixture should accept some merge"


def _clusters(seed, d, sizes, spreads):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(size=(n, d)) * sd + rng.normal(size=d) * 5 for n, sd in zip(sizes, spreads, strict=True)])
    z = np.repeat(np.arange(len(sizes)), sizes)
    xt = torch.as_tensor(x, dtype=torch.float64)
    return sparse_stats(xt, torch.as_tensor(z), torch.ones(len(x)), len(sizes))


@pytest.mark.parametrize("diagonal", [False, True])
def test_empirical_bayes_scale_maximises_the_summed_marginal_likelihood(diagonal):
    """The grid search's s against a brute-force search of Σ_k ln f(X_k; s) over ln s."""
    d = 4
    stats = _clusters(6, d, [40, 7, 120], [0.5, 2.0, 1.0])
    shape = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    base = NIWPrior.from_shape(torch.zeros(d), shape, 0.03, None, 1.0, diagonal=diagonal)

    def total(log_s):
        prior = base.with_scale(shape, math.exp(log_s), base.kappa)
        return float(log_marginal_likelihood(prior, stats).sum())

    grid = np.linspace(-8, 4, 2401)
    best = grid[np.argmax([total(g) for g in grid])]
    fine = np.linspace(best - 0.01, best + 0.01, 401)
    best = fine[np.argmax([total(g) for g in fine])]
    s = empirical_bayes_scale(base, stats, shape)
    assert math.log(s) == pytest.approx(best, abs=1e-4)
    # and it does not depend on the prior's current s (Λn − Λ0 does not)
    other = base.with_scale(shape, 37.0, base.kappa)
    assert empirical_bayes_scale(other, stats, shape) == pytest.approx(s, rel=1e-9)


def test_empirical_bayes_scale_of_isotropic_clusters_is_their_variance():
    # many points per cluster: the fixed point is s = sigma^2 (docstring)
    stats = _clusters(7, 3, [20000, 20000], [0.3, 0.3])
    prior = NIWPrior.from_shape(torch.zeros(3), torch.ones(3), 1e-4, None, 1.0)
    assert empirical_bayes_scale(prior, stats, torch.ones(3, dtype=torch.float64)) == pytest.approx(0.09, rel=0.03)


@pytest.mark.parametrize("diagonal", [False, True])
def test_empirical_bayes_nu_maximises_the_summed_marginal_likelihood(diagonal):
    """The grid search's ν0 against a brute-force search of Σ_k ln f(X_k; ν0) over ν0."""
    d = 4
    stats = _clusters(9, d, [60, 25, 90], [0.7, 0.8, 0.75])
    shape = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    base = NIWPrior.from_shape(torch.zeros(d), shape, 0.03, None, 1.0, diagonal=diagonal)
    s = empirical_bayes_scale(base, stats, shape)

    def total(nu0):
        return float(log_marginal_likelihood(base.with_scale(shape, s, base.kappa, nu0), stats).sum())

    floor = 3.0 if diagonal else d + 2.0
    grid = np.linspace(math.log(floor), math.log(1e4 * floor), 301)
    best = grid[int(np.argmax([total(math.exp(g)) for g in grid]))]
    fine = np.linspace(max(best - 0.04, grid[0]), best + 0.04, 161)
    values = [total(math.exp(g)) for g in fine]
    best = fine[int(np.argmax(values))]
    nu0 = empirical_bayes_nu(base, stats, shape, s)
    assert total(nu0) >= max(values) - 1e-9
    assert math.log(nu0) == pytest.approx(best, abs=1e-3)


def test_empirical_bayes_nu_ends_at_the_ceiling_when_the_optimum_is_beyond_it():
    d, shape = 3, torch.ones(3, dtype=torch.float64)
    prior = NIWPrior.from_shape(torch.zeros(d), shape, 1e-4, None, 1.0)
    same = _clusters(5, d, [400] * 3, [0.5] * 3)
    s = empirical_bayes_scale(prior, same, shape)
    # one shared isotropic shape wants ν0 above a low ceiling: the ceiling, to 1e-9
    assert empirical_bayes_nu(prior, same, shape, s, ceiling=2.0 * (d + 2)) == pytest.approx(2.0 * (d + 2), rel=1e-9)


def test_empirical_bayes_nu_is_high_for_one_shared_shape_and_weak_for_varied_shapes():
    d, shape = 8, torch.ones(8, dtype=torch.float64)
    prior = NIWPrior.from_shape(torch.zeros(d), shape, 1e-4, None, 1.0)
    same = _clusters(3, d, [300] * 4, [0.5] * 4)  # isotropic, one spread: Σ_k = 0.25 I
    nu_same = empirical_bayes_nu(prior, same, shape, empirical_bayes_scale(prior, same, shape))
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.normal(size=(300, d)) * rng.uniform(0.05, 3.0, size=d) + 10 * k for k in range(4)])
    varied = sparse_stats(torch.as_tensor(x), torch.as_tensor(np.repeat(np.arange(4), 300)), torch.ones(len(x)), 4)
    nu_varied = empirical_bayes_nu(prior, varied, shape, empirical_bayes_scale(prior, varied, shape))
    assert nu_same > 50 * d
    assert nu_varied == pytest.approx(d + 2.0, rel=1e-6)  # the weakest allowed: the paper's D + 2


def test_diagonal_marginal_is_the_product_of_one_dimensional_models():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(9, 3)) * [0.5, 1.0, 2.0] + 0.2
    shape = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    diag = NIWPrior.from_shape(torch.zeros(3), shape, 0.3, 4.0, 0.7, diagonal=True)
    per_feature = 0.0
    for j in range(3):
        one = NIWPrior(torch.zeros(1, dtype=torch.float64), 0.3, 4.0, diag.scale[j : j + 1, j : j + 1].clone())
        per_feature += float(log_marginal_likelihood(one, _stats(x[:, j : j + 1]))[0])
    assert float(log_marginal_likelihood(diag, _stats(x))[0]) == pytest.approx(per_feature, rel=1e-12)
    mean, cov = map_estimate(diag, _stats(x))
    for j in range(3):
        one = NIWPrior(torch.zeros(1, dtype=torch.float64), 0.3, 4.0, diag.scale[j : j + 1, j : j + 1].clone())
        m1, c1 = map_estimate(one, _stats(x[:, j : j + 1]))
        assert float(mean[0, j]) == pytest.approx(float(m1[0, 0]), rel=1e-12)
        assert float(cov[0, j, j]) == pytest.approx(float(c1[0, 0, 0]), rel=1e-12)
    assert torch.count_nonzero(cov[0] - torch.diag(cov[0].diagonal())) == 0


class _LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an operator returns while it is active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        return out


def test_a_diagonal_prior_reads_only_the_statistics_diagonals():
    """A diagonal prior's marginals and MAP variances are the full posterior's diagonals, to
    the bit, and no (R, D, D) posterior is built for them (at K = 1,000, D = 128 one is
    131 MB of which 1/128 was read)."""
    d = 16
    stats = _clusters(9, d, [30, 1, 80, 0, 12], [0.5, 1.0, 2.0, 1.0, 0.3])
    prior = NIWPrior.from_shape(torch.full((d,), 0.3), torch.linspace(0.5, 2.0, d), 0.03, None, 0.7,
                                diagonal=True, floor=torch.full((d,), 1e-3, dtype=torch.float64))
    full = posterior(prior, stats)
    lam0, lamn = prior.scale.diagonal(), full.scale.diagonal(dim1=-2, dim2=-1)
    reference = (-0.5 * stats.n * d * math.log(math.pi)
                 + d * (torch.lgamma(full.nu / 2.0) - math.lgamma(prior.nu / 2.0))
                 + 0.5 * prior.nu * torch.log(lam0).sum() - 0.5 * full.nu * torch.log(lamn).sum(-1)
                 + 0.5 * d * (math.log(prior.kappa) - torch.log(full.kappa)))
    with _LargestOutput() as seen:
        marginals = log_marginal_likelihood(prior, stats)
    assert torch.equal(marginals, reference)
    assert seen.numel <= d * d  # Λ0's own (D, D), not R of them
    mean, cov = map_estimate(prior, stats)
    assert torch.equal(mean, full.mean)
    assert torch.equal(cov, torch.diag_embed(lamn / (full.nu + 3.0)[:, None]))


def test_marginal_likelihoods_factor_the_posteriors_a_block_at_a_time(monkeypatch):
    """ln f of many rows is that of one factorisation of all their posterior scales, to the
    bit, without an (R, D, D) buffer; a numerically singular row anywhere gives the whole
    batch's jittered retry, as before."""
    monkeypatch.setattr(niw, "LOGDET_BLOCK_ELEMS", 3 * 8 * 8, raising=False)  # blocks of 3 rows
    d = 8
    stats = _clusters(5, d, [30, 1, 80, 0, 12, 9, 40, 2, 3, 60, 7], [0.5, 1.0, 2.0, 1.0, 0.3] + [1.0] * 6)
    prior = NIWPrior.from_shape(torch.full((d,), 0.3), torch.linspace(0.5, 2.0, d), 0.03, None, 0.7,
                                floor=torch.full((d,), 1e-3, dtype=torch.float64))

    def whole(prior, stats):
        full = posterior(prior, stats)
        return (-0.5 * stats.n * d * math.log(math.pi) + torch.special.multigammaln(full.nu / 2.0, d)
                - torch.special.multigammaln(torch.tensor(prior.nu / 2.0, dtype=torch.float64), d)
                + 0.5 * prior.nu * niw.logdet_spd(prior.scale) - 0.5 * full.nu * niw.logdet_spd(full.scale)
                + 0.5 * d * (math.log(prior.kappa) - torch.log(full.kappa)))

    with _LargestOutput() as seen:
        marginals = log_marginal_likelihood(prior, stats)
    assert torch.equal(marginals, whole(prior, stats))
    assert seen.numel < stats.n_rows * d * d
    # a last row whose scale is rank one (u uᵀ) up to rounding
    plain = NIWPrior.from_shape(torch.full((d,), 0.3), torch.linspace(0.5, 2.0, d), 0.03, None, 0.7)
    n, s1 = torch.tensor([5.0], dtype=torch.float64), torch.linspace(-1.0, 2.0, d, dtype=torch.float64)[None]
    kn, mn = plain.kappa + n, (plain.kappa * plain.m0 + s1) / (plain.kappa + n)
    u = 1e3 * torch.linspace(0.2, 1.0, d, dtype=torch.float64)
    s2 = (torch.outer(u, u) - plain.scale - plain.kappa * torch.outer(plain.m0, plain.m0)
          + kn * torch.outer(mn[0], mn[0]))
    singular = SuffStats(torch.cat([stats.n, n]), torch.cat([stats.s1, s1]), torch.cat([stats.s2, s2[None]]))
    assert bool(torch.linalg.cholesky_ex(posterior(plain, singular).scale)[1][-1] > 0)
    assert torch.equal(log_marginal_likelihood(plain, singular), whole(plain, singular))


def test_diagonal_prior_defaults_to_three_degrees_of_freedom_per_feature():
    assert NIWPrior.from_shape(torch.zeros(50), torch.ones(50), 1e-4, None, 1.0, diagonal=True).nu == 3.0
    assert NIWPrior.from_shape(torch.zeros(50), torch.ones(50), 1e-4, None, 1.0).nu == 52.0


def test_the_spread_the_scale_fits_read_is_the_posterior_scatter_less_the_prior():
    """diag(B_k)/P from the statistics' diagonals against Λn − Λ0 of the full posterior."""
    d = 5
    stats = _clusters(11, d, [30, 1, 80, 0], [0.5, 1.0, 2.0, 1.0])  # a single point and an empty row
    shape = torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0], dtype=torch.float64)
    prior = NIWPrior.from_shape(torch.full((d,), 0.3), shape, 0.03, None, 0.7,
                                floor=torch.full((d,), 1e-3, dtype=torch.float64))
    spread, rows = empirical_bayes._spread(prior, stats, shape)
    scatter = posterior(prior, stats).scale - prior.scale
    expected = scatter.diagonal(dim1=-2, dim2=-1)[stats.n > 0] / shape
    assert rows.tolist() == [0, 1, 2]
    torch.testing.assert_close(spread, expected.clamp_min(0.0), rtol=1e-10, atol=1e-12)


def test_nu_fitted_to_evenly_spaced_clusters_is_near_the_optimum_over_all_of_them(monkeypatch):
    """Above NU_FIT_CLUSTERS clusters ν0 reads the shapes of that many (here 10 of 40): the
    evidence of every cluster is at most a tenth of a nat a cluster below its optimum."""
    d, k = 6, 40
    rng = np.random.default_rng(2)
    stats = _clusters(12, d, list(rng.integers(20, 200, size=k)), list(rng.uniform(0.4, 0.9, size=k)))
    shape = torch.ones(d, dtype=torch.float64)
    prior = NIWPrior.from_shape(torch.zeros(d), shape, 1e-3, None, 1.0)
    s = empirical_bayes_scale(prior, stats, shape)
    every = empirical_bayes_nu(prior, stats, shape, s)
    monkeypatch.setattr(empirical_bayes, "NU_FIT_CLUSTERS", 10)
    some = empirical_bayes_nu(prior, stats, shape, s)

    def total(nu0):
        return float(log_marginal_likelihood(prior.with_scale(shape, s, prior.kappa, nu0), stats).sum())

    assert some != every  # it read fewer clusters
    assert total(every) >= total(some) >= total(every) - 0.1 * k



@pytest.mark.parametrize("step", [2, 3])
def test_marginal_likelihoods_in_blocks_never_factor_one_row_alone(monkeypatch, step):
    """Blocks of 2 or 3 rows over 2·step + 1 clusters in 24-D: the last row joins the block
    before it (for D ≥ 20 a batch of one matrix takes other kernels and rounds otherwise),
    so ln|Λn| is the whole batch's to the bit, for every seed."""
    d = 24
    monkeypatch.setattr(niw, "LOGDET_BLOCK_ELEMS", step * d * d, raising=False)
    prior = NIWPrior.from_shape(torch.full((d,), 0.3), torch.linspace(0.5, 2.0, d), 0.03, None, 0.7,
                                floor=torch.full((d,), 1e-3, dtype=torch.float64))
    for seed in range(4):
        rng = np.random.default_rng(seed)
        sizes = rng.integers(d + 5, 200, size=2 * step + 1)
        stats = _clusters(seed, d, list(sizes), list(rng.uniform(0.3, 2.0, size=len(sizes))))
        kn = prior.kappa + stats.n
        mn = (prior.kappa * prior.m0 + stats.s1) / kn[:, None]
        whole = niw.logdet_spd(niw._posterior_scale(prior, stats, kn, mn))
        assert torch.equal(niw._posterior_logdet(prior, stats, kn, mn), whole), seed
