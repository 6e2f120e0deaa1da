"""A tracked fit names its run and store in its result line, and a short fit is tracked
once its outputs are published, MLflow's start-up kept out of its epochs."""

from __future__ import annotations

import json
import re

import numpy as np
from mlflow import MlflowClient

from pipeline.cli import main


def test_the_result_line_names_the_run_made_after_the_outputs(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DEEPDPM_TRACK_LIVE_AFTER_S", raising=False)
    X = np.random.default_rng(0).normal(size=(300, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", X)
    store = f"sqlite:///{tmp_path / 'runs.db'}"
    assert main(["fit", "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "out"),
                 "--quiet", "--tracking-uri", store, "--set", "schedule.max_epochs=3"]) == 0
    line = capsys.readouterr().out.strip()
    found = re.search(r" -> \S+ \[MLflow run ([0-9a-f]{32}) in (\S+)\]$", line)
    assert found and found.group(2) == store, line
    run = MlflowClient(store).get_run(found.group(1))
    assert run.info.status == "FINISHED"
    # the run was made once the fit's outputs were written
    written_ms = (tmp_path / "out" / "summary.json").stat().st_mtime * 1000
    assert run.info.start_time >= written_ms - 1, (run.info.start_time, written_ms)
    assert len(run.data.metrics) > 0  # the epochs were logged all the same
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    history = MlflowClient(store).get_metric_history(found.group(1), "n_clusters")
    assert len(history) == summary["epochs"]
