"""Sparse E-step and grouped statistics: same answer as the dense computation."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from deepdpm_core.bayes import TripleBuffer, grouped_stats, sparse_stats
from deepdpm_core.bayes.blocks import DEFAULT_LAYOUT, BlockLayout
from deepdpm_core.config import Config
from deepdpm_core.data import make_mixture, nmi
from deepdpm_core.estep import GaussianMixture, SparseEStep
from deepdpm_core.estep.pair_bounds import PairBounds
from deepdpm_core.estep.support_bounds import (
    SUPPORT_LOG_GAP,
    faiss_proxy_keys,
    largest_eigenvalue_bound,
    proxy_top_m_faiss,
    proxy_top_m_torch,
    trace_power_bound,
)
from deepdpm_core.model import FittedModel
from deepdpm_core.training import start_fit


def _mixture(k=12, d=5, seed=0, work_dtype=torch.float64, thin=False, offset=0.0, layout=DEFAULT_LAYOUT):
    """Random full covariances; ``thin`` gives axis scales spread over 1e-3..1 (near-degenerate)."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(k, d)) * 8 + offset
    if thin:
        rot = np.linalg.qr(rng.normal(size=(k, d, d)))[0]
        covs = np.einsum("kij,kj,klj->kil", rot, np.exp(rng.uniform(-7, 0, size=(k, d))), rot)
    else:
        covs = np.stack([a @ a.T / d + 0.2 * np.eye(d) for a in rng.normal(size=(k, d, d))])
    logw = np.log(rng.dirichlet(np.ones(k)))
    gmm = GaussianMixture(torch.tensor(means), torch.tensor(covs), torch.tensor(logw), work_dtype=work_dtype,
                          layout=layout)
    return gmm, means


def _dense_log_resp(gmm, x):
    """ln r^E over every component: the dense E-step the bounded one is checked against."""
    lp = gmm.weighted_log_prob(x)
    return lp - torch.logsumexp(lp, dim=1, keepdim=True)


def _pairs(index):
    """(points, comps) of every entry of an (N, m) index."""
    return torch.arange(index.shape[0]).repeat_interleave(index.shape[1]), index.reshape(-1)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _evaluated(index, log_resp):
    """Entries that are a component of their row: column 0 (the anchor) and every later
    column that does not repeat it (unused columns are padded with the anchor)."""
    out = torch.ones_like(log_resp, dtype=torch.bool)
    out[:, 1:] = index[:, 1:] != index[:, :1]
    return out


def test_log_prob_pairs_equal_dense_columns():
    gmm, _ = _mixture()
    x = torch.randn(300, 5, dtype=torch.float64, generator=_gen()) * 8
    index = torch.randint(0, 12, (300, 3))
    dense = gmm.weighted_log_prob(x)
    got = gmm.weighted_log_prob_pairs(x, *_pairs(index), chunk_rows=7).view(index.shape)
    torch.testing.assert_close(got, dense.gather(1, index))
    # float32 whitening GEMMs (the default): points are centred first, so ~1e-6 relative
    gmm32, _ = _mixture(work_dtype=torch.float32)
    got32 = gmm32.weighted_log_prob_pairs(x.float(), *_pairs(index)).view(index.shape)
    torch.testing.assert_close(got32, dense.gather(1, index), rtol=1e-5, atol=1e-4)


def test_faiss_and_torch_rank_the_proxy_alike():
    gmm, means = _mixture(k=40, d=6)
    x = (torch.tensor(means).repeat_interleave(30, 0) + torch.randn(1200, 6, dtype=torch.float64, generator=_gen()) * 2).float()
    w, a, c = gmm._proxy
    score = x @ w - x.square().sum(1, keepdim=True) * a + c
    ref = proxy_top_m_torch(x, w, a, c, 5)
    got = proxy_top_m_faiss(x, faiss_proxy_keys(w, a, c), 5)
    assert got.shape == ref.shape == (1200, 5) and got.dtype == torch.long
    # the same scores in the same order (index sets may differ only between exact ties)
    torch.testing.assert_close(score.gather(1, got), score.gather(1, ref), rtol=1e-5, atol=1e-4)
    assert (got == ref).float().mean() > 0.99
    torch.testing.assert_close(gmm.candidates(x, 5, chunk_elems=40 * 7), got)


def _pair_directions(gmm, anchors, comps, batched=None):
    """Every pair's (u, a) of :meth:`PairBounds.pair_directions`, its parts put in place."""
    u = torch.full((len(comps), gmm.dim), torch.nan, dtype=torch.float64)
    a = torch.full((len(comps),), torch.nan, dtype=torch.float64)
    for sel, u_part, a_part in PairBounds(gmm).pair_directions(anchors, comps, batched):
        u[sel], a[sel] = u_part, a_part
    assert not (u.isnan().any() or a.isnan().any())  # every pair in some part
    return u, a


def test_the_pairs_kept_are_sorted_by_anchor_and_find_their_own_vectors():
    """:meth:`PairBounds.reachable_pairs` keeps u in the order level 2 made it: each kept
    pair's row of u (``u_row``) and its a are :meth:`PairBounds.pair_directions`' for that
    pair, and the pairs come by anchor, then by component."""
    gmm, _ = _mixture(k=10, d=6, thin=False)
    anchors = torch.tensor([0, 2, 3, 5, 6, 9])
    radius, floor = torch.full((6,), 3.0, dtype=torch.float64), torch.full((6,), -30.0, dtype=torch.float64)
    pairs = PairBounds(gmm).reachable_pairs(anchors, radius, floor)
    assert 0 < len(pairs.anchor) < 60 and set(pairs.anchor.tolist()) <= set(anchors.tolist())
    key = pairs.anchor * 10 + pairs.comp
    assert (key.diff() > 0).all()
    u, a = _pair_directions(gmm, pairs.anchor, pairs.comp)  # (fewer pairs a component: maybe the other GEMM path)
    torch.testing.assert_close(pairs.u[pairs.u_row], u.to(pairs.u.dtype), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pairs.a, a.to(pairs.a.dtype), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("thin", [False, True])
def test_pair_bound_never_exceeds_the_mahalanobis_distance(thin):
    gmm, means = _mixture(k=10, d=6, thin=thin)
    anchors, comps = torch.arange(10).repeat_interleave(10), torch.arange(10).repeat(10)
    u, a = _pair_directions(gmm, anchors, comps)
    # a component with fewer pairs than features takes them through P_k twice, with more
    # through Σ_k⁻¹ once: both give the same vectors
    few = comps < 5
    for got, ref in zip(_pair_directions(gmm, anchors[few][::3], comps[few][::3]),
                        (u[few][::3], a[few][::3]), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    mu, cov = gmm.means, gmm.covariances
    # u_jk is a unit vector in Σ_k's metric and a_jk the Mahalanobis distance of μ_j under k
    off = anchors != comps
    torch.testing.assert_close(torch.einsum("pd,pde,pe->p", u, cov[comps], u)[off],
                               torch.ones(90, dtype=torch.float64))
    delta_means = mu[anchors] - mu[comps]
    maha_means = torch.einsum("pd,pde,pe->p", delta_means, torch.linalg.inv(cov[comps]), delta_means)
    torch.testing.assert_close(a.square(), maha_means)
    assert (u[~off] == 0).all() and (a[~off] == 0).all()
    # (a_jk + u_jkᵀ(x − μ_j))² ≤ Maha_k(x) for points around each anchor
    x = torch.tensor(means).repeat_interleave(40, 0) + torch.randn(400, 6, dtype=torch.float64, generator=_gen()) * 2
    u, a = u.view(10, 10, 6), a.view(10, 10)
    anchor = torch.arange(10).repeat_interleave(40)
    along = torch.einsum("nkd,nd->nk", u[anchor], x - mu[anchor])
    bound = (a[anchor] + along).square()
    exact = -2 * (gmm.weighted_log_prob(x) - gmm.log_norm)  # Maha_k(x), (N, K)
    assert (bound <= exact * (1 + 1e-9) + 1e-9).all()
    # and with level 3's lower bound on the rest of Maha_k(x), ‖P_kᵀδ‖² − (u_jkᵀδ)²
    estep = SparseEStep(gmm)
    lam = torch.linalg.eigvalsh(cov)[:, -1]
    rest = estep._off_axis(along, 1.0, 0.0, (x - mu[anchor]).norm(dim=1, keepdim=True),
                           mu[anchor].norm(dim=1, keepdim=True), lam)
    assert (bound + rest <= exact * (1 + 1e-9) + 1e-9).all()
    assert (rest > 0).float().mean() > 0.25  # it adds to z² (the points are not on the axes)


@pytest.mark.parametrize(("thin", "offset", "spread"), [(False, 0.0, 0.5), (True, 0.0, 0.5),
                                                        (False, 0.0, 4.0), (True, 300.0, 2.0)])
def test_sparse_e_step_is_the_dense_e_step_on_its_support(thin, offset, spread):
    # separated and overlapping clusters, near-degenerate covariances, float32 points far
    # from the origin: no component above float32 ε may be dropped
    gmm, means = _mixture(k=12, d=5, thin=thin, offset=offset, work_dtype=torch.float32)
    x = (torch.tensor(means).repeat_interleave(40, 0) + torch.randn(480, 5, dtype=torch.float64, generator=_gen()) * spread).float()
    index, log_resp = SparseEStep(gmm).log_responsibilities(x, 12, chunk_rows=17)
    dense = _dense_log_resp(gmm, x.double()).gather(1, index)
    kept = torch.isfinite(log_resp)
    # float32 points 300 units out, Mahalanobis distances ~1e4: whitening rounding ~1e-2
    torch.testing.assert_close(log_resp[kept], dense[kept], rtol=1e-5, atol=5e-2 if offset else 1e-4)
    evaluated = _evaluated(index, log_resp)
    assert (dense[evaluated & ~kept] < -SUPPORT_LOG_GAP + 1e-3).all()
    # every component at or above float32 ε is in its point's support
    above = _dense_log_resp(gmm, x.double()) > -SUPPORT_LOG_GAP + 1e-3
    support = torch.zeros(above.shape, dtype=torch.long).scatter_add_(1, index, kept.long()) > 0
    assert (support | ~above).all(), int((above & ~support).sum())


def test_sparse_e_step_keeps_components_with_nearly_equal_means():
    # twins 1e-7 apart, 100 units from the origin (a_jk ≈ 0, distance between the means
    # below the rounding of ‖μ_j‖² + ‖μ_k‖² − 2 μ_j·μ_k): each holds half of every point
    base, _ = _mixture(k=30, d=5, offset=100.0)
    means = base.means.clone()
    means[1] = means[0] + 1e-7
    gmm = GaussianMixture(means, base.covariances[[0, 0, *range(2, 30)]],
                          torch.zeros(30, dtype=torch.float64).log_softmax(0))
    x = (means[0] + torch.randn(200, 5, dtype=torch.float64, generator=_gen()) * 0.3).float()
    index, log_resp = SparseEStep(gmm).log_responsibilities(x, 4)
    kept = torch.isfinite(log_resp)
    both = torch.zeros(200, 30, dtype=torch.long).scatter_add_(1, index, kept.long())[:, :2]
    assert (both == 1).all()


def test_sparse_e_step_evaluates_only_what_the_bound_cannot_rule_out(monkeypatch):
    gmm, means = _mixture(thin=True)
    x = torch.tensor(means).repeat_interleave(50, 0) + torch.randn(600, 5, dtype=torch.float64, generator=_gen()) * 0.2
    evaluated = []
    exact_pairs = GaussianMixture.weighted_log_prob_pairs

    def counting(self, x, points, comps, chunk_rows=None):
        evaluated.append(len(comps))
        return exact_pairs(self, x, points, comps, chunk_rows)

    monkeypatch.setattr(GaussianMixture, "weighted_log_prob_pairs", counting)
    index, log_resp = SparseEStep(gmm).log_responsibilities(x, 12)
    monkeypatch.undo()
    # the anchors are evaluated in the same pass as the bound; then a few of 11 x 600
    assert sum(evaluated) < 60, evaluated
    dense = _dense_log_resp(gmm, x)
    torch.testing.assert_close(log_resp[:, 0], dense.gather(1, index[:, :1])[:, 0])
    assert (~torch.isfinite(log_resp[:, 1:])).all() and (dense.topk(2, 1).values[:, 1] < -SUPPORT_LOG_GAP).all()


def test_sparse_e_step_is_the_same_from_any_anchors():
    # anchors only decide how much the bound has to rule out, never the result
    gmm, means = _mixture(thin=True, work_dtype=torch.float32)
    x = (torch.tensor(means).repeat_interleave(30, 0) + torch.randn(360, 5, dtype=torch.float64, generator=_gen())).float()
    ref_index, ref = SparseEStep(gmm).log_responsibilities(x, 6)
    best = ref_index.gather(1, ref.argmax(1, keepdim=True)).squeeze(1)
    some_missing = best.clone()
    some_missing[::3] = -1
    for anchors in (best, some_missing, torch.randint(0, 12, (360,), generator=_gen(1))):
        index, log_resp = SparseEStep(gmm).log_responsibilities(x, 6, anchors=anchors)
        # per cluster (unused slots repeat the anchor with −inf, so take the max)
        dense_ref = torch.full((360, 12), -torch.inf, dtype=torch.float64).scatter_reduce(1, ref_index, ref, "amax")
        dense_got = torch.full((360, 12), -torch.inf, dtype=torch.float64).scatter_reduce(1, index, log_resp, "amax")
        torch.testing.assert_close(dense_got, dense_ref, rtol=1e-5, atol=1e-5)


def test_batched_log_prob_pairs_and_pair_directions_equal_the_loops():
    # what CUDA runs (blocks of 5 pairs, 3 blocks or 2 pairs per chunk), checked on the CPU
    gmm, _ = _mixture(work_dtype=torch.float32, layout=BlockLayout(rows=5, chunk_elems=3 * (2 * 5 * 5 + 5 * 5)))
    x = torch.randn(300, 5, dtype=torch.float64, generator=_gen()).float() * 8
    points, comps = _pairs(torch.randint(0, 12, (300, 3), generator=_gen(2)))
    got = gmm.weighted_log_prob_pairs(x, points, comps, batched=True)
    torch.testing.assert_close(got, gmm.weighted_log_prob_pairs(x, points, comps, batched=False), rtol=1e-6, atol=1e-5)
    anchors, comps = torch.arange(12).repeat_interleave(12), torch.arange(12).repeat(12)
    for got, ref in zip(_pair_directions(gmm, anchors, comps, batched=True),
                        _pair_directions(gmm, anchors, comps, batched=False), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("thin", "offset", "spread", "m", "atol"), [
    (False, 0.0, 0.5, 12, 1e-4), (True, 0.0, 0.5, 12, 1e-4), (False, 0.0, 4.0, 12, 1e-4),
    (True, 300.0, 2.0, 12, 5e-2), (False, 0.0, 20.0, 3, 1e-3)])
def test_batched_sparse_e_step_equals_the_loops(thin, offset, spread, m, atol):
    # the GPU path on the CPU, in blocks of 7 points and small chunks: the same support and
    # values to float32 rounding of the whitening (larger where Mahalanobis distances are:
    # far from the origin, or spread 20, where the cap binds)
    gmm, means = _mixture(k=12, d=5, thin=thin, offset=offset, work_dtype=torch.float32,
                          layout=BlockLayout(rows=7, chunk_elems=2000))
    x = (torch.tensor(means).repeat_interleave(40, 0) + torch.randn(480, 5, dtype=torch.float64, generator=_gen()) * spread).float()
    anchors = torch.randint(0, 12, (480,), generator=_gen(3))
    anchors[::5] = -1
    ref_index, ref = SparseEStep(gmm).log_responsibilities(x, m, chunk_rows=17, anchors=anchors, batched=False)
    index, log_resp = SparseEStep(gmm).log_responsibilities(x, m, anchors=anchors, batched=True)
    assert torch.equal(index[:, 0], ref_index[:, 0])

    def dense(idx, lr):
        return torch.full((480, 12), -torch.inf, dtype=torch.float64).scatter_reduce(1, idx, lr, "amax")

    assert torch.equal(torch.isfinite(dense(index, log_resp)), torch.isfinite(dense(ref_index, ref)))
    torch.testing.assert_close(dense(index, log_resp), dense(ref_index, ref), rtol=1e-5, atol=atol)


def test_trace_power_bound_is_an_upper_bound_within_d_to_the_one_over_q():
    rng = np.random.default_rng(4)
    d = 128
    rot = np.linalg.qr(rng.normal(size=(4, d, d)))[0]
    spectra = np.stack([np.ones(d),                              # the worst case: q-th root of D
                        np.exp(rng.uniform(-30, 0, size=d)),     # near-degenerate
                        np.r_[np.ones(3), np.zeros(d - 3)],      # rank 3
                        rng.chisquare(4, size=d)])
    covs = torch.tensor(np.einsum("kij,kj,klj->kil", rot, spectra, rot))
    covs = torch.cat([covs, covs[3:] * 1e-250, covs[3:] * 1e250, torch.zeros(1, d, d, dtype=torch.float64)])
    exact = torch.linalg.eigvalsh(covs)[:, -1]
    bound = trace_power_bound(covs)
    assert torch.isfinite(bound).all() and (bound >= exact).all()
    assert (bound[:-1] <= exact[:-1] * d ** (1 / 32) * (1 + 1e-9)).all()
    torch.testing.assert_close(bound[0], exact[0] * d ** (1 / 32), rtol=1e-9, atol=0)
    assert bound[-1] < 1e-300  # zero matrix: a (tiny) bound, no NaN
    torch.testing.assert_close(largest_eigenvalue_bound(covs[:4]), exact[:4].clamp_min(0))  # CPU: exact


@pytest.mark.parametrize("thin", [False, True])
def test_sparse_e_step_is_the_same_with_the_trace_power_bound(thin):
    # what CUDA uses for level 1 (at most D^(1/32) above λ_max, so level 1 may keep more
    # pairs for levels 2 and 3): the same result. (A bound 1000x too low loses 23 entries.)
    gmm, means = _mixture(k=30, d=6, thin=thin, work_dtype=torch.float32)
    x = (torch.tensor(means).repeat_interleave(20, 0) + torch.randn(600, 6, dtype=torch.float64, generator=_gen()) * 2).float()
    ref_index, ref = SparseEStep(gmm).log_responsibilities(x, 6, chunk_rows=13)
    index, log_resp = SparseEStep(gmm, eigen_bound=trace_power_bound).log_responsibilities(x, 6, chunk_rows=13)

    def dense(idx, lr):
        return torch.full((600, 30), -torch.inf).scatter_reduce(1, idx, lr.float(), "amax")

    assert torch.equal(dense(index, log_resp), dense(ref_index, ref))


def test_sparse_e_step_caps_the_support_at_m():
    # heavily overlapping components (spread 20 around means 8 apart): several within
    # float32 resolution of each other
    base, means = _mixture(k=12, d=3)
    gmm = GaussianMixture(base.means, base.covariances * 400, base.log_weights)
    x = torch.tensor(means).repeat_interleave(25, 0) + torch.randn(300, 3, dtype=torch.float64, generator=_gen()) * 20
    index, log_resp = SparseEStep(gmm).log_responsibilities(x, 3)
    assert index.shape == log_resp.shape == (300, 3)
    kept = torch.isfinite(log_resp)
    assert kept.any(1).all() and (kept.sum(1) <= 3).all() and (kept.sum(1) == 3).sum() > 30
    # normalised over the kept components, from their exact log-densities
    lp = gmm.weighted_log_prob(x).gather(1, index).masked_fill(~kept, -torch.inf)
    torch.testing.assert_close(log_resp[kept], (lp - torch.logsumexp(lp, 1, keepdim=True))[kept], rtol=1e-5, atol=1e-5)
    # besides its anchor, a full row keeps its two most likely components
    full = kept.all(1)
    dense = gmm.weighted_log_prob(x).scatter(1, index[:, :1], -torch.inf)
    best_two = dense.topk(2, dim=1).indices[full].sort(1).values
    assert torch.equal(index[full, 1:].sort(1).values, best_two)


def test_sparse_e_step_keeps_the_mass_on_separated_clusters():
    gmm, means = _mixture()
    x = torch.tensor(means).repeat_interleave(20, 0) + torch.randn(240, 5, dtype=torch.float64, generator=_gen()) * 0.5
    index, log_resp = SparseEStep(gmm).log_responsibilities(x, 3)
    dense = _dense_log_resp(gmm, x).exp()
    kept = dense.gather(1, index).masked_fill(~torch.isfinite(log_resp), 0).sum(1)
    assert kept.min() > 1 - 1e-6
    torch.testing.assert_close(log_resp.exp(), dense.gather(1, index).masked_fill(~torch.isfinite(log_resp), 0),
                               atol=1e-6, rtol=0)


def test_grouped_and_buffered_stats_match_sparse_stats():
    rng = np.random.default_rng(2)
    x = torch.tensor(rng.normal(size=(150, 4)))
    rows = torch.tensor(rng.integers(0, 6, size=(150, 2)))
    w = torch.tensor(rng.random(size=(150, 2)))
    ref = sparse_stats(x, rows, w, 6)
    pts = torch.arange(150)[:, None].expand(150, 2).reshape(-1)
    got = grouped_stats(x, pts, rows.reshape(-1), w.reshape(-1), 6, chunk_rows=11)
    torch.testing.assert_close(got.flat(), ref.flat(), rtol=1e-12, atol=1e-12)
    # float32 GEMMs on points far from the origin: centring keeps the float64 sums accurate
    far = x + 100.0
    got32 = grouped_stats(far.float(), pts, rows.reshape(-1), w.reshape(-1), 6)
    ref_far = sparse_stats(far, rows, w, 6)
    torch.testing.assert_close(got32.s1, ref_far.s1, rtol=1e-6, atol=0)
    cov = lambda st: st.s2 / st.n[:, None, None] - (st.s1 / st.n[:, None])[:, :, None] * (st.s1 / st.n[:, None])[:, None, :]  # noqa: E731
    torch.testing.assert_close(cov(got32), cov(ref_far), rtol=0, atol=2e-4)
    buf = TripleBuffer(300, dtype=torch.float64)
    perm = torch.randperm(150)
    for part in perm.split(40):
        buf.add(part.repeat_interleave(2), rows[part].reshape(-1), w[part].reshape(-1))
    torch.testing.assert_close(buf.stats(x, 6).flat(), ref.flat(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="holds 300 triples"):
        buf.add(perm[:1], rows[0, :1], w[0, :1])


@pytest.mark.parametrize("chunk_elems", [1 << 25, 7 * (11 * 4 + 3 * 4 * 4)])
def test_batched_grouped_stats_match_the_row_loop(chunk_elems):
    # what CUDA runs: blocks of 11 rows, and (second case) 7 blocks per batched GEMM, so
    # rows span several blocks and chunks; imbalanced rows, empty rows, float32 far out
    layout = BlockLayout(rows=11, chunk_elems=chunk_elems)
    rng = np.random.default_rng(5)
    x = torch.tensor(rng.normal(size=(400, 4)) + 50.0)
    rows = torch.tensor(rng.choice(9, size=(400, 2), p=[.4, .2, .1, .1, .1, .05, .05, 0, 0]))
    w = torch.tensor(rng.random(size=(400, 2)))
    pts = torch.arange(400)[:, None].expand(400, 2).reshape(-1)
    ref = sparse_stats(x, rows, w, 9)
    got = grouped_stats(x, pts, rows.reshape(-1), w.reshape(-1), 9, batched=True, layout=layout)
    torch.testing.assert_close(got.flat(), ref.flat(), rtol=1e-12, atol=1e-9)
    assert (got.n[7:] == 0).all() and (got.s2[7:] == 0).all()
    loop32 = grouped_stats(x.float(), pts, rows.reshape(-1), w.reshape(-1), 9, batched=False)
    got32 = grouped_stats(x.float(), pts, rows.reshape(-1), w.reshape(-1), 9, batched=True, layout=layout)
    torch.testing.assert_close(got32.s1, ref.s1, rtol=1e-6, atol=0)
    torch.testing.assert_close(_covariance(got32), _covariance(ref), rtol=0, atol=1e-5)
    torch.testing.assert_close(_covariance(got32), _covariance(loop32), rtol=0, atol=1e-5)


def _covariance(st, rows=7):
    """Covariances of the first (non-empty) ``rows`` rows."""
    n, s1, s2 = st.n[:rows], st.s1[:rows], st.s2[:rows]
    mean = s1 / n[:, None]
    return s2 / n[:, None, None] - mean[:, :, None] * mean[:, None, :]


def _fit(x, dense_max_k):
    cfg = Config().with_overrides({
        "device": "cpu", "init.n_clusters": 40, "estep.top_m": 4, "estep.dense_max_k": dense_max_k,
        "schedule.max_epochs": 24, "schedule.warmup_epochs": 3, "schedule.move_every": 3,
        "small_data.max_rows": 0,  # the net search: the sparse targets of its minibatch steps
    })
    search = start_fit(cfg, torch.as_tensor(x))
    search.fit()
    labels = FittedModel.from_search(search).predict_log_proba(torch.as_tensor(x)).argmax(1).numpy()
    return search.n_clusters, labels


@pytest.mark.slow
def test_top_m_fit_matches_dense_fit():
    torch.set_num_threads(1)
    x, y = make_mixture(20_000, 16, 40, imbalance=1.0, min_weight=0.005, random_state=3)
    k_dense, lab_dense = _fit(x, dense_max_k=10_000)
    k_top, lab_top = _fit(x, dense_max_k=0)
    nmi_dense, nmi_top = nmi(y, lab_dense), nmi(y, lab_top)
    assert k_top == k_dense, (k_top, k_dense)
    assert abs(nmi_top - nmi_dense) <= 0.01, (nmi_top, nmi_dense)
    assert nmi_top > 0.9, nmi_top


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op returns (shape and op) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.where = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.where = t.numel(), (str(func), tuple(t.shape))
        return out


@pytest.mark.slow
@pytest.mark.parametrize("dense_max_k", [32, 1000])
def test_epochs_with_moves_never_hold_an_n_by_k_tensor(dense_max_k):
    # memory O(N·D + N·m + K·D² + batch·K), never N x K. Above estep.dense_max_k the
    # largest tensor of initialisation, epochs and a split and a merge round is the sparse
    # E-step's (N, m) or a (65536, K) chunk of nearest centres / the net's hard counts; the
    # dense E-step (K <= dense_max_k, by design only for small K) holds the (N, K) targets,
    # which shows the probe sees them
    # (from 48 of the 64 clusters, so that the split round has real splits to make: the
    # density-valley rule turns down cuts inside one cluster)
    torch.set_num_threads(1)
    n, k, k_init, m = 200_000, 64, 48, 8
    x, _ = make_mixture(n, 4, k, imbalance=1.0, min_weight=0.1 / k, random_state=0)
    cfg = Config().with_overrides({
        "seed": 0, "init.n_clusters": k_init, "schedule.warmup_epochs": 1, "schedule.move_every": 1,
        "prior.sigma_scale": 0.1, "estep.top_m": m, "estep.dense_max_k": dense_max_k,
    })
    search = start_fit(cfg, torch.as_tensor(x))
    probe = _LargestTensor()
    with probe:
        search.initialize()
        records = [search.step_epoch() for _ in range(4)]
    assert sum(r["splits_accepted"] for r in records) > 0  # a move round really ran
    k_max = max(r["n_clusters"] for r in records)
    if dense_max_k < k_init:
        assert probe.numel <= max(n * m, 65536 * k_max) < n * k_init, probe.where
    else:
        assert probe.numel >= n * k_init, probe.where
