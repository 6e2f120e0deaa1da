"""Features the clusters live in: embeddings (PCA, UMAP, autoencoder) and the paper's
alternation of autoencoder training and clustering."""

from deepdpm_core.features.alternation import AlternationStep, fit_alternating
from deepdpm_core.features.autoencoder import MLPAutoencoder, encode
from deepdpm_core.features.autoencoder_files import load_autoencoder, save_autoencoder
from deepdpm_core.features.embedding import as_feature_matrix, embed

__all__ = [
    "AlternationStep", "as_feature_matrix", "embed", "encode", "fit_alternating", "load_autoencoder",
    "MLPAutoencoder", "save_autoencoder",
]
