"""``deepdpm fit --num-workers 2``: Ray Train, DDP over gloo, checkpoints, crashes, resume.

One local Ray cluster for the module (``ray.init(address="local", num_cpus=2)``, token
auth with a token of its own). The data: an imbalanced 8-Gaussian mixture in 4-D
(cluster sizes 1 : 6) stored as Parquet in several row groups, so each worker reads only
the row groups of its slice.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
from pathlib import Path

# Ray reads its auth mode once, when it is first imported (and the driver's token when
# it first connects): set both before anything imports ray. Token auth with a token of
# this session, never the machine's ~/.ray/auth_token (which Ray 2.60 would pick up).
# Later Ray clusters of this pytest process (other modules') inherit the same settings.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402

from deepdpm_core import DeepDPM  # noqa: E402
from pipeline.cli import build_parser  # noqa: E402
from pipeline.cli import main as cli  # noqa: E402
from pipeline.commands.fit import request_from_args  # noqa: E402
from pipeline.fit import run_fit  # noqa: E402
from pipeline.fit.checkpoints import TRAIN_DIR  # noqa: E402
from pipeline.fit.request import FitRequest  # noqa: E402
from pipeline.io.table_writing import features_table  # noqa: E402
from tests.support.fault_hooks import FailOnce  # noqa: E402
from tests.support.ray_cluster import local_ray  # noqa: E402

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
TRUE_K = 8
CHECKPOINT_EVERY = 3
# local.yaml with a short move schedule
FIT_SETTINGS = [
    "--config", "cluster_configs/local.yaml", "--seed", "0",
    "--set", "init.n_clusters=3",
    "--set", "schedule.warmup_epochs=3", "--set", "schedule.move_every=3",
    "--set", "schedule.max_epochs=45", "--quiet",
]


def _mixture(path: Path, n: int = 2400, seed: int = 0) -> np.ndarray:
    """8 Gaussians (unit covariance) on corners of a 4-D cube of side 12, sizes 1 : 6."""
    rng = np.random.default_rng(seed)
    corners = np.array([[int(b) for b in f"{i:04b}"] for i in range(16)], float)
    centres = corners[rng.choice(16, TRUE_K, replace=False)] * 12.0
    weights = np.geomspace(1, 6, TRUE_K)
    sizes = rng.multinomial(n, weights / weights.sum())
    X = np.concatenate([c + rng.normal(size=(s, 4)) for c, s in zip(centres, sizes, strict=True)])
    y = np.repeat(np.arange(TRUE_K), sizes)
    order = rng.permutation(n)
    table = features_table(X[order].astype(np.float32), np.arange(n), y[order])
    pq.write_table(table, path, row_group_size=500)
    return y[order]


@pytest.fixture(scope="module")
def ray_session():
    with local_ray():
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "mixture.parquet"
    labels = _mixture(path)
    assert pq.ParquetFile(path).metadata.num_row_groups == 5
    return path, labels


def _fit(*args: str) -> int:
    cwd = os.getcwd()
    os.chdir(REPO)  # --config paths are relative to the repository
    try:
        return cli(["fit", *args])
    finally:
        os.chdir(cwd)


def _fit_with_fault(fault, *args: str):
    """``deepdpm fit ARGS`` with a test-only fault hook (the CLI takes none)."""
    cwd = os.getcwd()
    os.chdir(REPO)  # --config paths are relative to the repository
    try:
        return run_fit(request_from_args(build_parser().parse_args(["fit", *args])), fault=fault)
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def two_worker_run(ray_session, data, tmp_path_factory):
    """The uninterrupted W = 2 fit (tracked to an MLflow sqlite store)."""
    out = tmp_path_factory.mktemp("w2") / "run"
    db = out.parent / "mlflow.db"
    code = _fit("--input", str(data[0]), "--output", str(out), *FIT_SETTINGS,
                "--num-workers", "2", "--checkpoint-every", "10",
                "--tracking-uri", f"sqlite:///{db}", "--experiment", "dist-test")
    assert code == 0
    return out, db


def _history(run: Path) -> list[dict]:
    summary = json.loads((run / "summary.json").read_text())
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in summary["history"]]


def test_two_workers_find_the_true_k_as_one_process_does(two_worker_run, data, tmp_path):
    run, db = two_worker_run
    one = tmp_path / "w1"
    assert _fit("--input", str(data[0]), "--output", str(one), *FIT_SETTINGS, "--no-tracking") == 0
    s1 = json.loads((one / "summary.json").read_text())
    s2 = json.loads((run / "summary.json").read_text())
    # observed: K = 8 and NMI 1.000 for both (W=1 in 33 epochs, W=2 in 27)
    assert s1["n_clusters"] == s2["n_clusters"] == TRUE_K
    assert s1["metrics"]["nmi"] > 0.95 and s2["metrics"]["nmi"] > 0.95
    assert s2["num_workers"] == 2 and s2["resumed_from_epoch"] is None

    # the same outputs as a single-process fit, written once (by rank 0)
    assignments = pq.read_table(run / "assignments.parquet")
    assert assignments.column_names == ["key", "cluster", "confidence", "label"]
    assert assignments.num_rows == len(data[1])
    np.testing.assert_array_equal(assignments.column("label").to_numpy(), data[1])
    model = DeepDPM.load(run / "model.pt")
    assert model.n_clusters_ == TRUE_K
    np.testing.assert_array_equal(model.predict(pq.read_table(data[0]).column("embedding")
                                                .combine_chunks().flatten().to_numpy().reshape(-1, 4)),
                                  assignments.column("cluster").to_numpy())
    # a checkpoint every 10 epochs and the final one (the last 2 kept), in Ray Train's storage
    checkpoints = sorted(p for p in (run / TRAIN_DIR).glob("checkpoint_*") if p.is_dir())
    assert len(checkpoints) == 2 and all((c / "model.pt").exists() for c in checkpoints)

    # one MLflow run (rank 0 only) with one K value per epoch
    with sqlite3.connect(db) as con:
        runs = con.execute("select run_uuid, status from runs").fetchall()
        assert len(runs) == 1 and runs[0][1] == "FINISHED"
        steps = con.execute("select step from metrics where key = 'n_clusters'").fetchall()
        workers = con.execute("select value from params where key = 'num_workers'").fetchall()
    assert sorted(s for (s,) in steps) == list(range(1, s2["epochs"] + 1))
    assert workers == [("2",)]


def test_crashes_resume_from_the_last_checkpoint(two_worker_run, data, tmp_path, capsys):
    reference = _history(two_worker_run[0])
    assert len(reference) > 11, "the reference fit must outlast the injected crashes"
    out = tmp_path / "crashy"
    # rank 1 raises before epochs 5 and 11. FailureConfig(max_failures=1): the first crash
    # restarts both workers from the epoch-3 checkpoint, the second stops the run
    fault = FailOnce(epochs=(5, 11), rank=1, marker_dir=out / TRAIN_DIR)
    with pytest.raises(ray.train.TrainingFailedError, match="injected failure on rank 1 at epoch 11"):
        _fit_with_fault(fault, "--input", str(data[0]), "--output", str(out), *FIT_SETTINGS,
                        "--num-workers", "2", "--checkpoint-every", str(CHECKPOINT_EVERY),
                        "--max-failures", "1", "--no-tracking")
    # the crash Ray Train recovered from shows on stderr too (the worker's traceback)
    assert "RuntimeError: injected failure on rank 1 at epoch 5" in capsys.readouterr().err
    markers = sorted(p.name for p in (out / TRAIN_DIR).glob(".injected_failure_*"))
    assert markers == [".injected_failure_epoch11_rank1", ".injected_failure_epoch5_rank1"]
    assert not (out / "summary.json").exists()

    # the stopped run continues from its epoch-9 checkpoint (crash markers stay, so the
    # injected crashes do not fire again) and ends exactly as the uninterrupted one
    assert _fit("--resume", str(out), "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_epoch"] == 9
    assert summary["n_clusters"] == TRUE_K
    assert _history(out) == reference


def test_bad_requests_fail_before_anything_starts(ray_session, data, two_worker_run, tmp_path, capsys):
    base = ["--input", str(data[0]), "--output", str(tmp_path / "x"), "--no-tracking",
            "--wait-for-workers", "0"]
    assert _fit(*base, "--num-workers", "3") == 2
    assert "--num-workers 3 needs 3 CPUs, but the Ray cluster has 2 CPUs" in capsys.readouterr().err
    assert _fit(*base, "--num-workers", "2", "--use-gpu") == 2
    assert "needs 2 CPUs and 2 GPUs, but the Ray cluster has 2 CPUs and 0 GPUs" in capsys.readouterr().err
    # a fresh fit into a directory with checkpoints would silently resume them
    assert _fit(*base[:2], "--output", str(two_worker_run[0]), "--num-workers", "2") == 2
    assert "holds checkpoints of an earlier fit: continue it with --resume" in capsys.readouterr().err
    assert _fit("--resume", str(tmp_path)) == 2
    assert "is not the output directory of a fit with checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bad_rows_stop_every_worker_without_retries(ray_session, tmp_path):
    X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    X[33, 1] = np.nan  # in rank 1's slice
    np.save(tmp_path / "bad.npy", X)
    request = FitRequest(input=str(tmp_path / "bad.npy"), output=str(tmp_path / "out"),
                         config={"device": "cpu"}, mode="ray", num_workers=2, tracking=False, quiet=True)
    with pytest.raises(Exception, match=r"rows with NaN or inf values \(rows 33\)") as info:
        run_fit(request)
    assert type(info.value).__name__ == "DataError"
    assert not list((tmp_path / "out" / TRAIN_DIR).glob("checkpoint_2*"))
