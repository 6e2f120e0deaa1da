"""Jointly learning features and clusters: the AE <-> DeepDPM alternation (paper Supmat).

DCN-style (Yang et al. 2017, as the paper adapts it; docs/features.md, "Learned feature
spaces"): pretrain the AE, cluster its embedding, train the AE with the clusters held
fixed, re-cluster from the previous clusters; repeat ``ae.alternations`` times, or until K
is unchanged (``ae.stop_when_k_stable``, Supmat 'Number of alternations'). How a clustering
is computed is a parameter (``cluster_fn``), so the pipeline can distribute, log or
checkpoint it; the default fits the single-process :class:`deepdpm_core.DeepDPM`. Pure
computation, no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from deepdpm_core.config import Config
from deepdpm_core.errors import ConfigError, DataError
from deepdpm_core.features.autoencoder import (
    AETrainSettings,
    EpochCallback,
    MLPAutoencoder,
    encode,
    resolve_device,
    train_autoencoder,
)
from deepdpm_core.features.embedding import as_feature_matrix, check_dim, pretrain_autoencoder


class FittedClustering(Protocol):
    """What the alternation needs from a fitted clustering (a fitted ``DeepDPM`` has it)."""

    labels_: np.ndarray  # [N] cluster index of each point, into means_
    means_: np.ndarray  # [K, d] cluster centres in the embedding space
    n_clusters_: int


#: ``cluster_fn(Z, init_labels, step) -> fitted clustering``; ``init_labels`` is None at step 0.
ClusterFn = Callable[[np.ndarray, "np.ndarray | None", int], FittedClustering]


@dataclass
class AlternationStep:
    """One clustering of the alternation (step 0 clusters the pretrained AE's embedding).

    Attributes
    ----------
    step : int
    n_clusters : int
        K found by DeepDPM at this step.
    labels : ndarray of shape (N,)
    ae_history : list of dict
        Per-epoch AE losses of the training that produced this step's embedding
        (pretraining for step 0, reconstruction + clustering term afterwards).
    ae_seconds, cluster_seconds : float
    """

    step: int
    n_clusters: int
    labels: np.ndarray
    ae_history: list[dict[str, float]]
    ae_seconds: float
    cluster_seconds: float


@dataclass
class AlternationResult:
    """Output of :func:`fit_alternating`.

    Attributes
    ----------
    autoencoder : MLPAutoencoder
        The final AE (on the CPU): ``encode(autoencoder, X)`` reproduces ``embedding``.
    clustering : fitted clustering
        The last DeepDPM fit (on ``embedding``).
    embedding : ndarray of shape (N, d), float32
    steps : list of AlternationStep
    stopped_because : str
        ``"k_stable"`` or ``"max_alternations"``.
    """

    autoencoder: MLPAutoencoder
    clustering: Any
    embedding: np.ndarray
    steps: list[AlternationStep] = field(default_factory=list)
    stopped_because: str = "max_alternations"

    @property
    def labels_(self) -> np.ndarray:
        """Final cluster of every point, [N]."""
        return self.steps[-1].labels

    @property
    def n_clusters_(self) -> int:
        """Final K."""
        return self.steps[-1].n_clusters


def default_cluster_fn(config: Config) -> ClusterFn:
    """Fit a single-process :class:`deepdpm_core.DeepDPM` per step (seed ``config.seed + step``)."""

    def fit(Z: np.ndarray, init_labels: np.ndarray | None, step: int) -> FittedClustering:
        from deepdpm_core.model import DeepDPM  # the estimator imports nets; keep this light

        model = DeepDPM(config=config, random_state=config.seed + step)
        return model.fit(Z, init_labels=init_labels)

    return fit


def fit_alternating(
    X: np.ndarray, config: Config | None = None, *, alternations: int | None = None,
    cluster_fn: ClusterFn | None = None, autoencoder: MLPAutoencoder | None = None,
    on_step: Callable[[AlternationStep], None] | None = None,
    on_ae_epoch: EpochCallback | None = None,
) -> AlternationResult:
    """Run the AE <-> DeepDPM alternation on raw data ``X``.

    Parameters
    ----------
    X : array of shape (N, D) or (N, H, W[, C])
        Raw data (pixels, or backbone features such as 128-d MoCo for ImageNet-50).
    config : Config, optional
        ``ae`` section (architecture, learning rate, epochs, ``recon_weight``, ``beta``,
        ``alternations``, ``stop_when_k_stable``), ``seed``, ``device``; the rest is
        DeepDPM's.
    alternations : int, optional
        Overrides ``config.ae.alternations`` (0 = pretrain and cluster once).
    cluster_fn : callable, optional
        ``cluster_fn(Z, init_labels, step)`` returns a fitted clustering with
        ``labels_``, ``means_`` and ``n_clusters_``. Default: :func:`default_cluster_fn`.
    autoencoder : MLPAutoencoder, optional
        An already pretrained AE (its input scaling set); skips pretraining.
    on_step : callable, optional
        Called after every clustering with its :class:`AlternationStep`.
    on_ae_epoch : callable, optional
        Called after every AE epoch (pretraining and alternations).

    Returns
    -------
    AlternationResult
    """
    config = config or Config()
    ae = config.ae
    n_alternations = ae.alternations if alternations is None else alternations
    if n_alternations < 0:
        raise ConfigError(f"the number of alternations must be >= 0, got {n_alternations}")
    X = as_feature_matrix(X)
    cluster_fn = cluster_fn or default_cluster_fn(config)
    device = resolve_device(config.device)

    start = time.perf_counter()
    if autoencoder is None:
        check_dim(ae.latent_dim, X.shape[1], "ae.latent_dim")
        model, history = pretrain_autoencoder(X, config, on_epoch=on_ae_epoch)
    else:
        if autoencoder.input_dim != X.shape[1]:
            raise DataError(
                f"the autoencoder expects {autoencoder.input_dim} features, the data have {X.shape[1]}"
            )
        model, history = autoencoder, []
    Z = encode(model, X, device=device)
    ae_seconds = time.perf_counter() - start

    result: AlternationResult | None = None
    labels: np.ndarray | None = None
    for step in range(n_alternations + 1):
        if step > 0:
            assert result is not None and labels is not None
            start = time.perf_counter()
            # Clusters held fixed while the AE trains (Supmat): DeepDPM's hard labels and means.
            centers = np.asarray(result.clustering.means_, dtype=np.float32)
            settings = AETrainSettings(
                epochs=ae.epochs, lr=ae.lr,
                batch_size=ae.batch_size, recon_weight=ae.recon_weight, beta=ae.beta)
            history = train_autoencoder(
                model, X, settings, seed=config.seed + step, centers=centers,
                assignments=labels, device=device, on_epoch=on_ae_epoch)
            model.cpu()
            Z = encode(model, X, device=device)
            ae_seconds = time.perf_counter() - start

        start = time.perf_counter()
        # Step > 0 re-clusters starting from the previous clusters (warm start by labels:
        # their means are recomputed in the new embedding space).
        clustering = cluster_fn(Z, labels, step)
        cluster_seconds = time.perf_counter() - start
        new_labels = np.asarray(clustering.labels_, dtype=np.int64)
        record = AlternationStep(
            step=step, n_clusters=int(clustering.n_clusters_), labels=new_labels,
            ae_history=history, ae_seconds=ae_seconds, cluster_seconds=cluster_seconds)
        if result is None:
            result = AlternationResult(autoencoder=model, clustering=clustering, embedding=Z)
        result.clustering, result.embedding = clustering, Z
        result.steps.append(record)
        if on_step is not None:
            on_step(record)
        previous_k = result.steps[-2].n_clusters if step > 0 else None
        labels = new_labels
        if ae.stop_when_k_stable and previous_k is not None and previous_k == record.n_clusters:
            result.stopped_because = "k_stable"
            break
    assert result is not None
    return result


__all__ = [
    "AlternationResult", "AlternationStep", "ClusterFn", "FittedClustering", "default_cluster_fn",
    "fit_alternating",
]
