"""The clustering net's start for its distillation: the mixture's linear discriminant.

With one covariance S shared by the clusters, the responsibilities of a Gaussian mixture are
a softmax of linear functions of x (Fisher's linear discriminant):

    ln r_k = μ_kᵀ S⁻¹ x − ½ μ_kᵀ S⁻¹ μ_k + ln π_k + const(x).

A net of one ReLU layer holds a linear function of u = A x exactly in pairs of units,
u = relu(A x) − relu(−A x), so the linear discriminant is a setting of its weights. Where
the hidden layer has fewer than 2D units, or the K means span fewer than D directions, the
pairs hold the r leading discriminant directions (reduced-rank LDA: the principal axes of
the whitened means, Hastie, Tibshirani & Friedman, *Elements of Statistical Learning*,
section 4.3.3), r = min(D, K − 1, H // 2); the other units keep their weights and start
with no say in the output. :func:`widen_hidden` first gives a net the 2·min(D, K − 1) units
that hold every direction, computing the same function as before. Distillation then moves
the net from there to the clusters' own covariances.

A net trained through the search follows the moves, not the final partition: on 100 blobs
along a curve (20,000 rows in 2-D) full-batch Adam from it stalls where the net's argmax
agrees with the mixture's on 95.9 % of the rows, while the discriminant starts near the
mixture's answer.
"""

from __future__ import annotations

import math

import torch

from deepdpm_core.nets.adam import Adam
from deepdpm_core.nets.networks import ClusterNet, reindex_rows

Tensor = torch.Tensor


@torch.no_grad()
def discriminant_start(net: ClusterNet, means: Tensor, covariances: Tensor, log_weights: Tensor) -> int:
    """Set ``net``'s weights to the (reduced-rank) linear discriminant of the mixture
    (module docstring); returns r, the discriminant directions held.

    Parameters
    ----------
    net : ClusterNet
        K outputs, H hidden units.
    means : Tensor of shape (K, D)
    covariances : Tensor of shape (K, D, D)
    log_weights : Tensor of shape (K,)
        ln π_k, normalised.
    """
    k, d = means.shape
    hidden = net.hidden.weight.shape[0]
    rank = min(d, k - 1, hidden // 2)
    if rank < 1:
        return 0
    mu = means.to(torch.float64)
    weights = log_weights.to(torch.float64).softmax(0)
    pooled = torch.einsum("k,kij->ij", weights, covariances.to(torch.float64))
    # whiten by the pooled covariance (a weighted mean of positive-definite MAP covariances):
    # S = L Lᵀ, w = L⁻¹ x
    chol = torch.linalg.cholesky(pooled)
    white = torch.linalg.solve_triangular(chol, mu.T, upper=False).T  # (K, D) whitened means
    centre = weights @ white
    between = (white - centre).T @ ((white - centre) * weights[:, None])
    _, vectors = torch.linalg.eigh(between)
    axes = vectors[:, -rank:]  # (D, r) leading discriminant directions, whitened
    # u = Pᵀx with P = L⁻ᵀV: the whitened x on the axes
    project = torch.linalg.solve_triangular(chol.T, axes, upper=True)  # (D, r)
    u_means = mu @ project  # (K, r)
    w1 = net.hidden.weight
    b1 = net.hidden.bias
    w1[:rank] = project.T.to(w1.dtype)
    w1[rank : 2 * rank] = -project.T.to(w1.dtype)
    b1[: 2 * rank] = 0.0
    out = net.out.weight
    out.zero_()
    out[:, :rank] = u_means.to(out.dtype)
    out[:, rank : 2 * rank] = -u_means.to(out.dtype)
    bias = -0.5 * (u_means * u_means).sum(1) + log_weights.to(torch.float64)
    net.out.bias.copy_((bias - bias.max()).to(net.out.bias.dtype))
    return rank


def widen_hidden(net: ClusterNet, width: int, optimizer: Adam, generator: torch.Generator) -> bool:
    """Give ``net`` ``width`` hidden units if it has fewer (returns whether it had),
    computing the same function: the new units take PyTorch's default random input weights
    (from ``generator``) and no say in the output (zero output weights); their Adam moments
    in ``optimizer`` start at zero."""
    hidden, dim = net.hidden.weight.shape
    extra = width - hidden
    if extra <= 0:
        return False
    device = net.hidden.weight.device
    src = torch.cat([torch.arange(hidden), torch.full((extra,), -1)]).to(device)
    bound = 1.0 / math.sqrt(dim)
    draws = (torch.rand(extra, dim + 1, generator=generator) * 2 - 1) * bound
    reindex_rows(net.hidden, "weight", src, draws[:, :dim], optimizer)
    reindex_rows(net.hidden, "bias", src, draws[:, dim], optimizer)
    reindex_rows(net.out, "weight", src, torch.zeros(extra, net.n_clusters), optimizer, axis=1)
    return True
