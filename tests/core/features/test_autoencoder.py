"""MLP autoencoder: losses against direct formulas, training decreases them, determinism."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from deepdpm_core.errors import DataError
from deepdpm_core.features import MLPAutoencoder, encode
from deepdpm_core.features.autoencoder import (
    AETrainSettings,
    build_autoencoder,
    cluster_loss,
    reconstruction_loss,
    train_autoencoder,
)

SMALL = (64, 64, 128)  # a narrower D-h-h-h-d net keeps CPU tests fast; same code path


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    X, y = load_digits(return_X_y=True)
    return X.astype(np.float32), y


def test_architecture_mirrors_encoder_and_is_linear_at_both_ends():
    model = MLPAutoencoder(64, 10, (500, 500, 2000))
    linear = [m for m in model.encoder if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [
        (64, 500),
        (500, 500),
        (500, 2000),
        (2000, 10),
    ]
    dec = [m for m in model.decoder if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in dec] == [
        (10, 2000),
        (2000, 500),
        (500, 500),
        (500, 64),
    ]
    # No activation on the latent code nor on the reconstruction (DEC/DCN/n2d).
    assert isinstance(model.encoder[-1], torch.nn.Linear)
    assert isinstance(model.decoder[-1], torch.nn.Linear)
    assert sum(isinstance(m, torch.nn.ReLU) for m in model.encoder) == 3


def test_latent_not_smaller_than_input_is_a_data_error():
    with pytest.raises(DataError, match=r"embedding dimension \(64\) must be smaller.*\(64\)"):
        MLPAutoencoder(64, 64)


def test_losses_match_direct_formulas():
    gen = torch.Generator().manual_seed(1)
    x, x_hat = torch.randn(7, 5, generator=gen), torch.randn(7, 5, generator=gen)
    expected = np.mean([np.sum((x_hat[i] - x[i]).numpy() ** 2) for i in range(7)])
    assert reconstruction_loss(x, x_hat).item() == pytest.approx(expected, rel=1e-6)

    z = torch.randn(7, 3, generator=gen, requires_grad=True)
    centers = torch.randn(4, 3, generator=gen, requires_grad=True)
    assign = torch.tensor([0, 3, 3, 1, 2, 0, 1])
    direct = np.mean([np.sum((z[i] - centers[assign[i]]).detach().numpy() ** 2) for i in range(7)])
    loss = cluster_loss(z, centers, assign)
    assert loss.item() == pytest.approx(direct, rel=1e-6)
    loss.backward()
    # Centres are held fixed while the AE trains: no gradient reaches them.
    assert centers.grad is None
    expected_grad = 2 * (z - centers[assign]).detach() / 7
    torch.testing.assert_close(z.grad, expected_grad)


def test_global_input_scaling_is_stored_and_used(digits):
    X, _ = digits
    model = build_autoencoder(64, 10, SMALL, seed=0)
    model.fit_input_scaling(X)
    assert model.input_shift.item() == pytest.approx(X.mean(), rel=1e-5)
    assert model.input_scale.item() == pytest.approx(X.std(), rel=1e-5)
    scaled = model.normalize(torch.from_numpy(X))
    assert scaled.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert scaled.std().item() == pytest.approx(1.0, abs=1e-3)
    # Scaling is part of the state dict, so a reloaded model encodes raw data the same way.
    clone = MLPAutoencoder(**model.architecture())
    clone.load_state_dict(model.state_dict())
    np.testing.assert_array_equal(encode(clone, X[:50]), encode(model, X[:50]))


def test_pretraining_decreases_reconstruction_loss(digits):
    X, _ = digits
    model = build_autoencoder(64, 10, SMALL, seed=0)
    model.fit_input_scaling(X)
    history = train_autoencoder(model, X, AETrainSettings(epochs=15, lr=2e-3), seed=0)
    losses = [h["loss"] for h in history]
    # Observed: 61.3 -> 27.7 (per-sample squared error in global-std units, 64 pixels).
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < min(losses[:3])
    assert all(h["cluster"] == 0.0 for h in history)


def test_cluster_term_pulls_embeddings_to_fixed_centres(digits):
    X, y = digits
    model = build_autoencoder(64, 10, SMALL, seed=0)
    model.fit_input_scaling(X)
    train_autoencoder(model, X, AETrainSettings(epochs=5), seed=0)
    Z = encode(model, X)
    centers = np.stack([Z[y == k].mean(axis=0) for k in range(10)])
    before = np.mean(np.sum((Z - centers[y]) ** 2, axis=1))
    history = train_autoencoder(
        model,
        X,
        AETrainSettings(epochs=10, beta=1.0, recon_weight=0.005),
        seed=0,
        centers=centers,
        assignments=y,
    )
    after = np.mean(np.sum((encode(model, X) - centers[y]) ** 2, axis=1))
    assert history[-1]["cluster"] < history[0]["cluster"]
    assert after < 0.5 * before
    # loss = recon_weight * recon + beta / 2 * cluster, recorded per epoch.
    last = history[-1]
    assert last["loss"] == pytest.approx(0.005 * last["recon"] + 0.5 * last["cluster"], rel=1e-4)


def test_cluster_term_needs_centres():
    model = build_autoencoder(8, 2, (4,), seed=0)
    with pytest.raises(ValueError, match="centres"):
        train_autoencoder(model, np.zeros((4, 8), np.float32), AETrainSettings(1, beta=1.0), seed=0)


def test_training_is_deterministic_for_a_seed_and_differs_across_seeds(digits):
    X = digits[0][:400]

    def run(seed: int) -> tuple[np.ndarray, list[dict[str, float]]]:
        model = build_autoencoder(64, 5, SMALL, seed=seed)
        model.fit_input_scaling(X)
        history = train_autoencoder(model, X, AETrainSettings(epochs=3, batch_size=64), seed=seed)
        return encode(model, X), history

    a, ha = run(3)
    b, hb = run(3)
    c, _ = run(4)
    np.testing.assert_array_equal(a, b)
    assert ha == hb
    assert not np.allclose(a, c)


def test_building_a_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_autoencoder(16, 4, (8,), seed=0)
    torch.testing.assert_close(torch.rand(3), expected)
