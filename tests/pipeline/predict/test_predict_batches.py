"""``deepdpm predict`` in memory bounded by the batch: a Parquet file read and written batch
by batch with the results of reading it whole, the model's assigner alone, and a folder
predict's driver without torch.

The reference, the file "read whole": :func:`pipeline.io.tables.read_features`, the
assigner the CLI runs (:func:`pipeline.predict.numpy_assigner.read_numpy_assigner`, whose
labels are ``DeepDPM.predict_confidence``'s) and :func:`pipeline.fit.outputs.label_metrics`
over the whole table.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from deepdpm_core import DeepDPM
from deepdpm_core.data import ContingencyCounts, clustering_scores, contingency, contingency_scores
from deepdpm_core.model import ClusterAssigner
from pipeline.cli import main
from pipeline.fit.outputs import label_metrics
from pipeline.io.table_writing import assignments_table, features_table
from pipeline.io.tables import FeatureTable, read_features
from pipeline.predict.files import read_assigner
from pipeline.predict.numpy_assigner import read_numpy_assigner

REPO = Path(__file__).resolve().parents[3]
#: rows of the row groups of the test file: uneven, one empty, none a multiple of the batch
ROW_GROUPS = [300, 7, 0, 150, 93]
BATCH = 64


def _blobs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    return (rng.normal(0.0, 0.3, (n, 4)) + 3.0 * y[:, None]).astype(np.float32), y


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    X, _ = _blobs(600)
    path = tmp_path_factory.mktemp("run") / "model.pt"
    DeepDPM(random_state=0, init__n_clusters=3, schedule__max_epochs=3).fit(X).save(path)
    return path


def _write_row_groups(path: Path, X: np.ndarray, y: np.ndarray, keys: bool) -> None:
    y = np.where(np.arange(len(y)) % 9 == 0, -1, y)  # some null labels
    table = features_table(X, np.array([f"row-{i}" for i in range(len(X))], dtype=object), y)
    if not keys:
        table = table.drop_columns(["key"])
    with pq.ParquetWriter(path, table.schema) as writer:
        at = 0
        for size in ROW_GROUPS:
            writer.write_table(table.slice(at, size), row_group_size=max(size, 1))
            at += size


def _read_whole(model: Path, path: Path) -> tuple[FeatureTable, np.ndarray, np.ndarray]:
    """The file read whole and assigned as the CLI assigns on the CPU (NumPy); its labels
    are the model's (torch)."""
    table = read_features(path)
    labels, confidence = read_numpy_assigner(model).predict_confidence(table.X, batch_size=BATCH)
    assert np.array_equal(labels, DeepDPM.load(model).predict_confidence(table.X)[0])
    return table, labels, confidence


@pytest.mark.parametrize("keys", [True, False])
def test_a_parquet_file_is_predicted_batch_by_batch_as_if_read_whole(model, tmp_path, monkeypatch,
                                                                     capsys, keys):
    X, y = _blobs(sum(ROW_GROUPS), seed=1)
    features, out = tmp_path / "features.parquet", tmp_path / "predicted.parquet"
    _write_row_groups(features, X, y, keys)
    table, labels, confidence = _read_whole(model, features)
    want = assignments_table(table, labels, confidence)

    read = []  # the rows of every batch read from the file, by the columns read
    iter_batches = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            read.append((tuple(batch.schema.names), batch.num_rows))
            yield batch

    def whole(*args, **kwargs):
        raise AssertionError("the file was read whole")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(pq, "read_table", whole)
    capsys.readouterr()
    old = os.umask(0o027)
    try:
        assert main(["predict", "--model", str(model), "--input", str(features), "--output", str(out),
                     "--batch-size", str(BATCH), "--json"]) == 0
    finally:
        os.umask(old)
    result = json.loads(capsys.readouterr().out)
    monkeypatch.undo()

    got = pq.read_table(out)
    assert got.equals(want)  # same columns, types and values, confidences to the last bit
    assert got["key"][0].as_py() == ("row-0" if keys else "0")
    assert result["n_rows"] == len(X) and result["metrics"] == label_metrics(table.labels, labels)
    assert result["n_clusters_used"] == len(np.unique(labels))
    # embeddings read a batch at a time, never more; the output written as they came
    rows = [n for names, n in read if "embedding" in names]
    assert sum(rows) == len(X) and max(rows) <= BATCH and len(rows) >= len(X) // BATCH
    assert pq.ParquetFile(out).metadata.num_row_groups == -(-len(X) // BATCH)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # 0o666 less the umask
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([features.name, out.name])


def test_bad_rows_in_a_later_batch_name_their_row_in_the_file_and_leave_no_output(model, tmp_path,
                                                                                   capsys):
    X, y = _blobs(sum(ROW_GROUPS))
    X[[400, 470]] = np.nan
    features, out = tmp_path / "features.parquet", tmp_path / "predicted.parquet"
    _write_row_groups(features, X, y, keys=True)
    assert main(["predict", "--model", str(model), "--input", str(features), "--output", str(out),
                 "--batch-size", str(BATCH)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"deepdpm predict: error: {features} has 1 row(s) with NaN or inf values "
                   "(rows 400)")
    assert sorted(p.name for p in tmp_path.iterdir()) == [features.name]  # no output, no temp file


def test_the_assigner_reads_only_what_assignment_needs_and_predicts_as_the_model(model, tmp_path):
    X, _ = _blobs(500, seed=2)
    assigner = ClusterAssigner.load(model)
    state = assigner.state_dict()
    assert not {"means", "covariances", "log_weights", "history"} & set(state)
    want = DeepDPM.load(model).predict_confidence(X, batch_size=BATCH)
    for got in (assigner.predict_confidence(X, batch_size=BATCH),
                ClusterAssigner.from_state(state).predict_confidence(X, batch_size=BATCH)):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and np.array_equal(g, w)

    dim, k, data = read_assigner(model)  # what a folder predict's actors get (torch is here)
    assert (dim, k) == (assigner.dim, assigner.n_clusters) == (4, DeepDPM.load(model).n_clusters_)
    (tmp_path / "assigner.pt").write_bytes(data)
    got = ClusterAssigner.load(tmp_path / "assigner.pt").predict_confidence(X, batch_size=BATCH)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_folder_predict_driver_reads_the_model_in_a_child_and_imports_no_torch(model, tmp_path):
    """The CLI's options, the folder predict and :func:`read_assigner` in a process without
    torch (470 MB of the driver's memory otherwise): a child process reads the model."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a model")
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from pipeline.cli import build_parser\n"
            "build_parser()\n"
            "import pipeline.commands.predict\n"
            "from deepdpm_core.errors import CheckpointError\n"
            "from pipeline.predict.files import read_assigner\n"
            "dim, k, state = read_assigner(sys.argv[1])\n"
            "Path(sys.argv[2]).write_bytes(state)\n"
            "try:\n"
            "    read_assigner(sys.argv[3])\n"
            "except CheckpointError as exc:\n"
            "    print(exc)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print(dim, k)\n")
    done = subprocess.run([sys.executable, "-c", code, str(model), str(tmp_path / "assigner.pt"), str(bad)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    refused, shape = done.stdout.strip().splitlines()
    assert refused.startswith(f"cannot read model checkpoint {bad}: not a PyTorch checkpoint")
    assert shape == f"4 {DeepDPM.load(model).n_clusters_}"
    X, _ = _blobs(200, seed=3)
    got = ClusterAssigner.load(tmp_path / "assigner.pt").predict_confidence(X, batch_size=BATCH)
    want = DeepDPM.load(model).predict_confidence(X, batch_size=BATCH)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_contingency_counted_in_batches_gives_the_scores_of_the_whole():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, 1000) * 2 - 3
    z = np.where(rng.random(1000) < 0.7, y, rng.integers(0, 9, 1000)) * 5
    counts = ContingencyCounts()
    for at in range(0, 1000, 96):
        counts.add(y[at : at + 96], z[at : at + 96])
    assert np.array_equal(counts.table(), contingency(y, z))
    assert contingency_scores(counts.table()) == clustering_scores(y, z)
    assert ContingencyCounts().table().shape == (0, 0)
