"""Real ``deepdpm fit`` and ``deepdpm extract`` runs tracked by a real ``mlflow server``.

Everything is read back through ``MlflowClient``: params, per-epoch metric histories,
tags, artifacts. A second server is SIGKILLed while a fit is logging to it; the fit must
finish with every local output and one warning. The report is rendered from the real
fit's output directory and from its MLflow run.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from PIL import Image

from deepdpm_core import DeepDPM
from deepdpm_core.config import Config
from deepdpm_core.model.diagnostics import move_kinds
from pipeline.cli import main
from pipeline.tracking.client_settings import HTTP_ENV_DEFAULTS
from pipeline.tracking.epoch_metrics import EPOCH_METRICS as TRACKING_EPOCH_METRICS
from tests.support.mlflow_server import mlflow_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
#: an exact EM fit's epochs: no ``loss_cluster`` (no net is trained during its search)
EPOCH_METRICS = {"n_clusters", "loss_subcluster", "splits_accepted",
                 "merges_accepted", "prior_scale", "prior_nu", "diagonal_covariances",
                 "epoch_seconds", "epoch_seconds_estep", "epoch_seconds_train",
                 "epoch_seconds_stats", "epoch_seconds_mstep", "epoch_seconds_moves"}  # fmt: skip
LABEL_METRICS = {"nmi", "ari", "acc"}
PNGS = ("k_over_epochs.png", "cluster_sizes.png", "moves.png", "losses.png", "scores.png", "epoch_time.png")
TRACKING_WARNING = "deepdpm: warning: MLflow tracking at"
#: optimizer steps per epoch of the test fits: one pass over 2000 rows in batches of 128
#: (the default tops small data up to 64 steps; 4x the time, same tracking)
ONE_PASS = 16

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tracking_env():
    """No telemetry, no inherited tracking URI, short HTTP retries (module-wide)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        for key, value in HTTP_ENV_DEFAULTS.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    """2000 points of 3 well-separated Gaussians in 4-D, labels in the .npz."""
    rng = np.random.default_rng(0)
    centers = rng.normal(0.0, 6.0, (3, 4))
    y = rng.integers(0, 3, 2000)
    X = (centers[y] + rng.normal(0.0, 1.0, (2000, 4))).astype(np.float32)
    path = tmp_path_factory.mktemp("data") / "mixture.npz"
    np.savez(path, X=X, y=y)
    return path


@pytest.fixture(scope="module")
def fit_run(mlflow_server, tracking_env, mixture, tmp_path_factory):  # noqa: F811
    """``deepdpm fit`` in this process against the live server: (output dir, run, stderr)."""
    out = tmp_path_factory.mktemp("fit") / "out"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main([
            "fit", "--input", str(mixture), "--output", str(out), "--quiet",
            "--set", "schedule.max_epochs=25", "--set", f"optim.min_steps_per_epoch={ONE_PASS}",
            "--set", "init.n_clusters=1",  # K inferred from 1, split by split
            "--tracking-uri", mlflow_server.uri, "--experiment", "fit-e2e", "--run-name", "mix",
        ])  # fmt: skip
    assert code == 0, stderr.getvalue()
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("fit-e2e")
    (run,) = client.search_runs([experiment.experiment_id])
    return out, run, stderr.getvalue()


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), path
    Image.open(io.BytesIO(data)).verify()  # a truncated or corrupt PNG raises
    with Image.open(io.BytesIO(data)) as img:
        assert img.format == "PNG" and img.width > 100 and img.height > 100


def _git_head() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def test_fit_run_params_and_tags(fit_run, mixture):
    out, run, _ = fit_run
    assert run.info.run_name == "mix" and run.info.status == "FINISHED"
    params = run.data.params
    config = Config().with_overrides({"schedule.max_epochs": 25, "optim.min_steps_per_epoch": ONE_PASS,
                                      "init.n_clusters": 1})
    for key, value in config.flat().items():
        assert params[key] == ("null" if value is None else str(value)), key
    assert params["prior.nu"] == "auto" and params["schedule.max_epochs"] == "25"
    assert (params["data.n_samples"], params["data.n_features"], params["num_workers"]) == (
        "2000", "4", "1",
    )  # fmt: skip
    assert len(params) == len(config.flat()) + 3

    tags = run.data.tags
    assert tags["input"] == str(mixture) and tags["deepdpm.command"] == "fit"
    assert tags["host"] == platform.node() and tags["gpu"] == "none"
    head = _git_head()
    if head is None:
        assert "mlflow.source.git.commit" not in tags
    else:
        assert tags["mlflow.source.git.commit"] == head


def test_fit_run_metric_histories_follow_the_fit(fit_run, mlflow_server):  # noqa: F811
    out, run, _ = fit_run
    summary = _summary(out)
    history = summary["history"]
    epochs = summary["epochs"]
    assert epochs == len(history) <= 25
    client = MlflowClient(mlflow_server.uri)
    final = {"fit_seconds", "final_n_clusters", "final_nmi", "final_ari", "final_acc",
             "splits_accepted_total", "merges_accepted_total"}
    assert set(run.data.metrics) == EPOCH_METRICS | LABEL_METRICS | final

    record_key = {name: key for key, name in TRACKING_EPOCH_METRICS.items()}
    for name in sorted(EPOCH_METRICS | LABEL_METRICS):
        points = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
        assert [m.step for m in points] == list(range(1, epochs + 1)), name  # one point per epoch
        want = [float(r[record_key.get(name, name)]) for r in history]
        np.testing.assert_allclose([m.value for m in points], want, rtol=1e-6, err_msg=name)

    k = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "n_clusters"),
                                 key=lambda m: m.step)]  # fmt: skip
    assert k[0] == 1 and k[-1] == summary["n_clusters"] > 1  # K was inferred, from 1
    assert run.data.metrics["final_n_clusters"] == summary["n_clusters"]
    for name in LABEL_METRICS:
        assert run.data.metrics[f"final_{name}"] == pytest.approx(summary["metrics"][name])
    assert run.data.metrics["fit_seconds"] == pytest.approx(summary["fit_seconds"])
    # the run's totals of accepted moves, in the overview beside the per-epoch counts
    for move in ("splits_accepted", "merges_accepted"):
        assert run.data.metrics[f"{move}_total"] == sum(r[move] for r in history)
    assert run.data.metrics["splits_accepted_total"] >= summary["n_clusters"] - 1  # from K = 1
    # per-epoch scores (on <= 10k rows: all 2000 here) end where the full-data ones do
    assert history[-1]["nmi"] == pytest.approx(summary["metrics"]["nmi"], abs=1e-9)
    assert summary["metrics"]["nmi"] > 0.8


def test_fit_run_artifacts(fit_run, mlflow_server, tmp_path):  # noqa: F811
    out, run, stderr = fit_run
    client = MlflowClient(mlflow_server.uri)
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"config.yaml", "summary.json", "model.pt", "assignments.parquet", *PNGS}
    for name in ("k_over_epochs.png", "cluster_sizes.png", "scores.png"):
        _assert_png(client.download_artifacts(run.info.run_id, name, str(tmp_path)))
    remote = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(remote).read_text()) == _summary(out)
    # a fit that grows from K = 1 to the data's K gets no diagnostics warning
    assert "warning" not in stderr and "warnings.txt" not in names


def test_predict_reproduces_the_fits_assignments(fit_run, mixture, tmp_path):
    """``deepdpm predict`` with the saved model, in small batches, writes the fit's table."""
    out, _, _ = fit_run
    written = tmp_path / "pred.parquet"
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = main(["predict", "--model", str(out / "model.pt"), "--input", str(mixture),
                     "--output", str(written), "--batch-size", "7"])
    assert code == 0, stderr.getvalue()
    fit_table, pred_table = pq.read_table(out / "assignments.parquet"), pq.read_table(written)
    assert pred_table.column_names == ["key", "cluster", "confidence", "label"]
    assert pred_table.column("key").to_pylist() == fit_table.column("key").to_pylist()
    assert pred_table.column("cluster").equals(fit_table.column("cluster"))
    np.testing.assert_allclose(pred_table.column("confidence").to_numpy(),
                               fit_table.column("confidence").to_numpy(), rtol=1e-6)
    proba = DeepDPM.load(out / "model.pt").predict_proba(np.load(mixture)["X"])
    np.testing.assert_allclose(pred_table.column("confidence").to_numpy(), proba.max(1), rtol=1e-6)
    nmi = _summary(out)["metrics"]["nmi"]
    assert f"nmi={nmi:.3f}" in stdout.getvalue()  # the result on stdout, not among the logs
    assert f"nmi={nmi:.3f}" not in stderr.getvalue()


def test_the_history_names_the_round_of_every_accepted_move(fit_run):
    out, _, _ = fit_run
    summary = _summary(out)
    kinds = move_kinds(summary["history"])
    moved = 0
    for kind, record in zip(kinds, summary["history"], strict=True):
        if record["splits_accepted"]:
            assert kind == "split", record
        if record["merges_accepted"]:
            assert kind == "merge", record
        moved += record["splits_accepted"] + record["merges_accepted"]
    assert moved >= 2  # K went from 1 to at least 3


def _report_images(path: Path) -> tuple[str, list[bytes]]:
    text = path.read_text(encoding="utf-8")
    pngs = [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', text)]
    return text, pngs


@pytest.mark.parametrize("source", ["directory", "run id"])
def test_report_of_the_real_fit(fit_run, mlflow_server, tmp_path, source):  # noqa: F811
    out, run, _ = fit_run
    html = tmp_path / "report.html"
    where = [str(out)] if source == "directory" else [
        run.info.run_id, "--tracking-uri", mlflow_server.uri,
    ]  # fmt: skip
    assert main(["report", *where, "-o", str(html)]) == 0
    text, pngs = _report_images(html)
    summary = _summary(out)
    assert f"DeepDPM report: K = {summary['n_clusters']}" in text
    # the rows in 2-D, cluster sizes, K, moves, losses, scores, epoch time
    assert len(pngs) == 7
    for png in pngs:
        Image.open(io.BytesIO(png)).verify()
    assert 'class="warn"' not in text
    assert f"{summary['metrics']['nmi']:.4g}" in text


@pytest.fixture
def ray_session():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.ray
def test_extract_run_is_tracked(ray_session, mlflow_server, tracking_env, tmp_path):  # noqa: F811
    from pipeline.extract.shards import write_shards
    from tests.support.image_data import generated_image_folder, write_raw_shard

    shards = tmp_path / "shards"
    write_shards(generated_image_folder(tmp_path / "images", 2, 3), shards, shard_size=4,
                 progress=False)  # 4 + 2 images  # fmt: skip
    write_raw_shard(shards / "bad.tar", [{"__key__": "bad/garbage", "png": b"not a png"}])
    out = tmp_path / "features"
    code = main([
        "extract", "--shards", str(shards), "--output", str(out), "--encoder", "pixels",
        "--pixel-size", "4", "--batch-size", "4", "--num-workers", "1", "--no-progress",
        "--tracking-uri", mlflow_server.uri, "--experiment", "extract-e2e",
    ])  # fmt: skip
    assert code == 0

    client = MlflowClient(mlflow_server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("extract-e2e").experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["encoder"], params["batch_size"], params["num_workers"]) == ("pixels", "4", "1")
    assert params["pixel_size"] == "4" and params["embedding_dim"] == "16"  # 4 x 4 grey
    assert params["weights"] == "null" and params["output"] == str(out)
    metrics = run.data.metrics
    assert (metrics["images_read"], metrics["images_embedded"], metrics["images_skipped"]) == (
        7.0, 6.0, 1.0,
    )  # fmt: skip
    assert metrics["shards_done"] == 3 and metrics["shards_failed"] == 0
    assert metrics["images_per_s"] == pytest.approx(7 / metrics["seconds"], rel=1e-6)
    assert run.data.tags["input"] == str(shards) and run.data.tags["deepdpm.command"] == "extract"
    (artifact,) = client.list_artifacts(run.info.run_id)
    manifest = json.loads(
        Path(client.download_artifacts(run.info.run_id, artifact.path, str(tmp_path))).read_text()
    )
    assert manifest == json.loads((out / "_manifest.json").read_text())


def test_fit_survives_its_tracking_server_being_killed(mlflow_server, mixture, tmp_path):  # noqa: F811
    """SIGKILL the server once the fit has logged a few epochs: the fit finishes, exits 0,
    writes every local output and warns once. The module's server: the last test of the
    module to use it."""
    server = mlflow_server
    out = tmp_path / "out"
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), "DEEPDPM_TRACK_LIVE_AFTER_S": "0"}  # fmt: skip
    env.pop("MLFLOW_TRACKING_URI", None)
    epochs = 40  # no move rounds, so nothing settles K: every epoch runs, most after the kill
    fit = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "fit", "--input", str(mixture),
         "--output", str(out), "--quiet", "--tracking-uri", server.uri, "--experiment", "kill",
         "--set", f"schedule.max_epochs={epochs}", "--set", "moves.split=false", "--set", "moves.merge=false",
         "--set", f"optim.min_steps_per_epoch={ONE_PASS}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        client = MlflowClient(server.uri)
        logged = 0
        deadline = time.monotonic() + 120
        while logged < 3 and time.monotonic() < deadline and fit.poll() is None:
            experiment = client.get_experiment_by_name("kill")
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            if runs:
                logged = len(client.get_metric_history(runs[0].info.run_id, "n_clusters"))
            time.sleep(0.1)
        assert logged >= 3 and fit.poll() is None, "the fit ended before the server was killed"
        server.kill()
        killed_at = time.monotonic()
        stdout, stderr = fit.communicate(timeout=180)
        after_kill = time.monotonic() - killed_at
    finally:
        if fit.poll() is None:
            fit.kill()
        server.kill()
    assert fit.returncode == 0, stderr
    assert stderr.count(TRACKING_WARNING) == 1, stderr
    # noticed mid-fit, or, when the remaining epochs outran the failing calls, at the close
    assert ("training continues without tracking" in stderr
            or "the next command tracked to this server ends its run" in stderr), stderr

    summary = _summary(out)
    assert summary["epochs"] == epochs
    assert pq.read_table(out / "assignments.parquet").num_rows == 2000
    assert DeepDPM.load(out / "model.pt").n_clusters_ == summary["n_clusters"]
    for name in PNGS:
        _assert_png(out / name)

    # what the server stored before it died: some epochs, and a run never closed
    store = MlflowClient(f"sqlite:///{server.root / 'mlflow.db'}")
    (run,) = store.search_runs([store.get_experiment_by_name("kill").experiment_id])
    assert run.info.status == "RUNNING"
    assert 3 <= len(store.get_metric_history(run.info.run_id, "n_clusters")) < epochs
    print(f"fit finished {after_kill:.1f} s after the server was killed")
