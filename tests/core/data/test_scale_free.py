"""No scale to choose: the fit does not depend on the units of the features, and a prior
fitted to the clusters finds them where the paper's fixed prior collapses to K = 1."""

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
from sklearn.preprocessing import StandardScaler

from deepdpm_core import DeepDPM
from deepdpm_core.config import DataConfig
from deepdpm_core.data import clustering_scores, make_mixture
from deepdpm_core.data.coordinates import resolve_transform
from deepdpm_core.errors import ConfigError

QUICK = {"schedule__max_epochs": 14}


def _data():
    X, y = make_mixture(900, 5, 4, imbalance=2.0, min_weight=0.1, random_state=3)
    return X.astype(np.float64), y


def test_units_and_offsets_do_not_change_the_fit():
    X, _ = _data()
    base = DeepDPM(random_state=1, **QUICK).fit(X)
    for Xs in (1e-3 * X + 7.0, 1e3 * X):
        other = DeepDPM(random_state=1, **QUICK).fit(Xs)
        np.testing.assert_array_equal(other.labels_, base.labels_)
        assert [r["n_clusters"] for r in other.history_] == [r["n_clusters"] for r in base.history_]
    # the fitted parameters come back in the user's units
    scaled = DeepDPM(random_state=1, **QUICK).fit(1e3 * X)
    np.testing.assert_allclose(scaled.means_, 1e3 * base.means_, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(scaled.covariances_, 1e6 * base.covariances_, rtol=1e-4, atol=1e-2)
    # the fitted prior scale s is in the features' units squared
    assert scaled.history_[-1]["prior_scale"] == pytest.approx(1e6 * base.history_[-1]["prior_scale"], rel=1e-6)
    # and the fitted degrees of freedom ν0 have no units
    assert scaled.history_[-1]["prior_nu"] == pytest.approx(base.history_[-1]["prior_nu"], rel=1e-6)


def test_standard_transform_removes_per_feature_units():
    X, _ = _data()
    units = np.array([1e-3, 1.0, 50.0, 7.0, 1e4])
    base = DeepDPM(random_state=2, data__transform="standard", **QUICK).fit(X)
    other = DeepDPM(random_state=2, data__transform="standard", **QUICK).fit(X * units + 3.0)
    np.testing.assert_array_equal(other.labels_, base.labels_)
    np.testing.assert_array_equal(other.predict(X[:50] * units + 3.0), base.predict(X[:50]))


def test_per_feature_units_do_not_decide_k_at_the_defaults():
    """Features in different units are standardised by ``data.transform: auto`` (the same
    fit as the same features standardised); features in one unit are left as they are."""
    X, _ = _data()
    units = np.array([1e-3, 1.0, 50.0, 7.0, 1e4])
    standard = DeepDPM(random_state=2, data__transform="standard", **QUICK).fit(X)
    mixed = DeepDPM(random_state=2, **QUICK).fit(X * units + 3.0)
    assert mixed.model_.coords.kind == "standard"
    np.testing.assert_array_equal(mixed.labels_, standard.labels_)
    np.testing.assert_array_equal(mixed.predict(X[:50] * units + 3.0), standard.predict(X[:50]))
    one_unit = DeepDPM(random_state=2, **QUICK).fit(X * 1e3)
    assert one_unit.model_.coords.kind == "none"
    np.testing.assert_array_equal(one_unit.labels_, DeepDPM(random_state=2, data__transform="none", **QUICK)
                                  .fit(X).labels_)


def _variance(X: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(X, dtype=np.float64).var(0))


@pytest.mark.parametrize(("name", "X", "expected"), [
    ("wine, raw units", load_wine().data, "standard"),
    ("breast cancer, raw units", load_breast_cancer().data, "standard"),
    # two features of like size in the thousands beside 11 small ones: participation 2.1
    ("two large features of one size", np.random.default_rng(0).normal(size=(500, 13))
     * np.r_[1500.0, 1200.0, np.geomspace(0.1, 400.0, 11)], "standard"),
    ("iris, centimetres", load_iris().data, "none"),
    ("digit pixels", load_digits().data, "none"),
    ("PCA scores, one dominant component", np.random.default_rng(1).normal(size=(500, 10))
     * np.geomspace(5.0, 2.0, 10) ** np.r_[2.0, np.ones(9)], "none"),
])
def test_auto_transform_standardises_features_in_different_units(name, X, expected):
    assert resolve_transform(DataConfig(), _variance(X)) == expected, name


def test_a_few_large_features_of_one_size_do_not_decide_k():
    """A table whose three widest features are of like size (participation ratio 2.6): the
    defaults standardise it and fit what the standardised features give."""
    X, _ = _data()
    units = np.array([1000.0, 1000.0, 600.0, 0.05, 3.0])
    standard = DeepDPM(random_state=2, data__transform="standard", **QUICK).fit(X)
    mixed = DeepDPM(random_state=2, **QUICK).fit(X * units)
    assert mixed.model_.coords.kind == "standard"
    assert mixed.n_clusters_ == standard.n_clusters_
    np.testing.assert_array_equal(mixed.labels_, standard.labels_)


@pytest.mark.parametrize("transform", ["normalize", "min_max"])
def test_reference_transforms_are_applied_at_predict_time(transform):
    X, _ = _data()
    X = X + 10.0  # rows away from the origin, so normalising them keeps the clusters
    model = DeepDPM(random_state=0, data__transform=transform, **QUICK).fit(X)
    np.testing.assert_array_equal(model.predict(X), model.labels_)
    if transform == "normalize":  # row norms do not matter
        np.testing.assert_array_equal(DeepDPM(random_state=0, data__transform=transform, **QUICK)
                                      .fit(X * 5.0).labels_, model.labels_)


def test_fixed_paper_prior_is_in_feature_units():
    """``prior.sigma_scale: 0.05`` is Ψ = 0.05·I in the units of X, as in the paper."""
    X, _ = _data()
    fixed = DeepDPM(random_state=0, schedule__max_epochs=14, prior__sigma_scale=0.05).fit(X)
    assert {r["prior_scale"] for r in fixed.history_} == {0.05}


@pytest.mark.slow
def test_small_data_are_not_collapsed_to_one_cluster():
    """Standardised wine (178 x 13, 3 cultivars), from one initial cluster: the paper's
    fixed prior (s = 0.005, κ0 = 1e-4, ν0 = D + 2) gives K = 1; the prior fitted by the
    evidence of the full model (``sigma_scale: evidence``, κ0 auto, the exact posterior)
    finds the three, as well as k-means given K = 3 does. (The defaults: docs/benchmarks.md.)"""
    X, y = load_wine(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    with pytest.warns(UserWarning, match=r"The fit ended with one cluster \(K = 1\)"):
        paper = DeepDPM(random_state=0, prior__sigma_scale=0.005, prior__kappa=1e-4, prior__nu=None,
                        prior__covariance_type="full", init__n_clusters=1).fit(X)
    assert paper.n_clusters_ == 1
    model = DeepDPM(random_state=0, prior__sigma_scale="evidence", prior__coarsening=None,
                    init__n_clusters=1).fit(X)
    nmi = clustering_scores(y, model.labels_)["nmi"]
    km = clustering_scores(y, KMeans(3, n_init=10, random_state=0).fit_predict(X))["nmi"]
    assert model.n_clusters_ == 3
    assert nmi >= km - 0.02, (nmi, km)


@pytest.mark.parametrize(("sigma_scale", "unit"), [(1e300, 1e-25), (1e-300, 1.0)])
def test_a_fixed_prior_scale_past_float64_is_a_config_error(sigma_scale, unit):
    """s fixed at 1e±300 times the features' variance overflows or underflows the NIW
    scales: refused before the fit, naming the key, not a LinAlgError from inside it."""
    X, _ = _data()
    with pytest.raises(ConfigError, match=r"prior\.sigma_scale=.* times the features' mean variance"):
        DeepDPM(random_state=0, prior__sigma_scale=sigma_scale).fit(X * unit)
