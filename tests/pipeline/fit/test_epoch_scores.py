"""Per-epoch NMI/ARI/ACC on labelled data, and the fit that makes them possible."""

from __future__ import annotations

import os

import numpy as np
import pytest

from deepdpm_core import DeepDPM
from deepdpm_core.config import Config
from deepdpm_core.data import clustering_scores
from pipeline.fit.epoch_scores import EpochLabelScores

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def blobs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    centers = rng.normal(0.0, 6.0, (3, 3))
    y = rng.integers(0, 3, 900)
    X = (centers[y] + rng.normal(0.0, 1.0, (900, 3))).astype(np.float32)
    return X, y


@pytest.fixture(scope="module")
def config() -> Config:
    # one pass per epoch (8 batches of 128), not the default 64 steps: 8x faster; from one
    # cluster, whose first epoch scores NMI 0
    return Config().with_overrides(
        {"schedule.max_epochs": 22, "optim.min_steps_per_epoch": 8, "seed": 5, "init.n_clusters": 1}
    )


def _without(record: dict, *keys: str) -> dict:
    """The record less ``keys`` and its timings (``seconds`` and its phases)."""
    return {k: v for k, v in record.items() if k not in keys and not k.startswith("seconds")}


def _scored_fit(config, X, scores, **kw):
    model = DeepDPM(config)
    scores.bind(model)
    return model.fit(X, callbacks=[scores], **kw)


def test_scoring_changes_nothing(blobs, config):
    X, y = blobs
    reference = DeepDPM(config).fit(X)
    plain = DeepDPM(config).fit(X)
    scores = EpochLabelScores(X, y, max_rows=500, seed=1)
    scored = _scored_fit(config, X, scores)

    assert reference.n_clusters_ > 1, "the data should make the fit split at least once"
    for model in (plain, scored):
        assert model.n_clusters_ == reference.n_clusters_
        np.testing.assert_array_equal(model.labels_, reference.labels_)
        np.testing.assert_allclose(model.predict_proba(X), reference.predict_proba(X), atol=1e-6)
        assert len(model.history_) == len(reference.history_)
        for got, want in zip(model.history_, reference.history_, strict=True):
            assert _without(got, "nmi", "ari", "acc") == _without(want)

    assert all("nmi" not in r for r in plain.history_)
    assert all({"nmi", "ari", "acc"} <= r.keys() for r in scored.history_)
    # the last epoch's scores are those of the final model on the scored rows
    # (pruning empty clusters renames clusters, which no score sees)
    last = scored.history_[-1]
    final = clustering_scores(y[scores.rows], scored.predict(X[scores.rows]))
    assert last["nmi"] == pytest.approx(final["nmi"]) and last["acc"] == pytest.approx(final["acc"])
    # scores follow K: one cluster explains nothing, the final fit a lot
    assert scored.history_[0]["n_clusters"] == 1 and scored.history_[0]["nmi"] == 0.0
    assert last["nmi"] > 0.5


def test_scored_warm_start_like_the_estimator(blobs, config):
    X, y = blobs
    short = config.with_overrides({"schedule.max_epochs": 6})
    reference = DeepDPM(short).fit(X, init_labels=y)
    scored = _scored_fit(short, X, EpochLabelScores(X, y), init_labels=y)
    assert scored.history_[0]["n_clusters"] == 3  # from the true classes, not K = 1
    assert all({"nmi", "ari", "acc"} <= r.keys() for r in scored.history_)
    np.testing.assert_array_equal(scored.labels_, reference.labels_)
    for got, want in zip(scored.history_, reference.history_, strict=True):
        assert _without(got, "nmi", "ari", "acc") == _without(want)


def test_scored_rows_are_a_fixed_labelled_subsample():
    X = np.arange(40, dtype=np.float32).reshape(20, 2)
    labels = np.array([0, 1, -1, 2] * 5)
    scores = EpochLabelScores(X, labels, max_rows=8, seed=0)
    assert len(scores.rows) == 8 and np.all(labels[scores.rows] >= 0)
    assert np.all(np.diff(scores.rows) > 0)
    np.testing.assert_array_equal(scores.rows, EpochLabelScores(X, labels, 8, seed=0).rows)
    everything = EpochLabelScores(X, labels, max_rows=100)
    np.testing.assert_array_equal(everything.rows, np.flatnonzero(labels >= 0))
    assert EpochLabelScores.for_labels(X, None) is None
    assert EpochLabelScores.for_labels(X, np.full(20, -1)) is None
    record = {"epoch": 0}
    EpochLabelScores(X, labels)(record)  # not bound to a search yet: nothing to score
    assert record == {"epoch": 0}
