"""The initial clusters (k-means with FAISS, or given labels) and data-free subcluster
initialisation."""

from __future__ import annotations

import math

import faiss
import numpy as np
import torch

from deepdpm_core.bayes import cache_blocks, row_blocks
from deepdpm_core.config import InitConfig, searches_by_exact_em
from deepdpm_core.moves.kmeans_pp import kmeans_pp_seeds
from deepdpm_core.runtime import Communicator

Tensor = torch.Tensor

#: ``init.n_clusters: auto`` starts from this many k-means clusters ...
AUTO_INITIAL_CLUSTERS = 10
#: ... or, in the minibatch search (above ``small_data.max_rows`` rows), one per this many rows
#: where that is more: that search has no growth, and a cluster that holds a block of
#: several classes has no two-way cut that pays
AUTO_ROWS_PER_INITIAL_CLUSTER = 1_000
#: ... or fewer, so that the initial clusters hold this many rows on average
AUTO_ROWS_PER_CLUSTER = 10
#: rows x clusters of the k-means sample where ``init.points_per_cluster`` asks for fewer rows:
#: every start up to K = 200 sees all of 200,000 rows, as before the sample was sized by K,
#: and one Lloyd iteration costs at most what 40 rows a cluster cost at K = 1,000
KMEANS_ROWS_X_CLUSTERS = 40_000_000


def initial_cluster_count(setting: int | str, n_rows: int, exact_rows: int | None) -> int:
    """The initial K of a fit: ``init.n_clusters`` itself, or (``auto``) 10 clusters, fewer
    when the data have under 100 rows. Not K = 1: a prior fitted to one cluster of all the
    data takes the spread between the clusters for their own and no split pays. Above
    ``exact_rows`` (the minibatch search, which has no growth) max(10, N/1,000): a cluster
    that holds a block of several classes has no two-way cut that pays, while merges join a
    surplus back (docs/design.md, "Why the fit starts from 10 clusters").

    Parameters
    ----------
    setting : int or "auto"
    n_rows : int
        N, the rows of the whole fit (all ranks).
    exact_rows : int or None
        ``small_data.max_rows``: up to this N the search is exact EM (None: at every N).
    """
    if setting != "auto":
        return int(setting)
    wanted = AUTO_INITIAL_CLUSTERS
    if not searches_by_exact_em(n_rows, exact_rows):
        wanted = max(wanted, n_rows // AUTO_ROWS_PER_INITIAL_CLUSTER)
    return max(1, min(wanted, n_rows // AUTO_ROWS_PER_CLUSTER))


def kmeans_sample_size(n_total: int, n_clusters: int, config: InitConfig) -> int:
    """Rows of the k-means sample: as many as :data:`KMEANS_ROWS_X_CLUSTERS` / K, or
    ``init.points_per_cluster`` a cluster where that is more; at most ``init.max_points``
    and N.

    Sized by K, not by N: a Lloyd iteration costs rows x K x D, so a sample of a fixed
    number of rows makes the start of a large-K fit dearer than its epochs (200k x 128 at
    K = 1,000, one CPU thread: 74 s on all rows, 10 s on 40 a cluster). 40 a cluster stays
    above the 39 below which FAISS warns of too few points.

    Parameters
    ----------
    n_total : int
        N over all ranks.
    n_clusters : int
        Initial clusters.
    config : InitConfig
    """
    wanted = max(KMEANS_ROWS_X_CLUSTERS // n_clusters, config.points_per_cluster * n_clusters)
    return min(n_total, config.max_points, wanted)


#: FAISS k-means runs on rows of at least this many features, zero columns appended: the
#: same squared distances, but its search below 8 features takes a path about 5 times
#: slower (20,000 rows in 2-D, 280 clusters, 25 iterations, one thread: 0.36 s in 2, 3 or 4
#: features, 0.07 s in 8; FAISS 1.15)
FAISS_MIN_DIM = 8


def kmeans_centers(
    x: np.ndarray, n_clusters: int, n_iter: int, max_points: int, rng: np.random.Generator,
    seeding: str = "kmeans++",
) -> np.ndarray:
    """k-means centres of at most ``max_points`` rows sampled from ``x``.

    Parameters
    ----------
    x : ndarray of shape (N, D), float32
    rng : numpy Generator
        Chooses the sample and the seeds and seeds FAISS, so the result is reproducible.
    seeding : {"kmeans++", "random"}
        :func:`kmeans_pp_seeds`, or FAISS's uniformly drawn rows.

    Returns
    -------
    ndarray of shape (n_clusters, D), float32
    """
    n, d = x.shape
    if n_clusters == 1:
        return x.mean(0, keepdims=True, dtype=np.float64).astype(np.float32)
    if n > max_points:
        x = x[np.sort(rng.choice(n, size=max_points, replace=False))]
    x = np.ascontiguousarray(x, dtype=np.float32)
    width = max(d, FAISS_MIN_DIM)
    km = faiss.Kmeans(
        width, n_clusters, niter=n_iter, seed=int(rng.integers(1, 2**31 - 1)),
        max_points_per_centroid=max(1, len(x) // n_clusters + 1), verbose=False,
        # FAISS only warns below 39 points per centroid; small data are a normal input here
        min_points_per_centroid=1,
    )
    seeds = kmeans_pp_seeds(x, n_clusters, rng) if seeding == "kmeans++" else None
    km.train(_zero_padded(x, width), init_centroids=None if seeds is None else _zero_padded(seeds, width))
    return np.ascontiguousarray(km.centroids[:, :d], dtype=np.float32)


def _zero_padded(x: np.ndarray, width: int) -> np.ndarray:
    """``x`` (n, D) with zero columns appended up to ``width`` (the same distances)."""
    if x.shape[1] >= width:
        return x
    out = np.zeros((x.shape[0], width), dtype=np.float32)
    out[:, : x.shape[1]] = x
    return out


def nearest_center(x: Tensor, centers: Tensor, chunk: int | None = None) -> Tensor:
    """Index of the nearest centre (squared L2) of every row.

    Parameters
    ----------
    x : Tensor of shape (N, D)
    centers : Tensor of shape (K, D)
    chunk : int, optional
        Rows at a time (default: 65,536 on a GPU; on a CPU
        :func:`~deepdpm_core.bayes.cache_blocks`, so the distances stay in the cache between
        the GEMM and the argmin, the same labels).

    Returns
    -------
    Tensor of shape (N,), int64
    """
    c = centers.to(x)
    c_sq = c.square().sum(1)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    blocks = row_blocks(x.shape[0], chunk) if chunk else cache_blocks(x.shape[0], c.shape[0], x.device, 65536)
    for s, e in blocks:
        out[s:e] = (c_sq - 2 * x[s:e] @ c.T).argmin(1)
    return out


#: Lanczos steps between two looks at the top Ritz value (each look is a small batched eigvalsh)
LANCZOS_CHECK_EVERY = 6
#: the Lanczos iteration stops once no top Ritz value grew by more than this share since the last look
LANCZOS_RTOL = 1e-6


def top_eigenpair(matrices: Tensor) -> tuple[Tensor, Tensor]:
    """The largest eigenvalue of each symmetric positive semi-definite matrix of a batch and
    a unit vector that attains it (to ``LANCZOS_RTOL``), by Lanczos with full
    reorthogonalisation.

    Only the top pair is read where clusters split along their principal axis, and a full
    ``eigh`` of every (D, D) matrix costs far more (350 matrices at D = 128, one thread:
    docs/benchmarks.md). The Ritz value θ never exceeds λ₁ and grows
    with every step (Cauchy interlacing); it converges at the Kaniel–Paige rate, and without
    any gap at least as fast as (ln D / m)² relatively after m steps (Kuczyński–Woźniakowski
    1992), so near-degenerate top eigenvalues cost no more steps: any unit vector of the
    near-top eigenspace explains the same variance. The iteration stops when θ has stopped
    growing by ``LANCZOS_RTOL`` over ``LANCZOS_CHECK_EVERY`` steps, at the latest after D
    steps, where the Krylov space is the whole space and θ = λ₁ (to the float32 products'
    ~1e-7, below ``LANCZOS_RTOL``). The start is the column of the largest variance plus the
    mean column, and the arithmetic is on the host, so every rank and device agree.

    Parameters
    ----------
    matrices : Tensor of shape (K, D, D)
        Symmetric positive semi-definite.

    Returns
    -------
    values : Tensor of shape (K,)
        vᵀ A v of the returned vectors, ≤ λ₁.
    vectors : Tensor of shape (K, D), unit norm
    """
    k, d, _ = matrices.shape
    a = matrices.detach().to("cpu", torch.float64)
    q = a[torch.arange(k), :, a.diagonal(dim1=1, dim2=2).argmax(1)] + a.mean(2)
    q = q / q.norm(dim=1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    v = torch.zeros(k, d, dtype=a.dtype)
    # the products A q in float32: they read all of A each step, and float32 halves that
    a32 = a.float()
    basis = a.new_empty(k, d, d)  # row j: the j-th Lanczos vector, written at step j
    alpha, beta = a.new_zeros(k, d), a.new_zeros(k, d)
    active, last = torch.arange(k), None  # the matrices still iterating; their last top Ritz values
    for j in range(d):
        basis[:, j] = q
        w = torch.bmm(a32, q.float()[:, :, None]).squeeze(2).double()
        alpha[:, j] = (w * q).sum(1)
        used = basis[:, : j + 1]
        # against every earlier vector, twice: one Gram-Schmidt pass loses orthogonality where
        # A v nearly lies in the basis (a near-isotropic A), and the Ritz values then run past λ₁
        for _ in range(2):
            w = w - torch.bmm(torch.bmm(used, w[:, :, None]).mT, used).squeeze(1)
        beta[:, j] = w.norm(dim=1)
        if (j + 1) % LANCZOS_CHECK_EVERY == 0 or j + 1 == d:
            top = torch.linalg.eigvalsh(_tridiagonal(alpha, beta, j + 1))[:, -1]
            if j + 1 == d:
                done = torch.ones_like(top, dtype=torch.bool)
            elif last is None:
                done = torch.zeros_like(top, dtype=torch.bool)
            else:
                done = top - last <= LANCZOS_RTOL * top.abs()
            if bool(done.any()):  # their Ritz vectors out; the rest iterate on, the batch smaller
                _, s = torch.linalg.eigh(_tridiagonal(alpha[done], beta[done], j + 1))
                v[active[done]] = torch.bmm(s[:, :, -1:].mT, basis[done, : j + 1]).squeeze(1)
                keep = ~done
                if not bool(keep.any()):
                    break
                active, a32, alpha, beta, w, top = (t[keep] for t in (active, a32, alpha, beta, w, top))
                # only the rows written so far move (the rest are written before they are read)
                kept = basis.new_empty(len(active), d, d)
                kept[:, : j + 1] = basis[keep, : j + 1]
                basis = kept
            last = top
        # an exhausted Krylov space (β = 0) leaves q = 0: θ is then exact and stays so
        q = w / beta[:, j, None].clamp_min(torch.finfo(a.dtype).tiny)
    norm = v.norm(dim=1, keepdim=True)
    # a zero matrix has every unit vector for its top eigenvector: the first axis
    v = torch.where(norm > 0, v / norm.clamp_min(torch.finfo(v.dtype).tiny), torch.eye(d, 1, dtype=v.dtype).T)
    values = torch.einsum("ki,kij,kj->k", v, a, v)
    return values.to(matrices), v.to(matrices)


def _tridiagonal(alpha: Tensor, beta: Tensor, m: int) -> Tensor:
    """The (K, m, m) Lanczos matrices of diagonals ``alpha`` and off-diagonals ``beta``."""
    off = torch.diag_embed(beta[:, : m - 1], 1)
    return torch.diag_embed(alpha[:, :m]) + off + off.mT


def principal_split(means: Tensor, covariances: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Subcluster parameters that halve each cluster along its principal axis.

    For N(μ, Σ) cut by the hyperplane through μ orthogonal to the top eigenvector v
    (eigenvalue λ; :func:`top_eigenpair`, the only pair read), each half has mean
    μ ± sqrt(2λ/π) v and covariance Σ − (2/π) λ v vᵀ (moments of a half-normal).
    Data-free, so identical on every rank.

    Parameters
    ----------
    means : Tensor of shape (K, D)
    covariances : Tensor of shape (K, D, D)

    Returns
    -------
    sub_means : Tensor of shape (K, 2, D)
    sub_covariances : Tensor of shape (K, 2, D, D)
    directions : Tensor of shape (K, D) — unit principal axes
    spreads : Tensor of shape (K,) — sqrt(λ)
    """
    lam, v = top_eigenpair(covariances)
    lam = lam.clamp_min(0)
    offset = torch.sqrt(2 * lam / math.pi)[:, None] * v
    sub_means = torch.stack([means + offset, means - offset], 1)
    shrink = (2 / math.pi) * lam[:, None, None] * v[:, :, None] * v[:, None, :]
    cov = covariances - shrink
    return sub_means, torch.stack([cov, cov], 1), v, torch.sqrt(lam).clamp_min(1e-12)


def initial_clusters(x: Tensor, config: InitConfig, n_total: int, rank_rows: list[int], comm: Communicator,
                     rng: np.random.Generator, init_labels: Tensor | None = None) -> tuple[Tensor, int]:
    """Each local row's initial cluster: k-means (rank 0, on a sample gathered from all
    ranks, :func:`kmeans_sample_size` rows) with ``config.n_clusters`` clusters (a number:
    :func:`initial_cluster_count` resolves ``auto``), then every row to its nearest centre;
    or the given warm-start labels.

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
        This rank's rows in the fit's coordinates.
    config : InitConfig
    n_total : int
        N over all ranks.
    rank_rows : list of int
        Rows held by each rank, in rank order.
    comm : Communicator
    rng : numpy.random.Generator
        Draws the k-means sample and seeds (the same stream on every rank).
    init_labels : Tensor of shape (N_local,), int64, optional
        Warm start from these hard clusters (the AE alternation re-clusters from the
        previous clusters).

    Returns
    -------
    labels : Tensor of shape (N_local,), int64
    n_init : int
        Initial clusters over all ranks (some may be empty).
    """
    device = x.device
    if init_labels is not None:
        z = init_labels.to(device=device, dtype=torch.long)
        local_max = torch.zeros(comm.world_size, dtype=torch.float64, device=device)
        local_max[comm.rank] = float(z.max()) if len(z) else 0.0
        return z, int(comm.all_reduce(local_max).max()) + 1
    n_clusters = int(config.n_clusters)
    if n_clusters == 1:  # one centre: every point is assigned to it anyway
        centers = torch.zeros(1, x.shape[1], device=device)
    else:
        size = kmeans_sample_size(n_total, n_clusters, config)
        sample = kmeans_sample(x, n_total, size, rank_rows, comm, rng)
        centers = None
        if comm.rank == 0:
            centers = kmeans_centers(sample.cpu().numpy(), n_clusters, config.kmeans_iters, size, rng)
        centers = torch.as_tensor(comm.broadcast_object(centers, src=0), device=device)
    return nearest_center(x, centers), int(centers.shape[0])


def kmeans_sample(x: Tensor, n_total: int, size: int, rank_rows: list[int], comm: Communicator,
                  rng: np.random.Generator) -> Tensor:
    """The rows k-means sees, shape (min(N, size), D): the same for any W.

    Global row indices are drawn with the seeded generator, identically on every rank; each
    rank fills in the rows it holds and one all-reduce assembles the sample (exact: one
    non-zero contributor a row). Rows are taken to be split over ranks in rank order, as
    ``pipeline`` slices inputs; any other split still gives a valid random sample.
    """
    idx = np.arange(n_total) if n_total <= size else np.sort(rng.choice(n_total, size=size, replace=False))
    offset = sum(rank_rows[: comm.rank])
    lo, hi = np.searchsorted(idx, [offset, offset + x.shape[0]])
    sample = torch.zeros(len(idx), x.shape[1], device=x.device)
    sample[lo:hi] = x[torch.as_tensor(idx[lo:hi] - offset, device=x.device)]
    return comm.all_reduce(sample)
