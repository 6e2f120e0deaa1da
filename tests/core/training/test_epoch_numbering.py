"""Epochs count from 1 everywhere: the schedule, the records, the MLflow steps."""

import numpy as np

from deepdpm_core.config import Config
from deepdpm_core.training import start_fit


def _blobs() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate([rng.normal(size=(60, 2)), rng.normal(size=(60, 2)) + 8]).astype(np.float32)


def test_the_record_of_the_eth_epoch_says_e_also_after_resuming_a_checkpoint_that_counted_from_0():
    config = Config().with_overrides({"seed": 0, "init.n_clusters": 2, "schedule.max_epochs": 6})
    search = start_fit(config, _blobs())
    search.initialize()
    for _ in range(3):
        search.step_epoch()
    assert [r["epoch"] for r in search.history] == [1, 2, 3] and search.epoch == 3
    state = search.state_dict()
    # a checkpoint written while the records counted from 0 resumes with records counted from 1
    older = {**state, "history": [{**r, "epoch": r["epoch"] - 1} for r in state["history"]]}
    for resumed in (start_fit(config, _blobs(), state=state), start_fit(config, _blobs(), state=older)):
        resumed.fit()
        assert [r["epoch"] for r in resumed.history] == list(range(1, resumed.epoch + 1))
