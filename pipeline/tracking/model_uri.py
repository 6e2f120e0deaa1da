"""``deepdpm predict --model``: a model file, or a model in MLflow.

Accepted: a path (``runs/x/model.pt``); ``runs:/<run id>/model``, the MLflow model a tracked
fit logged (or ``runs:/<id>/model.pt``, the plain artifact); ``models:/NAME@ALIAS`` or
``models:/NAME/VERSION``, a registered version. A model in MLflow is downloaded from the
tracking server (``$MLFLOW_TRACKING_URI``, else the per-user store of ``deepdpm fit``,
:func:`pipeline.tracking.environment.resolve_tracking_uri`) into a temporary folder that is
removed when the prediction that needed it ends (:func:`local_model_path`, a context manager),
so a long-lived process keeps none.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from deepdpm_core.errors import CheckpointError

#: URI schemes resolved through MLflow
MLFLOW_SCHEMES = ("runs:/", "models:/")


def is_mlflow_uri(model: str | Path) -> bool:
    """True for ``runs:/…`` and ``models:/…``."""
    return str(model).startswith(MLFLOW_SCHEMES)


@contextlib.contextmanager
def local_model_path(model: str | Path, tracking_uri: str | None = None) -> Iterator[Path]:
    """The local ``model.pt`` that ``model`` names, for the ``with`` block (a path is given
    as it is; a model in MLflow is downloaded into a folder removed when the block ends).

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
        yield Path(model)
        return
    from pipeline.tracking.client_settings import QUIET_ENV_DEFAULTS
    from pipeline.tracking.environment import resolve_tracking_uri

    for key, value in QUIET_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="deepdpm-model-", ignore_cleanup_errors=True) as dst:
        yield _download(model, Path(dst), resolve_tracking_uri(tracking_uri))


def _download(model: str | Path, dst: Path, tracking_uri: str) -> Path:
    """Download the MLflow ``model`` into ``dst``; its ``model.pt``.

    Raises
    ------
    CheckpointError
        As :func:`local_model_path`.
    """
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    try:
        local = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=str(model), dst_path=str(dst), tracking_uri=tracking_uri))
    except (MlflowException, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot download model {model}: {reason}") from None
    if local.is_file():
        return local
    path = local / "artifacts" / "model.pt"  # an MLflow model of pipeline.tracking.mlflow_model
    if not path.is_file():
        raise CheckpointError(f"{model} is not a deepdpm model (no artifacts/model.pt)")
    return path
