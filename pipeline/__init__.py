"""I/O and distribution around :mod:`deepdpm_core`: CLI, Ray, MLflow, shards, Parquet."""
