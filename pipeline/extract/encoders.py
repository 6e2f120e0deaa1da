"""Image encoders for feature extraction: MoCo v1/v2/v3 and torchvision ResNets, raw pixels.

Checkpoint layouts understood (the published ones): ``moco_v2`` (also MoCo v1;
facebookresearch/moco), the query encoder under ``module.encoder_q.``; ``moco_v3``
(facebookresearch/moco-v3), the base encoder under ``module.base_encoder.``;
``torchvision``, a plain ResNet ``state_dict`` (optionally under ``state_dict``/``model``
and/or with DDP's ``module.`` prefix). Their ``fc`` heads: :func:`_default_head`,
:func:`head_from_state`. Without ``--head`` the encoder returns the pooled trunk (2048-D
for ResNet-50), with it the projection output (128-D for MoCo v2, the ImageNet-50 features
DeepDPM clusters; 256-D for v3; the 1000 logits for torchvision); docs/features.md.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepdpm_core.errors import CheckpointError, ConfigError
from deepdpm_core.model import safe_load
from pipeline.extract.encoder_choices import ENCODERS, RESNET_ARCHS
from pipeline.extract.preprocess import Preprocess
from pipeline.io.input_fingerprint import file_sha256

#: prefixes of the query/base encoder inside the published MoCo checkpoints (DDP and not)
MOCO_PREFIXES = {"moco_v2": ("module.encoder_q.", "encoder_q."),
                 "moco_v3": ("module.base_encoder.", "base_encoder.")}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: seed of the random initialisation when no weights are given (same weights on every actor)
RANDOM_INIT_SEED = 0


@dataclass(frozen=True)
class EncoderSpec:
    """Everything that determines the embeddings (also the identity checked on resume).

    Parameters
    ----------
    name : one of :data:`ENCODERS`
    weights : checkpoint path, or None for a seeded random initialisation
    arch : torchvision ResNet name (ignored by ``pixels``)
    head : return the projection head's output instead of the pooled trunk
    pixel_size : side of the grayscale thumbnail of the ``pixels`` encoder
    l2_normalize : scale every embedding to unit length
    """

    name: str = "pixels"
    weights: str | None = None
    arch: str = "resnet50"
    head: bool = False
    pixel_size: int = 8
    l2_normalize: bool = False

    def __post_init__(self) -> None:
        if self.name not in ENCODERS:
            raise ConfigError(f"unknown encoder '{self.name}': choose one of {', '.join(ENCODERS)}")
        if self.name != "pixels" and self.arch not in RESNET_ARCHS:
            raise ConfigError(f"unknown arch '{self.arch}': choose one of "
                              f"{', '.join(RESNET_ARCHS)}")
        if self.name == "pixels" and (self.weights is not None or self.head):
            raise ConfigError("the 'pixels' encoder takes no --weights and no --head")
        if self.pixel_size < 1:
            raise ConfigError(f"pixel_size must be >= 1, got {self.pixel_size}")
        if self.weights is not None and not Path(self.weights).is_file():
            raise FileNotFoundError(f"weights not found: {self.weights}")

    @property
    def preprocess(self) -> Preprocess:
        if self.name == "pixels":
            return Preprocess(mode="L", resize=self.pixel_size, crop=self.pixel_size)
        return Preprocess(mode="RGB", resize=256, crop=224)

    def identity(self) -> dict:
        """A JSON-able description that changes whenever the embeddings would."""
        ident = asdict(self)
        if self.weights is not None:
            ident["weights"] = str(Path(self.weights).resolve())
            ident["weights_sha256"] = file_sha256(self.weights)
        return ident


class PixelEncoder(nn.Module):
    """Flattened grayscale thumbnail scaled to [0, 1]: [B, 1, s, s] uint8 -> [B, s*s]."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.output_dim = size * size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.flatten(1).float() / 255.0


class ResNetEncoder(nn.Module):
    """ImageNet-normalised ResNet trunk, optionally followed by a projection head.

    ``forward`` takes uint8 images [B, 3, 224, 224] and returns float embeddings
    [B, output_dim]: pooled trunk features, or the head's output when a head is set.
    """

    def __init__(self, trunk: nn.Module, trunk_dim: int, head: nn.Module | None) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = head
        self.register_buffer("mean", 255.0 * torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", 255.0 * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))
        self.output_dim = _head_dim(head) if head is not None else trunk_dim

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float() - self.mean) / self.std
        x = x.contiguous(memory_format=torch.channels_last)
        features = self.trunk(x)
        return self.head(features) if self.head is not None else features


def _head_dim(head: nn.Module) -> int:
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features


def _resnet_trunk(arch: str) -> tuple[nn.Module, int]:
    """A torchvision ResNet without its classifier: [B, 3, H, W] -> [B, trunk_dim]."""
    import torchvision  # slow to import; the pixels encoder never needs it

    model = torchvision.models.get_model(arch, weights=None)
    trunk_dim = model.fc.in_features
    model.fc = nn.Identity()
    return model, trunk_dim


def _default_head(name: str, trunk_dim: int) -> nn.Module:
    """The published head of ``name`` (random weights), for runs without a checkpoint."""
    if name == "moco_v2":
        return nn.Sequential(nn.Linear(trunk_dim, trunk_dim), nn.ReLU(), nn.Linear(trunk_dim, 128))
    if name == "moco_v3":
        return nn.Sequential(nn.Linear(trunk_dim, 4096, bias=False), nn.BatchNorm1d(4096),
                             nn.ReLU(), nn.Linear(4096, 256, bias=False),
                             nn.BatchNorm1d(256, affine=False))
    return nn.Linear(trunk_dim, 1000)  # torchvision classifier


def head_from_state(state: dict[str, torch.Tensor]) -> nn.Module:
    """Build the ``fc`` module that ``state`` (keys relative to ``fc.``) was saved from.

    ``weight``/``bias`` is a single Linear (MoCo v1, torchvision). ``<i>.<param>`` is an
    ``nn.Sequential``: 2-D ``weight`` -> Linear (bias if saved), ``running_mean`` ->
    BatchNorm1d (affine if it has a weight); indices without parameters are the ReLUs
    (MoCo v2: 0, 2; MoCo v3: 0, 1, 3, 4).
    """
    if "weight" in state:
        out_dim, in_dim = state["weight"].shape
        return nn.Linear(in_dim, out_dim, bias="bias" in state)
    groups: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = re.fullmatch(r"(\d+)\.(\w+)", key)
        if match is None:
            raise CheckpointError(f"unexpected key in the projection head: fc.{key}")
        groups.setdefault(int(match.group(1)), {})[match.group(2)] = value
    if not groups:
        raise CheckpointError("the checkpoint has no projection head (no 'fc.' keys)")
    layers: list[nn.Module] = []
    for index in range(max(groups) + 1):
        params = groups.get(index)
        if params is None:
            layers.append(nn.ReLU())
        elif "running_mean" in params:
            layers.append(nn.BatchNorm1d(len(params["running_mean"]), affine="weight" in params))
        elif "weight" in params and params["weight"].ndim == 2:
            out_dim, in_dim = params["weight"].shape
            layers.append(nn.Linear(in_dim, out_dim, bias="bias" in params))
        else:
            raise CheckpointError(f"cannot tell what layer fc.{index} is: {sorted(params)}")
    return nn.Sequential(*layers)


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a checkpoint safely (``weights_only=True``) and return its tensor state dict.

    Unwraps ``{"state_dict": ...}`` and ``{"model": ...}`` (MoCo and most training scripts).
    """
    obj = safe_load(path)
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
            break
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} holds no state dict of tensors")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def _top_prefixes(keys: list[str], depth: int = 2) -> list[str]:
    return sorted({".".join(k.split(".")[:depth]) + "." for k in keys})


def split_checkpoint(
    state: dict[str, torch.Tensor], name: str, source: str = "checkpoint"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Select the encoder of a ``name``-format state dict: (trunk state, ``fc`` state).

    Raises
    ------
    CheckpointError
        The expected key prefix is absent (wrong format); the message lists what is there.
    """
    keys = list(state)
    if name in MOCO_PREFIXES:
        prefix = next((p for p in MOCO_PREFIXES[name] if any(k.startswith(p) for k in keys)), None)
        if prefix is None:
            hint = next((f" (looks like a {other} checkpoint: use --encoder {other})"
                         for other, prefixes in MOCO_PREFIXES.items()
                         if other != name and any(k.startswith(prefixes) for k in keys)), "")
            raise CheckpointError(f"{source} is not a {name} checkpoint: no key starts with "
                                  f"'{MOCO_PREFIXES[name][0]}'; key prefixes found: "
                                  f"{', '.join(_top_prefixes(keys)[:8])}{hint}")
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    elif all(k.startswith("module.") for k in keys):
        state = {k[len("module.") :]: v for k, v in state.items()}
    trunk = {k: v for k, v in state.items() if not k.startswith("fc.")}
    head = {k[len("fc.") :]: v for k, v in state.items() if k.startswith("fc.")}
    return trunk, head


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``load_state_dict(strict=True)`` with one readable error naming the offending keys."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k} {list(state[k].shape)} vs {list(v.shape)}"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("shape mismatches (checkpoint vs model)", mismatched)):
        if items:
            shown = ", ".join(items[:6]) + (", ..." if len(items) > 6 else "")
            problems.append(f"{len(items)} {label}: {shown}")
    if problems:
        raise CheckpointError(f"{what} does not match the checkpoint: " + "; ".join(problems))
    module.load_state_dict(state, strict=True)


def build_encoder(spec: EncoderSpec) -> nn.Module:
    """Construct the encoder of ``spec`` in eval mode, weights loaded.

    Returns
    -------
    nn.Module
        Maps uint8 images [B, *spec.preprocess.shape] to float embeddings
        [B, module.output_dim].

    Raises
    ------
    CheckpointError
        Unreadable checkpoint, wrong format, missing/unexpected keys, shape mismatch.
    """
    if spec.name == "pixels":
        return PixelEncoder(spec.pixel_size).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)  # weights=None: identical weights on every actor
        trunk, trunk_dim = _resnet_trunk(spec.arch)
        head = _default_head(spec.name, trunk_dim) if spec.head else None
    if spec.weights is not None:
        source = str(spec.weights)
        trunk_state, head_state = split_checkpoint(load_state_dict_file(spec.weights),
                                                   spec.name, source)
        _load_strict(trunk, trunk_state, f"{spec.arch} trunk ({spec.name}, {source})")
        if spec.head:
            head = head_from_state(head_state)
            _load_strict(head, head_state, f"projection head fc ({spec.name}, {source})")
    return ResNetEncoder(trunk, trunk_dim, head).eval()


def embed_numpy(encoder: nn.Module, images: np.ndarray, device: torch.device | str = "cpu",
                amp_dtype: torch.dtype | None = None, l2_normalize: bool = False) -> np.ndarray:
    """Embed one batch of uint8 images [B, C, H, W] -> float32 [B, D] (no autograd).

    On CUDA the batch is pinned and copied asynchronously; ``amp_dtype`` (bf16/fp16)
    runs the convolutions under autocast. Outputs are always float32.
    """
    device = torch.device(device)
    batch = torch.from_numpy(np.ascontiguousarray(images))
    if device.type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    with (torch.inference_mode(),
          torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                         enabled=amp_dtype is not None)):
        out = encoder(batch).float()
    if l2_normalize:
        out = nn.functional.normalize(out, dim=1)
    return out.cpu().numpy()
