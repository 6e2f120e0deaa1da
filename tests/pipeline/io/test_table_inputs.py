"""Tables in: a CSV with a header, a headerless CSV, a wide Parquet from pandas, an Arrow
file and a folder of tables are read as the ``.npy`` of the same rows, and fitted from the
CLI and the API to the same clusters; a table that cannot be read says why in one line.
"""

import json
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from sklearn.datasets import make_blobs

from deepdpm_core import DeepDPM
from deepdpm_core.errors import DataError
from pipeline.cli import main
from pipeline.io.columns import TableColumns
from pipeline.io.parquet_batches import feature_batches
from pipeline.io.row_checks import check_fit_rows
from pipeline.io.tables import read_features

N, D = 240, 3
SPECIES = np.array(["ash", "birch", "cedar", "fir"])


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """The same rows as .npy and as every table layout, with the flags that read them."""
    root = tmp_path_factory.mktemp("tables")
    X, y = make_blobs(n_samples=N, centers=4, n_features=D, random_state=3)
    X = np.round(X, 3).astype(np.float32)  # exact in text
    np.save(root / "x.npy", X)
    frame = pd.DataFrame(X, columns=[f"f{j}" for j in range(D)])
    named = frame.assign(species=SPECIES[y], tree_id=[f"t{i}" for i in range(N)])
    named.to_csv(root / "header.csv", index=False)
    np.savetxt(root / "plain.csv", np.column_stack([X, y]), delimiter=",", fmt="%.3f")
    frame.assign(label=y).to_parquet(root / "wide.parquet")
    feather.write_feather(pa.Table.from_pandas(named), str(root / "wide.arrow"))
    (root / "folder").mkdir()
    named.iloc[:100].to_csv(root / "folder" / "a.csv", index=False)
    named.iloc[100:].to_csv(root / "folder" / "b.csv", index=False)
    inputs = {
        "header.csv": ["--label", "species", "--key", "tree_id"],
        "plain.csv": ["--label", "-1"],
        "wide.parquet": [],
        "wide.arrow": ["--label", "species", "--key", "tree_id"],
        "folder": ["--label", "species", "--key", "tree_id"],
    }
    return root, X, y, inputs


def _columns(flags: list[str]) -> TableColumns:
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    return TableColumns(label=pairs.get("--label"), key=pairs.get("--key"))


def test_every_layout_reads_as_the_npy(tables):
    root, X, y, inputs = tables
    for name, flags in inputs.items():
        table = read_features(root / name, _columns(flags))
        np.testing.assert_array_equal(table.X, X, err_msg=name)
        # the label column is not a feature, and labels are numbered as the classes are
        assert table.X.shape == (N, D) and table.labels is not None, name
        assert len(np.unique(table.labels)) == 4
        np.testing.assert_array_equal(np.unique(table.labels, return_inverse=True)[1],
                                      np.unique(y, return_inverse=True)[1], err_msg=name)
    assert read_features(root / "header.csv", _columns(inputs["header.csv"])).keys[0] == "t0"
    assert read_features(root / "folder", _columns(inputs["folder"])).label_names == list(SPECIES)
    # streamed in batches as read whole
    streamed = np.concatenate([b.X for b in feature_batches(root / "wide.parquet", 50)])
    np.testing.assert_array_equal(streamed, X)


def test_api_and_cli_give_the_npy_clusters(tables, tmp_path):
    root, X, _, inputs = tables
    reference = DeepDPM(random_state=0).fit(np.load(root / "x.npy")).labels_
    assert main(["fit", "--input", str(root / "x.npy"), "--output", str(tmp_path / "npy"),
                 "--no-tracking", "--quiet", "--seed", "0"]) == 0
    cli_reference = pq.read_table(tmp_path / "npy" / "assignments.parquet")["cluster"].to_numpy()
    for name, flags in inputs.items():
        table = read_features(root / name, _columns(flags))
        np.testing.assert_array_equal(DeepDPM(random_state=0).fit(table.X).labels_, reference,
                                      err_msg=name)
        out = tmp_path / name.replace(".", "_")
        assert main(["fit", "--input", str(root / name), "--output", str(out), "--no-tracking",
                     "--quiet", "--seed", "0", *flags]) == 0
        assignments = pq.read_table(out / "assignments.parquet")
        np.testing.assert_array_equal(assignments["cluster"].to_numpy(), cli_reference,
                                      err_msg=name)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["n_features"] == D and "nmi" in summary["metrics"], name
    # the key column is carried into the assignments
    keys = pq.read_table(tmp_path / "header_csv" / "assignments.parquet")["key"].to_pylist()
    assert keys[:2] == ["t0", "t1"]
    out = tmp_path / "predicted.parquet"
    assert main(["predict", "--model", str(tmp_path / "npy" / "model.pt"), "--input",
                 str(root / "header.csv"), "--output", str(out), "--label", "species",
                 "--key", "tree_id"]) == 0
    np.testing.assert_array_equal(pq.read_table(out)["cluster"].to_numpy(), cli_reference)


def test_non_numeric_columns_are_named(tables, tmp_path):
    root, *_ = tables
    with pytest.raises(DataError, match=r"'species' \(string\).*'tree_id' \(string\).*--label"):
        read_features(root / "header.csv")
    with pytest.raises(DataError, match="no column 'kind' for --label"):
        read_features(root / "header.csv", TableColumns(label="kind"))
    table = read_features(root / "header.csv", TableColumns(features=("f0", "f2"), key="tree_id"))
    assert table.X.shape == (N, 2) and table.labels is None


@pytest.mark.parametrize("name, write, message", [
    ("empty.csv", lambda p: p.write_text(""), "is empty"),
    ("header_only.csv", lambda p: p.write_text("a,b\n"), "has no rows"),
    ("nan.csv", lambda p: p.write_text("a,b\n1,2\n3,\n5,6\n"), r"1 row\(s\) with NaN .*rows 1\)"),
    ("oned.npy", lambda p: np.save(p, np.arange(5.0)), "must be a 2-D array"),
    ("strings.npy", lambda p: np.save(p, np.array([["a", "b"]])), "must be real numbers"),
    ("words.parquet", lambda p: pd.DataFrame({"w": ["x", "y"]}).to_parquet(p), "'w'"),
    ("notes.txt", lambda p: p.write_text("1,2\n"), "unsupported input"),
])
def test_bad_tables_fail_in_one_line_before_torch(tmp_path, name, write, message):
    path = tmp_path / name
    write(path)
    with pytest.raises(DataError, match=message):
        check_fit_rows(read_features(path), path)
    # the command answers without loading torch: one line, exit code 2, well within a second
    code = ("import sys, time; t = time.perf_counter(); from pipeline.cli import main; "
            f"rc = main(['fit', '--input', {str(path)!r}, '--output', {str(tmp_path / 'o')!r}, "
            "'--no-tracking']); assert 'torch' not in sys.modules, 'torch loaded'; "
            "assert 'pandas' not in sys.modules, 'pandas loaded'; "
            "print(time.perf_counter() - t); sys.exit(rc)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    wall = time.perf_counter() - start
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepdpm fit: error: "), done.stderr
    # the command itself (printed) takes ~0.4 s on a quiet machine, the interpreter's start
    # aside; what keeps it so is that neither torch nor pandas loads (asserted above)
    assert float(done.stdout) < 3.0 and wall < 6.0, (done.stdout, wall)
