"""``deepdpm predict --model``: a model file, or a model in MLflow.

Accepted: a path (``runs/x/model.pt``); ``runs:/<run id>/model``, the MLflow model a tracked
fit logged (or ``runs:/<id>/model.pt``, the plain artifact); ``models:/NAME@ALIAS`` or
``models:/NAME/VERSION``, a registered version. A model in MLflow is downloaded from the
tracking server (``$MLFLOW_TRACKING_URI``, else the per-user store of ``deepdpm fit``,
:func:`pipeline.tracking.environment.resolve_tracking_uri`) into a temporary folder that is removed when the process exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from deepdpm_core.errors import CheckpointError

#: URI schemes resolved through MLflow
MLFLOW_SCHEMES = ("runs:/", "models:/")


def is_mlflow_uri(model: str | Path) -> bool:
    """True for ``runs:/…`` and ``models:/…``."""
    return str(model).startswith(MLFLOW_SCHEMES)


def local_model_path(model: str | Path, tracking_uri: str | None = None) -> Path:
    """The local ``model.pt`` that ``model`` names (a path is returned as it is).

    Parameters
    ----------
    model : str or Path
        A path, ``runs:/<run id>/<artifact path>`` or ``models:/NAME@ALIAS|VERSION``.
    tracking_uri : str, optional
        Default: as ``deepdpm fit`` (:func:`pipeline.tracking.environment.resolve_tracking_uri`).

    Raises
    ------
    CheckpointError
        The run, model or artifact does not exist, the server cannot be reached, or what
        was downloaded is not a deepdpm model.
    """
    if not is_mlflow_uri(model):
        return Path(model)
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.client_settings import QUIET_ENV_DEFAULTS
    from pipeline.tracking.environment import resolve_tracking_uri

    for key, value in QUIET_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    dst = Path(tempfile.mkdtemp(prefix="deepdpm-model-"))
    atexit.register(shutil.rmtree, dst, ignore_errors=True)
    try:
        local = Path(
            mlflow.artifacts.download_artifacts(
                artifact_uri=str(model),
                dst_path=str(dst),
                tracking_uri=resolve_tracking_uri(tracking_uri),
            )
        )
    except (MlflowException, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot download model {model}: {reason}") from None
    if local.is_file():
        return local
    path = local / "artifacts" / "model.pt"  # an MLflow model of pipeline.tracking.mlflow_model
    if not path.is_file():
        raise CheckpointError(f"{model} is not a deepdpm model (no artifacts/model.pt)")
    return path
