"""Embedding functions and the ``deepdpm embed`` command on real data (scikit-learn digits)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.datasets import load_digits

from deepdpm_core.config import Config
from deepdpm_core.errors import ConfigError, DataError
from deepdpm_core.features import as_feature_matrix, embed, load_autoencoder
from deepdpm_core.features.embedding import pca_embed
from pipeline.cli import main
from pipeline.io.table_writing import features_table, write_parquet_atomic
from pipeline.io.tables import read_features

# A narrower net and few epochs keep the CPU tests fast; the code path is the paper's.
FAST = ["--set", "ae.hidden=[64,64,128]", "--set", "ae.pretrain_epochs=8"]
FAST_CONFIG = Config().with_overrides({"ae.hidden": [64, 64, 128], "ae.pretrain_epochs": 8})


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_digits(return_X_y=True)
    return X.astype(np.float32), y


@pytest.fixture(scope="module")
def digits_npz(tmp_path_factory, digits) -> Path:
    path = tmp_path_factory.mktemp("raw") / "digits.npz"
    X, y = digits
    # Raw 8x8 images, as an image loader would give them: the command flattens them.
    np.savez(path, X=X.reshape(-1, 8, 8), y=y)
    return path


# ---------------------------------------------------------------- functions


def test_pca_matches_sklearn_up_to_sign(digits):
    from sklearn.decomposition import PCA

    X, _ = digits
    ours = pca_embed(X, 5)
    ref = PCA(n_components=5, svd_solver="full").fit_transform(X.astype(np.float64))
    for j in range(5):
        corr = np.corrcoef(ours[:, j], ref[:, j])[0, 1]
        assert abs(corr) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_array_equal(pca_embed(X, 5), ours)


def test_ae_embedding_shape_and_determinism(digits):
    X, _ = digits
    cfg = FAST_CONFIG.with_overrides({"ae.pretrain_epochs": 3})
    a = embed(X[:500], "ae", cfg, dim=6)
    b = embed(X[:500], "ae", cfg, dim=6)
    assert a.embedding.shape == (500, 6) and a.embedding.dtype == np.float32
    np.testing.assert_array_equal(a.embedding, b.embedding)
    c = embed(X[:500], "ae", cfg.with_overrides({"seed": 1}), dim=6)
    assert not np.allclose(a.embedding, c.embedding)
    assert a.autoencoder is not None and a.autoencoder.latent_dim == 6
    assert len(a.ae_history) == 3


def test_umap_embedding_is_deterministic_for_a_seed(digits):
    X, _ = digits
    a = embed(X[:300], "umap", Config(), dim=3)
    b = embed(X[:300], "umap", Config(), dim=3)
    assert a.embedding.shape == (300, 3)
    np.testing.assert_array_equal(a.embedding, b.embedding)


def test_umap_leaves_the_callers_torch_threads_alone(digits):
    """UMAP's numba kernels reset the OpenMP pool torch shares to every core: a fit after
    an embedding would otherwise run on threads the caller never asked for."""
    X, _ = digits
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        embed(X[:300], "umap", Config(), dim=3)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("X", "message"),
    [
        (
            np.array([[1.0, np.nan], [0.0, 1.0], [2.0, 2.0]]),
            r"1 NaN/infinite value\(s\) in 1 row\(s\), first at row 0",
        ),
        (
            np.array([[1.0, 2.0], [np.inf, 1.0], [0.0, -np.inf]]),
            r"2 NaN/infinite.*2 row\(s\), first at row 1",
        ),
        (np.arange(5.0), r"shape \[N, D\]"),
        (np.zeros((1, 4)), "at least 2 are needed"),
        (np.array([["a", "b"], ["c", "d"]]), "numeric"),
    ],
)
def test_bad_arrays_are_data_errors(X, message):
    with pytest.raises(DataError, match=message):
        as_feature_matrix(X)


def test_dim_must_be_smaller_than_input(digits):
    X, _ = digits
    for method in ("ae", "umap", "ae-umap", "pca"):
        with pytest.raises(
            DataError, match=r"--dim \(64\) must be smaller than the input dimension \(64\)"
        ):
            embed(X[:50], method, FAST_CONFIG, dim=64)
    with pytest.raises(ConfigError, match="must not exceed the autoencoder latent size"):
        embed(X[:50], "ae-umap", FAST_CONFIG, dim=12)
    with pytest.raises(ConfigError, match="unknown embedding method 'tsne'"):
        embed(X[:50], "tsne", FAST_CONFIG)


# ---------------------------------------------------------------- command


def test_embed_command_writes_a_feature_table_with_labels(tmp_path, digits_npz, digits, capsys):
    out = tmp_path / "emb.parquet"
    model_path = tmp_path / "ae.pt"
    code = main(
        [
            "embed",
            "--input",
            str(digits_npz),
            "--output",
            str(out),
            "--method",
            "ae",
            "--dim",
            "7",
            "--save-model",
            str(model_path),
            "--quiet",
            *FAST,
        ]
    )
    assert code == 0
    assert "1797 rows: 64 -> 7 dims with ae" in capsys.readouterr().out
    table = pq.read_table(out)
    assert table.column_names == ["key", "embedding", "label"]
    assert str(table.schema.field("embedding").type) == "fixed_size_list<element: float>[7]"
    features = read_features(out)
    np.testing.assert_array_equal(features.labels, digits[1])
    assert features.keys[:3].tolist() == ["0", "1", "2"]
    # The saved autoencoder encodes raw data to exactly the written embedding.
    model = load_autoencoder(model_path)
    with torch.no_grad():
        again = model.encode(torch.from_numpy(digits[0])).numpy()
    np.testing.assert_allclose(again, features.X, rtol=1e-5, atol=1e-5)


def test_embed_command_reads_parquet_features_and_keeps_keys(tmp_path, digits):
    X, y = digits
    keys = np.array([f"img_{i:04d}" for i in range(len(X))], dtype=object)
    labels = y.copy()
    labels[::5] = -1  # unlabelled rows stay null
    src = tmp_path / "features.parquet"
    write_parquet_atomic(features_table(X, keys, labels), src)
    out = tmp_path / "pca.parquet"
    assert (
        main(["embed", "--input", str(src), "--output", str(out), "--method", "pca", "--dim", "4"])
        == 0
    )
    result = read_features(out)
    assert result.X.shape == (len(X), 4)
    assert result.keys.tolist() == keys.tolist()
    np.testing.assert_array_equal(result.labels, labels)
    np.testing.assert_allclose(result.X, pca_embed(X, 4), rtol=1e-6)


def test_embed_command_bad_inputs_are_one_line_errors(tmp_path, digits_npz, capsys):
    out = tmp_path / "out.parquet"
    nan_path = tmp_path / "nan.npz"
    X = np.ones((10, 6), np.float32)
    X[3, 2] = np.nan
    np.savez(nan_path, X=X)
    ragged = tmp_path / "ragged.npz"
    np.savez(ragged, X=np.ones((10, 6)), y=np.zeros(9))
    bad = {  # file name -> bytes of a file numpy cannot read as features
        "empty.npy": b"", "empty.npz": b"", "text.npy": b"1 2 3\n4 5 6\n",
        "truncated.npz": (tmp_path / "ragged.npz").read_bytes()[:200],
    }
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
    np.save(tmp_path / "scalar.npy", np.float32(3.0))
    np.save(tmp_path / "complex.npy", np.ones((10, 6), np.complex64))
    np.savez(tmp_path / "y2d.npz", X=np.ones((10, 6)), y=np.zeros((10, 3)))
    np.savez(tmp_path / "ynan.npz", X=np.ones((10, 6)), y=np.full(10, np.nan))
    cases = [
        *(
            (["--input", str(tmp_path / name), "--method", "pca", "--dim", "2"], message)
            for name, message in [
                ("empty.npy", "is not a .npy file (no NumPy header)"),
                ("text.npy", "is not a .npy file (no NumPy header)"),
                ("empty.npz", "cannot read"),
                ("truncated.npz", "cannot read"),
                ("scalar.npy", "features must be an array of rows [N, D], got a single value"),
                ("complex.npy", "features must be real numbers, got dtype complex64"),
                ("y2d.npz", "'y' must be one label per row, shape (10,), got (10, 3)"),
                ("ynan.npz", "'y' must hold integer labels, got non-integer or NaN values"),
            ]
        ),
        (
            ["--input", str(digits_npz), "--method", "ae", "--save-model", str(out)],
            "--save-model must differ from --output",
        ),
        (  # the model cannot be written: no feature table is left either
            ["--input", str(digits_npz), "--method", "ae", "--save-model", str(tmp_path / "empty.npy" / "m.pt"),
             "--set", "ae.pretrain_epochs=1", "--set", "ae.hidden=[8]", "--quiet"],
            "empty.npy",
        ),
        (
            ["--input", str(nan_path), "--method", "pca", "--dim", "2"],
            "has 1 row(s) with NaN or inf values (rows 3)",
        ),
        (
            ["--input", str(ragged), "--method", "pca", "--dim", "2"],
            "'y' has 9 rows but 'X' has 10",
        ),
        (
            ["--input", str(digits_npz), "--method", "pca", "--dim", "64"],
            "--dim (64) must be smaller than the input dimension (64)",
        ),
        (
            ["--input", str(digits_npz), "--method", "pca", "--dim", "80"],
            "--dim (80) must be smaller",
        ),
        (["--input", str(tmp_path / "missing.npz"), "--method", "pca"], "input not found"),
        (["--input", str(digits_npz), "--method", "ae", "--set", "ae.hidden=[]"], "ae.hidden"),
        (
            ["--input", str(digits_npz), "--method", "ae", "--set", "ae.latnet_dim=3"],
            "unknown config key 'ae.latnet_dim'",
        ),
        (
            ["--input", str(digits_npz), "--method", "pca", "--save-model", str(tmp_path / "m.pt")],
            "--save-model needs an autoencoder",
        ),
    ]
    for argv, message in cases:
        code = main(["embed", "--output", str(out), *argv])
        err = capsys.readouterr().err
        assert code == 2, argv
        assert message in err, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err
        assert not out.exists()
    with pytest.raises(SystemExit):
        main(["embed", "--input", str(digits_npz), "--output", str(out), "--method", "tsne"])


def test_load_autoencoder_rejects_foreign_files(tmp_path):
    from deepdpm_core.errors import CheckpointError

    bad = tmp_path / "bad.pt"
    torch.save({"weights": torch.zeros(2)}, bad)
    with pytest.raises(CheckpointError, match="not a deepdpm autoencoder"):
        load_autoencoder(bad)
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read autoencoder"):
        load_autoencoder(bad)


# ---------------------------------------------------------------- method quality


@pytest.mark.slow
def test_digits_ae_umap_then_fit_finds_the_digits(tmp_path, digits_npz):
    """Raw 64-d digits -> ``embed ae-umap`` (n2d) -> ``fit`` with the n2d recipe: K in 8-12.

    A 256-256-512 AE (the paper's is 500-500-2000) trained 200 epochs keeps this ~1 min on
    one CPU thread. Observed (seed 0): K = 11, NMI 0.896; seeds 1-3: K 9/11/11, NMI
    0.870/0.915/0.877. With the default prior (Psi = 0.005 I, the paper's for AE codes) the
    same embedding gives K = 13: writing styles of 1 and 9 as extra clusters.
    """
    import json

    recipe = str(Path(__file__).parents[3] / "cluster_configs" / "n2d.yaml")
    emb = tmp_path / "n2d.parquet"
    code = main(
        ["embed", "--input", str(digits_npz), "--output", str(emb), "--method", "ae-umap", "--quiet",
         "--config", recipe, "--set", "ae.hidden=[256,256,512]", "--set", "ae.pretrain_epochs=200"]
    )  # fmt: skip
    assert code == 0
    assert read_features(emb).X.shape == (1797, 10)
    out = tmp_path / "fit"
    assert main(["fit", "--input", str(emb), "--output", str(out), "--config", recipe,
                 "--quiet", "--no-tracking"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert 8 <= summary["n_clusters"] <= 12, summary["n_clusters"]
    assert summary["metrics"]["nmi"] >= 0.85


def test_command_methods_match_the_core():
    from deepdpm_core.features.embedding import METHODS
    from pipeline.commands import embed as command

    assert command.METHODS == METHODS
