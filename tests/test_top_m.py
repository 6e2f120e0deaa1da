"""Top-m E-step and grouped statistics (issue 8): same answer as the dense computation."""

import numpy as np
import pytest
import torch

from deepdpm_core.config import Config
from deepdpm_core.datasets import make_mixture
from deepdpm_core.gmm import GaussianMixture, faiss_proxy_keys, proxy_top_m_faiss, proxy_top_m_torch
from deepdpm_core.metrics import nmi
from deepdpm_core.stats import TripleBuffer, grouped_stats, sparse_stats
from deepdpm_core.trainer import Trainer


def _mixture(k=12, d=5, seed=0, work_dtype=torch.float64):
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(k, d)) * 8
    covs = np.stack([a @ a.T / d + 0.2 * np.eye(d) for a in rng.normal(size=(k, d, d))])
    logw = np.log(rng.dirichlet(np.ones(k)))
    gmm = GaussianMixture(torch.tensor(means), torch.tensor(covs), torch.tensor(logw), work_dtype=work_dtype)
    return gmm, means


def test_log_prob_at_pairs_equals_dense_columns():
    gmm, _ = _mixture()
    x = torch.randn(300, 5, dtype=torch.float64) * 8
    index = torch.randint(0, 12, (300, 3))
    dense = gmm.weighted_log_prob(x)
    torch.testing.assert_close(gmm.weighted_log_prob_at(x, index, chunk_rows=7), dense.gather(1, index))
    # float32 whitening GEMMs (the default): points are centred first, so ~1e-6 relative
    gmm32, _ = _mixture(work_dtype=torch.float32)
    torch.testing.assert_close(gmm32.weighted_log_prob_at(x.float(), index), dense.gather(1, index),
                               rtol=1e-5, atol=1e-4)


def test_faiss_and_torch_rank_the_proxy_alike():
    gmm, means = _mixture(k=40, d=6)
    x = (torch.tensor(means).repeat_interleave(30, 0) + torch.randn(1200, 6, dtype=torch.float64) * 2).float()
    w, a, c = gmm._proxy
    score = x @ w - x.square().sum(1, keepdim=True) * a + c
    ref = proxy_top_m_torch(x, w, a, c, 5)
    got = proxy_top_m_faiss(x, faiss_proxy_keys(w, a, c), 5)
    assert got.shape == ref.shape == (1200, 5) and got.dtype == torch.long
    # the same scores in the same order (index sets may differ only between exact ties)
    torch.testing.assert_close(score.gather(1, got), score.gather(1, ref), rtol=1e-5, atol=1e-4)
    assert (got == ref).float().mean() > 0.99
    torch.testing.assert_close(gmm.candidates(x, 5, chunk_elems=40 * 7), got)


def test_top_m_with_all_components_is_the_dense_e_step():
    gmm, _ = _mixture()
    x = torch.randn(200, 5, dtype=torch.float64) * 8
    index, log_resp = gmm.top_m_log_responsibilities(x, 12)
    dense = gmm.log_responsibilities(x)
    torch.testing.assert_close(log_resp, dense.gather(1, index))
    assert (index.sort(1).values == torch.arange(12)).all()


def test_top_m_keeps_the_mass_on_separated_clusters():
    gmm, means = _mixture()
    x = torch.tensor(means).repeat_interleave(20, 0) + torch.randn(240, 5, dtype=torch.float64) * 0.5
    index, log_resp = gmm.top_m_log_responsibilities(x, 3)
    dense = gmm.log_responsibilities(x).exp()
    kept = dense.gather(1, index).sum(1)
    assert kept.min() > 1 - 1e-6
    torch.testing.assert_close(log_resp.exp(), dense.gather(1, index), atol=1e-6, rtol=0)


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


def _fit(x, dense_max_k):
    cfg = Config().with_overrides({
        "device": "cpu", "init.n_clusters": 40, "estep.top_m": 4, "estep.dense_max_k": dense_max_k,
        "schedule.max_epochs": 24, "schedule.warmup_epochs": 3, "schedule.move_every": 3,
    })
    trainer = Trainer(cfg, torch.as_tensor(x))
    trainer.fit()
    labels = trainer.predict_log_proba(torch.as_tensor(x)).argmax(1).numpy()
    return trainer.n_clusters, labels


def test_top_m_fit_matches_dense_fit():
    torch.set_num_threads(1)
    x, y = make_mixture(20_000, 16, 40, imbalance=1.0, min_weight=0.005, random_state=3)
    k_dense, lab_dense = _fit(x, dense_max_k=10_000)
    k_top, lab_top = _fit(x, dense_max_k=0)
    nmi_dense, nmi_top = nmi(y, lab_dense), nmi(y, lab_top)
    assert k_top == k_dense, (k_top, k_dense)
    assert abs(nmi_top - nmi_dense) <= 0.01, (nmi_top, nmi_dense)
    assert nmi_top > 0.9, nmi_top
