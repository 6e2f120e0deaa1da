"""Eigendecompositions spread over host threads (deepdpm_core.bayes.linalg)."""

import pytest
import torch

from deepdpm_core.bayes import symmetric_eigh


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
