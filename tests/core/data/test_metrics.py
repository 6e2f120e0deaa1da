"""Clustering metrics against scikit-learn."""

import numpy as np
import pytest
from sklearn import metrics as skm

from deepdpm_core.data import acc, ari, nmi


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 6, 500)
    z = np.where(rng.random(500) < 0.7, y, rng.integers(0, 9, 500)) * 3 + 1
    assert nmi(y, z) == pytest.approx(skm.normalized_mutual_info_score(y, z), abs=1e-12)
    assert ari(y, z) == pytest.approx(skm.adjusted_rand_score(y, z), abs=1e-12)


def test_acc_is_best_one_to_one_map():
    y = np.array([0, 0, 1, 1, 2, 2])
    assert acc(y, np.array([5, 5, 7, 7, 9, 9])) == 1.0
    assert acc(y, np.array([1, 1, 1, 1, 1, 1])) == pytest.approx(2 / 6)
