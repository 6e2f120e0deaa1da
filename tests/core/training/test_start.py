"""Every fit starts in start_fit, and there its rows are checked, once for every caller."""

import numpy as np
import pytest
import torch

from deepdpm_core.config import Config
from deepdpm_core.errors import DataError
from deepdpm_core.training import start_fit


@pytest.mark.parametrize(("rows", "message"), [
    (np.zeros((2, 3)), "X has 2 rows, fewer than the 5 needed (initial clusters)"),
    (np.array([[0.0, 1.0]] * 6 + [[np.nan, 1.0]]), "X has 1 row(s) with NaN or inf values (rows 6)"),
    (np.zeros(8), "X must be a 2-D array [N, D], got shape (8,)"),
])
def test_a_single_process_fit_refuses_rows_it_cannot_fit_as_the_estimator_does(rows, message):
    with pytest.raises(DataError) as info:
        start_fit(Config().with_overrides({"init.n_clusters": 5}), rows)
    assert str(info.value) == message


@pytest.mark.parametrize("max_rows", [0, 10_000])  # the net search, exact EM
def test_a_state_dict_is_a_snapshot_that_neither_its_fit_nor_a_resumed_one_writes_into(max_rows):
    # the M-step writes its covariances into the memory of the last ones: a state dict
    # aliasing them would change as either fit goes on (two ranks given one state in
    # shared memory read each other's covariances)
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(150, 3)) + 6 * k for k in range(3)]).astype(np.float32)
    config = Config().with_overrides({"seed": 0, "init.n_clusters": 3, "schedule.max_epochs": 6,
                                      "small_data.max_rows": max_rows})
    search = start_fit(config, x)
    search.initialize()
    for _ in range(2):
        search.step_epoch()
    state = search.state_dict()
    kept = {name: state[name].clone() for name in ("means", "covariances", "sub_covariances")}
    resumed = start_fit(config, x, state=state)
    for fit in (search, resumed):
        for _ in range(2):
            fit.step_epoch()
    for name, tensor in kept.items():
        assert torch.equal(state[name], tensor), name
    # and the resumed fit goes on as the uninterrupted one
    assert torch.equal(resumed.state.means, search.state.means)
    assert torch.equal(resumed.mixture.covariances, search.mixture.covariances)
