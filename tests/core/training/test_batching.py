"""Large-batch training: the batch-size rule, the learning-rate rule, and an epoch
that is exactly one pass over the data whatever its number of optimizer steps."""

import math

import numpy as np
import pytest
import torch

from deepdpm_core.config import Config
from deepdpm_core.training import auto_batch_size, start_fit
from deepdpm_core.training.batching import scaled_lr


@pytest.mark.parametrize("n, expected", [
    (1_000, 128),         # small data keep the paper's batch (and get extra steps)
    (8_192, 128),         # exactly 64 steps of 128
    (20_000, 313),        # ceil(20000 / 64)
    (262_144, 4096),      # exactly 64 steps of the largest batch
    (1_281_167, 4096),    # ImageNet: capped, so more steps (313) instead of larger batches
])
def test_auto_batch_makes_one_pass_in_steps_per_epoch_within_bounds(n, expected):
    assert auto_batch_size(n) == expected


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("sqrt", 2.0), ("linear", 4.0)])
def test_learning_rate_rules(rule, factor):
    assert scaled_lr(5e-4, 512, rule) == pytest.approx(5e-4 * factor, rel=1e-15)
    assert scaled_lr(5e-4, 128, rule) == 5e-4


def _trainer(n, **overrides):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)) + 6 * rng.integers(0, 3, size=(n, 1))
    # the net search's epochs (small data search by exact EM otherwise)
    cfg = Config().with_overrides({"seed": 0, "init.n_clusters": 3, "small_data.max_rows": 0, **overrides})
    search = start_fit(cfg, torch.as_tensor(x, dtype=torch.float32))
    search.initialize()
    return search


@pytest.mark.parametrize("n, batch, steps", [(20_000, 313, 64), (1_000, 128, 64), (9_000, 141, 64)])
def test_an_epoch_is_one_pass_of_statistics_and_the_configured_steps(n, batch, steps):
    search = _trainer(n)
    assert search.batch_size == batch
    groups = search.nets.opt_cluster.param_groups + search.nets.opt_sub.param_groups
    lrs = [g["lr"] for g in groups]
    assert lrs == pytest.approx([5e-4 * math.sqrt(batch / 128)] * len(search.nets.opt_cluster.param_groups)
                                + [5e-3 * math.sqrt(batch / 128)] * len(search.nets.opt_sub.param_groups))
    soft, sub, _ = search.run_epoch()
    # every row counted once in the subclusters' hard statistics and (summed over its
    # support) in the soft ones, also when extra re-drawn batches train the nets
    assert float(sub.n.sum()) == n
    assert float(soft.n.sum()) == pytest.approx(n, rel=1e-5)
    for opt in (search.nets.opt_cluster, search.nets.opt_sub):
        assert {int(s["step"]) for s in opt.state.values()} == {steps}


def test_learning_rates_survive_a_split():
    search = _trainer(20_000, **{"init.n_clusters": 1, "schedule.warmup_epochs": 1, "schedule.move_every": 1})
    before = [g["lr"] for g in search.nets.opt_cluster.param_groups + search.nets.opt_sub.param_groups]
    while search.n_clusters == 1 and search.epoch < 12:
        search.step_epoch()
    assert search.n_clusters > 1
    assert [g["lr"] for g in search.nets.opt_cluster.param_groups + search.nets.opt_sub.param_groups] == before
