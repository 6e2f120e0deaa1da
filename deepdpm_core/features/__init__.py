"""Features the clusters live in: embeddings (PCA, UMAP, autoencoder) and the paper's
alternation of autoencoder training and clustering."""

from deepdpm_core.features.alternation import AlternationStep, default_cluster_fn, fit_alternating
from deepdpm_core.features.autoencoder import (
    AETrainSettings,
    MLPAutoencoder,
    build_autoencoder,
    cluster_loss,
    encode,
    reconstruction_loss,
    train_autoencoder,
)
from deepdpm_core.features.embedding import METHODS, as_feature_matrix, embed, pca_embed, umap_embed

__all__ = [
    "AETrainSettings", "AlternationStep", "as_feature_matrix", "build_autoencoder", "cluster_loss",
    "default_cluster_fn", "embed", "encode", "fit_alternating", "METHODS", "MLPAutoencoder",
    "pca_embed", "reconstruction_loss", "train_autoencoder", "umap_embed"
]
