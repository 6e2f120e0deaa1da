"""AE <-> DeepDPM alternation (paper Supmat 'Jointly Learning Features and Clustering')."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits

from deepdpm_core.config import Config
from deepdpm_core.errors import ConfigError, DataError
from deepdpm_core.features import encode, fit_alternating
from tests.support.mlflow_server import mlflow_env, mlflow_server  # noqa: F401

# Narrow net, few epochs: the loop's mechanics, fast on 1 CPU thread.
FAST = Config().with_overrides(
    {"ae.hidden": [64, 64, 128], "ae.pretrain_epochs": 8, "ae.epochs": 4}
)


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_digits(return_X_y=True)
    return X.astype(np.float32), y


@dataclass
class KMeansClustering:
    labels_: np.ndarray
    means_: np.ndarray
    n_clusters_: int


class RecordingKMeans:
    """A real clustering (k-means) standing in for DeepDPM, recording what it was given."""

    def __init__(self, ks: list[int]):
        self.ks = ks
        self.calls: list[tuple[np.ndarray, np.ndarray | None, int]] = []

    def __call__(self, Z, init_labels, step):
        self.calls.append((Z.copy(), None if init_labels is None else init_labels.copy(), step))
        k = self.ks[min(step, len(self.ks) - 1)]
        km = KMeans(n_clusters=k, n_init=1, random_state=step).fit(Z)
        return KMeansClustering(km.labels_, km.cluster_centers_.astype(np.float32), k)


def test_loop_passes_previous_labels_and_stops_when_k_is_stable(digits):
    X, _ = digits
    kmeans = RecordingKMeans(ks=[7, 9, 9, 12])
    steps = []
    result = fit_alternating(X, FAST, alternations=3, cluster_fn=kmeans, on_step=steps.append)
    # K: 7 -> 9 -> 9: stable after the second alternation, the third is not run.
    assert [s.n_clusters for s in result.steps] == [7, 9, 9]
    assert result.stopped_because == "k_stable"
    assert steps == result.steps and result.n_clusters_ == 9
    assert [c[2] for c in kmeans.calls] == [0, 1, 2]
    assert kmeans.calls[0][1] is None
    # Each re-clustering starts from the previous step's clusters.
    np.testing.assert_array_equal(kmeans.calls[1][1], result.steps[0].labels)
    np.testing.assert_array_equal(kmeans.calls[2][1], result.steps[1].labels)
    # The AE kept training between clusterings, and the result encodes to the final embedding.
    assert not np.allclose(kmeans.calls[0][0], kmeans.calls[1][0])
    np.testing.assert_array_equal(encode(result.autoencoder, X), result.embedding)
    assert len(result.steps[0].ae_history) == 8 and len(result.steps[1].ae_history) == 4


def test_alternation_count_is_honoured_without_early_stop(digits):
    X, _ = digits
    cfg = FAST.with_overrides({"ae.stop_when_k_stable": False, "ae.epochs": 1})
    result = fit_alternating(X[:600], cfg, alternations=2, cluster_fn=RecordingKMeans([5]))
    assert [s.step for s in result.steps] == [0, 1, 2]
    assert result.stopped_because == "max_alternations"
    zero = fit_alternating(X[:600], cfg, alternations=0, cluster_fn=RecordingKMeans([5]))
    assert len(zero.steps) == 1


def test_cluster_term_tightens_clusters_in_the_embedding(digits):
    X, _ = digits
    cfg = FAST.with_overrides({"ae.stop_when_k_stable": False, "ae.epochs": 8})
    kmeans = RecordingKMeans([10])
    result = fit_alternating(X, cfg, alternations=1, cluster_fn=kmeans)
    z0, labels0 = kmeans.calls[0][0], result.steps[0].labels
    z1 = result.embedding

    centres0 = kmeans_centres(z0, labels0)

    def within_over_total(Z):
        within = np.sum((Z - kmeans_centres(Z, labels0)[labels0]) ** 2)
        return within / np.sum((Z - Z.mean(axis=0)) ** 2)

    # With the step-0 clusters held fixed, the AE pulled points towards their centres...
    dist0 = np.mean(np.sum((z0 - centres0[labels0]) ** 2, axis=1))
    dist1 = np.mean(np.sum((z1 - centres0[labels0]) ** 2, axis=1))
    assert dist1 < dist0  # observed 0.116 -> 0.089
    # ...and the clusters got tighter relative to the spread of the whole embedding
    # (not just a shrunken latent space). Observed ratio 0.063 -> 0.044.
    assert within_over_total(z1) < 0.9 * within_over_total(z0)
    cluster_losses = [h["cluster"] for h in result.steps[1].ae_history]
    assert cluster_losses[-1] < cluster_losses[0]


def kmeans_centres(Z: np.ndarray, labels: np.ndarray) -> np.ndarray:
    return np.stack([Z[labels == k].mean(axis=0) for k in range(labels.max() + 1)])


def test_bad_arguments(digits):
    X, _ = digits
    with pytest.raises(ConfigError, match="alternations must be >= 0"):
        fit_alternating(X, FAST, alternations=-1, cluster_fn=RecordingKMeans([3]))
    with pytest.raises(
        DataError, match=r"ae.latent_dim \(10\) must be smaller than the input dimension \(8\)"
    ):
        fit_alternating(X[:, :8], FAST, cluster_fn=RecordingKMeans([3]))
    bad = X.copy()
    bad[5, 5] = np.nan
    with pytest.raises(DataError, match="NaN"):
        fit_alternating(bad, FAST, cluster_fn=RecordingKMeans([3]))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "mnist_ae",
            {
                "ae.latent_dim": 10,
                "ae.recon_weight": 0.005,
                "ae.beta": 1.0,
                "ae.alternations": 3,
                "init.n_clusters": 3,
                "prior.sigma_scale": 0.005,
                "schedule.max_epochs": 200,
            },
        ),
        (
            "imagenet50_ae",
            {
                "ae.latent_dim": 10,
                "ae.recon_weight": 0.05,
                "ae.beta": 0.01,
                "ae.alternations": 2,
                "init.n_clusters": 10,
                "prior.nu": 12.0,
                "prior.psi": "data_std",
                "prior.sigma_scale": 1e-4,
                "schedule.max_epochs": 300,
            },
        ),
    ],
)
def test_paper_recipes_load_strictly(name, expected):
    from pathlib import Path

    from deepdpm_core.config import load_config

    flat = load_config(Path(__file__).parents[3] / "cluster_configs" / f"{name}.yaml").flat()
    assert {key: flat[key] for key in expected} == expected
    assert flat["ae.hidden"] == (500, 500, 2000)


# ------------------------------------------------------------ with DeepDPM and the CLI


def test_deepdpm_warm_start_from_labels(digits):
    from deepdpm_core import DeepDPM

    X, y = digits
    E = PCA_10(X)
    cfg = {"schedule.max_epochs": 15}
    # Arbitrary non-negative ids with gaps: the empty ids are dropped.
    model = DeepDPM(**cfg).fit(E, init_labels=y * 3 + 2)
    assert model.history_[0]["n_clusters"] == 10
    assert model.labels_.shape == (len(X),)
    for bad, message in [
        (y[:-1], r"shape \(1797,\)"),
        (y.astype(float), "integers"),
        (y - 1, ">= 0"),
    ]:
        with pytest.raises(DataError, match=message):
            DeepDPM(**cfg).fit(E, init_labels=bad)


def PCA_10(X: np.ndarray) -> np.ndarray:
    from deepdpm_core.features.embedding import pca_embed

    return pca_embed(X, 10)


@pytest.mark.slow  # the CLI with a real MLflow server
def test_fit_alternate_command_writes_outputs_and_nested_mlflow_runs(
    tmp_path,
    digits,
    mlflow_server,  # noqa: F811
    mlflow_env,  # noqa: F811
    capsys,
    monkeypatch,
):
    import json

    from mlflow import MlflowClient

    from deepdpm_core.features import load_autoencoder
    from pipeline.cli import main
    from pipeline.io.tables import read_features

    X, y = digits
    raw = tmp_path / "digits.npz"
    np.savez(raw, X=X.reshape(-1, 8, 8), y=y)  # raw images: flattened by the command
    out = tmp_path / "fit"
    argv = [
        "fit", "--input", str(raw), "--output", str(out), "--alternate", "2", "--quiet",
        "--tracking-uri", mlflow_server.uri, "--experiment", "alternation", "--run-name", "alt",
        "--set", "ae.hidden=[64,64,128]", "--set", "ae.pretrain_epochs=8", "--set", "ae.epochs=3",
        "--set", "ae.stop_when_k_stable=false", "--set", "schedule.max_epochs=20",
    ]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "alternation 0: K=" in err and "alternation 2: K=" in err

    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["alternation"]] == [0, 1, 2]
    assert summary["stopped_because"] == "max_alternations"
    assert (
        summary["alternation"][0]["ae_epochs"] == 8 and summary["alternation"][1]["ae_epochs"] == 3
    )
    assert summary["n_features"] == 10  # clustered in the learned 10-d space
    assert set(summary["metrics"]) == {"nmi", "ari", "acc"}
    # The saved autoencoder reproduces the written embedding from the raw pixels.
    learned = read_features(out / "embedding.parquet")
    np.testing.assert_array_equal(learned.labels, y)
    np.testing.assert_allclose(
        encode(load_autoencoder(out / "autoencoder.pt"), X), learned.X, atol=1e-5
    )

    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("alternation")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = sorted(
        (r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
        key=lambda r: int(r.data.tags["alternation"]),
    )
    assert [r.info.run_name for r in children] == [f"alt/alternation-{i}" for i in range(3)]
    assert all(r.info.status == "FINISHED" for r in [parent, *children])
    for step, child in enumerate(children):
        assert child.data.metrics["final_n_clusters"] == summary["alternation"][step]["n_clusters"]
        assert child.data.metrics["final_nmi"] == pytest.approx(
            summary["alternation"][step]["metrics"]["nmi"]
        )
        assert "ae_loss" in child.data.metrics and "loss_subcluster" in child.data.metrics
        assert child.data.params["alternation"] == str(step)
    assert parent.data.params["alternate"] == "2"
    assert parent.data.metrics["final_nmi"] == pytest.approx(summary["metrics"]["nmi"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"autoencoder.pt", "model.pt", "summary.json"} <= artifacts
    ae_history = client.get_metric_history(children[0].info.run_id, "ae_loss")
    assert len(ae_history) == 8  # one point per pretraining epoch
    # the MLflow model takes raw rows: its input example is the first flattened images
    import mlflow.artifacts
    import mlflow.pyfunc

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    local = Path(mlflow.artifacts.download_artifacts(f"runs:/{parent.info.run_id}/model"))
    meta = mlflow.pyfunc.load_model(str(local)).metadata
    np.testing.assert_allclose(np.asarray(meta.load_input_example(str(local)), dtype=np.float32),
                               X[:5].astype(np.float32))


def test_fit_bad_arguments_are_one_line_errors(tmp_path, capsys):
    from pipeline.cli import main

    raw = tmp_path / "small.npz"
    np.savez(raw, X=np.random.default_rng(0).normal(size=(50, 6)))
    (tmp_path / "afile").write_text("x")
    empty_dir = tmp_path / "features"
    empty_dir.mkdir()
    rows = [[float(i), 1.0] for i in range(50)]
    pq.write_table(pa.table({"a": [float(i) for i in range(50)], "kind": ["x"] * 50}),
                   tmp_path / "words.parquet")
    pq.write_table(pa.table({"embedding": [[r] for r in rows]}), tmp_path / "nested.parquet")
    for argv, message in [
        (["--input", str(raw), "--output", str(tmp_path / "afile")], "exists and is not a directory"),
        (["--resume", str(tmp_path / "afile")], "is not the output directory of a fit with checkpoints"),
        (["--input", str(tmp_path / "words.parquet"), "--output", str(tmp_path / "o")],
         "column(s) 'kind' (string) do not hold numbers"),
        (["--input", str(tmp_path / "nested.parquet"), "--output", str(tmp_path / "o")],
         "column 'embedding' must be a list of numbers, got list<"),
        (["--input", str(empty_dir), "--output", str(tmp_path / "o")], "is a folder without .parquet files"),
    ]:
        code = main(["fit", "--no-tracking", *argv])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    assert (tmp_path / "afile").read_text() == "x"
    for extra, message in [
        (["--alternate", "-1"], "--alternate must be >= 0"),
        (["--alternate", "1"], "ae.latent_dim (10) must be smaller than the input dimension (6)"),
        (["--set", "prior.nu=5"], "prior.nu must exceed D - 1 = 5 for 6-dimensional data, got 5.0"),
    ]:
        code = main(["fit", "--input", str(raw), "--output", str(tmp_path / "o"), "--no-tracking",
                     *extra])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err


def _within_fraction(Z: np.ndarray, labels: np.ndarray) -> float:
    """Within-cluster sum of squares over the total sum of squares of ``Z`` [N, d]."""
    Z = Z.astype(np.float64)
    within = sum(((Z[labels == k] - Z[labels == k].mean(0)) ** 2).sum() for k in np.unique(labels))
    return float(within / ((Z - Z.mean(0)) ** 2).sum())


@pytest.mark.slow
def test_alternation_with_deepdpm_on_digits_tightens_clusters_and_keeps_nmi(digits):
    """Raw 64-d digits: pretrain the AE, DeepDPM, then AE <-> DeepDPM alternations.

    A 256-256-512 AE x 100 pretraining epochs keeps this ~20 s on one CPU thread.
    The clustering term does what it is trained for: under the previous step's labels the
    within-cluster share of the variance falls from ~0.35 to ~0.02, and under the true
    digits from ~0.40 to ~0.18. On digits that sharpens the clusters DeepDPM found rather
    than correcting them: observed NMI per step (seeds 0, 2, 3, 4) 0.772 -> 0.769 -> 0.771,
    0.806 -> 0.803 -> 0.803, 0.780 -> 0.775 -> 0.775, 0.757 -> 0.751 -> 0.752, and seed 1
    0.754 -> 0.769 (K stable, stopped); an earlier search gave 0.772 -> 0.766 -> 0.759.
    The paper's gains from alternating are on MNIST-size data; digits are too small to
    show them, so this checks the mechanism and that NMI does not degrade.
    """
    from deepdpm_core.data import nmi
    from deepdpm_core.features.alternation import default_cluster_fn

    X, y = digits
    cfg = Config().with_overrides(
        {"ae.hidden": [256, 256, 512], "ae.pretrain_epochs": 100, "ae.epochs": 20,
         # the paper's fixed prior, which the observations above were made with
         "prior.sigma_scale": 0.005, "prior.kappa": 1e-4, "prior.nu": None}
    )
    embeddings: list[np.ndarray] = []
    fit_deepdpm = default_cluster_fn(cfg)

    def cluster_fn(Z, init_labels, step):
        embeddings.append(Z)
        return fit_deepdpm(Z, init_labels, step)

    result = fit_alternating(X, cfg, alternations=2, cluster_fn=cluster_fn)
    assert len(result.steps) >= 2
    first = result.steps[0].labels
    assert _within_fraction(embeddings[1], first) < 0.25 * _within_fraction(embeddings[0], first)
    assert _within_fraction(embeddings[-1], y) < 0.7 * _within_fraction(embeddings[0], y)
    scores = [nmi(y, step.labels) for step in result.steps]
    assert scores[0] > 0.6
    assert min(scores[1:]) >= scores[0] - 0.02, scores
    assert 5 <= result.n_clusters_ <= 15
