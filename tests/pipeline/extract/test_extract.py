"""``deepdpm extract`` on a real local Ray cluster (2 CPUs), real shards, real Parquet."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from deepdpm_core.errors import ConfigError
from pipeline.cli import main
from pipeline.extract.encoders import EncoderSpec, build_encoder, embed_numpy
from pipeline.extract.manifest import read_shard_entry
from pipeline.extract.preprocess import preprocess_image
from pipeline.extract.ray_pipeline import extract_features
from pipeline.extract.shards import digits_image_folder, write_shards
from pipeline.io.tables import read_features
from tests.support.image_data import (
    encode_png,
    generated_image_folder,
    moco_v2_state,
    save_checkpoint,
    write_raw_shard,
)

pytestmark = pytest.mark.ray

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    write_shards(
        digits_image_folder(root / "images"), root / "shards", shard_size=600, progress=False
    )
    return root / "shards"


@pytest.fixture(scope="module")
def digit_features(ray_cluster, digit_shards, tmp_path_factory):
    """pixels features of all digits, with a pool of 2 encoder actors (half a CPU each)."""
    out = tmp_path_factory.mktemp("features") / "digits"
    report = extract_features(
        digit_shards,
        out,
        "pixels",
        batch_size=128,
        num_workers=2,
        cpus_per_worker=0.5,
        progress=False,
    )
    return out, report


def test_pixels_of_rendered_digits_are_the_digits(digit_features):
    out, report = digit_features
    assert (report.images_read, report.images_embedded, report.images_skipped) == (1797, 1797, 0)
    assert report.shards_done == 3 and report.dim == 64 and report.images_per_s > 0
    assert sorted(p.name for p in out.iterdir()) == [
        "_manifest.json",
        "shard-000000.parquet",
        "shard-000001.parquet",
        "shard-000002.parquet",
    ]
    features = read_features(out)
    digits = load_digits()
    index = np.array([int(k.rsplit("_", 1)[1]) for k in features.keys])
    assert sorted(index) == list(range(1797))  # one row per image, no duplicates
    # rendering rounds v*255/16 to uint8 and the box filter averages it back: |error| <= 0.5/255
    np.testing.assert_allclose(features.X, digits.data[index] / 16.0, atol=0.5 / 255 + 1e-6)
    np.testing.assert_array_equal(features.labels, digits.target[index])

    table = pq.read_table(out / "shard-000001.parquet")
    embedding_type = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(embedding_type) and embedding_type.list_size == 64
    assert embedding_type.value_type == pa.float32()
    keys = table.column("key").to_pylist()
    assert keys == sorted(keys) and len(keys) == 600

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["totals"] == {"shards": 3, "read": 1797, "embedded": 1797, "skipped": 0}


def test_rerun_redoes_only_the_deleted_shard(digit_features, digit_shards, tmp_path):
    original, _ = digit_features
    out = tmp_path / "resume"
    shutil.copytree(original, out)
    (out / "shard-000001.parquet").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}

    report = extract_features(digit_shards, out, "pixels", batch_size=128, progress=False)
    assert (report.shards_done, report.shards_reused, report.images_read) == (1, 2, 600)
    assert report.totals == {"shards": 3, "read": 1797, "embedded": 1797, "skipped": 0}
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet") if p.name in kept} == kept
    # same input, same embeddings (and same file)
    redone = pq.read_table(out / "shard-000001.parquet")
    assert redone.equals(pq.read_table(original / "shard-000001.parquet"))

    nothing = extract_features(digit_shards, out, "pixels", progress=False)
    assert (nothing.shards_done, nothing.shards_reused, nothing.images_read) == (0, 3, 0)


def test_another_encoder_into_the_same_output_is_refused(digit_features, digit_shards):
    out, _ = digit_features
    with pytest.raises(ConfigError, match="another encoder"):
        extract_features(digit_shards, out, "pixels", pixel_size=4, progress=False)


def _jpeg(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory):
    """Generated photos through ``write_shards`` plus a hand-made shard with bad samples."""
    root = tmp_path_factory.mktemp("mixed")
    images = generated_image_folder(root / "images", n_classes=3, per_class=4)
    write_shards(images, root / "shards", shard_size=5, progress=False)  # 5 + 5 + 2 samples
    rng = np.random.default_rng(7)
    photo = rng.integers(0, 256, size=(90, 70, 3), dtype=np.uint8)
    good_jpeg = _jpeg(photo)
    write_raw_shard(
        root / "shards" / "extra.tar",
        [
            {"__key__": "extra/good", "jpg": good_jpeg, "cls": b"2"},
            {"__key__": "extra/truncated", "jpg": good_jpeg[: len(good_jpeg) // 2], "cls": b"1"},
            {"__key__": "extra/garbage", "png": b"\x89PNG but not really", "cls": b"0"},
            {"__key__": "extra/no_image", "json": b"{}"},
            {"__key__": "extra/unlabeled", "png": encode_png(photo)},
        ],
    )
    return root / "shards"


@pytest.fixture(scope="module")
def moco_checkpoint(tmp_path_factory):
    return save_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "moco_v2.pth.tar", moco_v2_state("resnet18")
    )


def test_moco_features_match_local_computation_and_bad_images_are_counted(
    ray_cluster, mixed_shards, moco_checkpoint, tmp_path
):
    spec = EncoderSpec("moco_v2", str(moco_checkpoint), "resnet18", head=True)
    report = extract_features(mixed_shards, tmp_path / "a", spec, batch_size=4, progress=False)
    assert (report.images_read, report.images_embedded, report.images_skipped) == (17, 14, 3)
    assert report.dim == 128 and report.shards_done == 4

    entry = read_shard_entry(tmp_path / "a" / "extra.parquet")
    reasons = {s["key"]: s["reason"] for s in entry["skipped_keys"]}
    assert sorted(reasons) == ["extra/garbage", "extra/no_image", "extra/truncated"]
    assert reasons["extra/truncated"].startswith("cannot decode jpg: OSError")
    assert "UnidentifiedImageError" in reasons["extra/garbage"]
    assert reasons["extra/no_image"] == "no image file in sample"

    table = pq.read_table(tmp_path / "a" / "extra.parquet")
    assert table.column("key").to_pylist() == ["extra/good", "extra/unlabeled"]
    assert table.column("label").to_pylist() == [2, None]

    # the Ray pipeline gives what one process computes from the same bytes
    features = read_features(tmp_path / "a")
    encoder = build_encoder(spec)
    image_dir = mixed_shards.parent / "images"
    for key, row in zip(features.keys, features.X, strict=True):
        if key.startswith("extra/"):
            continue
        path = next(image_dir.glob(f"{key}.*"))
        want = embed_numpy(encoder, preprocess_image(path.read_bytes(), spec.preprocess)[None])[0]
        np.testing.assert_allclose(row, want, rtol=1e-4, atol=1e-5)

    again = extract_features(mixed_shards, tmp_path / "b", spec, batch_size=8, progress=False)
    assert again.images_embedded == 14
    np.testing.assert_allclose(read_features(tmp_path / "b").X, features.X, rtol=1e-5, atol=1e-6)

    # resuming compares checkpoints by content: a moved copy matches, other weights do not
    moved = shutil.copy(moco_checkpoint, tmp_path / "moved.pth.tar")
    spec_moved = EncoderSpec("moco_v2", str(moved), "resnet18", head=True)
    resumed = extract_features(mixed_shards, tmp_path / "a", spec_moved, progress=False)
    assert (resumed.shards_reused, resumed.shards_done) == (4, 0)
    other = save_checkpoint(tmp_path / "other.pth.tar", moco_v2_state("resnet18", mlp=True, seed=5))
    with pytest.raises(ConfigError, match="another encoder"):
        extract_features(
            mixed_shards, tmp_path / "a", EncoderSpec("moco_v2", str(other), "resnet18", head=True)
        )


def test_truncated_shard_is_reported_and_the_others_are_done(
    ray_cluster, digit_shards, tmp_path, capsys
):
    shards = tmp_path / "shards"
    shutil.copytree(digit_shards, shards)
    data = (shards / "shard-000002.tar").read_bytes()
    (shards / "shard-000002.tar").write_bytes(data[: len(data) // 2])

    code = main(
        [
            "extract",
            "--shards",
            str(shards / "*.tar"),
            "--output",
            str(tmp_path / "out"),
            "--encoder",
            "pixels",
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "shard not extracted" in captured.err and "shard-000002.tar: truncated" in captured.err
    assert "embedded 1200/1200 images of 2 shards" in captured.out
    assert f"manifest:  {tmp_path / 'out' / '_manifest.json'}" in captured.out
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert [f["shard"] for f in manifest["failed_shards"]] == [str(shards / "shard-000002.tar")]
    assert not (tmp_path / "out" / "shard-000002.parquet").exists()


def test_cli_errors_are_one_line(tmp_path, digit_shards, capsys):
    bad = save_checkpoint(tmp_path / "v2.pth.tar", moco_v2_state("resnet18"))
    code = main(
        [
            "extract",
            "--shards",
            str(digit_shards),
            "--output",
            str(tmp_path / "o"),
            "--encoder",
            "moco_v3",
            "--weights",
            str(bad),
            "--arch",
            "resnet18",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "not a moco_v3 checkpoint" in err
    assert (
        main(["extract", "--shards", str(tmp_path / "none"), "--output", str(tmp_path / "o")]) == 2
    )
    assert "no .tar shards found" in capsys.readouterr().err


def test_cli_choices_match_the_library():
    from pipeline.commands import extract as command
    from pipeline.extract import encoders, ray_pipeline

    assert command.ENCODERS == encoders.ENCODERS
    assert command.RESNET_ARCHS == encoders.RESNET_ARCHS
    assert command.PRECISIONS == ray_pipeline.PRECISIONS
