"""Decoding webdataset samples into encoder inputs (CPU side of ``deepdpm extract``).

Imports only numpy and PIL: it is the ``decoder`` of Ray Data's ``read_webdataset``, so the
decode stays in the CPU read tasks, which never load torch, and is never fused into the
(GPU) encoder actors.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

#: tar member suffixes read as images (compared lower-cased), and the label member
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "bmp", "tif", "tiff", "webp")
LABEL_SUFFIX = "cls"


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes the encoder's uint8 input.

    ``mode="RGB"``: resize the shorter side to ``resize`` (bilinear, antialiased) and
    centre-crop ``crop`` x ``crop`` (the standard ImageNet evaluation transform).
    ``mode="L"``: grayscale, the whole image box-averaged to ``crop`` x ``crop``.
    """

    mode: str
    resize: int
    crop: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one preprocessed image."""
        return (3 if self.mode == "RGB" else 1, self.crop, self.crop)


def preprocess_image(data: bytes, spec: Preprocess) -> np.ndarray:
    """Decode image bytes into a uint8 array [C, H, W] (see :class:`Preprocess`).

    Raises whatever PIL raises for a corrupt or truncated image.
    """
    with Image.open(io.BytesIO(data)) as img:
        if spec.mode == "RGB":
            # JPEG draft mode decodes at the smallest 1/2^k scale that is still >= the
            # target, a large saving on big photos; a no-op for other formats.
            img.draft("RGB", (spec.resize, spec.resize))
        img = img.convert(spec.mode)
    if spec.mode == "L":
        img = img.resize((spec.crop, spec.crop), Image.Resampling.BOX)
        return np.asarray(img, dtype=np.uint8)[None]
    w, h = img.size
    scale = spec.resize / min(w, h)  # shorter side -> resize, as torchvision Resize(int)
    size = (spec.resize, int(h * scale)) if w <= h else (int(w * scale), spec.resize)
    img = img.resize(size, Image.Resampling.BILINEAR)
    left = int(round((size[0] - spec.crop) / 2.0))
    top = int(round((size[1] - spec.crop) / 2.0))
    img = img.crop((left, top, left + spec.crop, top + spec.crop))
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


def _label(value: object) -> int:
    """The ``cls`` member as an int; -1 when absent or not an integer."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return int(value.decode("utf-8").strip())
        except ValueError:
            return -1
    return -1


def decode_sample(sample: dict, preprocess: Preprocess) -> dict:
    """One raw webdataset sample -> one row, never raising.

    Returns
    -------
    dict
        ``key`` (str), ``shard`` (source path), ``label`` (int, -1 = none), ``ok`` (bool),
        ``error`` (why the sample is skipped, "" if ok), ``image`` uint8 [C, H, W]
        (zeros when not ok).
    """
    row = {
        "key": str(sample["__key__"]),
        "shard": str(sample.get("__url__", "")),
        "label": _label(sample.get(LABEL_SUFFIX)),
        "ok": False,
        "error": "",
        "image": np.zeros(preprocess.shape, dtype=np.uint8),
    }
    member = next((k for k in sample if k.lower() in IMAGE_SUFFIXES), None)
    if member is None:
        row["error"] = "no image file in sample"
        return row
    try:
        row["image"] = preprocess_image(sample[member], preprocess)
        row["ok"] = True
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, bomb errors...
        row["error"] = f"cannot decode {member}: {type(exc).__name__}: {exc}"
    return row


def wanted_member(suffix: str) -> bool:
    """Tar members kept by the reader: images and labels (``json`` etc. are dropped)."""
    suffix = suffix.lower()
    return suffix in IMAGE_SUFFIXES or suffix == LABEL_SUFFIX
