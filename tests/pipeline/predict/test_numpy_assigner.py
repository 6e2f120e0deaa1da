"""``deepdpm predict`` on the CPU without torch: a model file's assigner read and run in
NumPy gives torch's labels and confidences, the command never imports torch, a file the
NumPy reader does not take is read by torch, and a pickle that would run code is refused
without running it.

The reference is the model loaded by torch: ``DeepDPM.load(path).predict_confidence``
(:class:`~deepdpm_core.model.ClusterAssigner`).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sklearn.datasets import load_digits

from deepdpm_core import DeepDPM
from pipeline.cli import main
from pipeline.predict.numpy_assigner import read_model_state, read_numpy_assigner

#: rows per forward pass: the 1,797 digits in four uneven batches
BATCH = 500
#: a 1,000-row predict's own seconds (the interpreter's start aside): 0.35 s on a 2-core machine,
#: 1.8-2.5 s when it imported torch; the headroom is for a loaded machine
PREDICT_S = 2.0


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    return load_digits().data.astype(np.float32)


def _fit(X: np.ndarray, path: Path, **params) -> DeepDPM:
    est = DeepDPM(random_state=0, schedule__max_epochs=4, **params).fit(X)
    est.save(path)
    return est


@pytest.mark.parametrize("transform, covariance_type, precision", [
    ("auto", "full", "auto"),
    ("none", "diag", "float32"),
    ("normalize", "full", "tf32"),
    ("standard", "auto", "auto"),
    ("min_max", "full", "float32"),
])  # fmt: skip
def test_the_numpy_assigner_gives_torchs_labels_and_confidences(digits, tmp_path, transform,
                                                                 covariance_type, precision):
    path = tmp_path / "model.pt"
    est = _fit(digits, path, data__transform=transform, prior__covariance_type=covariance_type,
               model__precision=precision)
    labels, confidence = DeepDPM.load(path).predict_confidence(digits, batch_size=BATCH)
    assigner = read_numpy_assigner(path)
    assert assigner is not None
    assert (assigner.dim, assigner.n_clusters) == (64, est.n_clusters_)
    assert assigner.kept is not None  # the digits' constant pixels are left out of x̃
    got_labels, got_confidence = assigner.predict_confidence(digits, batch_size=BATCH)
    assert got_labels.dtype == np.int64 and got_confidence.dtype == np.float32
    np.testing.assert_array_equal(got_labels, labels)
    np.testing.assert_array_equal(got_labels, est.predict(digits))
    np.testing.assert_allclose(got_confidence, confidence, rtol=0, atol=1e-5)


def test_a_bf16_model_is_left_to_torch_and_predicts_as_torch_does(digits, tmp_path):
    path = tmp_path / "model.pt"
    _fit(digits, path, model__precision="bf16")
    assert read_model_state(path) is not None  # readable, but its forward is autocast's
    assert read_numpy_assigner(path) is None
    rows, out = tmp_path / "rows.npy", tmp_path / "out.parquet"
    np.save(rows, digits[:1000])
    assert main(["predict", "--model", str(path), "--input", str(rows), "--output", str(out)]) == 0
    labels, confidence = DeepDPM.load(path).predict_confidence(digits[:1000])
    np.testing.assert_array_equal(pq.read_table(out)["cluster"].to_numpy(), labels)
    np.testing.assert_allclose(pq.read_table(out)["confidence"].to_numpy(), confidence,
                               rtol=0, atol=1e-6)


def test_a_1000_row_predict_from_the_cli_does_not_import_torch(digits, tmp_path):
    path, rows, out = tmp_path / "model.pt", tmp_path / "rows.npy", tmp_path / "out.parquet"
    _fit(digits, path)
    np.save(rows, digits[:1000])
    argv = ["predict", "--model", str(path), "--input", str(rows), "--output", str(out), "--json"]
    done = subprocess.run([sys.executable, "-c",
                           "import sys, time; t = time.perf_counter(); from pipeline.cli import main; "
                           "rc = main(sys.argv[1:]); seconds = time.perf_counter() - t; "
                           "print('torch' in sys.modules, seconds); sys.exit(rc)", *argv],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    *result, last = done.stdout.strip().splitlines()
    loaded, seconds = last.split()
    assert loaded == "False"
    assert float(seconds) < PREDICT_S
    assert json.loads(result[-1])["n_rows"] == 1000
    labels, confidence = DeepDPM.load(path).predict_confidence(digits[:1000])
    np.testing.assert_array_equal(pq.read_table(out)["cluster"].to_numpy(), labels)
    np.testing.assert_allclose(pq.read_table(out)["confidence"].to_numpy(), confidence,
                               rtol=0, atol=1e-5)


class _RunsCode:
    """Unpickled, it would create the file ``marker`` (``os.system``'s shell)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_pickle_with_a_foreign_global_is_refused_without_running_it(digits, tmp_path):
    path, bad = tmp_path / "model.pt", tmp_path / "bad.pt"
    _fit(digits, path)
    marker = tmp_path / "ran"
    with zipfile.ZipFile(path) as good, zipfile.ZipFile(bad, "w") as out:
        for name in good.namelist():  # the same archive, its pickle with one more entry
            data = good.read(name)
            if name.endswith("/data.pkl"):
                data = pickle.dumps({"format": "deepdpm-model/1", "hook": _RunsCode(marker)})
            out.writestr(name, data)
    assert read_model_state(bad) is None
    assert read_numpy_assigner(bad) is None
    assert not marker.exists()
    rows = tmp_path / "rows.npy"
    np.save(rows, digits[:10])
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "predict", "--model", str(bad),
                           "--input", str(rows), "--output", str(tmp_path / "out.parquet")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "refused as unsafe" in done.stderr and "system" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_the_numpy_reader_reads_the_format_and_keys_torch_writes():
    """The reader keeps its own copy of the format name and the assigner's keys (the
    module that defines them imports torch): the two copies must not drift apart."""
    from deepdpm_core.model import fitted_model
    from pipeline.predict import numpy_assigner

    assert numpy_assigner.FORMAT == fitted_model.FORMAT
    assert numpy_assigner.ASSIGNER_KEYS == fitted_model._ASSIGNER_KEYS
