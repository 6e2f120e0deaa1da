"""The rank-consistency checksum (the gloo test of diverged ranks is in tests/pipeline/fit/test_distributed.py)."""

import pytest
import torch

from deepdpm_core.runtime import LocalCommunicator
from deepdpm_core.training.consistency import check_ranks_agree, position_checksum

CPU = torch.device("cpu")


def test_the_checksum_weights_each_value_by_its_position():
    a = torch.tensor([1.0, 2.0, 3.0])
    # weights 1, 1.5, 2 on the three positions
    assert position_checksum([a], CPU) == pytest.approx(1.0 + 3.0 + 6.0)
    assert position_checksum([a.flip(0)], CPU) != position_checksum([a], CPU)  # swaps show
    assert position_checksum([a, a.view(3, 1)], CPU) == pytest.approx(2 * 10.0)  # tensors add
    assert position_checksum([torch.tensor([float("nan"), 1.0])], CPU) == pytest.approx(2.0)


def test_one_rank_always_agrees_with_itself():
    check_ranks_agree(LocalCommunicator(), 123.456, CPU, 1e-12, "at epoch 1", "K = 2")
