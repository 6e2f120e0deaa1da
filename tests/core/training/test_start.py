"""Every fit starts in start_fit, and there its rows are checked, once for every caller."""

import numpy as np
import pytest

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
