"""The report's sample images: a few rows of each cluster, found in the webdataset shards or
the image folder a fit came from, drawn as one strip of thumbnails per cluster."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from deepdpm_core.errors import DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".gif", ".tif", ".tiff")


def sample_keys(
    assignments: pa.Table, clusters: Iterable[int], per_cluster: int
) -> dict[int, list[str]]:
    """The ``per_cluster`` most confident keys of each cluster in ``clusters``."""
    keys = np.asarray(assignments.column("key").to_pylist(), dtype=object)
    cluster = assignments.column("cluster").to_numpy()
    conf = (
        assignments.column("confidence").to_numpy()
        if "confidence" in assignments.column_names
        else np.zeros(len(keys))
    )
    out = {}
    for k in clusters:
        idx = np.flatnonzero(cluster == k)
        best = idx[np.argsort(-conf[idx], kind="stable")[:per_cluster]]
        out[int(k)] = [str(key) for key in keys[best]]
    return out


def _tar_key(member_name: str) -> tuple[str, str]:
    """webdataset's split of ``dir/name.a.b`` into key ``dir/name`` and extension ``a.b``."""
    head, _, base = member_name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


def _shards(path: Path) -> list[Path]:
    if path.is_file() and tarfile.is_tarfile(path):
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix == ".tar" or p.name.endswith(".tar.gz"))
    return []


def _images_from_shards(shards: list[Path], wanted: set[str]) -> Iterator[tuple[str, bytes]]:
    remaining = set(wanted)
    for shard in tqdm(shards, desc="report: scanning shards", unit="shard", leave=False):
        with tarfile.open(shard, "r|*") as tar:  # streaming: shards can be large
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _tar_key(member.name)
                if key in remaining and "." + ext.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS:
                    data = tar.extractfile(member)
                    if data is not None:
                        remaining.discard(key)
                        yield key, data.read()
        if not remaining:
            return


def _images_from_dir(root: Path, wanted: set[str]) -> Iterator[tuple[str, bytes]]:
    for path in sorted(root.rglob("*")):
        if path.suffix.lower() not in IMAGE_EXTENSIONS or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        for candidate in (rel[: -len(path.suffix)], rel, path.stem, path.name):
            if candidate in wanted:
                yield candidate, path.read_bytes()
                break


def find_images(images: str | Path, keys: Iterable[str]) -> dict[str, bytes]:
    """Encoded image bytes for those ``keys`` found under ``images``.

    ``images`` is a webdataset shard (``.tar``), a directory of shards (keys are
    webdataset keys), or a directory of image files (a key matches the file's path
    relative to the directory with or without extension, or its name or stem).
    """
    images = Path(images)
    if not images.exists():
        raise FileNotFoundError(f"--images not found: {images}")
    wanted = set(keys)
    shards = _shards(images)
    if not images.is_dir() and not shards:
        raise DataError(f"--images {images} is neither a folder nor a webdataset .tar shard")
    found = dict(_images_from_shards(shards, wanted) if shards else _images_from_dir(images, wanted))
    if wanted and not found:  # a wrong folder would otherwise give a report without images
        raise DataError(f"--images {images} holds none of the {len(wanted)} sample keys of this run")
    return found


def image_strip(encoded: list[bytes], thumb: int = 96) -> bytes | None:
    """Thumbnails of ``encoded`` images side by side, as PNG bytes (None if none decode).

    Each image is scaled to fit a ``thumb`` x ``thumb`` tile, keeping its aspect ratio:
    larger ones shrink, smaller ones (e.g. 32 px digits) grow, pixels kept sharp.
    """
    tiles = []
    for data in encoded:
        try:
            with Image.open(io.BytesIO(data)) as img:
                tile = img.convert("RGB")
        except (UnidentifiedImageError, OSError):
            continue  # a corrupt image is left out, not fatal to the report
        if max(tile.size) < thumb:  # thumbnail() only shrinks
            scale = thumb / max(tile.size)
            tile = tile.resize((max(1, round(tile.width * scale)), max(1, round(tile.height * scale))),
                               Image.Resampling.NEAREST)
        tile.thumbnail((thumb, thumb))
        tiles.append(tile)
    if not tiles:
        return None
    gap = 4
    strip = Image.new("RGB", (len(tiles) * (thumb + gap) - gap, thumb), "white")
    for i, tile in enumerate(tiles):
        x = i * (thumb + gap) + (thumb - tile.width) // 2
        strip.paste(tile, (x, (thumb - tile.height) // 2))
    return _png_bytes(strip)


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()
