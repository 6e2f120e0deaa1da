"""The extraction side: image folders -> webdataset shards -> image embeddings in Parquet
(docs/design.md, "Extraction"). Submodules are imported on use: the CLI reads the encoder
choices without importing torch.
"""
