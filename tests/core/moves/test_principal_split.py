"""The principal-axis split reads the top eigenpair of each covariance and computes no other."""

import math

import torch

from deepdpm_core.moves.initial import principal_split

D = 128


def _covariances() -> torch.Tensor:
    """Covariances like a large-K fit's restarts: anisotropic ones with a heavy-tailed
    spectrum, near-isotropic ones (the MAP covariance of a cluster with almost no points),
    a top eigenvalue repeated exactly and one repeated to 1e-9, a rank-one matrix and zero."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(40, D, D, generator=gen, dtype=torch.float64) / math.sqrt(D)
    scale = torch.rand(40, 1, D, generator=gen, dtype=torch.float64) ** 3
    eye = torch.eye(D, dtype=torch.float64)
    covs = (a * scale) @ (a * scale).mT + 0.05 * eye
    covs[:10] = eye + 0.01 * covs[:10]
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    for i, top in enumerate((torch.tensor([3.0, 3.0, 3.0]), torch.tensor([3.0, 3.0 * (1 - 1e-9), 2.999]))):
        spectrum = torch.linspace(0.1, 2.0, D, dtype=torch.float64)
        spectrum[-3:] = top.to(spectrum)
        covs[10 + i] = (q * spectrum) @ q.T
    u = torch.randn(D, generator=gen, dtype=torch.float64)
    covs[12] = torch.outer(u, u)
    covs[13] = 0
    return covs


def test_the_split_explains_the_top_eigenvalue_whatever_the_eigenvector_chosen():
    covs = _covariances()
    means = torch.randn(len(covs), D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    top = torch.linalg.eigvalsh(covs)[:, -1]  # the closed-form reference
    sub_means, sub_covs, v, spread = principal_split(means, covs)
    torch.testing.assert_close(v.norm(dim=1), torch.ones(len(covs), dtype=torch.float64))
    # the variance the axis explains is λ₁ (with a repeated top eigenvalue any vector of its
    # eigenspace does: the sign and the vector within it are not compared)
    explained = torch.einsum("ki,kij,kj->k", v, covs, v)
    torch.testing.assert_close(explained, top, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(spread, top.sqrt().clamp_min(1e-12), rtol=1e-6, atol=1e-12)
    # half-normal moments: the halves sit sqrt(2λ₁/π) either side of μ along v, and each
    # half's covariance loses (2/π)λ₁ of trace and stays positive semi-definite
    torch.testing.assert_close((sub_means - means[:, None]).norm(dim=2),
                               (2 * top / math.pi).sqrt()[:, None].expand(-1, 2), rtol=1e-6, atol=1e-9)
    lost = covs.diagonal(dim1=1, dim2=2).sum(1) - sub_covs[:, 0].diagonal(dim1=1, dim2=2).sum(1)
    torch.testing.assert_close(lost, 2 / math.pi * top, rtol=1e-6, atol=1e-9)
    assert bool((torch.linalg.eigvalsh(sub_covs[:, 0])[:, 0] >= -1e-9 * top.clamp_min(1)).all())


def test_the_split_decomposes_no_covariance_in_full(monkeypatch):
    # only the top pair is read: no (D, D) eigendecomposition, which at K = 1,000 restarts
    # of D = 128 cost more than the rest of them
    covs = _covariances()
    sizes = []
    for name in ("eigh", "eigvalsh"):
        real = getattr(torch.linalg, name)

        def recording(m, *args, _real=real, **kwargs):
            sizes.append(m.shape[-1])
            return _real(m, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, recording)
    principal_split(torch.zeros(len(covs), D, dtype=torch.float64), covs)
    assert sizes and max(sizes) < D
