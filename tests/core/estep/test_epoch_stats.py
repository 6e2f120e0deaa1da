"""An epoch's statistics accumulated batch by batch (dense and sparse supports) against the
same sums written out over all rows."""

import numpy as np
import pytest
import torch

from deepdpm_core.estep import R_FLOOR, EpochStats
from deepdpm_core.runtime import LocalCommunicator


def _epoch(m: int, k: int = 4, d: int = 3, n: int = 50, seed: int = 0):
    """Two batches of one pass; returns the reduced statistics and the inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    logits = torch.randn(n, k, generator=g) * 3.0
    log_r = torch.log_softmax(logits, 1)
    slots = torch.stack([torch.randperm(k, generator=g)[:m] for _ in range(n)])
    target = torch.rand(n, m, generator=g)
    if m < k:
        target[:, -1] = 0.0  # a slot outside the target's support
    target = target / target.sum(1, keepdim=True)
    sub_rows = 2 * logits.argmax(1) + torch.randint(0, 2, (n,), generator=g)
    stats = EpochStats(k, d, n, m, torch.device("cpu"))
    for batch in (torch.arange(0, 20), torch.arange(20, n)):
        stats.add(x[batch], batch, logits[batch], slots[batch], target[batch],
                  log_r[batch].gather(1, slots[batch]), sub_rows[batch],
                  torch.tensor(float(len(batch))), torch.tensor(2.0 * len(batch)))
    soft, sub, losses = stats.reduce(x, LocalCommunicator())
    return soft, sub, losses, (x, log_r, slots, target, sub_rows)


@pytest.mark.parametrize("m", [4, 2])  # every cluster on the support (dense), or 2 of 4
def test_statistics_match_the_sums_over_all_rows(m):
    k = 4
    soft, sub, losses, (x, log_r, slots, target, sub_rows) = _epoch(m, k)
    xd = x.double().numpy()
    r = log_r.exp().double().numpy()
    if m < k:  # sparse: the net's r on the slots where the target is positive
        weights = np.zeros_like(r)
        for i in range(len(xd)):
            for j in range(m):
                if target[i, j] > 0 and r[i, slots[i, j]] >= R_FLOOR:
                    weights[i, slots[i, j]] = r[i, slots[i, j]]
    else:  # dense: the net's r on every cluster above the floor
        weights = np.where(r >= R_FLOOR, r, 0.0)
    np.testing.assert_allclose(soft.n.numpy(), weights.sum(0), rtol=1e-5)
    np.testing.assert_allclose(soft.s1.numpy(), weights.T @ xd, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(soft.s2.numpy(), np.einsum("nk,nd,ne->kde", weights, xd, xd),
                               rtol=1e-5, atol=1e-5)
    rows = sub_rows.numpy()
    np.testing.assert_array_equal(sub.n.numpy(), np.bincount(rows, minlength=2 * k))
    for row in range(2 * k):
        np.testing.assert_allclose(sub.s1[row].numpy(), xd[rows == row].sum(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sub.s2[row].numpy(), xd[rows == row].T @ xd[rows == row],
                                   rtol=1e-5, atol=1e-5)
    assert losses == pytest.approx({"loss_cluster": 1.0, "loss_subcluster": 2.0})
