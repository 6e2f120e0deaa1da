"""``DeepDPM``: a scikit-learn-style estimator around the single-process trainer."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepdpm_core.checkpoints import safe_load
from deepdpm_core.config import Config, from_dict, load_config
from deepdpm_core.errors import CheckpointError, ConfigError
from deepdpm_core.progress import progress_bar
from deepdpm_core.trainer import Trainer
from deepdpm_core.validation import check_features, check_init_labels, readonly_tensor

FORMAT = "deepdpm-model/1"


def _leaf_index() -> dict[str, list[str]]:
    """Leaf name -> dotted keys having it (for ``DeepDPM(alpha=1.0)`` shortcuts)."""
    index: dict[str, list[str]] = {}
    for f in dataclasses.fields(Config):
        sub = typing.get_type_hints(Config)[f.name]
        if dataclasses.is_dataclass(sub):
            for g in dataclasses.fields(sub):
                index.setdefault(g.name, []).append(f"{f.name}.{g.name}")
        else:
            index.setdefault(f.name, []).append(f.name)
    return index


def resolve_config(config: Config | dict | str | Path | None, overrides: dict[str, Any]) -> Config:
    """Combine a config (object, mapping, YAML path or None) with keyword overrides.

    Overrides may be dotted (``{"prior.alpha": 1.0}``), double-underscored
    (``prior__alpha=1.0``), a whole section (``prior={"alpha": 1.0}``) or an unambiguous
    leaf name (``alpha=1.0``).
    """
    if config is None:
        cfg = Config()
    elif isinstance(config, Config):
        cfg = config
    elif isinstance(config, dict):
        cfg = from_dict(config)
    else:
        cfg = load_config(config)
    leaves = _leaf_index()
    sections = {f.name for f in dataclasses.fields(Config)}
    dotted: dict[str, Any] = {}
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if "." in key:
            dotted[key] = value
        elif key in sections and isinstance(value, dict):
            dotted.update({f"{key}.{k}": v for k, v in value.items()})
        elif len(leaves.get(key, [])) == 1:
            dotted[leaves[key][0]] = value
        elif key in leaves:
            raise ConfigError(f"ambiguous parameter '{key}': use one of {', '.join(leaves[key])}")
        else:
            close = difflib.get_close_matches(key, [*leaves, *sections], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown parameter '{key}'{hint}")
    return cfg.with_overrides(dotted) if dotted else cfg


class DeepDPM:
    """Deep clustering with an unknown number of clusters (Ronen et al., CVPR 2022).

    Parameters
    ----------
    config : Config, dict, str or Path, optional
        A config object, a nested mapping or a YAML file; defaults follow the paper.
    random_state : int, optional
        Overrides ``config.seed``; equal seeds give identical fits.
    **overrides
        Config keys, e.g. ``DeepDPM(alpha=1.0, prior__sigma_scale=0.01)``.

    Attributes
    ----------
    n_clusters_ : int
        K found (clusters owning at least one training point).
    labels_ : ndarray of shape (N,)
        Cluster of each training point.
    means_ : ndarray of shape (K, D)
    covariances_ : ndarray of shape (K, D, D)
    weights_ : ndarray of shape (K,)
    history_ : list of dict
        One record per epoch: epoch, n_clusters, loss_cluster, loss_subcluster,
        splits_accepted, merges_accepted, prior_scale (s of Ψ = s·I, in the features'
        units squared), diagonal_covariances (0 or 1), seconds, and where the seconds went:
        seconds_estep (E-step targets), seconds_train (minibatch steps), seconds_stats
        (statistics and their all-reduce), seconds_mstep, seconds_moves (split/merge round).
    """

    def __init__(self, config: Config | dict | str | Path | None = None,
                 random_state: int | None = None, **overrides: Any) -> None:
        cfg = resolve_config(config, overrides)
        if random_state is not None:
            cfg = cfg.with_overrides({"seed": int(random_state)})
        self.config = cfg
        self._trainer: Trainer | None = None

    # ----------------------------------------------------------------- fitting
    def fit(self, X: Any, y: Any = None, callbacks: list[Callable[[dict], None]] | None = None,
            progress: bool = False, init_labels: Any = None) -> DeepDPM:
        """Fit on X (float [N, D]); ``y`` is ignored (scikit-learn convention).

        Parameters
        ----------
        callbacks : list of callables, optional
            Each is called with every epoch's history record.
        progress : bool
            Show a progress bar with K and the losses.
        init_labels : array of shape (N,), int, optional
            Warm start: initial hard clusters (any non-negative ids; empty ids are
            dropped) instead of k-means with ``init.n_clusters``.
        """
        X = check_features(X, min_rows=max(2, self.config.init.n_clusters))
        start_labels = None
        if init_labels is not None:
            start_labels = torch.from_numpy(check_init_labels(init_labels, len(X)))
        cbs = list(callbacks or [])
        # while the bar is open, lines written to stderr (warnings) go above it
        with progress_bar(progress, total=self.config.schedule.max_epochs, desc="deepdpm fit",
                          unit="epoch") as bar:
            if bar is not None:

                def show(rec: dict) -> None:
                    bar.update(1)
                    bar.set_postfix(K=rec["n_clusters"], cl=f"{rec['loss_cluster']:.3f}",
                                    sub=f"{rec['loss_subcluster']:.3g}")

                cbs.append(show)
            trainer = Trainer(self.config, readonly_tensor(X), callbacks=cbs)
            self._trainer = trainer  # callbacks may predict with the model while it trains
            trainer.fit(start_labels)
        self._trainer = trainer
        self.labels_ = self.predict(X)
        return self

    def fit_predict(self, X: Any, y: Any = None) -> np.ndarray:
        """Fit and return :attr:`labels_`."""
        return self.fit(X).labels_

    # --------------------------------------------------------------- inference
    def _fitted(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError("this DeepDPM instance is not fitted yet; call fit() or load()")
        return self._trainer

    def predict_proba(self, X: Any) -> np.ndarray:
        """Cluster responsibilities r = softmax(f_cl(x)), shape (N, K)."""
        t = self._fitted()
        X = check_features(X, n_features=t.dim)
        return t.predict_log_proba(readonly_tensor(X)).exp().numpy()

    def predict(self, X: Any) -> np.ndarray:
        """Hard cluster of each row, argmax of :meth:`predict_proba`, shape (N,)."""
        t = self._fitted()
        X = check_features(X, n_features=t.dim)
        return t.predict_labels(readonly_tensor(X)).numpy()

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
            Same as :meth:`predict`.
        confidence : ndarray, shape (N,), float32
            ``predict_proba(X).max(1)``, computed batch by batch.
        """
        t = self._fitted()
        X = check_features(X, n_features=t.dim)
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        labels, confidence = t.predict_assignments(readonly_tensor(X), batch_size)
        return labels.numpy(), confidence.numpy()

    @property
    def n_features_in_(self) -> int:
        return self._fitted().dim

    @property
    def n_clusters_(self) -> int:
        return self._fitted().n_clusters

    @property
    def means_(self) -> np.ndarray:
        t = self._fitted()
        return t.coords.means_to_features(t.means).cpu().numpy()

    @property
    def covariances_(self) -> np.ndarray:
        t = self._fitted()
        return t.coords.covariances_to_features(t.covs).cpu().numpy()

    @property
    def weights_(self) -> np.ndarray:
        return self._fitted().log_weights.exp().cpu().numpy()

    @property
    def history_(self) -> list[dict]:
        return list(self._fitted().history)

    # ------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write the fitted model (config, nets, NIW parameters, history) atomically."""
        t = self._fitted()
        state = {"format": FORMAT, **t.state_dict()}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(state, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> DeepDPM:
        """Load a model written by :meth:`save` (``torch.load(weights_only=True)``)."""
        path = Path(path)
        state = safe_load(path, "model checkpoint")
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a DeepDPM model checkpoint ({FORMAT})")
        cfg = from_dict(state["config"]).with_overrides({"device": "cpu"})
        est = cls(cfg)
        est._trainer = Trainer.from_state(state, config=cfg)
        return est

    @classmethod
    def from_trainer(cls, trainer: Trainer) -> DeepDPM:
        """A fitted estimator around a finished trainer (e.g. one rank of a distributed fit)."""
        est = cls(trainer.config)
        est._trainer = trainer
        return est
