"""A fit's input file as an MLflow dataset (the run's "Datasets" in the UI).

The dataset is described from the file's metadata and a few of its rows, never the whole
table: name (the file or folder name), source (its absolute path), N and D (profile and
schema), and a digest of (N, D) and the first and last :data:`DIGEST_ROWS` rows, as
MLflow's own NumPy datasets hash a bounded part of the data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from deepdpm_core.errors import DeepDPMError
from pipeline.io.feature_rows import feature_shape, read_feature_rows

#: rows at each end of the input that go into the digest
DIGEST_ROWS = 1000
#: the run input's ``mlflow.data.context`` tag
CONTEXT = "training"


def input_rows(path: str | Path, n_rows: int, columns: Any = None) -> np.ndarray | None:
    """The first ``n_rows`` rows of a feature input (``columns``: of a wide table), float32
    (n, D); None when the input is gone or not an [N, D] table (e.g. images that
    ``--alternate`` flattens)."""
    try:
        return read_feature_rows(path, 0, n_rows, columns)
    except (DeepDPMError, OSError):
        return None


def input_digest(path: str | Path, n_rows: int, n_features: int, columns: Any = None) -> str:
    """8 hex digits of sha256 over (N, D) and the first and last :data:`DIGEST_ROWS` rows."""
    h = hashlib.sha256(np.array([n_rows, n_features], dtype=np.int64).tobytes())
    h.update(read_feature_rows(path, 0, DIGEST_ROWS, columns).tobytes())
    h.update(read_feature_rows(path, max(DIGEST_ROWS, n_rows - DIGEST_ROWS), n_rows,
                               columns).tobytes())
    return h.hexdigest()[:8]


def feature_input(path: str | Path, columns: Any = None) -> Any | None:
    """The run input (``mlflow.entities.DatasetInput``, context ``training``) of a feature
    file or Parquet folder; None when it cannot be read as an [N, D] table."""
    from mlflow.data.schema import TensorDatasetSchema
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.types import Schema, TensorSpec

    path = Path(path).resolve()
    try:
        n_rows, n_features = feature_shape(path, columns)
        digest = input_digest(path, n_rows, n_features, columns)
    except (DeepDPMError, OSError):
        return None
    schema = TensorDatasetSchema(
        features=Schema([TensorSpec(np.dtype(np.float32), (-1, n_features))])
    )
    dataset = Dataset(
        name=path.name,
        digest=digest,
        # what MLflow's own datasets record for a local file (LocalArtifactDatasetSource)
        source_type="local",
        source=json.dumps({"uri": str(path)}),
        schema=json.dumps(schema.to_dict()),
        profile=json.dumps({"num_rows": n_rows, "num_features": n_features}),
    )
    return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", CONTEXT)])
