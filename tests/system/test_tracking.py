"""RunTracker against a real ``mlflow server`` (and a real sqlite store).

Records here follow the epoch-record contract of ``DeepDPM.history_`` (what the
estimator passes to its per-epoch callbacks).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient
from PIL import Image

from deepdpm_core.config import Config
from pipeline.report import plots
from pipeline.tracking.client_settings import HTTP_ENV_DEFAULTS
from pipeline.tracking.environment import environment_tags, resolve_tracking_uri
from pipeline.tracking.epoch_metrics import epoch_metrics
from pipeline.tracking.fit_runs import (
    epoch_callback,
    fit_params,
    log_fit_outputs,
    tracker_from_args,
)
from pipeline.tracking.options import add_tracking_arguments
from pipeline.tracking.run_tracker import RunTracker
from tests.support.histories import named_rounds
from tests.support.mlflow_server import mlflow_env, mlflow_server  # noqa: F401


def _records(n: int, with_labels: bool = True) -> list[dict]:
    """Epoch records of a fit that splits at epoch 2 and merges at epoch 4."""
    k = {0: 1, 1: 1, 2: 3, 3: 3, 4: 2}
    out = []
    for e in range(n):
        record = {
            "epoch": e,
            "n_clusters": k.get(e, 2),
            "loss_cluster": 1.0 / (e + 1),
            "loss_subcluster": 2.0 / (e + 1),
            "splits_accepted": 2 if e == 2 else 0,
            "merges_accepted": 1 if e == 4 else 0,
            "seconds": 0.01 * (e + 1),
        }
        if with_labels:
            record.update(nmi=0.1 * e, ari=0.05 * e, acc=0.5 + 0.01 * e)
        out.append(record)
    return out


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def _warning_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "MLflow tracking at" in line]


@pytest.fixture
def experiment() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def test_epoch_metrics_renames_seconds_and_skips_missing_labels():
    record = _records(3, with_labels=False)[2]
    metrics = epoch_metrics(record)
    assert set(metrics) == {
        "n_clusters", "loss_cluster", "loss_subcluster",
        "splits_accepted", "merges_accepted", "epoch_seconds",
    }  # fmt: skip
    assert metrics["epoch_seconds"] == pytest.approx(0.03)


def test_resolve_tracking_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    # the per-user store, not the working directory
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path.resolve()}/data/deepdpm/mlflow.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert resolve_tracking_uri(None) == f"sqlite:///{Path.home().resolve()}/.local/share/deepdpm/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert resolve_tracking_uri(None) == "http://env:5000"
    assert resolve_tracking_uri("http://flag:5000") == "http://flag:5000"


def test_run_logged_to_live_server(mlflow_server, mlflow_env, experiment, tmp_path, capsys):  # noqa: F811
    history = _records(6)
    plots.plot_k_over_epochs(history, tmp_path / "k_over_epochs.png")
    plots.plot_cluster_sizes([50, 30, 5], tmp_path / "cluster_sizes.png")
    (tmp_path / "summary.json").write_text(json.dumps({"n_clusters": 2, "history": history}))
    params = {**Config().flat(), "data.n_samples": 85, "data.n_features": 4, "num_workers": 1}

    with RunTracker(mlflow_server.uri, experiment, run_name="unit") as tracker:
        tracker.log_params(params)
        tracker.set_tags(environment_tags("data/x.parquet"))
        for record in history:
            tracker.log_epoch(record)
        tracker.warn("K collapsed to 2")
        tracker.log_artifacts(
            [tmp_path / n for n in ("summary.json", "k_over_epochs.png", "cluster_sizes.png")]
        )
        run_id = tracker.run_id
    assert not tracker.failed
    assert run_id is not None
    assert "K collapsed to 2" in capsys.readouterr().err

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "unit"
    assert client.get_experiment(run.info.experiment_id).name == experiment
    assert run.data.params["prior.alpha"] == "10.0"
    assert run.data.params["prior.nu"] == "auto"
    assert run.data.params["data.n_samples"] == "85"
    assert set(params) <= set(run.data.params)
    assert run.data.tags["input"] == "data/x.parquet"
    assert run.data.tags["host"] and run.data.tags["gpu"]

    k_history = client.get_metric_history(run_id, "n_clusters")
    assert [m.step for m in sorted(k_history, key=lambda m: m.step)] == list(range(6))
    assert [m.value for m in sorted(k_history, key=lambda m: m.step)] == [
        r["n_clusters"] for r in history
    ]
    for name in ("loss_cluster", "loss_subcluster", "splits_accepted", "merges_accepted",
                 "epoch_seconds", "nmi", "ari", "acc"):  # fmt: skip
        assert len(client.get_metric_history(run_id, name)) == 6, name
    assert "seconds" not in run.data.metrics
    assert run.data.metrics["epoch_seconds"] == pytest.approx(0.06)

    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "k_over_epochs.png", "cluster_sizes.png", "warnings.txt"} <= names
    local = Path(client.download_artifacts(run_id, "k_over_epochs.png", str(tmp_path / "dl")))
    with Image.open(local) as img:
        assert img.format == "PNG" and img.width > 100
    warnings_txt = client.download_artifacts(run_id, "warnings.txt", str(tmp_path / "dl"))
    assert Path(warnings_txt).read_text() == "K collapsed to 2\n"


def test_failed_training_marks_run_failed(mlflow_server, mlflow_env, experiment):  # noqa: F811
    with pytest.raises(ZeroDivisionError):
        with RunTracker(mlflow_server.uri, experiment) as tracker:
            tracker.log_epoch(_records(1)[0])
            _ = 1 / 0
    run = MlflowClient(mlflow_server.uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED"


def test_disabled_or_other_rank_logs_nothing(tmp_path, monkeypatch, mlflow_env, capsys):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    for tracker in (RunTracker(None, enabled=False), RunTracker(None, rank=1)):
        with tracker:
            tracker.log_params({"a": 1})
            tracker.log_epoch(_records(1)[0])
            tracker.warn("only rank 0 prints")
        assert tracker.run_id is None
    assert not (tmp_path / "mlflow.db").exists()
    # --no-tracking still prints diagnostics; rank 1 stays silent
    assert capsys.readouterr().err.count("only rank 0 prints") == 1


def test_default_store_is_the_per_user_sqlite_store(tmp_path, monkeypatch, mlflow_env):  # noqa: F811
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    for key in HTTP_ENV_DEFAULTS:
        monkeypatch.delenv(key)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")  # the user's choice wins
    with RunTracker(None, "local") as tracker:
        for record in _records(3):
            tracker.log_epoch(record)
        tracker.log_artifacts([Path(__file__)])
    assert not tracker.failed
    store = tmp_path / "data" / "deepdpm"
    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    assert len(client.get_metric_history(tracker.run_id, "n_clusters")) == 3
    # the artifacts beside the database, nothing in the working directory
    assert list((store / "mlartifacts").rglob(Path(__file__).name))
    assert list((tmp_path / "work").iterdir()) == []
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"


def test_dead_server_warns_once_and_never_blocks(mlflow_env, capsys):  # noqa: F811
    with socket.socket() as sock:  # a port with nothing listening: connection refused
        sock.bind(("127.0.0.1", 0))
        uri = f"http://deepdpm:s3cret@127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    with RunTracker(uri, "nowhere", close_timeout=60) as tracker:
        for record in _records(20):
            t0 = time.monotonic()
            tracker.log_epoch(record)
            assert time.monotonic() - t0 < 0.5  # logging never waits for the server
    assert tracker.failed and tracker.run_id is None
    # 2 retries with backoff factor 1 (HTTP_ENV_DEFAULTS): ~10 s, not MLflow's ~4 min
    assert time.monotonic() - start < 45
    err = capsys.readouterr().err
    assert len(_warning_lines(err)) == 1
    assert "s3cret" not in err and "***@127.0.0.1" in err


def test_hung_server_does_not_stall_training(mlflow_env, capsys):  # noqa: F811
    # a server that accepts connections but never answers
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        tracker = RunTracker(uri, "hung", queue_size=8, close_timeout=2).__enter__()
        for record in _records(30):
            tracker.log_epoch(record)  # the 9th pending call overflows the queue
        assert time.monotonic() - start < 1.0
        tracker.__exit__(None, None, None)
        assert time.monotonic() - start < 5.0  # close gives up after close_timeout
    assert tracker.failed
    assert len(_warning_lines(capsys.readouterr().err)) == 1


def test_fit_output_directory_and_diagnostics_logged(
    mlflow_server,  # noqa: F811
    mlflow_env,  # noqa: F811
    experiment,
    tmp_path,
    capsys,
):
    import yaml

    out = tmp_path / "fit"
    out.mkdir()
    config = Config()
    history = named_rounds([
        {**r, "n_clusters": 1, "splits_accepted": 0, "merges_accepted": 0}
        for r in _records(30, with_labels=False)
    ], config)  # a fit that never splits: K = 1 is named once it stops
    (out / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    summary = {"n_clusters": 1, "epochs": 30, "fit_seconds": 3.5, "history": history}
    (out / "summary.json").write_text(json.dumps({**summary, "metrics": {"nmi": 0.0}}))
    plots.write_fit_plots(history, [85], out)
    (out / "model.pt").write_bytes(b"checkpoint bytes")

    with tracker_from_args(
        build_args(["--tracking-uri", mlflow_server.uri, "--experiment", experiment])
    ) as tracker:
        tracker.log_params(fit_params(config.flat(), 85, 4, num_workers=2))
        on_epoch = epoch_callback(tracker, config)
        for record in history:
            on_epoch(record)
        log_fit_outputs(tracker, out)
    assert not tracker.failed
    err = capsys.readouterr().err
    assert err.count("deepdpm: warning: The fit ended with one cluster (K = 1)") == 1

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(tracker.run_id)
    assert run.data.params["num_workers"] == "2"
    assert run.data.metrics["final_nmi"] == 0.0
    assert run.data.metrics["fit_seconds"] == 3.5
    assert run.data.metrics["splits_accepted_total"] == run.data.metrics["merges_accepted_total"] == 0
    names = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert names == {
        "config.yaml", "summary.json", "k_over_epochs.png", "cluster_sizes.png",
        "moves.png", "losses.png", "model.pt", "warnings.txt",
    }  # fmt: skip
    text = Path(
        client.download_artifacts(tracker.run_id, "warnings.txt", str(tmp_path))
    ).read_text()
    assert len(text.strip().splitlines()) == 1  # the one warning the fit printed


def test_server_killed_mid_run(mlflow_server, mlflow_env, capsys):  # noqa: F811
    """The module's server (the last test of the module to use it) is killed mid-run."""
    server = mlflow_server
    client = MlflowClient(server.uri)
    history = _records(10)
    with RunTracker(server.uri, "killed", close_timeout=60) as tracker:
        for record in history[:4]:
            tracker.log_epoch(record)
        run_id = tracker.run_id
        _wait_for(lambda: len(client.get_metric_history(run_id, "n_clusters")) == 4)
        server.kill()
        for record in history[4:]:
            t0 = time.monotonic()
            tracker.log_epoch(record)
            assert time.monotonic() - t0 < 0.5
        start_close = time.monotonic()
    assert time.monotonic() - start_close < 45
    assert tracker.failed
    assert len(_warning_lines(capsys.readouterr().err)) == 1


def build_args(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    add_tracking_arguments(parser)
    return parser.parse_args(argv)
