"""A model fitted on a table knows its columns by name: ``deepdpm predict`` and
``DeepDPM.predict`` match another table's columns to them, in any order, and refuse
missing or extra ones in one line, before torch loads."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from sklearn.datasets import load_digits

from deepdpm_core import DataError, DeepDPM
from pipeline.cli import main

#: a short fit: the columns are what is tested, not the clusters
SHORT = {"schedule__max_epochs": 4}
ROWS = 400


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, pd.DataFrame]:
    """Digit rows as a CSV with a label column ``digit``, and a fit of it by the CLI."""
    root = tmp_path_factory.mktemp("digits")
    frame = load_digits(as_frame=True).frame.iloc[:ROWS].rename(columns={"target": "digit"})
    frame.to_csv(root / "digits.csv", index=False)
    assert main(["fit", "--input", str(root / "digits.csv"), "--output", str(root / "fit"),
                 "--label", "digit", "--no-tracking", "--quiet", "--seed", "0",
                 "--set", "schedule.max_epochs=4"]) == 0
    return root, frame


def _clusters(path: Path) -> np.ndarray:
    return pq.read_table(path)["cluster"].to_numpy()


def test_reversed_columns_give_the_same_clusters_from_the_cli_and_the_api(digits, tmp_path):
    root, frame = digits
    frame[frame.columns[::-1]].to_csv(tmp_path / "reversed.csv", index=False)
    for name, folder in (("digits.csv", root), ("reversed.csv", tmp_path)):
        assert main(["predict", "--model", str(root / "fit" / "model.pt"), "--input", str(folder / name),
                     "--output", str(tmp_path / f"{name}.parquet"), "--label", "digit"]) == 0
    np.testing.assert_array_equal(_clusters(tmp_path / "reversed.csv.parquet"),
                                  _clusters(tmp_path / "digits.csv.parquet"))
    features = frame.drop(columns="digit")
    assert json.loads((root / "fit" / "summary.json").read_text())["feature_names"] == list(features)

    model = DeepDPM(random_state=0, **SHORT).fit(features)
    np.testing.assert_array_equal(model.predict(features[features.columns[::-1]]), model.labels_)
    np.testing.assert_array_equal(model.feature_names_in_, features.columns)
    model.save(tmp_path / "model.pt")
    loaded = DeepDPM.load(tmp_path / "model.pt")
    np.testing.assert_array_equal(loaded.feature_names_in_, features.columns)
    np.testing.assert_array_equal(loaded.predict(features[features.columns[::-1]]), model.labels_)
    # the CLI's model reads its names back too
    cli_model = DeepDPM.load(root / "fit" / "model.pt")
    np.testing.assert_array_equal(cli_model.feature_names_in_, features.columns)


def test_the_api_follows_scikit_learns_feature_name_rules(digits):
    _, frame = digits
    features = frame.drop(columns="digit")
    named = DeepDPM(random_state=0, **SHORT).fit(features)
    with pytest.raises(DataError, match=r"unseen at fit time: 'digit'; seen at fit time, yet now "
                                        r"missing: 'pixel_0_0'"):
        named.predict(frame.drop(columns="pixel_0_0"))
    with pytest.warns(UserWarning, match="X does not have valid feature names, but DeepDPM was "
                                         "fitted with feature names"):
        named.predict(features.to_numpy())
    unnamed = DeepDPM(random_state=0, **SHORT).fit(features.to_numpy())
    assert not hasattr(unnamed, "feature_names_in_")
    with pytest.warns(UserWarning, match="X has feature names, but DeepDPM was fitted without "
                                         "feature names"):
        unnamed.predict(features)
    with warnings.catch_warnings():  # a fit predicts its own rows without a warning
        warnings.simplefilter("error")
        DeepDPM(random_state=0, **SHORT).fit(features)


def _predict_before_torch(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """``deepdpm predict ARGV`` in a fresh interpreter that asserts torch never loaded;
    returns it and the command's own seconds."""
    code = ("import sys, time; t = time.perf_counter(); from pipeline.cli import main; "
            f"rc = main(['predict', *{list(argv)!r}]); "
            "assert 'torch' not in sys.modules, 'torch loaded'; "
            "print(time.perf_counter() - t); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    last = done.stdout.strip().splitlines()[-1:] or ["nan"]
    return done, float(last[0]) if last[0].replace(".", "", 1).isdigit() else float("nan")


def test_missing_or_extra_columns_are_named_in_one_line_before_torch(digits, tmp_path):
    root, frame = digits
    frame.drop(columns="pixel_0_3").assign(notes=1.0).to_csv(tmp_path / "bad.csv", index=False)
    done, seconds = _predict_before_torch("--model", str(root / "fit" / "model.pt"), "--input",
                                          str(tmp_path / "bad.csv"), "--output",
                                          str(tmp_path / "p.parquet"), "--label", "digit")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"deepdpm predict: error: {tmp_path / 'bad.csv'} does not hold the 64 "
                           "feature columns the model was fitted on ('notes' is not among them; "
                           "'pixel_0_3' missing): name the label column with --label NAME, the "
                           "row ids with --key NAME, or the features with --features\n")
    assert seconds < 1.0, seconds
    assert not (tmp_path / "p.parquet").exists()


def test_a_wrong_width_is_answered_before_torch_and_names_label(digits, tmp_path):
    root, frame = digits
    np.save(tmp_path / "x.npy", frame.drop(columns="digit").to_numpy(np.float32))
    assert main(["fit", "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "fit"),
                 "--no-tracking", "--quiet", "--set", "schedule.max_epochs=2"]) == 0
    # a model without column names, a table with one column too many (its label)
    done, seconds = _predict_before_torch("--model", str(tmp_path / "fit" / "model.pt"),
                                          "--input", str(root / "digits.csv"), "--output",
                                          str(tmp_path / "p.parquet"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[-1] == (f"deepdpm predict: error: {root / 'digits.csv'} has 65 feature columns "
                         "but the model takes 64: name a label column with --label NAME, a "
                         "row-id column with --key NAME, or the features with --features")
    # the CLI's form of scikit-learn's warning, names on one side only
    assert lines[:-1] == ["deepdpm predict: warning: the model was fitted without column names, "
                          f"but {root / 'digits.csv'} has them: its columns are taken by position"]
    assert seconds < 1.0, seconds


def test_model_takes_a_fit_folder_and_names_a_folder_without_a_model(digits, tmp_path):
    root, _ = digits
    assert main(["predict", "--model", str(root / "fit"), "--input", str(root / "digits.csv"),
                 "--output", str(tmp_path / "p.parquet"), "--label", "digit"]) == 0
    done, seconds = _predict_before_torch("--model", str(tmp_path), "--input",
                                          str(root / "digits.csv"), "--output",
                                          str(tmp_path / "q.parquet"))
    assert (done.returncode, done.stderr) == (2, f"deepdpm predict: error: --model {tmp_path} "
                                                 "is a folder without a model.pt: name the "
                                                 "model.pt that deepdpm fit wrote, or its folder\n")
    assert seconds < 1.0, seconds
