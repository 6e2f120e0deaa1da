"""Eigendecompositions spread over host threads and the precision factors of many covariances
(deepdpm_core.bayes.linalg)."""

import pytest
import torch

from deepdpm_core.bayes import cholesky_jittered, precision_cholesky, symmetric_eigh


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_symmetric_eigh_is_single_threaded_lapack_per_matrix(threads):
    a = torch.randn(7, 9, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mats = a @ a.transpose(1, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_values, ref_vectors = torch.linalg.eigh(mats)
        torch.set_num_threads(threads)
        values, vectors = symmetric_eigh(mats)
        assert torch.get_num_threads() == threads  # restored after the pool
    finally:
        torch.set_num_threads(before)
    # the same routine on the same input: the same result, signs included, whatever the
    # number of threads (so restarts are identical on every rank and device)
    assert torch.equal(values, ref_values) and torch.equal(vectors, ref_vectors)
    torch.testing.assert_close(vectors @ torch.diag_embed(values) @ vectors.transpose(1, 2), mats)
    empty = symmetric_eigh(mats[:0])
    assert empty[0].shape == (0, 9) and empty[1].shape == (0, 9, 9)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_precision_cholesky_is_the_batched_factor_and_solve(chunk):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(11, 9, 20, dtype=torch.float64, generator=g)
    # not symmetric in the last bits, as accumulated statistics are not: the lower triangle is read
    covs = a @ a.transpose(1, 2) / 20 + 1e-12 * torch.randn(11, 9, 9, dtype=torch.float64, generator=g)
    chol = torch.linalg.cholesky(covs)
    eye = torch.eye(9, dtype=torch.float64).expand_as(chol)
    ref = torch.linalg.solve_triangular(chol, eye, upper=False).transpose(-1, -2)
    prec, work, log_det = precision_cholesky(covs, torch.float32, chunk)
    assert torch.equal(prec, ref) and prec.is_contiguous()
    # the float32 copy made chunk by chunk is the conversion of the whole P
    assert work.dtype == torch.float32 and work.is_contiguous() and torch.equal(work, ref.to(torch.float32))
    assert torch.equal(log_det, 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1))
    torch.testing.assert_close(prec @ prec.transpose(1, 2), torch.linalg.inv(covs))


def test_precision_cholesky_of_a_singular_batch_is_the_jittered_one():
    covs = torch.eye(3, dtype=torch.float64).repeat(5, 1, 1)
    covs[3] = 1.0  # rank one
    prec, work, log_det = precision_cholesky(covs, chunk=2)
    chol = cholesky_jittered(covs)
    ref = torch.linalg.solve_triangular(chol, torch.eye(3, dtype=torch.float64).expand_as(chol), upper=False)
    assert torch.equal(prec, ref.transpose(-1, -2)) and bool(torch.isfinite(log_det).all())
    assert torch.equal(work, prec.to(torch.float32))


def test_precision_cholesky_writes_over_memory_that_fits():
    a = torch.randn(6, 5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    covs = a @ a.transpose(1, 2) / 9
    prec, work, log_det = precision_cholesky(covs, chunk=4)
    out = torch.full_like(prec, float("nan")), torch.full_like(work, float("nan"))
    again = precision_cholesky(covs, chunk=4, out=out)
    assert again[0].data_ptr() == out[0].data_ptr() and again[1].data_ptr() == out[1].data_ptr()
    assert torch.equal(again[0], prec) and torch.equal(again[1], work) and torch.equal(again[2], log_det)
    # memory of another dtype does not fit: fresh memory, the same factors
    unfit = torch.empty_like(prec), torch.empty_like(prec)
    fresh = precision_cholesky(covs, chunk=4, out=unfit)
    assert fresh[1].data_ptr() != unfit[1].data_ptr() and torch.equal(fresh[1], work)


def test_precision_cholesky_reads_covariances_written_chunk_by_chunk():
    a = torch.randn(7, 24, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    covs = a @ a.transpose(1, 2) / 30
    covs[3] = 1.0  # rank one: the chunk that holds it fails, and the rest goes the jittered way
    for source in (covs, covs[:5]):
        k, ranges = len(source), []
        target = torch.full_like(source, float("nan"))

        def fill(start, stop, source=source, target=target, ranges=ranges):
            ranges.append((start, stop))
            target[start:stop] = source[start:stop]

        got = precision_cholesky(target, chunk=2, fill=fill)
        ref = precision_cholesky(source, chunk=2)
        assert all(torch.equal(g, r) for g, r in zip(got, ref, strict=True)) and torch.equal(target, source)
        # every row written once, in order, never one row alone (MAP blocks of one row round otherwise)
        assert [r for span in ranges for r in range(*span)] == list(range(k))
        assert all(stop - start > 1 for start, stop in ranges)
