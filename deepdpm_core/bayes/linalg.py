"""Eigendecompositions of many small symmetric matrices, spread over host threads.

A batched ``torch.linalg.eigh`` decomposes the matrices one after another (on CUDA one
cuSOLVER ``syevd`` each). On one H100 host (16 cores), 580 float64 matrices of 128 x 128
took 0.94 s on the GPU and 0.83 s as one CPU call, but 0.13 s split over 16 threads of
single-threaded LAPACK (0.16 s with the copies to and from the GPU), to 3e-15.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

Tensor = torch.Tensor


def symmetric_eigh(matrices: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of a batch, by host LAPACK over ``torch.get_num_threads()``
    threads (one matrix chunk each, single-threaded), results on the input's device.

    Every caller gets the same LAPACK routine on the same input, so the result does not
    depend on the device (subcluster restarts are identical on every rank and device).

    Parameters
    ----------
    matrices : Tensor of shape (K, D, D)
        Symmetric (the lower triangle is read).

    Returns
    -------
    eigenvalues : Tensor of shape (K, D), ascending
    eigenvectors : Tensor of shape (K, D, D), columns
    """
    host = matrices.cpu()
    threads = min(torch.get_num_threads(), len(host))
    if threads <= 1:
        values, vectors = torch.linalg.eigh(host)
    else:
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # the pool's threads each run single-threaded LAPACK
        try:
            with ThreadPoolExecutor(threads) as pool:
                parts = list(pool.map(torch.linalg.eigh, host.chunk(2 * threads)))
        finally:
            torch.set_num_threads(before)
        values, vectors = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return values.to(matrices.device), vectors.to(matrices.device)


def row_blocks(n_rows: int, step: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) blocks of ``step`` rows covering ``n_rows``, none of one
    row unless ``n_rows`` is 1: a last single row joins the block before it.

    A batched product of one (D, 1) x (1, D) pair can round differently from the same
    pair in a batch of several (for D ≥ 20 a batch of one takes another kernel), so blocks
    of one row would not give the bits of the whole batch (the MAP covariances of
    :func:`~deepdpm_core.bayes.map_covariance_writer`).
    """
    starts = list(range(0, n_rows, step))
    if len(starts) > 1 and n_rows - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, [*starts[1:], n_rows][: len(starts)], strict=True))


#: a pass over a large array on a CPU takes blocks of about this many numbers
#: (:func:`cache_blocks`): a block stays in the cache while every operation on it runs
#: (200,000 rows x 1,000 clusters, one thread: the distillation's logits and softmax 2.29 s at
#: once, 1.44 s in blocks; nearest centres 1.36 s in blocks of 65,536 rows, 0.69 s in these)
CACHE_FLOATS = 1 << 20


def cache_blocks(n_rows: int, numbers_per_row: int, device: torch.device, other_rows: int | None = None
                 ) -> list[tuple[int, int]]:
    """[start, stop) blocks of rows for a row-by-row pass over ``numbers_per_row`` numbers a
    row: on a CPU :data:`CACHE_FLOATS` numbers a block (:func:`row_blocks`: no block of one
    row), elsewhere ``other_rows`` rows a block (None: every row at once). Always at least
    one block, empty where there are no rows, so that the parts can be concatenated."""
    step = CACHE_FLOATS // max(1, numbers_per_row) if device.type == "cpu" else other_rows or n_rows
    return row_blocks(n_rows, max(1, step)) or [(0, 0)]


def cholesky_jittered(mat: Tensor) -> Tensor:
    """Cholesky factor with a tiny relative jitter retry for numerically singular input."""
    chol, info = torch.linalg.cholesky_ex(mat)
    if bool((info > 0).any()):
        d = mat.shape[-1]
        eye = torch.eye(d, dtype=mat.dtype, device=mat.device)
        diag = mat.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(1e-300)
        chol = torch.linalg.cholesky(mat + 1e-10 * diag[..., None, None] * eye)
    return chol


def precision_cholesky(covariances: Tensor, work_dtype: torch.dtype = torch.float32, chunk: int = 16,
                       out: tuple[Tensor, Tensor] | None = None,
                       fill: Callable[[int, int], None] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """P = L⁻ᵀ, with Σ = L Lᵀ (so Σ⁻¹ = P Pᵀ), its copy in ``work_dtype`` and ln|Σ| of a
    batch of covariances.

    The factors of :func:`cholesky_jittered` and a triangular solve against the identity,
    to the same bits. On the CPU, ``chunk`` matrices at a time are factored in place in
    one small column-major buffer, solved in place in the output and copied into the
    ``work_dtype`` output while they are still in cache: a batched
    ``torch.linalg.cholesky`` copies its input into a fresh output with a strided lower
    triangle, ``solve_triangular`` its right-hand side into another, and a conversion of
    the whole result reads it back from memory, which at K = 1,000, D = 128 cost more
    than the factorisations.

    Parameters
    ----------
    covariances : Tensor of shape (K, D, D)
        Symmetric positive definite (the lower triangle is read).
    work_dtype : torch.dtype
        The dtype of the copy of P.
    out : tuple of two Tensors, optional
        On the CPU, memory that P and its copy overwrite where it fits (contiguous, of
        their shapes and dtypes) instead of fresh memory: at K = 1,000, D = 128 the first
        writes to 200 MB of new pages cost about as much as the triangular solves.
    fill : callable (start, stop), optional
        Writes rows [start, stop) of ``covariances``, which are not computed yet (e.g.
        :func:`~deepdpm_core.bayes.map_covariance_writer`): on the CPU each chunk just
        before it is factored, so it is read from cache; a range is one row only when K is 1.

    Returns
    -------
    prec_chol : Tensor of shape (K, D, D)
        P, upper triangular (contiguous).
    prec_chol_work : Tensor of shape (K, D, D), ``work_dtype``
        P rounded to ``work_dtype`` (contiguous).
    log_det : Tensor of shape (K,)
    """
    k, d = covariances.shape[0], covariances.shape[-1]
    if covariances.device.type == "cpu":
        if not (out is not None and all(
                t.device.type == "cpu" and t.shape == covariances.shape and t.dtype == dtype and t.is_contiguous()
                for t, dtype in zip(out, (covariances.dtype, work_dtype), strict=True))):
            out = torch.empty(k, d, d, dtype=covariances.dtype), torch.empty(k, d, d, dtype=work_dtype)
        solved, work = out[0].mT, out[1]  # solved is column-major: its transpose is P
        log_det = torch.empty(k, dtype=covariances.dtype)
        buffer = torch.empty(min(chunk + 1, k), d, d, dtype=covariances.dtype).mT
        info = torch.empty(min(chunk + 1, k), dtype=torch.int32)
        eye = torch.eye(d, dtype=covariances.dtype)
        e = 0
        for s, e in row_blocks(k, chunk):
            n = e - s
            chol, x = buffer[:n], solved[s:e]
            if fill is not None:
                fill(s, e)
            chol.copy_(covariances[s:e])
            torch.linalg.cholesky_ex(chol, out=(chol, info[:n]))
            if bool((info[:n] > 0).any()):
                break  # numerically singular: cholesky_jittered's retry, over the whole batch
            x.mT.copy_(eye)  # (the identity is its own transpose: a contiguous write)
            torch.linalg.solve_triangular(chol, x, upper=False, out=x)
            work[s:e].copy_(x.mT)
            log_det[s:e] = 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)
        else:
            return solved.mT, work, log_det
        if fill is not None and e < k:  # the rows after the one that failed
            fill(e, k)
    elif fill is not None:
        fill(0, k)
    chol = cholesky_jittered(covariances)
    eye = torch.eye(d, dtype=chol.dtype, device=chol.device).expand_as(chol)
    prec_chol = torch.linalg.solve_triangular(chol, eye, upper=False).transpose(-1, -2)
    return prec_chol, prec_chol.to(work_dtype), 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)
