"""``deepdpm demo`` (README's first command) end to end, image stages skipped."""

import json
import os
import re
import stat

import pytest

from pipeline.cli import main


@pytest.mark.slow
def test_demo_clusters_the_digits_with_the_n2d_recipe(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory
    old = os.umask(0o027)  # every output honours the umask
    try:
        assert main(["demo", "--no-ray", "--output", str(out)]) == 0
    finally:
        os.umask(old)
    printed = capsys.readouterr().out
    found = re.search(r"K found = (\d+) \(true K = 10\), NMI=([\d.]+)", printed)
    assert found, printed
    k, nmi = int(found[1]), float(found[2])
    assert 8 <= k <= 12 and nmi >= 0.85, printed  # measured: K 11, NMI 0.902
    summary = json.loads((out / "fit" / "summary.json").read_text())
    assert summary["n_clusters"] == k
    assert summary["config"]["prior"]["sigma_scale"] == 0.05  # the recipe, not the defaults
    for name in ("assignments.parquet", "model.pt", "k_over_epochs.png"):
        assert (out / "fit" / name).stat().st_size > 0
    assert (out / "embedding.parquet").exists()

    # the report and the MLflow run, and where they are, on stdout
    report = out / "report.html"
    assert f"report:  {report}" in printed
    assert f"DeepDPM report: K = {k}" in report.read_text()
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    found = re.search(rf"MLflow:  run ([0-9a-f]{{32}}) in {re.escape(uri)}", printed)
    assert found, printed
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(found[1])
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"
    assert run.data.metrics["final_n_clusters"] == k
    assert run.data.metrics["final_nmi"] == pytest.approx(summary["metrics"]["nmi"])
    assert len(client.get_metric_history(run.info.run_id, "n_clusters")) == summary["epochs"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.html", "model.pt", "summary.json", "k_over_epochs.png"} <= artifacts
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no ./mlruns, no ./mlflow.db
    modes = {str(p): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o640}, modes


def test_demo_with_a_missing_config_fails_before_any_work(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--no-ray", "--output", str(out), "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    assert not out.exists()
