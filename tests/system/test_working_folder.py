"""A tracked fit and its report leave the working folder as it was: the MLflow store is the
per-user one (its artifacts beside its database, not ``./mlruns``), the report goes beside
the fit, and a successful run prints no library INFO lines or error-level lines."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import make_blobs

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_fit_and_report_write_nothing_in_the_working_folder(tmp_path):
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    X, _ = make_blobs(n_samples=300, centers=3, n_features=2, random_state=0)
    np.savetxt(work / "points.csv", X, delimiter=",", header="x,y", comments="")
    env = {**os.environ, "XDG_DATA_HOME": str(data), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    before = sorted(p.name for p in work.iterdir())
    fit = _run(["fit", "--input", "points.csv", "--output", str(tmp_path / "fit"), "--quiet"],
               work, env)
    assert fit.returncode == 0, fit.stderr
    report = _run(["report", str(tmp_path / "fit")], work, env)
    assert report.returncode == 0, report.stderr
    assert sorted(p.name for p in work.iterdir()) == before  # no mlflow.db, mlruns/, report.html
    assert (tmp_path / "fit" / "report.html").is_file()
    store = data / "deepdpm"
    assert (store / "mlflow.db").is_file() and (store / "mlartifacts").is_dir()
    for line in (fit.stderr + report.stderr).splitlines():
        assert " INFO " not in line and " ERROR " not in line and "[E " not in line, line
