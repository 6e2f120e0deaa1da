"""Feature spaces to cluster in: autoencoder, UMAP, autoencoder + UMAP (n2d) and PCA.

n2d (McConville et al., ICPR 2021; the paper's comparison with classical methods) is UMAP
(``n_neighbors=20, min_dist=0``) of an autoencoder's embedding. ``umap-learn`` is imported
only when a UMAP method runs, and UMAP does not scale to ImageNet-size N: use ``ae`` or
``pca`` there (docs/features.md). Pure computation, no I/O.
"""

from __future__ import annotations

import importlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
import torch

from deepdpm_core.config import Config
from deepdpm_core.data import is_real_dtype
from deepdpm_core.errors import ConfigError, DataError
from deepdpm_core.features.autoencoder import (
    AETrainSettings,
    EpochCallback,
    MLPAutoencoder,
    build_autoencoder,
    encode,
    resolve_device,
    train_autoencoder,
)

EmbedMethod = Literal["ae", "umap", "ae-umap", "pca"]
METHODS: tuple[str, ...] = get_args(EmbedMethod)


def as_feature_matrix(X: np.ndarray, name: str = "X") -> np.ndarray:
    """Validate raw data and return it as a C-contiguous float32 matrix [N, D].

    Images ``[N, H, W]`` or ``[N, H, W, C]`` are flattened to ``[N, H*W*C]``.

    Raises
    ------
    DataError
        Non-numeric data, fewer than 2 dimensions, fewer than 2 rows or a single
        feature, NaN or infinite values (the message gives the count and the first row).
    """
    X = np.asarray(X)
    if not is_real_dtype(X.dtype):
        raise DataError(f"{name} must be a numeric array, got dtype {X.dtype}")
    if X.ndim < 2:
        raise DataError(f"{name} must have shape [N, D] or [N, H, W(, C)], got shape {X.shape}")
    if X.ndim > 2:
        X = X.reshape(len(X), -1)
    n, d = X.shape
    if n < 2:
        raise DataError(f"{name} has {n} row(s); at least 2 are needed")
    if d < 2:
        raise DataError(f"{name} has {d} feature(s); at least 2 are needed to embed")
    X = np.ascontiguousarray(X, dtype=np.float32)
    bad = ~np.isfinite(X)
    if bad.any():
        rows = np.flatnonzero(bad.any(axis=1))
        raise DataError(
            f"{name} has {int(bad.sum())} NaN/infinite value(s) in {len(rows)} row(s), "
            f"first at row {int(rows[0])}"
        )
    return X


@dataclass
class EmbeddingResult:
    """Output of :func:`embed`.

    Attributes
    ----------
    embedding : ndarray of shape (N, dim), float32
    method : str
    autoencoder : MLPAutoencoder or None
        The trained autoencoder (``ae`` and ``ae-umap``), on the CPU.
    ae_history : list of dict
        Per-epoch AE losses (empty without an AE).
    seconds : dict
        Wall time of each stage (``ae``, ``umap``, ``pca``).
    """

    embedding: np.ndarray
    method: str
    autoencoder: MLPAutoencoder | None = None
    ae_history: list[dict[str, float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def check_dim(dim: int, input_dim: int, what: str) -> None:
    """An embedding must reduce the dimension: ``1 <= dim < input_dim``."""
    if dim < 1:
        raise ConfigError(f"{what} must be >= 1, got {dim}")
    if dim >= input_dim:
        raise DataError(f"{what} ({dim}) must be smaller than the input dimension ({input_dim})")


def pretrain_autoencoder(
    X: np.ndarray, config: Config, *, latent_dim: int | None = None,
    on_epoch: EpochCallback | None = None,
) -> tuple[MLPAutoencoder, list[dict[str, float]]]:
    """Build and pretrain (reconstruction only) the autoencoder of ``config.ae`` on ``X`` [N, D].

    The model is returned on the CPU, in eval mode.
    """
    ae = config.ae
    latent = ae.latent_dim if latent_dim is None else latent_dim
    check_dim(latent, X.shape[1], "the autoencoder latent dimension")
    model = build_autoencoder(X.shape[1], latent, ae.hidden, seed=config.seed)
    model.fit_input_scaling(X)
    settings = AETrainSettings(
        epochs=ae.pretrain_epochs,
        lr=ae.lr,
        batch_size=ae.batch_size,
        recon_weight=1.0,  # a constant factor is irrelevant to Adam without the second term
        beta=0.0,
    )
    history = train_autoencoder(model, X, settings, seed=config.seed,
                                device=resolve_device(config.device), on_epoch=on_epoch)
    return model.cpu(), history


def pca_embed(X: np.ndarray, dim: int) -> np.ndarray:
    """Project ``X`` [N, D] on its top ``dim`` principal axes -> float32 [N, dim].

    Eigendecomposition of the D x D covariance in float64 (cheap for large N); each
    axis's sign is fixed so that its largest-magnitude loading is positive, which makes
    the output deterministic.
    """
    check_dim(dim, X.shape[1], "the PCA dimension")
    mean = X.mean(axis=0, dtype=np.float64)
    centred = X.astype(np.float64) - mean
    cov = centred.T @ centred / max(len(X) - 1, 1)
    eigvals, eigvecs = np.linalg.eigh(cov)
    axes = eigvecs[:, np.argsort(eigvals)[::-1][:dim]]
    signs = np.sign(axes[np.abs(axes).argmax(axis=0), np.arange(dim)])
    axes *= np.where(signs == 0, 1.0, signs)
    return (centred @ axes).astype(np.float32)


#: UMAP's distance: n2d's (McConville et al. 2021), on autoencoder codes whose Euclidean
#: distances the clustering term shapes
UMAP_METRIC = "euclidean"


def umap_embed(X: np.ndarray, dim: int, *, n_neighbors: int, min_dist: float, seed: int) -> np.ndarray:
    """UMAP of ``X`` [N, D] -> float32 [N, dim], deterministic for ``seed`` (single-threaded).

    ``dim == D`` is allowed: n2d maps a 10-d autoencoder code to a 10-d UMAP space.

    Raises
    ------
    ConfigError
        ``umap-learn`` is not installed, or UMAP rejects the settings.
    DataError
        Fewer rows than ``n_neighbors + 1``.
    """
    if not 1 <= dim <= X.shape[1]:
        raise DataError(f"the UMAP dimension ({dim}) must be in [1, {X.shape[1]}]")
    if len(X) <= n_neighbors:
        raise DataError(f"UMAP needs more rows ({len(X)}) than embed.n_neighbors ({n_neighbors})")
    try:
        umap = importlib.import_module("umap")
    except ImportError as exc:
        raise ConfigError(
            'the UMAP methods need the optional package umap-learn: pip install "deepdpm[umap]"'
        ) from exc
    try:
        reducer = umap.UMAP(
            n_components=dim,
            n_neighbors=n_neighbors,
            min_dist=min_dist,
            metric=UMAP_METRIC,
            random_state=seed,
            n_jobs=1,  # a fixed random_state forces one thread anyway; say so to silence a warning
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid UMAP settings: {exc}") from exc
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        # Expected and harmless with a fixed seed / a small N.
        warnings.filterwarnings("ignore", message=".*n_jobs.*")
        warnings.filterwarnings("ignore", message=".*spectral initialisation.*")
        try:
            out = reducer.fit_transform(X)
        except ValueError as exc:
            raise ConfigError(f"UMAP failed: {exc}") from exc
        finally:
            # UMAP's numba kernels set the OpenMP pool that torch shares to every core
            # (1 -> 2 on two cores): give the caller back the threads it had
            torch.set_num_threads(threads)
    return np.ascontiguousarray(out, dtype=np.float32)


def embed(X: np.ndarray, method: str, config: Config | None = None, *, dim: int | None = None,
          on_epoch: EpochCallback | None = None) -> EmbeddingResult:
    """Embed raw data with ``method`` in {``ae``, ``umap``, ``ae-umap``, ``pca``}.

    Parameters
    ----------
    X : array of shape (N, D) or (N, H, W[, C])
        Raw data (pixels or features); validated by :func:`as_feature_matrix`.
    method : str
        ``ae``: the autoencoder's latent code (``dim`` = ``ae.latent_dim``).
        ``umap``: UMAP of the raw data. ``ae-umap``: UMAP of the AE code (n2d).
        ``pca``: principal components.
    config : Config, optional
        ``ae`` and ``embed`` sections, ``seed`` and ``device`` are used.
    dim : int, optional
        Output dimension. Defaults to ``ae.latent_dim`` for ``ae`` and ``embed.dim``
        otherwise. For ``ae-umap`` the AE latent size stays ``ae.latent_dim`` and ``dim``
        must not exceed it.
    on_epoch : callable, optional
        Per-epoch AE progress (see :func:`deepdpm_core.features.autoencoder.train_autoencoder`).

    Returns
    -------
    EmbeddingResult
    """
    if method not in METHODS:
        raise ConfigError(f"unknown embedding method '{method}' (choose from {', '.join(METHODS)})")
    config = config or Config()
    X = as_feature_matrix(X)
    out_dim = (
        dim if dim is not None else (config.ae.latent_dim if method == "ae" else config.embed.dim)
    )
    check_dim(out_dim, X.shape[1], "--dim")
    if method == "ae-umap" and out_dim > config.ae.latent_dim:
        raise ConfigError(
            f"ae-umap: --dim ({out_dim}) must not exceed the autoencoder latent size "
            f"ae.latent_dim ({config.ae.latent_dim})"
        )
    result = EmbeddingResult(embedding=X, method=method)
    if method == "pca":
        start = time.perf_counter()
        result.embedding = pca_embed(X, out_dim)
        result.seconds["pca"] = time.perf_counter() - start
        return result
    features = X
    if method in ("ae", "ae-umap"):
        start = time.perf_counter()
        latent = out_dim if method == "ae" else config.ae.latent_dim
        model, history = pretrain_autoencoder(X, config, latent_dim=latent, on_epoch=on_epoch)
        features = encode(model, X)
        result.autoencoder, result.ae_history = model, history
        result.seconds["ae"] = time.perf_counter() - start
    if method in ("umap", "ae-umap"):
        start = time.perf_counter()
        emb = config.embed
        features = umap_embed(features, out_dim, n_neighbors=emb.n_neighbors,
                              min_dist=emb.min_dist, seed=config.seed)
        result.seconds["umap"] = time.perf_counter() - start
    result.embedding = features
    return result


__all__ = [
    "METHODS",
    "EmbedMethod",
    "EmbeddingResult",
    "as_feature_matrix",
    "check_dim",
    "embed",
    "pca_embed",
    "pretrain_autoencoder",
    "umap_embed",
]
