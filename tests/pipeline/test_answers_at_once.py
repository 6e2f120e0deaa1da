"""Every command answers a mistake in its arguments, paths or column widths before torch
loads, and a predict loads only what predicting needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipeline.cli import main

#: the command's own seconds (the interpreter's start aside), with headroom for a loaded
#: machine: about 0.2 s idle for a path, 0.5 s for a table read with the config checked
AT_ONCE_S = 1.5


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def _timed(argv: list[str], absent: tuple[str, ...] = ("torch",)) -> tuple[subprocess.CompletedProcess, float]:
    """``deepdpm ARGV`` in a fresh interpreter; fails if one of ``absent`` was imported."""
    done = _run("import sys, time; t = time.perf_counter(); from pipeline.cli import main; "
                f"rc = main({argv!r}); seconds = time.perf_counter() - t; "
                f"loaded = [m for m in {absent!r} if m in sys.modules]; "
                "print(f'{seconds} {loaded}'); sys.exit(rc)")
    seconds, loaded = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert loaded == "[]", (argv, loaded)
    return done, float(seconds)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A table of 1,000 rows with a label, its features as .npy, and a short fit of them."""
    root = tmp_path_factory.mktemp("at_once")
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(size=(500, 4)), rng.normal(size=(500, 4)) + 6])
    frame = pd.DataFrame(X, columns=[f"f{j}" for j in range(4)]).assign(label=[0, 1] * 500)
    frame.to_csv(root / "rows.csv", index=False)
    frame.assign(extra=1.0).to_csv(root / "wide.csv", index=False)
    np.save(root / "x.npy", X.astype(np.float32))
    assert main(["fit", "--input", str(root / "x.npy"), "--output", str(root / "fit"),
                 "--no-tracking", "--quiet", "--set", "schedule.max_epochs=2"]) == 0
    (root / "notes.txt").write_text("mine\n")
    return root


def test_import_deepdpm_core_loads_neither_torch_nor_its_config():
    done = _run("import sys, deepdpm_core; "
                "print([m for m in ('torch', 'pydantic', 'sklearn') if m in sys.modules])")
    assert done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("argv, message", [
    (["predict", "--model", "{root}/fit", "--input", "{root}/wide.csv", "--output", "{root}/p.parquet"],
     "{root}/wide.csv has 5 feature columns but the model takes 4: name a label column with "
     "--label NAME"),
    (["predict", "--model", "{root}", "--input", "{root}/rows.csv", "--output", "{root}/p.parquet"],
     "--model {root} is a folder without a model.pt"),
    (["predict", "--model", "{root}/fit/model.pt", "--input", "{root}/rows.csv", "--output",
      "{root}/notes.txt"], "--output {root}/notes.txt already exists"),
    (["fit", "--input", "{root}/rows.csv", "--output", "{root}/o", "--label", "nope"],
     "{root}/rows.csv: no column 'nope' for --label"),
    (["fit", "--input", "{root}/rows.csv", "--output", "{root}/o", "--set", "prior.alpah=1"],
     "unknown config key 'prior.alpah'"),
    (["embed", "--input", "{root}/nope.npy", "--output", "{root}/e.parquet", "--method", "pca"],
     "input not found: {root}/nope.npy"),
    (["embed", "--input", "{root}/rows.csv", "--output", "{root}/e.parquet", "--method", "pca",
      "--key", "nope"], "{root}/rows.csv: no column 'nope' for --key"),
    (["report", "{root}/fit", "--output", "{root}/notes.txt"],
     "--output {root}/notes.txt already exists"),
    (["report", "{root}/fit", "--max-clusters", "0"], "--max-clusters and --per-cluster must be >= 1"),
    (["fit", "--input", "{root}/x.npy", "--output", "{root}/o", "--set", "init.n_clusters=2000"],
     "{root}/x.npy has 1000 rows, fewer than the 2000 needed (initial clusters)"),
])
def test_errors_are_answered_before_torch_in_one_line(files, argv, message):
    argv = [a.format(root=files) for a in argv]
    done, seconds = _timed(argv)
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(f"deepdpm {argv[0]}: error: {message.format(root=files)}"), error
    assert seconds < AT_ONCE_S, seconds


def test_a_predict_loads_neither_scikit_learn_nor_the_moves(files, tmp_path):
    done, seconds = _timed(["predict", "--model", str(files / "fit"), "--input",
                            str(files / "x.npy"), "--output", str(tmp_path / "p.parquet")],
                           absent=("sklearn", "faiss", "scipy.optimize"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("assigned 1000 rows"), done.stdout
