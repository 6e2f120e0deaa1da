"""A fit from a table says which columns it used as features, label and key, and warns
of a feature column that looks like a class code."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.datasets import load_iris, load_wine

from deepdpm_core import DeepDPM
from pipeline.cli import main

SHORT = ["--no-tracking", "--quiet", "--seed", "0", "--set", "schedule.max_epochs=3"]


@pytest.fixture(scope="module")
def iris(tmp_path_factory):
    """Iris as scikit-learn's ``as_frame`` gives it: its classes in the column ``target``."""
    path = tmp_path_factory.mktemp("iris") / "iris.csv"
    frame = load_iris(as_frame=True).frame
    frame.assign(key=[f"flower{i}" for i in range(len(frame))]).to_csv(path, index=False)
    return path


def test_the_result_line_and_summary_name_the_columns_used(iris, tmp_path, capsys):
    assert main(["fit", "--input", str(iris), "--output", str(tmp_path / "a"), *SHORT,
                 "--label", "target"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("features=4 (sepal length (cm) … petal width (cm)) label=target "
                                f"key=key -> {tmp_path / 'a'}"), out
    assert "warning" not in err
    used = json.loads((tmp_path / "a" / "summary.json").read_text())["columns_used"]
    assert used == {"features": ["sepal length (cm)", "sepal width (cm)", "petal length (cm)",
                                 "petal width (cm)"], "label": "target", "key": "key"}


def test_a_class_code_among_the_features_is_warned_of_in_one_line(iris, tmp_path, capsys):
    assert main(["fit", "--input", str(iris), "--output", str(tmp_path / "a"), *SHORT]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "deepdpm fit: warning: column 'target' looks like a class code but is clustered as a "
        "feature: name the label column with --label target, or the features with --features"]
    assert "features=5 (sepal length (cm) … target) label=none key=key" in out
    used = json.loads((tmp_path / "a" / "summary.json").read_text())["columns_used"]
    assert used["features"][-1] == "target" and used["label"] is None
    # --features is the user's own choice: no warning
    assert main(["fit", "--input", str(iris), "--output", str(tmp_path / "b"), *SHORT,
                 "--features", "0,1,2,3,4"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_class_codes_by_name_or_by_a_few_whole_numbers():
    from deepdpm_core.class_codes import class_code_columns

    wine = load_wine(as_frame=True).frame.rename(columns={"target": "cultivar"})
    # three whole numbers beside measurements; proline and magnesium are whole but many
    assert class_code_columns(wine.to_numpy(), list(wine)) == ["cultivar"]
    iris = load_iris(as_frame=True).frame
    assert class_code_columns(iris.to_numpy(), [*iris.columns[:-1], "Class"]) == ["Class"]
    # whole numbers everywhere (pixels): none is told apart by its values
    grid = np.random.default_rng(0).integers(0, 5, size=(100, 4)).astype(float)
    assert class_code_columns(grid, ["a", "b", "c", "d"]) == []


def test_the_estimator_warns_of_a_class_code_in_a_dataframe():
    frame = load_iris(as_frame=True).frame
    with pytest.warns(UserWarning, match=r"column\(s\) 'target' of X look like class codes"):
        DeepDPM(random_state=0, schedule__max_epochs=2).fit(frame)
