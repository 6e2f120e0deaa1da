"""The epoch records the report draws: every change of K is a recorded move, and the
per-epoch scores are of the partition the fit holds at that epoch."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_wine

from deepdpm_core import DeepDPM
from deepdpm_core.config import Config
from deepdpm_core.data import clustering_scores, readonly_tensor
from deepdpm_core.model import FittedModel
from deepdpm_core.training import start_fit
from pipeline.fit.epoch_scores import EpochLabelScores
from pipeline.fit.runner import SearchPredictor


@pytest.fixture(scope="module")
def wine() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_wine(return_X_y=True)
    return X.astype(np.float32), y


def test_every_change_of_k_is_a_recorded_move(wine):
    history = DeepDPM().fit(wine[0]).history_
    for before, record in zip(history[:-1], history[1:], strict=True):
        if record.get("polished") or record.get("grown"):
            continue  # the end's k-means partition or a grown restart: K is set anew
        change = record["n_clusters"] - before["n_clusters"]
        moved = record["splits_accepted"] - record["merges_accepted"] - record.get("prunes", 0)
        assert change == moved, record
    # wine's first split round also drops two clusters too small to keep (K 10 -> 9)
    assert any(r["prunes"] for r in history)


def test_epoch_scores_follow_the_partition_not_the_untrained_net(wine):
    """A small-data fit trains its clustering net only once K has settled: the scores of
    the epochs before must not be those of the untrained net (flat, then a jump)."""
    X, y = wine
    search = start_fit(Config(), readonly_tensor(X))
    scores = EpochLabelScores(X, y)
    scores.bind(SearchPredictor(search))
    search.fit(callbacks=[scores])
    history = search.history
    final = clustering_scores(y, FittedModel.from_search(search).predict_assignments(
        readonly_tensor(X))[0].numpy())
    assert history[-1]["nmi"] == pytest.approx(final["nmi"])  # the report's Result
    settled = max(i for i in range(1, len(history))
                  if history[i]["n_clusters"] != history[i - 1]["n_clusters"])
    for record in history[settled:-1]:  # K is final: so is the partition, near enough
        assert record["nmi"] == pytest.approx(final["nmi"], abs=0.05), record
