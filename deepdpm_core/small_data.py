"""Small data: one epoch of exact EM, and the clustering net fitted to its result.

On a few thousand rows the nets' minibatch steps are nearly all of a fit's time (a
150-row fit: 2,600 steps for 40 epochs), while the E-step they learn to imitate costs
milliseconds. So up to ``small_data.max_rows`` rows the search runs on the exact
quantities the nets approximate (docs/design.md, "Small data"):

* the soft cluster statistics take the E-step responsibilities r^E (paper Eq. 5), the
  target the clustering net's KL loss (Eq. 6) drives its output r towards;
* each point's subcluster is the nearer of its cluster's two subcluster means: a 2-means
  step, the minimiser of the subclustering nets' loss (Eq. 7) for the current means;

and the M-step, the prior, the split/merge moves and the stop rule are unchanged. Once K
has settled, :func:`distil` fits the clustering net to the final responsibilities, so
``predict`` works as after any fit.
"""

from __future__ import annotations

import torch
from torch import nn

from deepdpm_core.communicator import Communicator
from deepdpm_core.epoch_stats import R_FLOOR
from deepdpm_core.losses import slot_kl
from deepdpm_core.mixture_state import MixtureState
from deepdpm_core.moves import coarsened
from deepdpm_core.niw import NIWPrior, log_split_hastings
from deepdpm_core.stats import SuffStats, grouped_stats

Tensor = torch.Tensor
#: rounds of :func:`distil` between agreement checks, and checks without a gain before it stops
CHECK_EVERY, PATIENCE = 25, 4


def exact_statistics(x: Tensor, state: MixtureState, candidates: Tensor, resp: Tensor,
                     z: Tensor) -> tuple[SuffStats, SuffStats, SuffStats, Tensor]:
    """This rank's soft cluster and hard subcluster statistics of one EM epoch.

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
    state : MixtureState
        K clusters and their subclusters, frozen at the last M-step.
    candidates, resp : Tensor of shape (N_local, m)
        Each row's E-step support and r^E on it
        (:func:`~deepdpm_core.estep.estep_targets`).
    z : Tensor of shape (N_local,), int64
        Each row's most responsible cluster.

    Returns
    -------
    soft : SuffStats
        K rows, weights r^E.
    sub : SuffStats
        2K rows (cluster k's subclusters at 2k, 2k + 1), hard counts.
    cut : SuffStats
        2K rows: each cluster's points either side of the hyperplane through its mean
        normal to its covariance's principal axis, hard counts (:func:`best_cuts`).
    sum_sub : Tensor
        Σ_i ‖x_i − μ̃_{z_i j_i}‖², the subcluster loss (Eq. 7) of the hard assignment.
    """
    k = state.n_clusters
    point, slot = (resp >= R_FLOOR).nonzero(as_tuple=True)
    soft = grouped_stats(x, point, candidates[point, slot], resp[point, slot], k)
    # the nearer of the cluster's two subcluster means: the minimiser of Eq. 7 for fixed means
    sub_means = state.sub_means.to(x.dtype)
    dist2 = (x[:, None, :] - sub_means.index_select(0, z)).square().sum(-1)  # (N_local, 2)
    nearest, j = dist2.min(1)
    sub_rows = 2 * z + j
    rows = torch.arange(x.shape[0], device=x.device)
    ones = torch.ones_like(z, dtype=torch.float32)
    sub = grouped_stats(x, rows, sub_rows, ones, 2 * k)
    axes = principal_axes(state.covariances).to(x.dtype)
    side = ((x - state.means.to(x.dtype).index_select(0, z)) * axes.index_select(0, z)).sum(1) > 0
    cut = grouped_stats(x, rows, 2 * z + side.long(), ones, 2 * k)
    return soft, sub, cut, nearest.sum().double()


def principal_axes(covariances: Tensor, iterations: int = 30) -> Tensor:
    """Each covariance's leading eigenvector by power iteration, shape (K, D).

    Deterministic (a fixed start, so every rank gets the same axes) and O(K·D²) per
    round, where a full eigendecomposition costs O(K·D³) per epoch at 512 features. A
    near-tie of the two leading eigenvalues leaves a mix of both axes, which is as good
    a cut for a round shape.
    """
    k, d = covariances.shape[:2]
    v = torch.ones(k, d, 1, dtype=covariances.dtype, device=covariances.device)
    v[:, ::2] = -1.0  # not orthogonal to an axis along the diagonal, nor to (1, .., 1)
    for _ in range(iterations):
        v = covariances @ v
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return v.squeeze(2)


def best_cuts(prior: NIWPrior, alpha: float, coarsening: float | None, sub: SuffStats,
              cut: SuffStats) -> tuple[SuffStats, Tensor]:
    """Each cluster's better two-way cut: its 2-means subclusters or its principal-axis cut.

    The 2-means step keeps each cluster's subclusters where they were, which may be a
    poor local optimum: a cluster holding three blobs in a row may keep cutting one blob
    in half (ln H_s near 0) while a cut between blobs gains tens of nats, and the cluster
    is never split. The principal-axis cut is a second proposal from the cluster's own
    shape; the one with the larger (coarsened) ln H_s becomes the subclusters, so the
    split proposal (Eq. 2) sees it and the next 2-means steps start from it. All inputs
    are all-reduced: every rank picks the same.

    Parameters
    ----------
    prior : NIWPrior
    alpha : float
        DP concentration.
    coarsening : float or None
        c of :func:`~deepdpm_core.moves.coarsened`.
    sub, cut : SuffStats with 2K rows
        The two candidates, cluster k's halves at rows 2k, 2k + 1.

    Returns
    -------
    best : SuffStats with 2K rows
    took_cut : Tensor of shape (K,), bool
        Where the principal-axis cut won.
    """
    union = sub.pair_sums().n.repeat_interleave(2)
    log_h_sub = log_split_hastings(prior, alpha, coarsened(sub, union, coarsening))
    log_h_cut = log_split_hastings(prior, alpha, coarsened(cut, union, coarsening))
    took_cut = log_h_cut > log_h_sub
    pick = took_cut.repeat_interleave(2)
    best = SuffStats(torch.where(pick, cut.n, sub.n), torch.where(pick[:, None], cut.s1, sub.s1),
                     torch.where(pick[:, None, None], cut.s2, sub.s2))
    return best, took_cut


def distil(model: nn.Module, x: Tensor, candidates: Tensor, resp: Tensor, n_total: int,
           comm: Communicator, lr: float, agreement: float, max_steps: int) -> tuple[int, float]:
    """Fit the clustering net to the final E-step targets: full-batch Adam on KL(r^E ‖ r).

    Stops when the net's argmax agrees with r^E's on ``agreement`` of the rows (over all
    ranks), when :data:`PATIENCE` checks in a row (every :data:`CHECK_EVERY` steps) bring
    no gain (rows near a boundary between overlapping clusters, which a 1-hidden-layer
    net may never place exactly), or after ``max_steps``. Every rank takes the same steps.

    Parameters
    ----------
    model : nn.Module
        The clustering net (maybe DDP-wrapped): (N_local, D) -> logits (N_local, K).
    x : Tensor of shape (N_local, D)
    candidates, resp : Tensor of shape (N_local, m)
        The final E-step support and targets.
    n_total : int
        Rows over all ranks (the loss is the mean KL over them).
    comm : Communicator
    lr, agreement, max_steps
        ``small_data.distil_lr``, ``distil_agreement``, ``distil_max_steps``.

    Returns
    -------
    steps : int
    agreement : float
        The fraction of rows whose net argmax is their most responsible cluster.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    target_z = candidates.gather(1, resp.argmax(1, keepdim=True)).squeeze(1)
    per_rank = max(n_total, 1) / comm.world_size  # DDP averages the ranks' gradients
    model.train(True)
    best, stale, agree, step = -1.0, 0, 0.0, 0
    while step < max_steps:
        logits = model(x)
        kl, z, _ = slot_kl(logits, candidates, resp)
        opt.zero_grad(set_to_none=True)
        (kl / per_rank).backward()
        opt.step()
        step += 1
        if step % CHECK_EVERY and step < max_steps:
            continue
        hits = (z == target_z).sum().to(torch.float64).reshape(1)
        agree = float(comm.all_reduce(hits)[0]) / max(n_total, 1)
        stale = 0 if agree > best + 1e-4 else stale + 1
        best = max(best, agree)
        if agree >= agreement or stale >= PATIENCE:
            break
    model.train(False)
    return step, agree
