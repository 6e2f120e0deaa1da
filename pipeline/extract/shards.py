"""Image folders -> webdataset ``.tar`` shards (the input of ``deepdpm extract``).

Input: torchvision's ImageFolder / the ImageNet train tree (one sub-folder per class,
searched recursively, classes indexed in sorted name order); a folder of images without
sub-folders is unlabeled. A sample holds the image bytes as stored (``jpeg`` -> ``jpg``),
``cls`` when labeled and ``json`` (``{"path", "class"}``); its key is the relative path
without extension, dots in the file name turned to ``_`` (webdataset splits keys at the
first dot), e.g. ``n01440764/n01440764_10026``. Files that fail PIL's header check are
skipped and listed in ``_manifest.json``; a truncated image body passes it and is
skipped, counted, by ``extract`` instead.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

from deepdpm_core.atomic_files import write_json_atomic
from deepdpm_core.errors import ConfigError, DataError

#: torchvision's IMG_EXTENSIONS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SHARD_PATTERN = "shard-%06d.tar"
MANIFEST_NAME = "_manifest.json"
CLASS_INDEX_NAME = "class_index.json"
#: fixed tar member mtime so the same input gives byte-identical shards
_TAR_MTIME = 0
#: files read ahead by the reader threads (bounds memory; reading is I/O bound)
_READ_AHEAD = 256


@dataclass
class ShardReport:
    """What :func:`write_shards` did.

    Attributes
    ----------
    output_dir : folder holding the shards, ``class_index.json`` and ``_manifest.json``
    shards : shard file names with their sample counts, in order
    images_written : samples written
    skipped : ``{"path": relative path, "reason": ...}`` of each unusable file
    files_ignored : files without an image extension (not counted as skipped)
    classes : class names; ``classes[i]`` has index ``i`` (empty when unlabeled)
    seconds : wall time
    """

    output_dir: str
    shards: list[dict] = field(default_factory=list)
    images_written: int = 0
    skipped: list[dict] = field(default_factory=list)
    files_ignored: int = 0
    classes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Source:
    path: Path
    rel: str
    label: int | None


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def list_image_folder(root: str | Path) -> tuple[list[_Source], list[str], int]:
    """Files of an ImageFolder tree in a deterministic order.

    Returns
    -------
    sources : image files sorted by (class, relative path)
    classes : sorted class folder names (empty for a flat, unlabeled folder)
    ignored : number of files without an image extension
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise DataError(f"input {root} is a file; expected a folder of images")
    if not root.is_dir():
        raise FileNotFoundError(f"input folder not found: {root}")
    entries = sorted(root.iterdir())
    class_dirs = [p for p in entries if p.is_dir() and not p.name.startswith(".")]
    classes = [p.name for p in class_dirs]
    sources: list[_Source] = []
    ignored = 0
    if not class_dirs:
        for path in entries:
            if path.is_file() and not path.name.startswith("."):
                if _is_image(path):
                    sources.append(_Source(path, path.name, None))
                else:
                    ignored += 1
        return sources, [], ignored
    ignored += sum(1 for p in entries if p.is_file() and not p.name.startswith("."))
    for label, class_dir in enumerate(class_dirs):
        for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if name.startswith("."):
                    continue
                if _is_image(path):
                    sources.append(_Source(path, path.relative_to(root).as_posix(), label))
                else:
                    ignored += 1
    return sources, classes, ignored


def sample_key(rel: str) -> str:
    """webdataset key of a relative path: no extension, no dots in the last component."""
    parent, _, name = rel.rpartition("/")
    stem = name.rsplit(".", 1)[0].replace(".", "_")
    return f"{parent}/{stem}" if parent else stem


def _tar_extension(path: Path) -> str:
    ext = path.suffix.lower().lstrip(".")
    return {"jpeg": "jpg", "tif": "tiff"}.get(ext, ext)


def _read_checked(source: _Source) -> tuple[bytes | None, str | None]:
    """The file's bytes, or None and the reason it is unusable (unreadable / not an image)."""
    try:
        data = source.path.read_bytes()
    except OSError as exc:
        return None, f"unreadable: {exc.strerror or exc}"
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()  # header/structure check; full decoding happens in extract
    except Exception as exc:  # PIL raises many exception types for bad files
        return None, f"not a readable image: {type(exc).__name__}: {exc}"
    return data, None


def _read_all(sources: list[_Source],
              threads: int) -> Iterator[tuple[_Source, bytes | None, str | None]]:
    """Read files with a thread pool, in order, at most ``_READ_AHEAD`` ahead."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for start in range(0, len(sources), _READ_AHEAD):
            chunk = sources[start : start + _READ_AHEAD]
            for source, (data, reason) in zip(chunk, pool.map(_read_checked, chunk), strict=True):
                yield source, data, reason


class _AtomicShardFiles:
    """``opener``/``post`` pair for ``wds.ShardWriter``: each shard is written to a hidden
    temporary file and renamed into place once complete, so a crash never leaves a
    truncated ``shard-*.tar`` behind."""

    def __init__(self) -> None:
        self._open: dict[str, object] = {}

    @staticmethod
    def _tmp(fname: str) -> str:
        path = Path(fname)
        return str(path.with_name(f".{path.name}.partial"))

    def open(self, fname: str):
        fh = open(self._tmp(fname), "wb")  # noqa: SIM115 - closed in post()
        self._open[fname] = fh
        return fh

    def post(self, fname: str) -> None:
        fh = self._open.pop(fname)
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        os.replace(self._tmp(fname), fname)


def write_shards(input_dir: str | Path, output_dir: str | Path, shard_size: int = 1000,
                 overwrite: bool = False, read_threads: int = 8,
                 progress: bool = True) -> ShardReport:
    """Write an ImageFolder tree as webdataset shards (``shard-000000.tar``, ...).

    Parameters
    ----------
    input_dir : ImageFolder root (one sub-folder per class) or a flat folder of images
    output_dir : created if needed; must hold no shards unless ``overwrite``
    shard_size : samples per shard
    overwrite : delete existing ``shard-*.tar`` in ``output_dir`` first
    read_threads : threads reading and checking files (I/O bound)

    Raises
    ------
    DataError
        No usable image under ``input_dir``.
    ConfigError
        ``output_dir`` already has shards and ``overwrite`` is False, or is a file; bad
        ``shard_size`` or ``read_threads``.
    """
    if shard_size < 1:
        raise ConfigError(f"shard size must be >= 1, got {shard_size}")
    if read_threads < 1:
        raise ConfigError(f"read threads must be >= 1, got {read_threads}")
    start = time.perf_counter()
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output {output_dir} exists and is not a folder")
    sources, classes, ignored = list_image_folder(input_dir)
    if not sources:
        raise DataError(f"no images under {input_dir} (expected one sub-folder per class holding "
                        f"{'/'.join(e.lstrip('.') for e in IMAGE_EXTENSIONS)} files)")
    output_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(output_dir.glob("shard-*.tar"))
    if existing and not overwrite:
        raise ConfigError(f"{output_dir} already holds {len(existing)} shards; choose an empty "
                          "folder or pass --overwrite")
    for path in existing:
        path.unlink()

    report = ShardReport(output_dir=str(output_dir), classes=classes, files_ignored=ignored)
    counts: dict[str, int] = {}
    used_keys: set[str] = set()
    files = _AtomicShardFiles()
    writer = wds.ShardWriter(
        str(output_dir / SHARD_PATTERN), maxcount=shard_size, verbose=0, opener=files.open,
        post=files.post, encoder=False, mtime=_TAR_MTIME,
        format="PAX_FORMAT",  # no 100-character limit on member names
    )
    bar = tqdm(total=len(sources), desc="shards", unit="img", disable=not progress)
    try:
        for source, data, reason in _read_all(sources, read_threads):
            bar.update(1)
            if data is None:
                report.skipped.append({"path": source.rel, "reason": reason})
                continue
            key = sample_key(source.rel)
            base, n = key, 1
            while key in used_keys:  # e.g. a.jpg and a.png in one folder
                key, n = f"{base}_{n}", n + 1
            used_keys.add(key)
            meta = {"path": source.rel}
            sample = {"__key__": key, _tar_extension(source.path): data}
            if source.label is not None:
                sample["cls"] = str(source.label).encode()
                meta["class"] = classes[source.label]
            sample["json"] = json.dumps(meta).encode()
            writer.write(sample)
            counts[Path(writer.fname).name] = writer.count
            report.images_written += 1
    finally:
        writer.close()
        bar.close()
    if report.images_written == 0:  # ShardWriter opens its first shard eagerly
        (output_dir / (SHARD_PATTERN % 0)).unlink(missing_ok=True)
        raise DataError(f"none of the {len(sources)} image files under {input_dir} is readable")
    report.shards = [{"file": name, "samples": count} for name, count in counts.items()]
    report.seconds = time.perf_counter() - start
    write_json_atomic({"class_to_idx": {name: i for i, name in enumerate(classes)}},
                      output_dir / CLASS_INDEX_NAME)
    write_json_atomic({"input_dir": str(input_dir), **report.to_dict()}, output_dir / MANIFEST_NAME)
    return report


def digits_image_folder(dest: str | Path, scale: int = 4) -> Path:
    """Render scikit-learn's bundled digits (1797 8x8 images, no download) as PNGs.

    Layout: ``dest/<digit>/digit_<index:04d>.png``, grayscale, each pixel of the
    original 0..16 image becoming a ``scale`` x ``scale`` block of value
    ``round(v * 255 / 16)``; so box-averaging back to 8x8 (the ``pixels`` encoder)
    recovers ``digits.data / 16`` up to 1/255.

    Returns
    -------
    Path
        ``dest``.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    dest = Path(dest)
    for index, (image, target) in enumerate(zip(digits.images, digits.target, strict=True)):
        pixels = np.rint(image * (255.0 / 16.0)).astype(np.uint8)
        pixels = np.kron(pixels, np.ones((scale, scale), dtype=np.uint8))
        folder = dest / str(int(target))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"digit_{index:04d}.png")
    return dest
