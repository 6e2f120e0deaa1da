"""Feature-extraction throughput: Ray Data actor pipeline vs. a plain single-process loop.

Rows (all on the same generated ImageNet-sized JPEGs, same preprocessing):

* decode: JPEG -> resize 256 -> centre-crop 224, one process, one thread;
* plain loop (the peer): decode + ResNet forward in one process, no Ray;
* Ray pipeline, 1 CPU actor: ``extract_features`` end to end (read shards, decode in
  read tasks, encoder actor, Parquet), and its steady rate (start-up cancelled by
  differencing a small and a full run);
* pixels on the digits (what ``deepdpm demo`` runs);
* GPU: ResNet at batch 256, bf16 autocast, channels_last, when CUDA is present; with the
  projected time for the 1.28M ImageNet train images on 8 GPUs.

Run: ``OMP_NUM_THREADS=1 python bench/extract_throughput.py [--images 64] [--arch resnet50]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.extract.encoders import EncoderSpec, build_encoder, embed_numpy  # noqa: E402
from pipeline.extract.preprocess import preprocess_image  # noqa: E402
from pipeline.extract.ray_pipeline import extract_features  # noqa: E402
from pipeline.extract.shards import digits_image_folder, write_shards  # noqa: E402

IMAGENET_TRAIN = 1_281_167


def imagenet_like_folder(dest: Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` JPEGs of ImageNet's typical size (~500x375, quality 90), 4 classes."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        h, w = (375, 500) if i % 3 else (500, 375)
        # smooth random field + noise: compresses like a photo, not like pure noise
        base = rng.integers(0, 256, size=(h // 25 + 1, w // 25 + 1, 3)).astype(np.uint8)
        img = Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC)
        pixels = np.asarray(img, dtype=np.int16) + rng.integers(-20, 20, size=(h, w, 3))
        folder = dest / f"class_{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"img_{i:05d}.jpg"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(path)
    return paths


def time_decode(blobs: list[bytes], spec) -> float:
    start = time.perf_counter()
    for blob in blobs:
        preprocess_image(blob, spec.preprocess)
    return len(blobs) / (time.perf_counter() - start)


def time_plain_loop(blobs: list[bytes], spec: EncoderSpec, batch_size: int) -> float:
    """The peer: decode + encoder forward in one process (1 thread), no Ray."""
    encoder = build_encoder(spec).to(memory_format=torch.channels_last)
    embed_numpy(encoder, np.stack([preprocess_image(blobs[0], spec.preprocess)]))  # warm-up
    start = time.perf_counter()
    for i in range(0, len(blobs), batch_size):
        batch = np.stack([preprocess_image(b, spec.preprocess) for b in blobs[i : i + batch_size]])
        embed_numpy(encoder, batch)
    return len(blobs) / (time.perf_counter() - start)


def time_gpu(arch: str, batch_size: int = 256, steps: int = 20) -> float | None:
    """ResNet forward at ``batch_size`` on one GPU (bf16 autocast, channels_last), images/s."""
    if not torch.cuda.is_available():
        return None
    torch.backends.cudnn.benchmark = True
    encoder = build_encoder(EncoderSpec("moco_v2", None, arch)).cuda()
    encoder = encoder.to(memory_format=torch.channels_last)
    batch = np.random.default_rng(0).integers(0, 256, (batch_size, 3, 224, 224), dtype=np.uint8)
    for _ in range(3):
        embed_numpy(encoder, batch, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        embed_numpy(encoder, batch, "cuda", torch.bfloat16)  # includes H2D copy and D2H result
    torch.cuda.synchronize()
    return steps * batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message=".*without --weights")
    torch.set_num_threads(1)

    import ray

    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = imagenet_like_folder(tmp / "images", args.images)
        blobs = [p.read_bytes() for p in paths]
        spec = EncoderSpec("moco_v2", None, args.arch)
        write_shards(
            tmp / "images", tmp / "shards", shard_size=max(1, args.images // 4), progress=False
        )
        shards_small = tmp / "shards" / "shard-000000.tar"  # a quarter of the images

        decode = time_decode(blobs, spec)
        plain = time_plain_loop(blobs, spec, args.batch_size)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

        # runs of two sizes: their difference cancels the fixed start-up cost (Ray tasks,
        # actor process, model build), leaving the steady per-actor rate. The shared
        # machine is noisy, so: one warm-up run, then the median of `--repeats` each.
        def run(shards, name):
            return extract_features(
                shards,
                tmp / f"features_{name}",
                spec,
                batch_size=args.batch_size,
                num_workers=1,
                cpus_per_worker=1,
                progress=False,
            )

        run(shards_small, "warmup")
        smalls = [run(shards_small, f"small{i}") for i in range(args.repeats)]
        fulls = [run(tmp / "shards", f"full{i}") for i in range(args.repeats)]
        small_s = float(np.median([r.seconds for r in smalls]))
        full_s = float(np.median([r.seconds for r in fulls]))
        report, small = fulls[0], smalls[0]
        steady = (report.images_read - small.images_read) / max(full_s - small_s, 1e-9)

        digits = digits_image_folder(tmp / "digits")
        write_shards(digits, tmp / "digit_shards", shard_size=600, progress=False)
        pixels = extract_features(
            tmp / "digit_shards", tmp / "digit_features", "pixels", batch_size=256, progress=False
        )
        ray.shutdown()
        gpu = time_gpu(args.arch)

    def per_s(x: float) -> str:
        return f"{x:8.1f}"

    rows.append(("decode+resize+crop 224 (1 CPU)", per_s(decode), f"{decode / plain:5.2f}x"))
    rows.append((f"plain loop {args.arch} fp32 (1 CPU) [peer]", per_s(plain), " 1.00x"))
    rows.append(
        (
            f"Ray pipeline, 1 CPU actor, end to end ({report.images_read} images in "
            f"{full_s:.0f} s)",
            per_s(report.images_read / full_s),
            f"{report.images_read / full_s / plain:5.2f}x",
        )
    )
    rows.append(
        (
            f"Ray pipeline, 1 CPU actor, steady ({report.images_read} minus "
            f"{small.images_read} images: start-up {small_s - small.images_read / steady:.0f} s "
            "cancelled)",
            per_s(steady),
            f"{steady / plain:5.2f}x",
        )
    )
    rows.append(
        (
            f"Ray pipeline, pixels on 1797 digits ({pixels.seconds:.0f} s)",
            per_s(pixels.images_per_s),
            "   - ",
        )
    )
    if gpu is None:
        rows.append((f"GPU {args.arch} batch 256 bf16", "not measured (no GPU lent)", "   - "))
    else:
        rows.append(
            (
                f"GPU {args.arch} batch 256 bf16 ({torch.cuda.get_device_name()})",
                per_s(gpu),
                f"{gpu / plain:5.0f}x",
            )
        )

    print(
        f"\n{args.images} generated ~500x375 JPEGs, {args.arch}, torch threads 1; "
        f"machine load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'stage':<{width}}  {'images/s':>8}  vs peer")
    for name, rate, ratio in rows:
        print(f"{name:<{width}}  {rate:>8}  {ratio}")
    cpu_days = IMAGENET_TRAIN / steady / 86400
    print(
        f"\nImageNet train ({IMAGENET_TRAIN:,} images) at the steady CPU-actor rate: "
        f"{cpu_days:.1f} actor-days (e.g. {cpu_days * 24 / 64:.1f} h on 64 CPU actors)"
    )
    if gpu is None:
        print(
            "ImageNet train on 8 GPUs: not measured (no GPU lent); projection = "
            f"{IMAGENET_TRAIN:,} / (8 x GPU images/s), if decoding keeps up "
            f"(decoding needs 8 x GPU images/s / {decode:.0f} CPUs)"
        )
    else:
        print(
            f"ImageNet train on 8 GPUs at {gpu:.0f} images/s each: "
            f"{IMAGENET_TRAIN / (8 * gpu) / 60:.1f} min, if decoding keeps up "
            f"(needs ~{8 * gpu / decode:.0f} decode CPUs at {decode:.0f} images/s each)"
        )


if __name__ == "__main__":
    main()
