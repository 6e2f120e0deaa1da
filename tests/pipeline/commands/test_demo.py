"""``deepdpm demo`` (README's first command) end to end, image stages skipped."""

import json
import os
import re
import stat

import pytest
import yaml

from pipeline.cli import main
from pipeline.commands.demo import N2D_RECIPE, DemoStages


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
    found = re.search(rf"MLflow:  run ([0-9a-f]{{32}}) in {re.escape(uri)} \(to browse: mlflow ui "
                      rf"--backend-store-uri {re.escape(uri)}, then (\S+)\)", printed)
    assert found, printed
    # the run's page, opened on the UI's model-training view rather than its GenAI default
    assert re.fullmatch(rf"http://127\.0\.0\.1:5000/#/experiments/\d+/runs/{found[1]}"
                        r"\?workflowType=machine_learning", found[2]), found[2]
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


@pytest.mark.slow
def test_a_second_demo_in_the_same_folder_reuses_the_embedding_and_overwrite_redoes_it(
        tmp_path, capsys):
    recipe = yaml.safe_load(N2D_RECIPE.read_text())
    recipe.setdefault("schedule", {})["max_epochs"] = 3  # the fit is not what is tested
    config = tmp_path / "short.yaml"
    config.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "demo"
    argv = ["demo", "--no-ray", "--no-tracking", "--json", "--output", str(out), "--config", str(config)]

    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["reused"] == []
    embedded = (out / "embedding.parquet").stat().st_mtime_ns

    assert main(argv) == 0
    captured = capsys.readouterr()
    second = json.loads(captured.out)
    assert second["reused"] == ["embedding"]
    assert f"reused the embedding of an earlier demo in {out} (--overwrite redoes them)" in captured.err
    assert (out / "embedding.parquet").stat().st_mtime_ns == embedded
    assert (second["n_clusters"], second["metrics"]) == (first["n_clusters"], first["metrics"])

    assert main([*argv, "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["reused"] == []
    assert (out / "embedding.parquet").stat().st_mtime_ns > embedded


def test_a_stage_is_reused_only_where_it_finished_with_the_same_key(tmp_path):
    output = tmp_path / "shards"
    output.mkdir()
    stages = DemoStages(tmp_path, fresh=False)
    assert not stages.reusable("shards", {"size": 500}, output)
    stages.finished("shards", {"size": 500})
    assert DemoStages(tmp_path, fresh=False).reusable("shards", {"size": 500}, output)
    assert not DemoStages(tmp_path, fresh=False).reusable("shards", {"size": 100}, output)
    # redone with the other key but killed before it finished: not reusable with either key
    assert not DemoStages(tmp_path, fresh=False).reusable("shards", {"size": 500}, output)
    stages = DemoStages(tmp_path, fresh=False)
    stages.finished("shards", {"size": 500})
    assert not DemoStages(tmp_path, fresh=True).reusable("shards", {"size": 500}, output)
    output.rmdir()  # finished once, but its output is gone
    assert not DemoStages(tmp_path, fresh=False).reusable("shards", {"size": 500}, output)
