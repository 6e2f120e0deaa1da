"""The autoencoder's file: architecture, weights and config in one checkpoint
(``OUT/autoencoder.pt`` of an alternating fit, ``deepdpm embed --save-model``), written
atomically and read through the one safe loader (:func:`deepdpm_core.model.safe_load`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from deepdpm_core.errors import CheckpointError
from deepdpm_core.features.autoencoder import MLPAutoencoder
from deepdpm_core.model import safe_load, save_checkpoint

if TYPE_CHECKING:
    from deepdpm_core.config import Config

AE_FORMAT = "deepdpm-autoencoder-v1"


def save_autoencoder(model: MLPAutoencoder, config: Config, path: str | Path) -> None:
    """Write ``model`` (architecture, weights, input scaling) and its ``config`` atomically."""
    payload = {
        "format": AE_FORMAT,
        "architecture": model.architecture(),
        "state_dict": model.state_dict(),
        "config": config.to_dict(),
    }
    save_checkpoint(payload, path)


def load_autoencoder(path: str | Path) -> MLPAutoencoder:
    """Read a model written by :func:`save_autoencoder`, in eval mode.

    Raises
    ------
    CheckpointError
        The file is unsafe or not a deepdpm autoencoder.
    """
    payload = safe_load(path, "autoencoder")
    if not isinstance(payload, dict) or payload.get("format") != AE_FORMAT:
        raise CheckpointError(f"{path} is not a deepdpm autoencoder ({AE_FORMAT})")
    arch = payload["architecture"]
    model = MLPAutoencoder(arch["input_dim"], arch["latent_dim"], arch["hidden"])
    model.load_state_dict(payload["state_dict"])
    return model.eval()


__all__ = ["AE_FORMAT", "load_autoencoder", "save_autoencoder"]
