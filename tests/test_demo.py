"""``deepdpm demo`` (README's first command) end to end, image stages skipped."""

import json
import re

import pytest

from pipeline.cli import main


@pytest.mark.slow
def test_demo_clusters_the_digits_with_the_n2d_recipe(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--no-ray", "--output", str(out)]) == 0
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


def test_demo_with_a_missing_config_fails_before_any_work(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--no-ray", "--output", str(out), "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    assert not out.exists()
