"""``DeepDPM``: the method as a scikit-learn estimator (clusterer).

Its parameters are ``config`` (a :class:`~deepdpm_core.config.Config`, a nested mapping, a
YAML path or None), ``random_state`` (the seed) and any config key as a keyword, stored as
given: names are checked at once, values when :meth:`DeepDPM.fit` builds the config
(:mod:`deepdpm_core.model.parameters`).
``get_params`` names every config key ``section__key`` (``prior__sigma_scale``), so
``set_params``, ``clone``, ``Pipeline`` (``dpm__prior__alpha``) and ``GridSearchCV`` reach
each of them. A fitted estimator holds a :class:`FittedModel` (``model_``).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClusterMixin
from sklearn.utils.validation import _get_feature_names, check_is_fitted

from deepdpm_core.class_codes import class_code_columns
from deepdpm_core.config import Config
from deepdpm_core.data import check_features, check_init_labels, readonly_tensor
from deepdpm_core.errors import ConfigError, DataError, listed
from deepdpm_core.model.diagnostics import (
    diagnose,
    tiny_cluster_rows,
    tiny_clusters,
    variance_summary,
)
from deepdpm_core.model.fitted_model import FORMAT, FittedModel
from deepdpm_core.model.parameters import param_names, resolve_config
from deepdpm_core.progress_bars import epoch_bar
from deepdpm_core.training import Search, start_fit

__all__ = ["FORMAT", "DeepDPM"]

_NOT_FITTED = "This %(name)s instance is not fitted yet: call fit() or DeepDPM.load() first"


class DeepDPM(ClusterMixin, BaseEstimator):
    """Deep clustering with an unknown number of clusters (Ronen et al., CVPR 2022).

    Parameters
    ----------
    config : Config, dict, str or Path, optional
        A config object, a nested mapping or a YAML file; defaults follow the paper.
    random_state : int, optional
        Overrides ``config.seed``; equal seeds give identical fits. Given with a
        different ``seed=`` keyword, ``fit`` raises a ``ConfigError``.
    **overrides
        Config keys, e.g. ``DeepDPM(alpha=1.0, prior__sigma_scale=0.01)`` or
        ``DeepDPM(init={"n_clusters": 3})``; :meth:`get_params` lists them as
        ``section__key``.

    Attributes
    ----------
    model_ : FittedModel
        The fitted model: clustering net, input transform, mixture parameters, config.
    n_features_in_ : int
        D, the number of features seen in fit.
    feature_names_in_ : ndarray of shape (D,), object
        The column names of a DataFrame fitted (all strings); absent for an array. A
        DataFrame predicted is matched to them by name (its columns reordered), and
        refused, naming them, when columns are missing or extra.
    n_clusters_ : int
        K found (clusters owning at least one training point).
    labels_ : ndarray of shape (N,)
        Cluster of each training point.
    cluster_sizes_ : ndarray of shape (K,)
        Training points per cluster.
    tiny_clusters_ : list of int
        Clusters too small to be a group (fewer than ``tiny_cluster_rows_`` points, smallest
        first): outliers or splinters that ``n_clusters_`` counts.
    tiny_cluster_rows_ : int
        Points below which a cluster is tiny: 10, or a twentieth of the mean cluster size
        where that is more (:func:`deepdpm_core.model.diagnostics.tiny_cluster_rows`).
    means_ : ndarray of shape (K, D)
    covariances_ : ndarray of shape (K, D, D)
    weights_ : ndarray of shape (K,)
    history_ : list of dict
        One record per epoch: epoch (counted from 1, as ``schedule`` counts), search
        (``exact_em``, or ``net``: the nets' minibatch search), n_clusters, loss_cluster
        (None in exact EM, which trains no net during its search), loss_subcluster,
        splits_accepted, merges_accepted, prunes (clusters removed without a merge),
        prior_scale (s of Ψ = s·diag(p), in the features'
        units squared), diagonal_covariances (0 or 1), seconds, and where the seconds went:
        seconds_estep (E-step targets), seconds_train (minibatch steps), seconds_stats
        (statistics and their all-reduce), seconds_mstep, seconds_moves (split/merge round),
        stop_reason (why the fit stopped after this epoch, in words; None while it goes
        on) and converged (whether it stopped because K had settled).
    """

    def __init__(self, config: Config | dict | str | Path | None = None,
                 random_state: int | None = None, **overrides: Any) -> None:
        self.config = config
        self.random_state = random_state
        #: ``section__key`` -> value as given (the names are checked, the values in fit)
        self._overrides = {name: v for key, value in overrides.items()
                           for name, v in param_names(key, value)}

    # ------------------------------------------------------------ parameters
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """``config``, ``random_state`` and the config keys given; with ``deep`` also
        every other config key as ``section__key`` with the value a fit would use."""
        params = {"config": self.config, "random_state": self.random_state, **self._overrides}
        if not deep:
            return params
        try:
            flat = self.get_config().flat()
        except ConfigError:  # fit reports it; the parameters as given still answer
            return params
        return {**{k.replace(".", "__"): v for k, v in flat.items()}, **params}

    def set_params(self, **params: Any) -> DeepDPM:
        """Set ``config``, ``random_state`` or config keys (named as in the constructor).

        Raises
        ------
        ConfigError
            An unknown or ambiguous key name (a ``ValueError``).
        """
        for key, value in params.items():
            if key in ("config", "random_state"):
                setattr(self, key, value)
                continue
            for name, v in param_names(key, value):
                self._overrides.pop(name, None)  # re-inserted last: applied after older ones
                self._overrides[name] = v
        return self

    def get_config(self) -> Config:
        """The config a fit uses: ``config``, the overrides, then ``random_state`` as seed.

        Raises
        ------
        ConfigError
            An unknown key, a bad value, an unreadable file, a bad ``random_state``, or
            ``seed`` and ``random_state`` both given with different values.
        """
        cfg = resolve_config(self.config, self._overrides)
        if self.random_state is None:
            return cfg
        seed = self.random_state
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ConfigError(f"random_state must be an integer seed or None, got {seed!r}")
        if "seed" in self._overrides and cfg.seed != seed:
            # both name the seed: neither silently wins
            raise ConfigError(f"seed={self._overrides['seed']!r} and random_state={seed!r} both "
                              "set the seed: give one of them")
        return cfg.with_overrides({"seed": int(seed)})

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        tags.input_tags.sparse = False
        return tags

    # ----------------------------------------------------------------- fitting
    def fit(self, X: Any, y: Any = None, callbacks: list[Callable[[dict], None]] | None = None,
            progress: bool = False, init_labels: Any = None) -> DeepDPM:
        """Fit on X (float [N, D]); ``y`` is ignored (scikit-learn convention).

        Parameters
        ----------
        callbacks : list of callables, optional
            Each is called with every epoch's history record; the estimator predicts
            with the model as it stands at the end of that epoch.
        progress : bool
            Show a progress bar with K and the losses.
        init_labels : array of shape (N,), int, optional
            Warm start: initial hard clusters (any non-negative ids; empty ids are
            dropped) instead of k-means with ``init.n_clusters``.

        Warns
        -----
        UserWarning
            A column of a DataFrame X looks like a class code
            (:func:`deepdpm_core.class_codes.class_code_columns`), or the fit ended with one
            cluster (:func:`deepdpm_core.model.diagnostics.diagnose`, as the CLI warns).
        """
        config = self.get_config()
        names = _get_feature_names(X)  # scikit-learn's rule: a DataFrame's string column names
        self._names = None if names is None else [str(n) for n in names]
        search = start_fit(config, X)  # checks X
        found = class_code_columns(X, self._names) if self._names else []
        if found:
            warnings.warn(f"column(s) {', '.join(map(repr, found))} of X look like class codes "
                          "but are clustered as features: fit on the feature columns alone",
                          UserWarning, stacklevel=2)
        start_labels = None
        if init_labels is not None:
            start_labels = torch.from_numpy(check_init_labels(init_labels, len(X)))
        # first, the model the epoch left, which the callbacks may predict with
        cbs = [lambda _: self._set_model(search), *callbacks] if callbacks else []
        with epoch_bar(search, progress) as show:
            search.fit(start_labels, [*cbs, *([show] if show else [])])
        variances = variance_summary(search.feature_variance.cpu().numpy())
        for diagnostic in diagnose(search.history, config, variances["feature_variance_ratio"]):
            # stacklevel 2: the warning points at the caller's fit
            warnings.warn(diagnostic.message, UserWarning, stacklevel=2)
        # only the model stays: the search (its copy of X, its optimisers) is freed on return
        self._set_model(search)
        self.model_.freeze()
        del self._names
        # the search's rows are X checked and transformed: X is not read a second time
        labels, _ = self.model_.predict_assignments(search.x, transformed=True)
        self.labels_ = labels.numpy()
        return self

    def _set_model(self, search: Search) -> None:
        self.model_ = FittedModel.from_search(search)
        self.model_.feature_names = self._names

    # --------------------------------------------------------------- inference
    def _fitted(self) -> FittedModel:
        check_is_fitted(self, "model_", msg=_NOT_FITTED)
        return self.model_

    def _rows(self, X: Any) -> Any:
        """X checked against the fitted D, as a tensor view, its columns by name."""
        model = self._fitted()
        return readonly_tensor(check_features(self._by_name(X, model), n_features=model.dim))

    def _by_name(self, X: Any, model: FittedModel) -> Any:
        """X with its columns in the order of ``feature_names_in_`` (scikit-learn's
        ``_check_feature_names``, but a DataFrame of the fit's columns in another order is
        reordered, not refused).

        Warns
        -----
        UserWarning
            Names on one side only (scikit-learn's two warnings, word for word).

        Raises
        ------
        DataError
            Columns missing or extra, each named, in one line.
        """
        given = _get_feature_names(X)
        fitted = model.feature_names
        name = type(self).__name__
        if given is None:
            if fitted is not None:
                warnings.warn(f"X does not have valid feature names, but {name} was fitted "
                              "with feature names", UserWarning, stacklevel=4)
            return X
        if fitted is None:
            warnings.warn(f"X has feature names, but {name} was fitted without feature names",
                          UserWarning, stacklevel=4)
            return X
        given = [str(n) for n in given]
        if given == fitted:
            return X
        unseen = [n for n in given if n not in set(fitted)]
        missing = [n for n in fitted if n not in set(given)]
        if unseen or missing:  # scikit-learn's words, on one line
            raise DataError(
                "The feature names should match those that were passed during fit: "
                + "; ".join(part for part in (
                    f"unseen at fit time: {listed(unseen)}" if unseen else "",
                    f"seen at fit time, yet now missing: {listed(missing)}" if missing else "")
                    if part))
        return X[fitted]

    def predict_proba(self, X: Any) -> np.ndarray:
        """Cluster responsibilities r = softmax(f_cl(x)), shape (N, K)."""
        return self._fitted().predict_log_proba(self._rows(X)).exp().numpy()

    def predict(self, X: Any) -> np.ndarray:
        """Hard cluster of each row, argmax of :meth:`predict_proba`, shape (N,)."""
        return self._fitted().predict_assignments(self._rows(X))[0].numpy()

    def predict_confidence(self, X: Any, batch_size: int = 65536) -> tuple[np.ndarray, np.ndarray]:
        """Hard cluster of each row and its responsibility, without the (N, K) array.

        Parameters
        ----------
        X : array-like, shape (N, D)
        batch_size : int
            Rows per forward pass; memory is O(batch_size * K).

        Returns
        -------
        labels : ndarray, shape (N,), int64
        confidence : ndarray, shape (N,), float32
            ``predict_proba(X).max(1)``.
        """
        model = self._fitted()
        return model.predict_confidence(self._by_name(X, model), batch_size)

    @property
    def n_features_in_(self) -> int:
        return self._fitted().dim

    @property
    def feature_names_in_(self) -> np.ndarray:
        names = self._fitted().feature_names
        if names is None:  # as scikit-learn: the attribute exists only for named features
            raise AttributeError(f"{type(self).__name__} was fitted without feature names")
        return np.asarray(names, dtype=object)

    @property
    def n_clusters_(self) -> int:
        return self._fitted().n_clusters

    @property
    def means_(self) -> np.ndarray:
        model = self._fitted()  # in the (transformed) features' space, as the covariances
        return model.coords.means_to_features(model.means).cpu().numpy()

    @property
    def covariances_(self) -> np.ndarray:
        model = self._fitted()
        return model.coords.covariances_to_features(model.covariances).cpu().numpy()

    @property
    def weights_(self) -> np.ndarray:
        return self._fitted().log_weights.exp().cpu().numpy()

    @property
    def cluster_sizes_(self) -> np.ndarray:
        check_is_fitted(self, "labels_", msg=_NOT_FITTED)
        return np.bincount(self.labels_, minlength=self.n_clusters_)

    @property
    def tiny_cluster_rows_(self) -> int:
        sizes = self.cluster_sizes_
        return tiny_cluster_rows(int(sizes.sum()), int((sizes > 0).sum()))

    @property
    def tiny_clusters_(self) -> list[int]:
        return tiny_clusters(self.cluster_sizes_, self.tiny_cluster_rows_)

    @property
    def history_(self) -> list[dict]:
        return list(self._fitted().history)

    # ------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write the fitted model (config, net, input transform, mixture, history) atomically."""
        self._fitted().save(path)

    @classmethod
    def load(cls, path: str | Path) -> DeepDPM:
        """Load a model written by :meth:`save` or by a fit (``torch.load(weights_only=True)``)."""
        return cls.from_model(FittedModel.load(path))

    @classmethod
    def from_model(cls, model: FittedModel) -> DeepDPM:
        """A fitted estimator around a fitted model (its config is the model's)."""
        est = cls(model.config)
        est.model_ = model
        return est

    @classmethod
    def from_search(cls, search: Search) -> DeepDPM:
        """A fitted estimator around a finished search's model (the search is not kept)."""
        return cls.from_model(FittedModel.from_search(search).freeze())
