"""``deepdpm predict --model runs:/...``: the model downloaded from MLflow is kept only while
the prediction that needs it runs, so a long-lived process gathers no download folders."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile

import numpy as np
import pyarrow.parquet as pq

from deepdpm_core import DeepDPM
from pipeline.cli import main


def test_a_model_downloaded_from_mlflow_is_removed_when_its_prediction_ends(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 300)
    X = (rng.normal(0.0, 0.3, (300, 4)) + 3.0 * y[:, None]).astype(np.float32)
    rows, model = tmp_path / "rows.npy", tmp_path / "model.pt"
    np.save(rows, X)
    DeepDPM(random_state=0, init__n_clusters=3, schedule__max_epochs=3).fit(X).save(model)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("downloads", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    client.log_artifact(run_id, str(model))
    client.set_terminated(run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the download folders go

    out = tmp_path / "assigned.parquet"
    with contextlib.redirect_stdout(io.StringIO()) as result:
        assert main(["predict", "--model", f"runs:/{run_id}/model.pt", "--input", str(rows),
                     "--output", str(out), "--json"]) == 0
    assert pq.read_table(out).num_rows == 300
    assert not list(temp.glob("deepdpm-model-*"))
    # the result names the model given, not its download that is gone
    assert json.loads(result.getvalue())["model"] == f"runs:/{run_id}/model.pt"
    # a download that is not a model fails with its one line, and leaves nothing either
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    client.log_artifacts(run_id, str(tmp_path / "notes"), "notes")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["predict", "--model", f"runs:/{run_id}/notes", "--input", str(rows),
                     "--output", str(tmp_path / "none.parquet")]) == 2
    assert "is not a deepdpm model" in err.getvalue()
    assert not list(temp.glob("deepdpm-model-*"))
