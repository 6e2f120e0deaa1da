"""Test data for shards/extract/encoders: image folders, raw shards, MoCo-layout checkpoints.

The checkpoints are built the way the published training scripts build their models
(facebookresearch/moco ``moco/builder.py`` and facebookresearch/moco-v3
``moco/builder.py``), randomly initialised, and saved as their ``main_moco.py`` saves
them (DDP ``module.`` prefix, ``{"epoch", "arch", "state_dict", "optimizer"}``).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torchvision
import webdataset as wds
from PIL import Image
from torch import nn


def generated_image_folder(
    dest: Path, n_classes: int = 3, per_class: int = 4, seed: int = 0
) -> Path:
    """RGB images of assorted sizes and formats (jpg, png), one folder per class.

    Class ``c`` images are tinted towards a class colour so classes differ visibly.
    """
    rng = np.random.default_rng(seed)
    for c in range(n_classes):
        folder = dest / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        tint = rng.integers(0, 256, size=3)
        for i in range(per_class):
            h, w = int(rng.integers(40, 120)), int(rng.integers(40, 120))
            noise = rng.integers(0, 256, size=(h, w, 3))
            pixels = ((noise + 2 * tint) / 3).astype(np.uint8)
            ext = "jpg" if i % 2 == 0 else "png"
            Image.fromarray(pixels).save(folder / f"img_{i}.{ext}")
    return dest


def encode_png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_raw_shard(path: Path, samples: list[dict]) -> Path:
    """Write ``samples`` (webdataset dicts of bytes) verbatim, bypassing ``deepdpm shards``."""
    with wds.TarWriter(str(path), encoder=False) as writer:
        for sample in samples:
            writer.write(sample)
    return path


def moco_v2_state(arch: str = "resnet18", dim: int = 128, mlp: bool = True, seed: int = 1) -> dict:
    """State dict of facebookresearch/moco's ``MoCo`` (v1: ``mlp=False``; v2: ``mlp=True``)."""
    torch.manual_seed(seed)
    encoders = {}
    for name in ("encoder_q", "encoder_k"):
        model = torchvision.models.get_model(arch, weights=None, num_classes=dim)
        if mlp:
            dim_mlp = model.fc.weight.shape[1]
            model.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), model.fc)
        encoders[name] = model
    encoders["encoder_k"].load_state_dict(encoders["encoder_q"].state_dict())
    state = {}
    for name, model in encoders.items():
        state.update({f"module.{name}.{k}": v for k, v in model.state_dict().items()})
    state["module.queue"] = nn.functional.normalize(torch.randn(dim, 64), dim=0)
    state["module.queue_ptr"] = torch.zeros(1, dtype=torch.long)
    return state


def moco_v3_mlp(num_layers, input_dim, mlp_dim, output_dim, last_bn=True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for layer in range(num_layers):
        dim1 = input_dim if layer == 0 else mlp_dim
        dim2 = output_dim if layer == num_layers - 1 else mlp_dim
        layers.append(nn.Linear(dim1, dim2, bias=False))
        if layer < num_layers - 1:
            layers.extend([nn.BatchNorm1d(dim2), nn.ReLU(inplace=True)])
        elif last_bn:
            layers.append(nn.BatchNorm1d(dim2, affine=False))
    return nn.Sequential(*layers)


def moco_v3_state(arch: str = "resnet18", dim: int = 256, mlp_dim: int = 4096) -> dict:
    """State dict of facebookresearch/moco-v3's ``MoCo_ResNet`` (projector and predictor)."""
    torch.manual_seed(2)
    state = {}
    for name in ("base_encoder", "momentum_encoder"):
        model = torchvision.models.get_model(arch, weights=None, num_classes=mlp_dim)
        hidden_dim = model.fc.weight.shape[1]
        model.fc = moco_v3_mlp(2, hidden_dim, mlp_dim, dim)
        # non-trivial BN statistics, so a head loaded wrongly would show
        for module in model.fc.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
        state.update({f"module.{name}.{k}": v for k, v in model.state_dict().items()})
    predictor = moco_v3_mlp(2, dim, mlp_dim, dim, last_bn=False)
    state.update({f"module.predictor.{k}": v for k, v in predictor.state_dict().items()})
    return state


def save_checkpoint(path: Path, state: dict, arch: str = "resnet18") -> Path:
    """Save as MoCo's ``main_moco.py`` does."""
    torch.save({"epoch": 200, "arch": arch, "state_dict": state, "optimizer": {}}, path)
    return path
