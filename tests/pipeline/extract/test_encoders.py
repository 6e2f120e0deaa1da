"""Encoders: MoCo v1/v2/v3 and torchvision checkpoints in their published layouts."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from deepdpm_core.errors import CheckpointError, ConfigError
from pipeline.extract.encoders import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EncoderSpec,
    build_encoder,
    embed_numpy,
    head_from_state,
)
from tests.support.image_data import moco_v2_state, moco_v3_mlp, moco_v3_state, save_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(3, 3, 224, 224), dtype=np.uint8)


def reference_embedding(state: dict, prefix: str, arch: str, head: nn.Module | None, images):
    """Embeddings computed independently of pipeline.extract.encoders: a torchvision model with
    the checkpoint's weights, normalised by hand."""
    model = torchvision.models.get_model(arch, weights=None)
    model.fc = head if head is not None else nn.Identity()
    own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    model.load_state_dict(
        own if head is not None else {k: v for k, v in own.items() if not k.startswith("fc.")}
    )
    x = torch.from_numpy(images).float() / 255.0
    x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(
        1, 3, 1, 1
    )
    with torch.no_grad():
        return model.eval()(x).numpy()


def test_moco_v2_resnet50_head_and_trunk_match_the_checkpoint(tmp_path, images):
    state = moco_v2_state("resnet50")
    path = save_checkpoint(tmp_path / "moco_v2_800ep_pretrain.pth.tar", state, "resnet50")

    head_enc = build_encoder(EncoderSpec("moco_v2", str(path), "resnet50", head=True))
    trunk_enc = build_encoder(EncoderSpec("moco_v2", str(path), "resnet50", head=False))
    assert head_enc.output_dim == 128 and trunk_enc.output_dim == 2048

    mlp = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 128))
    want_head = reference_embedding(state, "module.encoder_q.", "resnet50", mlp, images)
    want_trunk = reference_embedding(state, "module.encoder_q.", "resnet50", None, images)
    np.testing.assert_allclose(embed_numpy(head_enc, images), want_head, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(embed_numpy(trunk_enc, images), want_trunk, rtol=1e-4, atol=1e-5)


def test_moco_v1_linear_head_loads(tmp_path, images):
    path = save_checkpoint(tmp_path / "v1.pth.tar", moco_v2_state("resnet18", mlp=False))
    encoder = build_encoder(EncoderSpec("moco_v2", str(path), "resnet18", head=True))
    assert isinstance(encoder.head, nn.Linear) and encoder.output_dim == 128
    assert embed_numpy(encoder, images).shape == (3, 128)


def test_moco_v3_projector_with_affine_free_bn_loads(tmp_path, images):
    state = moco_v3_state("resnet18")
    path = save_checkpoint(tmp_path / "r-50-300ep.pth.tar", state)
    encoder = build_encoder(EncoderSpec("moco_v3", str(path), "resnet18", head=True))
    assert encoder.output_dim == 256
    last_bn = encoder.head[4]
    assert isinstance(last_bn, nn.BatchNorm1d) and not last_bn.affine

    want = reference_embedding(
        state, "module.base_encoder.", "resnet18", moco_v3_mlp(2, 512, 4096, 256), images
    )
    np.testing.assert_allclose(embed_numpy(encoder, images), want, rtol=1e-4, atol=1e-5)


def test_torchvision_state_dict_with_ddp_prefix(tmp_path, images):
    model = torchvision.models.resnet18(weights=None, num_classes=1000)
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "r18.pth")
    encoder = build_encoder(
        EncoderSpec("torchvision", str(tmp_path / "r18.pth"), "resnet18", head=True)
    )
    assert encoder.output_dim == 1000
    want = reference_embedding(
        {f"m.{k}": v for k, v in model.state_dict().items()},
        "m.",
        "resnet18",
        nn.Linear(512, 1000),
        images,
    )
    np.testing.assert_allclose(embed_numpy(encoder, images), want, rtol=1e-4, atol=1e-5)


def test_wrong_format_names_the_right_one(tmp_path):
    path = save_checkpoint(tmp_path / "v2.pth.tar", moco_v2_state("resnet18"))
    with pytest.raises(
        CheckpointError, match=r"not a moco_v3 checkpoint.*module\.encoder_q\..*--encoder moco_v2"
    ):
        build_encoder(EncoderSpec("moco_v3", str(path), "resnet18"))


def test_wrong_arch_lists_missing_unexpected_and_mismatched_keys(tmp_path):
    path = save_checkpoint(tmp_path / "v2.pth.tar", moco_v2_state("resnet18"))
    with pytest.raises(CheckpointError) as err:
        build_encoder(EncoderSpec("moco_v2", str(path), "resnet50"))
    message = str(err.value)
    assert "resnet50 trunk" in message and str(path) in message
    assert "missing keys" in message and "layer1.0.conv3.weight" in message
    assert "shape mismatches" in message


def test_partial_checkpoint_names_missing_keys(tmp_path):
    state = {k: v for k, v in moco_v2_state("resnet18").items() if ".layer4." not in k}
    path = save_checkpoint(tmp_path / "partial.pth.tar", state)
    with pytest.raises(CheckpointError, match=r"missing keys: layer4\.0\.conv1\.weight"):
        build_encoder(EncoderSpec("moco_v2", str(path), "resnet18"))


def test_unsafe_or_garbage_files_are_refused(tmp_path):
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint"):
        build_encoder(EncoderSpec("torchvision", str(tmp_path / "junk.pth"), "resnet18"))
    torch.save({"args": argparse.Namespace(lr=0.1), "state_dict": {}}, tmp_path / "args.pth")
    with pytest.raises(CheckpointError, match=r"weights_only=True.*argparse\.Namespace"):
        build_encoder(EncoderSpec("moco_v2", str(tmp_path / "args.pth"), "resnet18"))


def test_random_init_is_seeded_and_leaves_global_rng_alone(images):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = embed_numpy(build_encoder(EncoderSpec("moco_v3", None, "resnet18", head=True)), images)
    after = torch.rand(1)
    b = embed_numpy(build_encoder(EncoderSpec("moco_v3", None, "resnet18", head=True)), images)
    np.testing.assert_array_equal(a, b)
    assert before == after


def test_head_from_state_reads_the_published_layouts():
    v2 = head_from_state(
        {
            "0.weight": torch.zeros(8, 4),
            "0.bias": torch.zeros(8),
            "2.weight": torch.zeros(3, 8),
            "2.bias": torch.zeros(3),
        }
    )
    assert [type(m) for m in v2] == [nn.Linear, nn.ReLU, nn.Linear]
    with pytest.raises(CheckpointError, match="fc.oops"):
        head_from_state({"oops": torch.zeros(1)})


def test_pixels_and_spec_validation(tmp_path):
    encoder = build_encoder(EncoderSpec("pixels", pixel_size=4))
    out = embed_numpy(encoder, np.full((2, 1, 4, 4), 51, np.uint8))
    np.testing.assert_allclose(out, 0.2, rtol=1e-6)
    with pytest.raises(ConfigError, match="unknown encoder"):
        EncoderSpec("simclr")
    with pytest.raises(ConfigError, match="unknown arch"):
        EncoderSpec("moco_v2", arch="vit_b_16")
    with pytest.raises(ConfigError, match="takes no --weights"):
        EncoderSpec("pixels", head=True)
    with pytest.raises(FileNotFoundError):
        EncoderSpec("moco_v2", weights=str(tmp_path / "missing.pth"))
