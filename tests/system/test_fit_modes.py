"""The three fit modes (local, Ray, alternating) give the same outputs and MLflow metrics.

One small labelled data set, one config; each mode runs through the real CLI with a real
MLflow tracking store (sqlite in a temporary folder). The Ray fit runs one worker on a
real local Ray cluster shared by the module (``tests/support/ray_cluster.py``): with one worker
its search sees exactly the local fit's rows, so the two give the same labels and the
same per-epoch metrics. The alternating fit learns its own features, so it is checked
for the same outputs and metric keys, and for per-epoch label scores.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
from pathlib import Path

# Ray reads its auth mode when it is first imported: token auth with a token of this
# session, as in tests/system/test_ray_fit.py
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import json  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pipeline.cli import build_parser  # noqa: E402
from pipeline.cli import main as cli  # noqa: E402
from pipeline.commands.fit import request_from_args  # noqa: E402
from pipeline.fit import run_fit  # noqa: E402
from pipeline.fit.outputs import ALTERNATING_FILES, FIT_FILES  # noqa: E402
from pipeline.io.table_writing import features_table  # noqa: E402
from tests.support.fault_hooks import FailOnce  # noqa: E402
from tests.support.ray_cluster import local_ray  # noqa: E402

ray = pytest.importorskip("ray")
mlflow = pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = "fit-modes"
SETTINGS = [
    "--config", str(REPO / "cluster_configs" / "local.yaml"), "--seed", "0",
    "--set", "init.n_clusters=2", "--set", "schedule.warmup_epochs=3",
    "--set", "schedule.move_every=3", "--set", "schedule.max_epochs=15", "--quiet",
]  # fmt: skip
#: one AE pretraining of 2 epochs and one alternation of 1 epoch, into a 2-D embedding
ALTERNATING = [
    "--alternate", "1", "--set", "ae.latent_dim=2", "--set", "ae.hidden=[16]",
    "--set", "ae.pretrain_epochs=2", "--set", "ae.epochs=1",
    "--set", "ae.stop_when_k_stable=false",
]  # fmt: skip
#: metrics that measure time, not the fit
TIMINGS = ("seconds", "epoch_seconds", "fit_seconds", "ae_seconds", "cluster_seconds")


@pytest.fixture(scope="module")
def ray_session():
    with local_ray():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A sqlite tracking store whose experiment keeps its artifacts in the temp folder
    (not in the working directory of whichever process creates it first)."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.MlflowClient(uri).create_experiment(EXPERIMENT,
                                               artifact_location=(root / "artifacts").as_uri())
    return uri


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """3 labelled Gaussian blobs in 4-D, 300 rows, as Parquet in 2 row groups."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 4)) * 8
    y = np.repeat(np.arange(3), 100)
    X = (centres[y] + rng.normal(size=(300, 4))).astype(np.float32)
    order = rng.permutation(300)
    path = tmp_path_factory.mktemp("data") / "blobs.parquet"
    pq.write_table(features_table(X[order], np.arange(300), y[order]), path, row_group_size=150)
    return path


@contextlib.contextmanager
def _one_thread():
    """One torch thread, as a Ray worker has (its OMP_NUM_THREADS is its one CPU): the
    same float sums in the same order, so the local and the Ray fit agree bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fit(data: Path, out: Path, store: str, *extra: str) -> None:
    with _one_thread():
        code = cli(["fit", "--input", str(data), "--output", str(out), *SETTINGS,
                    "--tracking-uri", store, "--experiment", EXPERIMENT, "--run-name", out.name,
                    *extra])
    assert code == 0


@pytest.fixture(scope="module")
def runs(ray_session, data, store, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fits")
    folders = {mode: root / mode for mode in ("local", "ray", "alternating")}
    _fit(data, folders["local"], store)
    _fit(data, folders["ray"], store, "--num-workers", "1", "--ray-address", "auto")
    _fit(data, folders["alternating"], store, *ALTERNATING)
    return folders


def _runs_named(store: str, prefix: str) -> list:
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return [r for r in client.search_runs([experiment.experiment_id])
            if r.info.run_name.split("/")[0] == prefix]


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(TIMINGS)}


def test_every_mode_writes_the_same_outputs(runs):
    local = _files(runs["local"])
    assert set(FIT_FILES) <= local and "scores.png" in local
    # a Ray fit also keeps its request and Ray Train's checkpoints, for --resume
    assert _files(runs["ray"]) == local | {"fit_request.json", "ray_train"}
    assert _files(runs["alternating"]) == local | set(ALTERNATING_FILES)
    keys = _summary(runs["local"]).keys()
    assert _summary(runs["ray"]).keys() == keys
    assert _summary(runs["alternating"]).keys() == keys | {"alternation", "stopped_because"}
    for mode in runs:
        summary = _summary(runs[mode])
        assert set(summary["metrics"]) == {"nmi", "ari", "acc"}, mode
        assert summary["median_feature_variance"] > 0, mode
        # per-epoch scores in every mode, on labelled input
        assert all({"nmi", "ari", "acc"} <= r.keys() for r in summary["history"]), mode


def test_local_and_ray_give_the_same_labels_and_history(runs):
    local, on_ray = _summary(runs["local"]), _summary(runs["ray"])
    assert local["n_clusters"] == on_ray["n_clusters"]
    assert on_ray["num_workers"] == 1 and local["num_workers"] == 1
    np.testing.assert_array_equal(pq.read_table(runs["local"] / "assignments.parquet")["cluster"],
                                  pq.read_table(runs["ray"] / "assignments.parquet")["cluster"])
    assert local["metrics"] == pytest.approx(on_ray["metrics"])
    assert local["median_feature_variance"] == pytest.approx(on_ray["median_feature_variance"])
    untimed = [[_untimed(r) for r in s["history"]] for s in (local, on_ray)]
    assert untimed[0] == untimed[1]


def test_local_and_ray_log_the_same_mlflow_metrics(runs, store):
    (local,) = _runs_named(store, "local")
    (on_ray,) = _runs_named(store, "ray")
    assert local.info.status == on_ray.info.status == "FINISHED"
    assert local.data.metrics.keys() == on_ray.data.metrics.keys()
    assert {"nmi", "ari", "acc", "n_clusters", "final_nmi", "fit_seconds"} <= local.data.metrics.keys()
    assert _untimed(local.data.metrics) == pytest.approx(_untimed(on_ray.data.metrics))
    client = mlflow.MlflowClient(store)
    for key in ("n_clusters", "nmi", "loss_subcluster"):
        histories = [[(m.step, m.value) for m in client.get_metric_history(r.info.run_id, key)]
                     for r in (local, on_ray)]
        assert histories[0] == histories[1], key
    assert (local.data.params.keys() == on_ray.data.params.keys())


def test_the_alternating_fit_logs_the_same_metrics_and_per_epoch_scores(runs, store):
    (local,) = _runs_named(store, "local")
    family = _runs_named(store, "alternating")
    (parent,) = [r for r in family if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in family if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in family)
    logged = set().union(*(r.data.metrics.keys() for r in family))
    assert local.data.metrics.keys() <= logged
    assert {"final_nmi", "fit_seconds", "final_n_clusters"} <= parent.data.metrics.keys()
    client = mlflow.MlflowClient(store)
    last = max(children, key=lambda r: int(r.data.tags["alternation"]))
    scores = client.get_metric_history(last.info.run_id, "nmi")
    assert len(scores) == _summary(runs["alternating"])["epochs"]  # one per epoch


def test_a_fault_hook_stops_a_local_fit_before_the_epoch(data, tmp_path):
    out = tmp_path / "run"
    args = build_parser().parse_args(["fit", "--input", str(data), "--output", str(out),
                                      *SETTINGS, "--no-tracking"])
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at epoch 4"):
        run_fit(request_from_args(args), fault=FailOnce(epochs=[4], rank=0, marker_dir=tmp_path))
    assert (tmp_path / ".injected_failure_epoch4_rank0").exists()
    assert not (out / "summary.json").exists()


def test_the_sqlite_store_holds_only_these_runs(runs, store):
    with sqlite3.connect(store.removeprefix("sqlite:///")) as con:
        names = sorted(n for (n,) in con.execute("select name from runs"))
    assert names == ["alternating", "alternating/alternation-0", "alternating/alternation-1",
                     "local", "ray"]
