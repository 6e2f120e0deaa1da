"""``deepdpm shards``: image folders -> webdataset shards (read back with webdataset itself)."""

from __future__ import annotations

import json

import pytest
import webdataset as wds
from sklearn.datasets import load_digits

from deepdpm_core.errors import ConfigError, DataError
from pipeline.cli import main
from pipeline.extract.shards import digits_image_folder, sample_key, write_shards
from tests.support.image_data import generated_image_folder


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    return digits_image_folder(tmp_path_factory.mktemp("digits"))


def read_samples(shard_dir):
    """All samples of a shard folder through webdataset's own reader (no decoding)."""
    urls = sorted(str(p) for p in shard_dir.glob("shard-*.tar"))
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def test_digits_shards_hold_every_image_as_stored(digits_folder, tmp_path):
    report = write_shards(digits_folder, tmp_path / "shards", shard_size=500, progress=False)
    digits = load_digits()
    assert report.images_written == len(digits.target) == 1797
    assert [s["samples"] for s in report.shards] == [500, 500, 500, 297]
    assert report.classes == [str(d) for d in range(10)] and not report.skipped

    samples = read_samples(tmp_path / "shards")
    assert len(samples) == 1797
    for sample in samples[::97]:
        meta = json.loads(sample["json"])
        assert sample["png"] == (digits_folder / meta["path"]).read_bytes()
        index = int(meta["path"].split("_")[-1].split(".")[0])
        assert int(sample["cls"]) == digits.target[index] == int(meta["class"])
        assert sample["__key__"] == meta["path"].rsplit(".", 1)[0]

    class_index = json.loads((tmp_path / "shards" / "class_index.json").read_text())
    assert class_index["class_to_idx"] == {str(d): d for d in range(10)}
    manifest = json.loads((tmp_path / "shards" / "_manifest.json").read_text())
    assert manifest["images_written"] == 1797 and manifest["shards"] == report.shards


def test_same_input_gives_byte_identical_shards(digits_folder, tmp_path):
    write_shards(digits_folder, tmp_path / "a", shard_size=1000, progress=False)
    write_shards(digits_folder, tmp_path / "b", shard_size=1000, progress=False)
    for name in ("shard-000000.tar", "shard-000001.tar"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_unreadable_files_are_skipped_and_reported(tmp_path):
    folder = generated_image_folder(tmp_path / "images", n_classes=2, per_class=3)
    (folder / "class_0" / "broken.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg")
    (folder / "class_1" / "empty.png").write_bytes(b"")
    (folder / "class_1" / "notes.txt").write_text("not an image, ignored")
    report = write_shards(folder, tmp_path / "shards", shard_size=4, progress=False)
    assert report.images_written == 6 and report.files_ignored == 1
    assert sorted(s["path"] for s in report.skipped) == ["class_0/broken.jpg", "class_1/empty.png"]
    assert all("not a readable image" in s["reason"] for s in report.skipped)
    samples = read_samples(tmp_path / "shards")
    assert len(samples) == 6 and {int(s["cls"]) for s in samples} == {0, 1}
    assert {k for s in samples for k in s if not k.startswith("__")} == {
        "jpg",
        "png",
        "cls",
        "json",
    }


def test_flat_folder_is_unlabeled_and_keys_stay_unique(tmp_path):
    folder = tmp_path / "flat"
    generated_image_folder(tmp_path / "src", n_classes=1, per_class=2)
    folder.mkdir()
    data = (tmp_path / "src" / "class_0" / "img_1.png").read_bytes()
    for name in ("photo.png", "photo.PNG.png", "photo.v2.png"):
        (folder / name).write_bytes(data)
    (folder / "photo.jpeg").write_bytes((tmp_path / "src" / "class_0" / "img_0.jpg").read_bytes())
    report = write_shards(folder, tmp_path / "shards", progress=False)
    assert report.classes == [] and report.images_written == 4
    samples = read_samples(tmp_path / "shards")
    assert all("cls" not in s for s in samples)
    keys = [s["__key__"] for s in samples]
    assert len(set(keys)) == 4 and "photo_v2" in keys and all("." not in k for k in keys)
    assert {k for s in samples for k in s if not k.startswith("__")} == {"png", "jpg", "json"}


def test_sample_key():
    assert sample_key("n01440764/n01440764_10026.JPEG") == "n01440764/n01440764_10026"
    assert sample_key("a.b/c/img.1.png") == "a.b/c/img_1"


def test_existing_shards_need_overwrite(digits_folder, tmp_path):
    write_shards(digits_folder, tmp_path / "out", shard_size=1000, progress=False)
    with pytest.raises(ConfigError, match="--overwrite"):
        write_shards(digits_folder, tmp_path / "out", shard_size=1000, progress=False)
    report = write_shards(
        digits_folder, tmp_path / "out", shard_size=2000, overwrite=True, progress=False
    )
    assert [p.name for p in sorted((tmp_path / "out").glob("*.tar"))] == ["shard-000000.tar"]
    assert report.images_written == 1797
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left


def test_bad_settings_fail_before_anything_is_written(digits_folder, tmp_path):
    for threads in (0, -2):
        with pytest.raises(ConfigError, match=f"read threads must be >= 1, got {threads}"):
            write_shards(digits_folder, tmp_path / "out", read_threads=threads, progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        write_shards(digits_folder, tmp_path / "afile", progress=False)
    assert (tmp_path / "afile").read_text() == "x"
    with pytest.raises(DataError, match="is a file; expected a folder of images"):
        write_shards(tmp_path / "afile", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_folder_without_images_is_an_error(tmp_path):
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    with pytest.raises(DataError, match="no images under"):
        write_shards(tmp_path / "empty", tmp_path / "out", progress=False)
    (tmp_path / "empty" / "cats" / "bad.png").write_bytes(b"junk")
    with pytest.raises(DataError, match="none of the 1 image files"):
        write_shards(tmp_path / "empty", tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").glob("*.tar"))


def test_cli(digits_folder, tmp_path, capsys):
    code = main(
        [
            "shards",
            "--input",
            str(digits_folder),
            "--output",
            str(tmp_path / "s"),
            "--shard-size",
            "900",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "wrote 1797 images (10 classes) into 2 shards" in out
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "_manifest.json",
        "class_index.json",
        "shard-000000.tar",
        "shard-000001.tar",
    ]
    assert (
        main(["shards", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "s2")])
        == 2
    )
    assert "input folder not found" in capsys.readouterr().err
