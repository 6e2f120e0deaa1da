"""A fitted DeepDPM as an MLflow model (``python_function`` flavor).

Every tracked fit logs one as its run's ``model``, for ``mlflow.pyfunc.load_model`` and
``mlflow models serve`` (docs/tracking.md, "The MLflow model"). Its artifacts are the fit's
``model.pt`` and, after ``--alternate``, ``autoencoder.pt`` (raw rows are encoded first).
It is logged "from code": MLflow runs :mod:`pipeline.tracking.mlflow_model_code` at load
time, so nothing is unpickled and the installed ``deepdpm`` (the one pip requirement)
predicts.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd

#: artifact path of the MLflow model in a fit's run (``runs:/<id>/model``)
MODEL_NAME = "model"
#: rows of the fit's input stored with the model as its input example
EXAMPLE_ROWS = 5


class DeepDPMModel(mlflow.pyfunc.PythonModel):
    """``predict(X)`` -> DataFrame with ``cluster`` (int64) and ``confidence`` (float64).

    ``confidence`` is the largest cluster responsibility of the row, as in
    ``deepdpm predict``'s output.
    """

    def load_context(self, context: Any) -> None:
        from deepdpm_core import DeepDPM

        self.model = DeepDPM.load(context.artifacts["model"])
        self.autoencoder = None
        if "autoencoder" in context.artifacts:
            from deepdpm_core.features import load_autoencoder

            self.autoencoder = load_autoencoder(context.artifacts["autoencoder"])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict | None = None):
        """Cluster ids and confidences of the rows of ``model_input``.

        Parameters
        ----------
        model_input : DataFrame with D numeric columns (MLflow makes one of an [N, D] array)
        params : dict, optional
            ``batch_size``: rows per forward pass (default 65536).

        Returns
        -------
        DataFrame of N rows: ``cluster`` (int64), ``confidence`` (float64).
        """
        batch_size = int((params or {}).get("batch_size", 65536))
        X = np.asarray(model_input, dtype=np.float32)
        if self.autoencoder is not None:
            from deepdpm_core.features import encode

            X = encode(self.autoencoder, X, batch_size=batch_size)
        labels, confidence = self.model.predict_confidence(X, batch_size=batch_size)
        return pd.DataFrame(
            {"cluster": labels.astype(np.int64), "confidence": confidence.astype(np.float64)}
        )


def model_signature(n_features: int) -> Any:
    """Input: D unnamed float32 columns (an [N, D] float32 array, or a DataFrame whose
    columns are taken in order); output: ``cluster`` long, ``confidence`` double;
    param ``batch_size``.

    float32 as the fit reads and computes; MLflow refuses float64 rows (a lossy cast).
    """
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("float") for _ in range(int(n_features))]),
        outputs=Schema([ColSpec("long", "cluster"), ColSpec("double", "confidence")]),
        params=ParamSchema([ParamSpec("batch_size", "long", 65536)]),
    )


def pip_requirements() -> list[str]:
    """The installed ``deepdpm`` (it brings torch, MLflow and the rest)."""
    try:
        return [f"deepdpm=={metadata.version('deepdpm')}"]
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return ["deepdpm"]


def log_fit_model(
    client: Any,
    run_id: str,
    out_dir: str | Path,
    input_example: np.ndarray | None = None,
    step: int = 0,
) -> str:
    """Log the fit in ``out_dir`` as the MLflow model ``model`` of run ``run_id``.

    Works through ``client`` only (no global MLflow state), so that it can run on
    :class:`pipeline.tracking.run_tracker.RunTracker`'s logging thread.

    Parameters
    ----------
    client : mlflow.MlflowClient
    run_id : str
    out_dir : path
        A fit's output directory: ``model.pt`` and, after ``--alternate``, ``autoencoder.pt``.
    input_example : ndarray of shape (n, D), optional
        A few rows of the fit's input (D of the raw input when there is an autoencoder).
    step : int
        The run's step the model belongs to (its last epoch).

    Returns
    -------
    str
        The logged model's id (``models:/<id>``).
    """
    import tempfile

    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    out = Path(out_dir)
    artifacts = {"model": str(out / "model.pt")}
    if (out / "autoencoder.pt").exists():
        artifacts["autoencoder"] = str(out / "autoencoder.pt")
    n_features = _input_features(artifacts)
    run = client.get_run(run_id)
    logged = client.create_logged_model(
        run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id, params=run.data.params
    )
    # what mlflow.models.Model.log writes, for a model whose experiment and client are ours
    meta = Model(
        artifact_path=logged.artifact_location,
        model_uuid=logged.model_id,
        run_id=run_id,
        model_id=logged.model_id,
    )
    with tempfile.TemporaryDirectory(prefix="deepdpm-mlflow-model-") as tmp:
        path = Path(tmp) / MODEL_NAME
        # MLflow copies the script with its mode: a fresh copy gets the umask's, as every output
        script = Path(tmp) / "mlflow_model_code.py"
        script.write_text(Path(__file__).with_name(script.name).read_text())
        mlflow.pyfunc.save_model(
            path,
            mlflow_model=meta,
            python_model=str(script),
            artifacts=artifacts,
            signature=model_signature(n_features),
            input_example=input_example,
            pip_requirements=pip_requirements(),
        )
        client.log_outputs(run_id, models=[LoggedModelOutput(logged.model_id, step=step)])
        client.log_model_artifacts(logged.model_id, str(path))
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return logged.model_id


def _input_features(artifacts: dict[str, str]) -> int:
    """D of the rows the model takes: the autoencoder's input, else the clustering's."""
    if "autoencoder" in artifacts:
        from deepdpm_core.features import load_autoencoder

        return int(load_autoencoder(artifacts["autoencoder"]).input_dim)
    from deepdpm_core import DeepDPM

    return int(DeepDPM.load(artifacts["model"]).n_features_in_)


def register_fit_model(client: Any, run_id: str, name: str, alias: str) -> int:
    """Register run ``run_id``'s model as a new version of ``name`` and point ``alias`` at it.

    Returns
    -------
    int
        The new version (``models:/NAME/<version>``, ``models:/NAME@<alias>``).
    """
    from mlflow.exceptions import MlflowException

    run = client.get_run(run_id)
    model_ids = [m.model_id for m in (run.outputs.model_outputs if run.outputs else [])]
    if not model_ids:
        raise RuntimeError(f"run {run_id} has no logged model to register")
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(
        name, source=f"models:/{model_ids[-1]}", run_id=run_id, model_id=model_ids[-1]
    )
    client.set_registered_model_alias(name, alias, version.version)
    return int(version.version)
