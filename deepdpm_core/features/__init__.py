"""Features the clusters live in: embeddings (PCA, UMAP, autoencoder) and the paper's
alternation of autoencoder training and clustering."""
