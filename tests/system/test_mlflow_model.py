"""A tracked fit's MLflow model, used through MLflow's own tools against a real server.

The module runs the example of "The MLflow model" in docs/tracking.md as written (``deepdpm`` as
``python -m pipeline.cli``, the fit made short with ``--set``, the server and port the
test's own): a ``deepdpm fit`` subprocess that registers its model, ``deepdpm predict``
from ``models:/NAME@ALIAS``, ``mlflow models serve --env-manager local`` answering the
``curl`` call, and the Python block. Then: the pyfunc model predicts what
``DeepDPM.load`` does, ``runs:/`` and ``models:/`` predict the same table as the file,
and the run has its dataset, name, Source and experiment kind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from deepdpm_core import DeepDPM
from pipeline.cli import main
from pipeline.tracking.client_settings import HTTP_ENV_DEFAULTS
from pipeline.tracking.experiments import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG
from pipeline.tracking.mlflow_model import pip_requirements
from pipeline.tracking.run_tracker import RunTracker
from tests.support.mlflow_server import free_port, mlflow_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
#: what makes the documented fit take seconds here (3 starting clusters, 5 short epochs)
FAST_FIT = ["--quiet", "--set", "init.n_clusters=3", "--set", "schedule.max_epochs=5",
            "--set", "optim.min_steps_per_epoch=4"]  # fmt: skip


def _documented_example() -> tuple[list[str], str]:
    """The bash lines and the Python block of docs/tracking.md's "The MLflow model" section."""
    text = (REPO / "docs" / "tracking.md").read_text()
    section = text.split("## The MLflow model", 1)[1].split("\n## ", 1)[0]
    bash, python = re.findall(r"```(?:bash|python)\n(.*?)```", section, re.S)
    lines = [line for line in bash.splitlines() if line and not line.startswith("#")]
    return lines, python


def _command(line: str) -> list[str]:
    """The argv of a documented line (its trailing comment and ``&`` dropped)."""
    words = shlex.split(line, comments=True)
    return words[:-1] if words[-1] == "&" else words


@pytest.fixture(scope="module")
def example(mlflow_server, tmp_path_factory):  # noqa: F811
    """The documented environment and fit: (work dir, env, X, run, fit output dir)."""
    work = tmp_path_factory.mktemp("readme")
    rng = np.random.default_rng(0)
    centers = rng.normal(0.0, 6.0, (3, 4))
    y = rng.integers(0, 3, 600)
    X = (centers[y] + rng.normal(0.0, 1.0, (600, 4))).astype(np.float32)
    np.savez(work / "features.npz", X=X, y=y)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "MLFLOW_DISABLE_TELEMETRY": "true", **HTTP_ENV_DEFAULTS}  # fmt: skip
    lines, _ = _documented_example()
    export, fit = lines[0], lines[1]
    assert export.startswith("export MLFLOW_TRACKING_URI=")
    env["MLFLOW_TRACKING_URI"] = mlflow_server.uri
    argv = _command(fit)
    assert argv[:2] == ["deepdpm", "fit"]
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv[1:], *FAST_FIT], cwd=work,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("deepdpm")
    (run,) = client.search_runs([experiment.experiment_id])
    return work, env, X, run, work / "runs" / "mix", done


def _labels_of_the_file(out: Path, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return DeepDPM.load(out / "model.pt").predict_confidence(X)


def test_documented_fit_registers_its_model_under_the_alias(example, mlflow_server):  # noqa: F811
    work, _, _, run, out, done = example
    assert re.match(rf"K=\d+ epochs=5 .* -> {re.escape(str(out.resolve()))} "
                    rf"\[MLflow run {run.info.run_id} in {re.escape(mlflow_server.uri)}\]\n", done.stdout)
    client = MlflowClient(mlflow_server.uri)
    version = client.get_model_version_by_alias("mix", "champion")
    assert version.run_id == run.info.run_id and version.version == "1"
    (output,) = client.get_run(run.info.run_id).outputs.model_outputs
    assert version.source == f"models:/{output.model_id}"
    model = client.get_logged_model(output.model_id)
    assert model.name == "model" and model.source_run_id == run.info.run_id
    assert model.status.to_proto() == model.status.READY.to_proto()
    # the run's page, opened on the UI's model-training view, is the last line on stderr
    url = (f"{mlflow_server.uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
           "?workflowType=machine_learning")  # fmt: skip
    assert done.stderr.strip().splitlines()[-1] == f"deepdpm: MLflow run mix: {url}"


def test_pyfunc_model_predicts_what_deepdpm_load_does(example, mlflow_server, monkeypatch):  # noqa: F811
    import mlflow
    import mlflow.artifacts
    import mlflow.pyfunc

    _, _, X, run, out, _ = example
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    labels, confidence = _labels_of_the_file(out, X)
    assert len(np.unique(labels)) > 1
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    for data in (X, pd.DataFrame(X, columns=list("abcd"))):
        got = model.predict(data, params={"batch_size": 64})
        assert list(got.columns) == ["cluster", "confidence"]
        np.testing.assert_array_equal(got["cluster"].to_numpy(), labels)
        np.testing.assert_allclose(got["confidence"].to_numpy(), confidence, rtol=1e-6)
    # the rows are float32, as the fit read them; MLflow refuses float64 (a lossy cast)
    signature = model.metadata.signature
    assert [s.type.name for s in signature.inputs.inputs] == ["float"] * 4
    with pytest.raises(MlflowException, match="Can not safely convert float64 to float32"):
        model.predict(X.astype(np.float64))
    assert signature.outputs.input_names() == ["cluster", "confidence"]
    local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model"))
    example_rows = model.metadata.load_input_example(str(local))
    np.testing.assert_allclose(np.asarray(example_rows, dtype=np.float32), X[:5])
    # code from the installed package, nothing pickled; requirements: the package (MLflow
    # adds its own version)
    assert not list(local.rglob("*.pkl"))
    requirements = (local / "requirements.txt").read_text().split()
    assert sorted(requirements) == sorted([*pip_requirements(), f"mlflow=={mlflow.__version__}"])

    # the documented Python block, with the rows of the fit as X
    _, python = _documented_example()
    scope = {"X": X}
    exec(compile(python, "docs/tracking.md", "exec"), scope)
    np.testing.assert_array_equal(scope["model"].predict(X)["cluster"].to_numpy(), labels)


def test_predict_takes_runs_and_models_uris(example, mlflow_server, monkeypatch, tmp_path):  # noqa: F811
    work, env, X, run, out, _ = example
    lines, _ = _documented_example()
    argv = _command(lines[2])
    assert argv[:4] == ["deepdpm", "predict", "--model", "models:/mix@champion"]
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv[1:]], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Downloading artifacts" not in done.stderr  # no MLflow progress bars
    want = pq.read_table(out / "assignments.parquet")
    got = {"models:/mix@champion": pq.read_table(work / "mix.parquet")}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    for uri in (f"runs:/{run.info.run_id}/model", f"runs:/{run.info.run_id}/model.pt",
                "models:/mix/1", str(out / "model.pt")):  # fmt: skip
        written = tmp_path / f"{len(got)}.parquet"
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["predict", "--model", uri, "--input", str(work / "features.npz"),
                         "--output", str(written)]) == 0  # fmt: skip
        got[uri] = pq.read_table(written)
    for uri, table in got.items():
        assert table.column("cluster").equals(want.column("cluster")), uri
        np.testing.assert_allclose(table.column("confidence").to_numpy(),
                                   want.column("confidence").to_numpy(), rtol=1e-6)  # fmt: skip

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["predict", "--model", "models:/no-such-model@champion", "--input",
                     str(work / "features.npz"), "--output", str(tmp_path / "x.parquet")])  # fmt: skip
    assert code == 2
    (line,) = err.getvalue().strip().splitlines()
    assert line.startswith("deepdpm predict: error: cannot download model models:/no-such-model@")


def test_mlflow_models_serve_answers_rest_with_the_same_labels(example):
    work, env, X, _, out, _ = example
    lines, _ = _documented_example()
    serve, curl = _command(lines[3]), _command(lines[4])
    assert serve[:3] == ["mlflow", "models", "serve"] and "--env-manager" in serve
    port = free_port()
    serve[serve.index("--port") + 1] = str(port)
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", *serve[1:]], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not _answers(f"http://127.0.0.1:{port}/ping"):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "mlflow models serve did not start in 300 s"
            time.sleep(0.5)
        # the documented curl call, then all rows
        assert curl[0] == "curl" and curl[1] == "-s"
        body = curl[curl.index("-d") + 1]
        row = np.array(json.loads(body)["inputs"], dtype=np.float32)
        labels, _ = _labels_of_the_file(out, row)
        answer = _post(f"http://127.0.0.1:{port}/invocations", body)
        assert [p["cluster"] for p in answer["predictions"]] == labels.tolist()
        labels, confidence = _labels_of_the_file(out, X)
        answer = _post(f"http://127.0.0.1:{port}/invocations", json.dumps({"inputs": X.tolist()}))
        assert [p["cluster"] for p in answer["predictions"]] == labels.tolist()
        np.testing.assert_allclose([p["confidence"] for p in answer["predictions"]], confidence,
                                   rtol=1e-5)  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _post(url: str, body: str) -> dict:
    request = urllib.request.Request(url, data=body.encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def test_run_records_its_input_name_source_and_experiment_kind(example, mlflow_server):  # noqa: F811
    from pipeline.tracking.run_dataset import input_digest

    work, _, X, run, _, _ = example
    assert run.info.run_name == "mix"  # the --output folder: the documented fit has no --run-name
    (dataset_input,) = (
        MlflowClient(mlflow_server.uri).get_run(run.info.run_id).inputs.dataset_inputs
    )
    dataset = dataset_input.dataset
    path = (work / "features.npz").resolve()
    assert dataset.name == "features.npz" and dataset.source_type == "local"
    assert json.loads(dataset.source) == {"uri": str(path)}
    assert json.loads(dataset.profile) == {"num_rows": 600, "num_features": 4}
    assert dataset.digest == input_digest(path, 600, 4) and len(dataset.digest) == 8
    assert [(t.key, t.value) for t in dataset_input.tags] == [("mlflow.data.context", "training")]

    tags = run.data.tags
    assert tags["mlflow.source.name"] == "deepdpm fit" and tags["mlflow.source.type"] == "LOCAL"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert tags["mlflow.source.git.commit"] == head.stdout.strip()
    experiment = MlflowClient(mlflow_server.uri).get_experiment(run.info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"


def test_the_digest_changes_with_the_data(tmp_path):
    from pipeline.tracking.run_dataset import input_digest

    X = np.random.default_rng(1).normal(size=(3000, 3)).astype(np.float32)
    np.save(tmp_path / "a.npy", X)
    X[2999, 0] += 1.0  # a row among the last 1000
    np.save(tmp_path / "b.npy", X)
    np.save(tmp_path / "c.npy", X[:2999])
    digests = {input_digest(tmp_path / f"{n}.npy", len(X) - (n == "c"), 3) for n in "abc"}
    assert len(digests) == 3


def test_an_experiment_kind_someone_set_is_kept(mlflow_server, monkeypatch):  # noqa: F811
    for key, value in HTTP_ENV_DEFAULTS.items():
        monkeypatch.setenv(key, value)
    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment("kept-kind")
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, "genai_development")
    with RunTracker(mlflow_server.uri, "kept-kind", run_name="r") as tracker:
        tracker.log_metrics({"x": 1.0})
    assert tracker.run_id is not None and not tracker.failed
    assert client.get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_the_model_of_an_alternating_fit_takes_raw_rows(mlflow_server, tmp_path, monkeypatch):  # noqa: F811
    """With an ``autoencoder.pt`` beside ``model.pt`` (``fit --alternate``) the MLflow model
    encodes the raw rows first: its signature has the raw D, its labels are the clustering's
    of the encoded rows."""
    import mlflow.pyfunc

    from deepdpm_core.config import Config
    from deepdpm_core.features import encode, save_autoencoder
    from deepdpm_core.features.autoencoder import build_autoencoder
    from pipeline.tracking.mlflow_model import log_fit_model

    rng = np.random.default_rng(2)
    X = (rng.normal(0.0, 5.0, (3, 12))[rng.integers(0, 3, 300)]
         + rng.normal(0.0, 1.0, (300, 12))).astype(np.float32)  # fmt: skip
    autoencoder = build_autoencoder(12, 3, [16], seed=0)  # its weights need no training here
    save_autoencoder(autoencoder, Config(), tmp_path / "autoencoder.pt")
    Z = encode(autoencoder, X)
    clustering = DeepDPM(random_state=0, init={"n_clusters": 3}, schedule__max_epochs=2).fit(Z)
    clustering.save(tmp_path / "model.pt")

    client = MlflowClient(mlflow_server.uri)
    run = client.create_run(client.create_experiment("alternating-model"))
    log_fit_model(client, run.info.run_id, tmp_path, input_example=X[:5])
    client.set_terminated(run.info.run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    assert len(model.metadata.signature.inputs.inputs) == 12
    labels, confidence = clustering.predict_confidence(Z)
    got = model.predict(X)
    np.testing.assert_array_equal(got["cluster"].to_numpy(), labels)
    np.testing.assert_allclose(got["confidence"].to_numpy(), confidence, rtol=1e-6)
