"""The CUDA path: the same code on a GPU gives the CPU's answer.

Skipped where no CUDA device is present (CI has none); run on a GPU machine with
``python -m pytest tests/core/runtime/test_cuda.py``.
"""

import pytest
import torch

from deepdpm_core.bayes import grouped_stats, sparse_stats
from deepdpm_core.config import Config
from deepdpm_core.data import make_mixture, nmi
from deepdpm_core.estep import SparseEStep
from deepdpm_core.model import FittedModel
from deepdpm_core.nets import SubclusterNets
from deepdpm_core.training import start_fit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def _fit(x, device, **overrides):
    cfg = Config().with_overrides({
        "device": device, "init.n_clusters": 1, "schedule.max_epochs": 80,
        "schedule.warmup_epochs": 3, "schedule.move_every": 3, **overrides,
    })
    search = start_fit(cfg, torch.as_tensor(x))
    search.fit()
    return search, FittedModel.from_search(search).predict_assignments(torch.as_tensor(x))[0].cpu().numpy()


def test_fit_on_cuda_finds_the_cpu_clusters():
    # model.precision "auto": TF32 nets on CUDA, float32 on the CPU
    x, y = make_mixture(20_000, 16, 40, imbalance=1.0, min_weight=0.005, random_state=3)
    cpu, lab_cpu = _fit(x, "cpu")
    gpu, lab_gpu = _fit(x, "cuda")
    assert gpu.x.device.type == gpu.state.means.device.type == "cuda" and gpu.precision == "tf32"
    assert gpu.state.means.dtype == gpu.state.covariances.dtype == torch.float64
    assert gpu.n_clusters == cpu.n_clusters == 40
    assert abs(nmi(y, lab_gpu) - nmi(y, lab_cpu)) <= 0.01 and nmi(y, lab_gpu) > 0.99


def test_sparse_estep_fit_on_cuda_finds_the_dense_clusters():
    # K above estep.dense_max_k: the sparse E-step, with the torch proxy instead of FAISS
    x, y = make_mixture(30_000, 8, 60, imbalance=1.0, min_weight=0.004, random_state=5)
    sparse, lab_sparse = _fit(x, "cuda", **{"init.n_clusters": 60, "estep.dense_max_k": 16,
                                             "estep.top_m": 8})
    dense, lab_dense = _fit(x, "cuda", **{"init.n_clusters": 60, "estep.dense_max_k": 1000})
    assert sparse.estep.support(sparse.n_clusters) == 8 and dense.estep.support(dense.n_clusters) == dense.n_clusters
    assert sparse.n_clusters == dense.n_clusters
    assert abs(nmi(y, lab_sparse) - nmi(y, lab_dense)) <= 0.01


def test_sparse_responsibilities_on_cuda_equal_the_cpu_ones():
    x, _ = make_mixture(20_000, 8, 120, imbalance=1.0, min_weight=0.002, random_state=1)
    cfg = Config().with_overrides({"device": "cpu", "init.n_clusters": 120})
    search = start_fit(cfg, torch.as_tensor(x))
    search.initialize()
    cpu_index, cpu_lr = SparseEStep(search.mixture).log_responsibilities(search.x, 6)
    gpu_index, gpu_lr = SparseEStep(search.mixture.to(CUDA)).log_responsibilities(search.x.to(CUDA), 6)
    lp = search.mixture.weighted_log_prob(search.x)
    dense = lp - torch.logsumexp(lp, dim=1, keepdim=True)  # every component: the reference
    for index, lr in ((cpu_index, cpu_lr), (gpu_index.cpu(), gpu_lr.cpu())):
        finite = torch.isfinite(lr)
        torch.testing.assert_close(lr[finite], dense.gather(1, index)[finite].to(lr.dtype),
                                   rtol=1e-4, atol=1e-4)
    # the same support (components per point) either way, up to ties at the float32 cut-off
    def support(index, lr):
        point, col = torch.nonzero(torch.isfinite(lr), as_tuple=True)
        return set(zip(point.tolist(), index[point, col].tolist(), strict=True))

    on_cpu, on_gpu = support(cpu_index, cpu_lr), support(gpu_index.cpu(), gpu_lr.cpu())
    assert len(on_cpu ^ on_gpu) <= 1e-3 * len(on_cpu)


def test_subclustering_nets_on_cuda_equal_the_cpu_ones():
    g = torch.Generator().manual_seed(0)
    net = SubclusterNets(24, 16, 50, g)
    x = torch.randn(3000, 24, generator=g)
    z = torch.cat([torch.full((1500,), 7), torch.randint(0, 50, (1500,), generator=g)])
    dist2 = torch.rand(3000, 2, generator=g)
    ref, ref_logits = net(x, z, dist2)
    grads_ref = torch.autograd.grad(ref, list(net.parameters()))
    gnet = net.to(CUDA)
    # float32 matmuls: TF32 is scoped to the search
    got, logits = gnet(x.to(CUDA), z.to(CUDA), dist2.to(CUDA))
    grads = torch.autograd.grad(got, list(gnet.parameters()))
    torch.testing.assert_close(logits.cpu(), ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-3)


def test_grouped_stats_on_cuda_equal_the_float64_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 12, generator=g) * 3 + 10
    points = torch.randint(0, 5000, (9000,), generator=g)
    rows = torch.randint(0, 37, (9000,), generator=g)
    w = torch.rand(9000, generator=g)
    ref = sparse_stats(x[points], rows, w, 37)
    got = grouped_stats(x.to(CUDA), points.to(CUDA), rows.to(CUDA), w.to(CUDA), 37)
    for a, b in zip((got.n, got.s1, got.s2), (ref.n, ref.s1, ref.s2), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6)
