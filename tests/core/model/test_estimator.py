"""The DeepDPM estimator: API, determinism, persistence and bad input."""

import numpy as np
import pytest
import torch

from deepdpm_core import CheckpointError, ConfigError, DataError, DeepDPM
from deepdpm_core.data import make_mixture

FAST = {"schedule__max_epochs": 25}


@pytest.fixture(scope="module")
def data():
    return make_mixture(1200, 3, 3, random_state=1)


@pytest.fixture(scope="module")
def fitted(data):
    return DeepDPM(random_state=0, **FAST).fit(data[0])


def test_fit_attributes_and_history(fitted, data):
    X, _ = data
    m = fitted
    assert m.labels_.shape == (len(X),)
    assert m.means_.shape == (m.n_clusters_, 3) and m.covariances_.shape == (m.n_clusters_, 3, 3)
    assert m.weights_.sum() == pytest.approx(1.0)
    phases = {"seconds_estep", "seconds_train", "seconds_stats", "seconds_mstep", "seconds_moves"}
    keys = {"epoch", "search", "n_clusters", "loss_cluster", "loss_subcluster", "move", "splits_accepted",
            "prior_scale", "prior_nu", "diagonal_covariances",
            "merges_accepted", "prunes", "seconds", "stop_reason", "converged", *phases}
    assert all(set(h) == keys for h in m.history_[:-1])
    # small data (exact EM): the last epoch also polishes the partition and fits the clustering net to it
    assert set(m.history_[-1]) == keys | {"polished", "distil_steps", "distil_agreement"}
    assert {h["move"] for h in m.history_} <= {None, "split", "merge"}
    assert {h["search"] for h in m.history_} == {"exact_em"}
    for h in m.history_:  # the phases are the epoch's parts: they add up to its seconds
        assert min(h[p] for p in phases) >= 0
        assert sum(h[p] for p in phases) == pytest.approx(h["seconds"], rel=0.02, abs=2e-3)
        assert h["seconds_estep"] > 0
    assert [h["epoch"] for h in m.history_] == list(range(1, len(m.history_) + 1))  # as the schedule counts
    proba = m.predict_proba(X[:10])
    np.testing.assert_allclose(proba.sum(1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(m.predict(X), m.labels_)
    # labels come batch by batch (no (N, K) array): batches of 7 rows give the same argmax
    chunked = m.model_.predict_assignments(torch.from_numpy(X.astype(np.float32)), batch_size=7)[0]
    np.testing.assert_array_equal(chunked.numpy(), m.predict_proba(X).argmax(1))
    labels, confidence = m.predict_confidence(X, batch_size=7)
    np.testing.assert_array_equal(labels, m.labels_)
    np.testing.assert_allclose(confidence, m.predict_proba(X).max(1), rtol=1e-6)


class _CountedReads:
    """Rows that count how often they are read as an array."""

    def __init__(self, X):
        self.X, self.reads = X, 0

    def __array__(self, dtype=None, copy=None):
        self.reads += 1
        return self.X

    def __len__(self):
        return len(self.X)


def test_fit_reads_and_checks_X_once(data):
    rows = _CountedReads(data[0])
    m = DeepDPM(random_state=0, schedule__max_epochs=3).fit(rows)
    assert rows.reads == 1  # the labels come from the fit's own copy of the rows
    np.testing.assert_array_equal(m.labels_, m.predict(data[0]))


def test_same_random_state_same_result(fitted, data):
    again = DeepDPM(random_state=0, **FAST).fit(data[0])
    np.testing.assert_array_equal(again.labels_, fitted.labels_)
    assert [h["n_clusters"] for h in again.history_] == [h["n_clusters"] for h in fitted.history_]
    assert [h["loss_cluster"] for h in again.history_] == [h["loss_cluster"] for h in fitted.history_]


def test_read_only_input_fits_without_warning_and_is_untouched(fitted, data):
    """Arrow/Parquet columns and memory maps are read-only: no copy, no torch warning."""
    import warnings

    X = data[0].astype(np.float32)
    X.flags.writeable = False
    before = X.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = DeepDPM(random_state=0, schedule__max_epochs=3).fit(X)
        m.predict_proba(X[:5])
    np.testing.assert_array_equal(X, before)


def test_save_load_round_trip(fitted, data, tmp_path):
    path = tmp_path / "model.pt"
    fitted.save(path)
    loaded = DeepDPM.load(path)
    np.testing.assert_allclose(loaded.predict_proba(data[0]), fitted.predict_proba(data[0]), rtol=1e-6)
    assert loaded.n_clusters_ == fitted.n_clusters_ and loaded.history_ == fitted.history_
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "empty.pt").write_bytes(b"")
    for junk in ("junk.pt", "empty.pt"):  # one line, and no advice to load it unsafely
        with pytest.raises(CheckpointError, match="cannot read model checkpoint .*: not a PyTorch checkpoint") as err:
            DeepDPM.load(tmp_path / junk)
        assert "\n" not in str(err.value) and "weights_only=False" not in str(err.value)
    with pytest.raises(ConfigError, match="batch_size must be >= 1, got 0"):
        loaded.predict_confidence(data[0], batch_size=0)
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a DeepDPM model"):
        DeepDPM.load(tmp_path / "other.pt")


def test_overrides_are_checked():
    assert DeepDPM(alpha=2.0).get_config().prior.alpha == 2.0
    assert DeepDPM(prior={"sigma_scale": 0.1}).get_config().prior.sigma_scale == 0.1
    with pytest.raises(ConfigError, match="unknown parameter 'alpah'"):
        DeepDPM(alpah=2.0)


def test_seed_and_random_state_must_agree():
    assert DeepDPM(seed=3).get_config().seed == 3
    assert DeepDPM(seed=3, random_state=3).get_config().seed == 3
    with pytest.raises(ConfigError, match=r"^seed=1 and random_state=2 both set the seed: give one of them$"):
        DeepDPM(seed=1, random_state=2).fit(np.zeros((50, 2)))


@pytest.mark.parametrize(
    ("X", "message"),
    [
        (np.array([[0.0, 1.0], [np.nan, 2.0], [1.0, np.inf], [3.0, 3.0]]), r"2 row\(s\) with NaN or inf values \(rows 1, 2\)"),
        (np.zeros(10), "2-D array"),
        (np.ones((4, 2), np.complex64), "numeric"),
        (np.array([[1e300, 0.0], [1.0, 2.0]]), r"1 row\(s\) with values beyond float32's range \(\|x\| > 3.4e38\) \(rows 0\)"),
        (np.zeros((0, 3)), "empty"),
        (np.array([["a", "b"]]), "numeric"),
    ],
)
def test_bad_input_is_named(X, message):
    with pytest.raises(DataError, match=message):
        DeepDPM().fit(X)


def test_fewer_points_than_initial_clusters():
    with pytest.raises(DataError, match="fewer than the 30 needed"):
        DeepDPM(init__n_clusters=30).fit(np.random.default_rng(0).normal(size=(20, 2)))


def test_wrong_dimension_at_predict(fitted):
    with pytest.raises(DataError, match="X has 5 features, but DeepDPM is expecting 3 features as input"):
        fitted.predict(np.zeros((4, 5)))


def test_degenerate_data_gives_finite_parameters():
    rng = np.random.default_rng(0)
    base = np.concatenate([rng.normal(size=(300, 2)) - 5, rng.normal(size=(300, 2)) + 5])
    # a constant feature and a duplicated feature make the sample covariance singular
    X = np.column_stack([base, np.full(600, 7.0), base[:, 0]])
    m = DeepDPM(random_state=0, schedule__max_epochs=30).fit(X)
    assert np.isfinite(m.means_).all() and np.isfinite(m.covariances_).all()
    assert m.n_clusters_ == 2
    const = DeepDPM(random_state=0, schedule__max_epochs=8).fit(np.ones((50, 3)))
    assert const.n_clusters_ == 1 and np.isfinite(const.covariances_).all()
