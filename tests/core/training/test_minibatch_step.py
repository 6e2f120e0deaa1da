"""The nets' minibatch step: how many operators it dispatches (a step of these small nets
costs its operator count on a GPU, not its arithmetic)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepdpm_core.training.minibatch as minibatch
from deepdpm_core.config import Config
from deepdpm_core.data import make_mixture
from deepdpm_core.training import start_fit


class _Count(TorchDispatchMode):
    """Operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_minibatch_step_dispatches_few_operators(monkeypatch):
    """Both nets' forward and backward, both losses, Adam and the statistics of one step:
    at most 170 operators (199 with a node per layer and loss operator, the subnets' primary
    and overflow blocks multiplied apart)."""
    k = 40  # above estep.dense_max_k: the top-m targets of large K
    x, _ = make_mixture(4000, 6, k, imbalance=1.0, min_weight=0.1 / k, random_state=0)
    cfg = Config().with_overrides({"seed": 0, "device": "cpu", "init.n_clusters": k, "schedule.warmup_epochs": 0,
                                   "moves.split": False, "moves.merge": False, "small_data.max_rows": 0})
    search = start_fit(cfg, torch.from_numpy(x))
    search.initialize()
    search.step_epoch()
    counter, starts = _Count(), []
    targets = minibatch.slot_targets

    def marked(*args):  # each step starts where it takes its batch's targets
        starts.append(counter.n)
        return targets(*args)

    monkeypatch.setattr(minibatch, "slot_targets", marked)
    with counter:
        search.step_epoch()
    assert len(starts) == 64
    per_step = (starts[-1] - starts[0]) / (len(starts) - 1)
    assert per_step <= 170
