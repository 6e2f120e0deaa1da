"""MLP autoencoder, its losses and its training loop (paper Supmat 'Jointly Learning Features').

The DEC/DCN/n2d architecture ``D-500-500-2000-d`` (ReLU after every hidden layer, linear
latent and reconstruction), trained on the per-sample loss, averaged over the minibatch,

    recon_weight * ||g(f(x)) - x||^2  +  (beta / 2) * ||f(x) - mu_{z(x)}||^2

with ``mu_{z(x)}`` the fixed centre of x's DeepDPM cluster during the alternation, and
``beta = 0`` when pretraining. Inputs are scaled by one global offset and scale
(the mean and std of all entries, kept in the module's buffers):
unlike per-feature standardisation it does not blow up near-constant border pixels, and it
frees the learning rate from the data's units (0..1, 0..255 pixels, MoCo features). Pure
torch, no I/O; every random choice derives from ``seed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepdpm_core.errors import DataError

# the search's: ``cuda`` without a CUDA device fails here, in one line, not deep in torch
from deepdpm_core.runtime import resolve_device


class MLPAutoencoder(nn.Module):
    """Fully connected autoencoder ``D-h1-...-hL-d-hL-...-h1-D``.

    Parameters
    ----------
    input_dim : int
        D, the input dimension.
    latent_dim : int
        d, the embedding dimension (must be < D).
    hidden : sequence of int
        Encoder hidden sizes; the decoder mirrors them.
    """

    def __init__(self, input_dim: int, latent_dim: int, hidden: Sequence[int] = (500, 500, 2000)):
        super().__init__()
        if latent_dim >= input_dim:
            raise DataError(
                f"the embedding dimension ({latent_dim}) must be smaller than the input "
                f"dimension ({input_dim})"
            )
        self.input_dim = int(input_dim)
        self.latent_dim = int(latent_dim)
        self.hidden = tuple(int(h) for h in hidden)
        self.encoder = _mlp([self.input_dim, *self.hidden, self.latent_dim])
        self.decoder = _mlp([self.latent_dim, *reversed(self.hidden), self.input_dim])
        self.register_buffer("input_shift", torch.zeros((), dtype=torch.float32))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32))

    def architecture(self) -> dict[str, object]:
        """Constructor arguments (stored beside the ``state_dict`` in checkpoints)."""
        return {
            "input_dim": self.input_dim,
            "latent_dim": self.latent_dim,
            "hidden": list(self.hidden),
        }

    def fit_input_scaling(self, X: np.ndarray) -> None:
        """Set the global offset and scale: the mean and std of all entries of ``X`` [N, D]."""
        shift = float(np.mean(X, dtype=np.float64))
        scale = float(np.std(X, dtype=np.float64)) or 1.0  # constant data: keep units
        self.input_shift.fill_(shift)
        self.input_scale.fill_(scale)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Raw input [B, D] -> the scaled space the decoder reconstructs."""
        return (x - self.input_shift) / self.input_scale

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Raw input [B, D] -> embedding f(x) [B, d]."""
        return self.encoder(self.normalize(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw input [B, D] -> (embedding [B, d], reconstruction of ``normalize(x)`` [B, D])."""
        z = self.encode(x)
        return z, self.decoder(z)


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def build_autoencoder(
    input_dim: int, latent_dim: int, hidden: Sequence[int], seed: int
) -> MLPAutoencoder:
    """An :class:`MLPAutoencoder` whose initial weights depend only on ``seed``.

    The global torch RNG is forked, so building a model does not disturb the caller's
    random stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLPAutoencoder(input_dim, latent_dim, hidden)


def reconstruction_loss(x_scaled: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``||x_hat_i - x_i||^2`` (Supmat Eq. L_AE_recon).

    Parameters
    ----------
    x_scaled, x_hat : Tensor of shape (B, D)
    """
    return (x_hat - x_scaled).pow(2).sum(dim=1).mean()


def cluster_loss(z: torch.Tensor, centers: torch.Tensor, assignments: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``||f(x_i) - mu_{z_i}||^2`` (Supmat Eq. L_AE_clus).

    Parameters
    ----------
    z : Tensor of shape (B, d)
        Embeddings f(x_i).
    centers : Tensor of shape (K, d)
        Cluster centres, held fixed (no gradient flows into them).
    assignments : LongTensor of shape (B,)
        Hard cluster index z_i of every point, in ``[0, K)``.
    """
    return (z - centers.detach()[assignments]).pow(2).sum(dim=1).mean()


@dataclass(frozen=True)
class AETrainSettings:
    """What one call of :func:`train_autoencoder` does (taken from ``AEConfig``)."""

    epochs: int
    lr: float = 0.002
    batch_size: int = 256
    recon_weight: float = 1.0
    beta: float = 0.0


EpochCallback = Callable[[dict[str, float]], None]


def train_autoencoder(
    model: MLPAutoencoder,
    X: np.ndarray,
    settings: AETrainSettings,
    *,
    seed: int,
    centers: np.ndarray | None = None,
    assignments: np.ndarray | None = None,
    device: str | torch.device = "cpu",
    on_epoch: EpochCallback | None = None,
) -> list[dict[str, float]]:
    """Train ``model`` in place with Adam on minibatches of ``X``.

    Parameters
    ----------
    model : MLPAutoencoder
        Its input scaling must already be set (:meth:`MLPAutoencoder.fit_input_scaling`).
    X : ndarray of shape (N, D), float32
    settings : AETrainSettings
        With ``beta > 0`` the clustering term is added; it then needs ``centers`` and
        ``assignments``.
    seed : int
        Seeds the minibatch order.
    centers : ndarray of shape (K, d), optional
        Fixed cluster centres in the embedding space.
    assignments : ndarray of shape (N,), int, optional
        Fixed cluster index of every row of ``X``.
    device : str or torch.device
    on_epoch : callable, optional
        Called after each epoch with ``{"epoch", "loss", "recon", "cluster"}`` (epoch means).

    Returns
    -------
    list of dict
        One entry per epoch, as passed to ``on_epoch``.
    """
    use_cluster_term = settings.beta > 0
    if use_cluster_term and (centers is None or assignments is None):
        raise ValueError("beta > 0 needs the fixed cluster centres and assignments")
    device = torch.device(device)
    model.to(device).train()
    data = torch.as_tensor(np.ascontiguousarray(X, dtype=np.float32), device=device)
    n = data.shape[0]
    if use_cluster_term:
        assert centers is not None and assignments is not None
        mu = torch.as_tensor(np.asarray(centers, dtype=np.float32), device=device)
        z_idx = torch.as_tensor(np.asarray(assignments, dtype=np.int64), device=device)
        if z_idx.shape != (n,) or int(z_idx.min()) < 0 or int(z_idx.max()) >= mu.shape[0]:
            raise ValueError("assignments must be [N] indices into centers")
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)  # the paper's recipe: no weight decay
    generator = torch.Generator().manual_seed(seed)
    history: list[dict[str, float]] = []
    for epoch in range(settings.epochs):
        order = torch.randperm(n, generator=generator).to(device)
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for start in range(0, n, settings.batch_size):
            idx = order[start : start + settings.batch_size]
            x = data[idx]
            z, x_hat = model(x)
            recon = reconstruction_loss(model.normalize(x), x_hat)
            loss = settings.recon_weight * recon
            clus = torch.zeros((), device=device)
            if use_cluster_term:
                clus = cluster_loss(z, mu, z_idx[idx])
                loss = loss + 0.5 * settings.beta * clus
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # Sums weighted by batch size -> exact epoch means; one host sync per epoch.
            sums += len(idx) * torch.stack([loss.detach(), recon.detach(), clus.detach()]).double()
        means = (sums / n).tolist()
        record = {"epoch": float(epoch), "loss": means[0], "recon": means[1], "cluster": means[2]}
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
    model.eval()
    return history


@torch.no_grad()
def encode(
    model: MLPAutoencoder,
    X: np.ndarray,
    *,
    batch_size: int = 4096,
    device: str | torch.device = "cpu",
) -> np.ndarray:
    """Embeddings f(x) of the rows of ``X`` [N, D] -> float32 [N, d]."""
    device = torch.device(device)
    model.to(device).eval()
    out = np.empty((len(X), model.latent_dim), dtype=np.float32)
    for start in range(0, len(X), batch_size):
        x = torch.as_tensor(
            np.ascontiguousarray(X[start : start + batch_size], dtype=np.float32), device=device
        )
        out[start : start + len(x)] = model.encode(x).cpu().numpy()
    return out


__all__ = [
    "AETrainSettings",
    "MLPAutoencoder",
    "build_autoencoder",
    "cluster_loss",
    "encode",
    "reconstruction_loss",
    "resolve_device",
    "train_autoencoder",
]
