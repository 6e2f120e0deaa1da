"""bench/k_suite.py: its data sets are what it says, and a small run reports every row.

The suite runs as a user runs it (a subprocess from the repository root) on two small
data sets; DeepDPM's K is not checked (its defaults are the suite's subject), the peers'
results on easy data are.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_suite():
    spec = importlib.util.spec_from_file_location("k_suite", ROOT / "bench" / "k_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


suite = _load_suite()


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "bench/k_suite.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_suite_names_every_data_set_at_three_scales():
    names = list(suite.DATASETS)
    assert names[:6] == ["digits-pca10", "digits-umap10", "digits-aeumap10", "wine-std",
                         "breast-cancer-std", "iris-std"]
    for base in ("blobs16", "imbalanced128", "sphere128", "blobs512"):
        assert {base, f"{base}@1e-3", f"{base}@1e3"} <= set(names)
    assert names[6:9] == ["wine-raw", "breast-cancer-raw", "digits-raw"]
    assert names[-6:] == list(suite.HARD) == [
        "blobs2d-dense", "blobs2d-overlap", "blobs2d-unequal", "blobs2d-100", "table-degenerate",
        "table-mixed-units"]
    assert len(names) == 27
    assert suite.select(suite.DATASETS, ["blobs16*", "iris-std"]) == [
        "iris-std", "blobs16", "blobs16@1e-3", "blobs16@1e3"]
    with pytest.raises(SystemExit, match="no data set matches nope"):
        suite.select(suite.DATASETS, ["nope"])


@pytest.mark.parametrize("base", ["blobs16", "imbalanced128", "sphere128", "blobs512"])
def test_rescaled_variants_are_exactly_the_base_data_times_the_factor(base):
    builders = suite.make_datasets(quick=True)
    X, y, _ = builders[base](1)
    for label, factor in (("1e-3", 1e-3), ("1e3", 1e3)):
        Xs, ys, description = builders[f"{base}@{label}"](1)
        assert Xs.dtype == X.dtype and label in description
        np.testing.assert_array_equal(Xs, (X * factor).astype(X.dtype))
        np.testing.assert_array_equal(ys, y)
    assert not np.array_equal(builders[base](2)[0], X)  # the seed draws another data set


def test_generated_sets_have_the_stated_shape_and_geometry():
    X, y, _ = suite.DATASETS["blobs16"](0)
    assert X.shape == (3160, 16) and sorted(np.bincount(y)) == list(suite.BLOB_SIZES)
    centres = np.stack([X[y == k].mean(0) for k in range(7)])
    gaps = np.linalg.norm(centres[:, None] - centres[None], axis=-1)[np.triu_indices(7, 1)]
    assert gaps.min() > 29.0 and 0.95 < (X - centres[y]).std() < 1.05
    X, y, _ = suite.make_datasets(quick=True)["sphere128"](0)
    assert X.shape == (1500, 128) and len(np.unique(y)) == 10
    np.testing.assert_allclose(np.linalg.norm(X, axis=1), 1.0, rtol=1e-5)
    X, y, _ = suite.make_datasets(quick=True)["imbalanced128"](0)
    assert X.shape == (4000, 128) and np.bincount(y).min() / len(y) < 0.01
    X, y, _ = suite.make_datasets(quick=True)["blobs512"](0)
    assert X.shape == (1000, 512) and len(np.unique(y)) == 5


def test_the_hard_sets_have_their_stated_defects():
    quick = suite.make_datasets(quick=True)
    X, y, _ = quick["blobs2d-dense"](0)
    assert X.shape == (600, 2) and list(np.bincount(y)) == [40] * 15
    centres = np.stack([X[y == k].mean(0) for k in range(15)])
    radius = np.linalg.norm(centres, axis=1)
    assert (radius < 3.3).sum() == 8 and (radius > 9.5).sum() == 7  # a dense centre, a ring
    gaps = np.linalg.norm(centres[:, None] - centres[None], axis=-1)[np.triu_indices(15, 1)]
    assert gaps.min() > 1.5 and 0.27 < (X - centres[y]).std() < 0.33  # >= 5 std apart
    assert not np.array_equal(quick["blobs2d-dense"](1)[0], X)  # the seed draws another set

    X, y, _ = quick["table-degenerate"](0)
    assert X.shape == (2000, 13) and len(np.unique(y)) == 5 and np.bincount(y).min() == 3
    assert (X.std(axis=0) == 0).sum() == 1  # one constant feature
    assert set(np.unique(X[:, 11])) == {0.0, 1.0} and np.abs(X[:, 12] - np.round(X[:, 12])).max() < 0.1
    assert len(np.unique(X, axis=0)) == 1800  # 10 % duplicate rows

    X, y, _ = quick["table-mixed-units"](0)
    spread = X.std(axis=0)
    assert X.shape == (1000, 13) and spread.max() / spread.min() > 1000
    assert quick["blobs2d-100"](0)[0].shape == (20_000, 2)
    assert quick["blobs2d-overlap"](0)[0].shape == (2000, 2)
    X, y, _ = suite.DATASETS["wine-raw"](0)
    assert X.shape == (178, 13) and X.max() > 1000  # proline, unscaled


def test_a_quick_run_reports_every_data_set_method_and_seed(tmp_path):
    out = tmp_path / "new" / "k.json"
    done = _run("--datasets", "iris-std", "blobs16", "--seeds", "0", "--quick",
                "--set", "schedule.max_epochs=10", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 2 * 3  # header, then 3 methods per data set
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["iris-std"] * 3 + ["blobs16"] * 3
    assert [r.split("|")[5].strip() for r in rows[1:4]] == list(suite.METHODS)
    assert "targets hold on" in done.stdout and "schedule.max_epochs=10" in done.stdout
    assert "blobs16 seed 0" in done.stderr  # progress goes to stderr

    report = json.loads(out.read_text())
    assert report["overrides"] == {"schedule.max_epochs": 10} and report["quick"] is True
    assert "--quick" in report["command"]
    assert [d["name"] for d in report["datasets"]] == ["iris-std", "blobs16"]
    records = report["records"]
    assert sorted((r["dataset"], r["method"], r["seed"]) for r in records) == sorted(
        (d, m, 0) for d in ("iris-std", "blobs16") for m in suite.METHODS)
    for r in records:
        assert {"n", "d", "true_k", "k", "nmi", "ari", "seconds"} <= set(r)
        assert 0.0 <= r["nmi"] <= 1.0 and -1.0 <= r["ari"] <= 1.0 and r["seconds"] > 0
        assert r["k"] >= 1
    by = {(r["dataset"], r["method"]): r for r in records}
    assert by["iris-std", "k-means (true K)"]["nmi"] > 0.6  # 0.66 on standardised iris
    assert by["blobs16", "k-means (true K)"]["nmi"] > 0.99
    assert by["blobs16", "k-means (true K)"]["k"] == by["blobs16", "BGM-DP"]["true_k"] == 7
    assert (by["blobs16", "BGM-DP"]["n"], by["blobs16", "BGM-DP"]["d"]) == (560, 16)
    assert 1 <= by["iris-std", "BGM-DP"]["k"] <= 20


def test_an_unknown_override_fails_before_any_fit(capsys):
    with pytest.raises(SystemExit) as stop:
        suite.main(["--datasets", "iris-std", "--seeds", "0", "--set", "prior.nonexistent=1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--set" in err and "nonexistent" in err
    assert "iris-std seed 0" not in err


def test_sigterm_stops_the_run_and_still_reports_the_data_sets_done(tmp_path):
    out = tmp_path / "k.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "bench/k_suite.py", "--datasets", "iris-std", "blobs16", "--seeds", "0",
         "--quick", "--set", "schedule.max_epochs=10", "--json", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("blobs16 seed 0"):  # iris-std is done and written
            proc.send_signal(signal.SIGTERM)
            break
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "| iris-std |" in stdout and "| blobs16 |" not in stdout
    assert "STOPPED EARLY: 1 of 2 data sets done; not finished: blobs16" in stdout
    report = json.loads(out.read_text())
    assert report["complete"] is False and [d["name"] for d in report["datasets"]] == ["iris-std"]
