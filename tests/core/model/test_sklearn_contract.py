"""DeepDPM as a scikit-learn estimator: parameters, clone, Pipeline, GridSearchCV, the
estimator checks, and a fitted estimator that holds the fitted model and nothing of the
training."""

from __future__ import annotations

import gc
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.base import clone
from sklearn.datasets import make_blobs
from sklearn.exceptions import NotFittedError
from sklearn.metrics import normalized_mutual_info_score
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks
from sklearn.utils.validation import check_is_fitted

from deepdpm_core import CheckpointError, Config, ConfigError, DataError, DeepDPM
from deepdpm_core.data import make_mixture
from deepdpm_core.model import FORMAT, FittedModel
from deepdpm_core.training import Search, start_fit

#: fits of a fraction of a second: 3 epochs of 4 steps, a clustering net of 8 units, and
#: k-means with 3 clusters (check_clustering scores the 3 blobs it fits by ARI)
TINY = {"device": "cpu", "init__n_clusters": 3, "schedule__max_epochs": 3, "model__hidden": 8,
        "optim__min_steps_per_epoch": 4}

_WORDED = ("refused with a DataError (a ValueError) in the project's words, not scikit-learn's "
           "(test_inputs_the_checks_word_otherwise)")
#: the checks expected to fail, and why
EXPECTED_FAILED_CHECKS = {
    "check_do_not_raise_errors_in_init_or_set_params": (
        "the check passes a keyword named after the **overrides of the signature, "
        "'overrides', which is no config key: unknown key names are refused at once, as an "
        "unknown keyword argument is (values are checked in fit)"),
    "check_complex_data": _WORDED,
    "check_dtype_object": "object arrays are refused by their dtype, not converted: " + _WORDED,
    "check_estimators_empty_data_messages": _WORDED,
    "check_fit2d_1sample": "a fit needs max(2, init.n_clusters) rows: " + _WORDED,
    "check_fit2d_predict1d": _WORDED,
}


@parametrize_with_checks([DeepDPM(random_state=0, **TINY)],
                         expected_failed_checks=lambda _: EXPECTED_FAILED_CHECKS)
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


def test_inputs_the_checks_word_otherwise():
    X = np.random.default_rng(0).normal(size=(20, 2))
    for bad, message in [
        (X.astype(np.complex128), "dtype complex128"),
        (X.astype(object), "dtype object"),
        (np.zeros((12, 0)), r"X is empty \(shape \(12, 0\)\)"),
        (X[:1], "X has 1 rows, fewer than the 3 needed"),
    ]:
        with pytest.raises(DataError, match=message):
            DeepDPM(**TINY).fit(bad)
    with pytest.raises(DataError, match=r"2-D array \[N, D\], got shape \(2,\)"):
        DeepDPM(**TINY).fit(X).predict(X[0])
    with pytest.raises(ConfigError, match="unknown parameter 'overrides'"):
        DeepDPM(overrides=-1)


def test_parameters_are_stored_as_given_and_name_every_config_key():
    m = DeepDPM(random_state=3, alpha=2, init={"n_clusters": 4})
    assert m.get_params(deep=False) == {"config": None, "random_state": 3, "prior__alpha": 2,
                                        "init__n_clusters": 4}
    deep = m.get_params()
    assert {k.replace("__", ".") for k in deep} == {"config", "random_state", *Config().flat()}
    assert (deep["prior__alpha"], deep["prior__sigma_scale"], deep["seed"]) == (2, "auto", 3)

    assert m.set_params(prior__sigma_scale=0.1, alpha=5.0) is m
    assert m.get_params(deep=False)["prior__alpha"] == 5.0 and "alpha" not in m.get_params(False)
    cfg = m.get_config()
    assert (cfg.prior.sigma_scale, cfg.prior.alpha, cfg.init.n_clusters, cfg.seed) == (0.1, 5.0, 4, 3)
    with pytest.raises(ValueError, match=r"unknown config key 'prior.sigma_scal' \(did you mean "
                                         r"prior.sigma_scale\?\)"):
        m.set_params(prior__sigma_scal=1.0)

    twin = clone(m)
    assert twin is not m and twin.get_params(deep=False) == m.get_params(deep=False)
    assert re.sub(r"\s+", " ", repr(twin)) == ("DeepDPM(init__n_clusters=4, prior__alpha=5.0, "
                                               "prior__sigma_scale=0.1, random_state=3)")

    # values are the fit's to check: the constructor and set_params store anything
    X = np.random.default_rng(0).normal(size=(30, 2))
    for bad, message in [(DeepDPM(prior__alpha=-1.0), "'prior.alpha' must be > 0"),
                         (DeepDPM(prior=3), "'prior' must be a mapping"),
                         (DeepDPM(config=7), "config must be a Config"),
                         (DeepDPM(random_state="x"), "random_state must be an integer seed"),
                         (DeepDPM().set_params(schedule__max_epochs="many"), "must be an integer")]:
        with pytest.raises(ConfigError, match=message):
            bad.fit(X)


def test_before_fit_nothing_is_fitted(tmp_path):
    m = DeepDPM()
    for name in ("model_", "labels_", "n_clusters_", "n_features_in_", "means_", "covariances_",
                 "weights_", "history_"):
        assert not hasattr(m, name), name
    X = np.zeros((3, 2))
    for call in (m.predict, m.predict_proba, m.predict_confidence, lambda _: m.save(tmp_path / "m.pt"),
                 lambda _: check_is_fitted(m)):
        with pytest.raises(NotFittedError, match="not fitted yet"):
            call(X)
    assert not (tmp_path / "m.pt").exists()


@pytest.fixture(scope="module")
def blobs() -> tuple[np.ndarray, np.ndarray]:
    return make_blobs(n_samples=150, centers=3, n_features=2, cluster_std=0.6, random_state=2)


def test_pipeline_and_grid_search_over_config_keys(blobs):
    X, y = blobs
    pipe = Pipeline([("scale", StandardScaler()), ("dpm", DeepDPM(random_state=0, **TINY))])
    labels = pipe.fit_predict(X)
    direct = DeepDPM(random_state=0, **TINY).fit(StandardScaler().fit_transform(X))
    np.testing.assert_array_equal(labels, direct.labels_)
    np.testing.assert_array_equal(pipe.predict(X), labels)
    assert pipe.get_params()["dpm__prior__sigma_scale"] == "auto"

    # the net search (small_data.max_rows 0): 4 epochs do not split, so K stays at
    # init.n_clusters; the net follows the k-means clusters in 4 epochs at the larger
    # learning rate only, so ARI picks both
    quick = {**TINY, "schedule__max_epochs": 4, "optim__min_steps_per_epoch": 16, "small_data__max_rows": 0}
    pipe.set_params(**{f"dpm__{k}": v for k, v in quick.items()})
    search = GridSearchCV(pipe, {"dpm__init__n_clusters": [1, 3], "dpm__optim__lr_cluster": [5e-4, 5e-3]},
                          scoring="adjusted_rand_score", cv=3).fit(X, y)
    assert search.best_params_ == {"dpm__init__n_clusters": 3, "dpm__optim__lr_cluster": 5e-3}
    assert search.best_score_ > 0.95
    best = search.best_estimator_["dpm"]
    assert best.n_clusters_ == 3
    assert best.get_config().optim.lr_cluster == 5e-3 and best.get_config().schedule.max_epochs == 4


def _reachable(root: object) -> list[object]:
    """Every object reachable from ``root`` through references (gc.get_referents), except
    through modules, classes and functions (which lead to all of the interpreter)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, types.FunctionType)):
            continue
        seen.add(id(obj))
        found.append(obj)
        stack.extend(gc.get_referents(obj))
        if isinstance(obj, torch.Tensor) and obj.grad is not None:
            stack.append(obj.grad)
    return found


def test_fitted_estimator_holds_the_model_only_and_predicts_as_its_trainer(tmp_path):
    X, _ = make_mixture(600, 3, 3, random_state=4)
    X32 = X.astype(np.float32)
    config = DeepDPM(random_state=0, schedule__max_epochs=12, optim__min_steps_per_epoch=8,
                     device="cpu").get_config()

    gc.collect()
    trainers_before = sum(type(o) is Search for o in gc.get_objects())
    model = DeepDPM(config).fit(X)
    gc.collect()
    assert sum(type(o) is Search for o in gc.get_objects()) == trainers_before

    held = _reachable(model)
    assert not [o for o in held if isinstance(o, (Search, torch.optim.Optimizer))]
    rows = [o for o in held if isinstance(o, (torch.Tensor, np.ndarray)) and o.ndim and o.shape[0] == len(X)]
    assert len(rows) == 1 and rows[0] is model.labels_  # no copy of the data, only the labels
    assert all(p.grad is None and not p.requires_grad for p in model.model_.cluster_net.parameters())

    # the same fit by a search: its net on its own training rows gives the same ln r
    search = start_fit(config, torch.from_numpy(X32))
    search.fit()
    with torch.no_grad():
        log_r = F.log_softmax(search.nets.cluster(search.x), dim=1)
    x = torch.from_numpy(X32)
    assert torch.equal(model.model_.predict_log_proba(x), log_r)
    np.testing.assert_array_equal(model.predict_proba(X), log_r.exp().numpy())
    np.testing.assert_array_equal(model.labels_, log_r.argmax(1).numpy())
    np.testing.assert_array_equal(model.means_, search.coords.means_to_features(search.state.means).numpy())
    untimed = [[{k: v for k, v in r.items() if not k.startswith("seconds")} for r in h]
               for h in (model.history_, search.history)]
    assert untimed[0] == untimed[1]
    from_search = DeepDPM.from_search(search)  # what a distributed fit's rank 0 builds
    np.testing.assert_array_equal(from_search.predict_proba(X), model.predict_proba(X))

    # the model file holds the model; a full search state (a checkpoint, or a model file
    # written when estimators kept their search) loads to the same predictions
    model.save(tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state["format"] == FORMAT and not {"opt_cluster", "sub_nets", "sub_means", "rng"} & set(state)
    torch.save({"format": FORMAT, **search.state_dict()}, tmp_path / "trainer_state.pt")
    for path, history in (("model.pt", model.history_), ("trainer_state.pt", search.history)):
        loaded = DeepDPM.load(tmp_path / path)
        assert isinstance(loaded.model_, FittedModel) and loaded.n_features_in_ == 3
        np.testing.assert_array_equal(loaded.predict_proba(X), model.predict_proba(X))
        assert loaded.history_ == history and loaded.get_config() == config
    assert (tmp_path / "model.pt").stat().st_size < (tmp_path / "trainer_state.pt").stat().st_size

    # a model file without its coordinates is refused in one line naming the key
    without = {k: v for k, v in search.state_dict().items() if k != "coordinates"}
    with pytest.raises(CheckpointError, match="without the key 'coordinates'"):
        FittedModel.from_state({**without, "format": FORMAT})
    # a fit resumes only with Adam's moments and the generators: a state without them (a
    # model file, which keeps neither) is refused in one line naming the key
    for key in ("opt_cluster", "rng"):
        lacking = {k: v for k, v in search.state_dict().items() if k != key}
        with pytest.raises(CheckpointError, match=f"without the key '{key}'"):
            start_fit(config, X32, state=lacking)


def test_readme_scikit_learn_example_runs():
    """The README's scikit-learn example, as written."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    code = re.search(r"### scikit-learn\n.*?```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the project's own README
    pipe, X, y, labels = (namespace[name] for name in ("pipe", "X", "y", "labels"))
    assert pipe["dpm"].n_clusters_ == 11
    assert normalized_mutual_info_score(y, labels) == pytest.approx(0.856, abs=0.005)
    # what the example puts before DeepDPM helps: a StandardScaler there would not
    scaled = Pipeline([("scale", StandardScaler()), ("dpm", DeepDPM(random_state=0))])
    assert normalized_mutual_info_score(y, scaled.fit_predict(X)) < 0.7
    np.testing.assert_array_equal(labels, pipe.predict(X))
    assert not hasattr(namespace["unfitted"]["dpm"], "n_clusters_")
    assert namespace["unfitted"]["dpm"].get_config().prior.alpha == 1.0
    assert namespace["search"].best_score_ == pytest.approx(0.656, abs=0.005)
