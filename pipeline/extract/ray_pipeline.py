"""webdataset shards -> image embeddings in Parquet, with Ray Data.

Pipeline (one Ray Data dataset over every shard still to do)::

    read_webdataset, decoder = decode + resize/crop  [CPU read tasks, torch-free]
      -> encoder actor pool (ActorPoolStrategy)       [one actor per GPU, or per CPU slot]
      -> driver: rows grouped by source shard; a shard whose rows are all in is
         written as one Parquet file

The driver groups rows because Ray Data writes one file per block and blocks of different
shards interleave, while a resumable run needs one output per shard: knowing each shard's
sample count (a scan of the tar headers), it writes ``<shard>.parquet`` atomically when the
shard's last row arrives, with its counts and skipped keys in the Parquet metadata (so
``_manifest.json`` can always be rebuilt). A missing or undecodable image is skipped and
counted, never fatal; rows are sorted by key. Details: docs/features.md, "Feature
extraction: image folders → webdataset shards → embeddings (Parquet)".
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from deepdpm_core.atomic_files import write_json_atomic
from deepdpm_core.errors import ConfigError, DataError
from pipeline.extract.encoder_choices import PRECISIONS
from pipeline.extract.encoders import RANDOM_INIT_SEED, EncoderSpec, build_encoder, embed_numpy
from pipeline.extract.manifest import (
    MANIFEST_NAME,
    ExtractReport,
    ShardAssembler,
    build_manifest,
    output_path,
    read_shard_entry,
    same_encoder,
)
from pipeline.extract.preprocess import decode_sample, wanted_member
from pipeline.extract.shard_inputs import count_samples, resolve_shards

_MANIFEST_EVERY_S = 30.0


class EmbedImages:
    """Ray Data actor: holds one encoder (on its GPU when given one) and embeds batches.

    GPU path: pinned host batches copied asynchronously, channels_last, bf16/fp16
    autocast, cuDNN autotuning. Outputs are float32 either way.
    """

    def __init__(self, spec: EncoderSpec, use_gpu: bool, precision: str, threads: int) -> None:
        import torch

        self.device = torch.device("cuda" if use_gpu else "cpu")
        if use_gpu:
            torch.backends.cudnn.benchmark = True
        else:
            torch.set_num_threads(threads)
        self.amp_dtype = _amp_dtype(precision, use_gpu)
        encoder = build_encoder(spec).to(self.device)
        self.encoder = encoder.to(memory_format=torch.channels_last)
        self.dim = encoder.output_dim
        self.l2_normalize = spec.l2_normalize

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok = batch["ok"].astype(bool)
        embedding = np.zeros((len(ok), self.dim), dtype=np.float32)
        if ok.any():
            embedding[ok] = embed_numpy(
                self.encoder, batch["image"][ok], self.device, self.amp_dtype, self.l2_normalize
            )
        return {
            "key": batch["key"],
            "shard": batch["shard"],
            "label": batch["label"],
            "ok": ok,
            "error": batch["error"],
            "embedding": embedding,
        }


def _amp_dtype(precision: str, use_gpu: bool):
    import torch

    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got '{precision}'")
    if precision == "auto":
        return torch.bfloat16 if use_gpu else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def ensure_ray(address: str | None = None) -> None:
    """Connect to Ray unless already connected: ``address``, else ``$RAY_ADDRESS`` (e.g. under
    ``ray job submit``), else a fresh local instance (never a stranger's cluster)."""
    import ray

    from pipeline.ray_cluster.local import init_local_ray

    if ray.is_initialized():
        return
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    if address == "local":  # a cluster of its own: without Ray's token-auth announcements
        init_local_ray(include_dashboard=False, log_to_driver=True)
        return
    ray.init(address=address, include_dashboard=False, log_to_driver=True)


def extract_features(shards: str | Path | Sequence[str | Path], output_dir: str | Path,
                     encoder: str | EncoderSpec = "pixels", *, weights: str | None = None,
                     arch: str = "resnet50", head: bool = False, pixel_size: int = 8,
                     l2_normalize: bool = False, batch_size: int = 256, num_workers: int = 1,
                     use_gpu: bool = False, cpus_per_worker: float = 1.0, precision: str = "auto",
                     ray_address: str | None = None, progress: bool = True,
                     overwrite: bool = False) -> ExtractReport:
    """Embed every image of ``shards`` into ``output_dir/<shard>.parquet`` (resumable).

    Parameters
    ----------
    shards : directory of ``.tar`` shards, glob, file, or a list of these
    output_dir : one Parquet file per shard (``key``, ``embedding`` [D] float32,
        ``label`` int64 or null) plus ``_manifest.json``
    encoder : an :class:`EncoderSpec`, or its name (then ``weights``, ``arch``, ``head``,
        ``pixel_size``, ``l2_normalize`` build it)
    batch_size : images per encoder call
    num_workers : encoder actors (one GPU each with ``use_gpu``, else ``cpus_per_worker`` CPUs)
    precision : ``auto`` (bf16 on GPU, fp32 on CPU), ``bf16``, ``fp16`` or ``fp32``
    ray_address : Ray cluster to use when not connected yet (see :func:`ensure_ray`)
    overwrite : extract every shard again, replacing its output (otherwise a complete output
        of the same encoder is kept, and one of another encoder, or a file this function did
        not write, is refused)

    Returns
    -------
    ExtractReport

    Raises
    ------
    ConfigError
        Bad options, or ``output_dir`` holds features of a different encoder.
    CheckpointError
        The weights do not fit the encoder (raised before any work starts).
    """
    start = time.perf_counter()
    spec = (encoder if isinstance(encoder, EncoderSpec)
            else EncoderSpec(encoder, weights, arch, head, pixel_size, l2_normalize))
    if batch_size < 1 or num_workers < 1 or cpus_per_worker <= 0:
        raise ConfigError("batch_size and num_workers must be >= 1 and cpus_per_worker > 0")
    _amp_dtype(precision, use_gpu)
    paths = resolve_shards(shards)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.glob(".*.parquet.*.tmp"):  # left by a killed run
        stale.unlink()
    dim = build_encoder(spec).output_dim  # fails here, early, on a bad checkpoint
    identity = spec.identity()
    if spec.weights is None and spec.name != "pixels":
        warnings.warn(
            f"--encoder {spec.name} without --weights: randomly initialised {spec.arch} "
            f"(seed {RANDOM_INIT_SEED}); its features are not meaningful for clustering",
            UserWarning,
            stacklevel=2,
        )

    outputs = {str(p): output_path(p, output_dir) for p in paths}
    entries: dict[str, dict] = {}
    pending: list[str] = []
    for shard, out in outputs.items():
        if overwrite or not out.exists():
            pending.append(shard)
            continue
        try:
            entry = read_shard_entry(out)
        except (OSError, ValueError, DataError):  # pyarrow's ArrowInvalid is a ValueError
            raise ConfigError(f"{out} exists and was not written by deepdpm extract: pass "
                              "--overwrite to replace it, or extract into a new --output folder") from None
        if not same_encoder(entry.get("encoder"), identity) or entry.get("dim") != dim:
            raise ConfigError(
                f"{out} holds features from another encoder ({entry.get('encoder')}): pass "
                "--overwrite to replace them, or extract into a new --output folder"
            )
        entries[shard] = entry
    report = ExtractReport(output_dir=str(output_dir), manifest=str(output_dir / MANIFEST_NAME),
                           encoder=identity, dim=dim, shards_total=len(paths),
                           shards_reused=len(entries))

    expected: dict[str, int] = {}
    unread: dict[str, list[dict]] = {}
    for shard in pending:
        try:
            samples = count_samples(shard)
        except DataError as exc:
            report.shards_failed.append({"shard": shard, "reason": str(exc)})
            continue
        expected[shard], unread[shard] = samples.read, samples.unread
    assembler = ShardAssembler(expected, outputs, dim, identity, unread)

    def finish(entry: dict) -> None:
        entries[entry["shard"]] = entry
        report.shards_done += 1
        report.images_read += entry["read"]
        report.images_embedded += entry["embedded"]
        report.images_skipped += entry["skipped"]

    for shard in [s for s, n in expected.items() if n == 0]:
        finish(assembler.write(shard))
    todo = [s for s, n in expected.items() if n > 0]
    try:
        if todo:
            last_manifest = time.perf_counter()
            bar = tqdm(total=sum(expected[s] for s in todo), desc="extract", unit="img",
                       disable=not progress)
            for batch in _pipeline(todo, spec, batch_size, num_workers, use_gpu, cpus_per_worker,
                                   precision, ray_address):
                if not report.seconds_to_first_batch:  # Ray start, actor start, model load
                    report.seconds_to_first_batch = time.perf_counter() - start
                bar.update(len(batch["key"]))
                for entry in assembler.add(batch):
                    finish(entry)
                    bar.set_postfix(shards=f"{report.shards_done}/{len(todo)}")
                if time.perf_counter() - last_manifest > _MANIFEST_EVERY_S:
                    write_json_atomic(build_manifest(entries, report.shards_failed, identity, dim),
                                      report.manifest)
                    last_manifest = time.perf_counter()
            bar.close()
            report.shards_failed.extend(assembler.incomplete())
    finally:
        manifest = build_manifest(entries, report.shards_failed, identity, dim)
        write_json_atomic(manifest, report.manifest)
    report.totals = manifest["totals"]
    report.seconds = time.perf_counter() - start
    report.images_per_s = report.images_read / report.seconds if report.seconds > 0 else 0.0
    return report


def _pipeline(shards: list[str], spec: EncoderSpec, batch_size: int, num_workers: int,
              use_gpu: bool, cpus_per_worker: float, precision: str, ray_address: str | None):
    """Build and run the Ray Data pipeline; yields driver-side numpy batches."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    ensure_ray(ray_address)
    DataContext.get_current().enable_progress_bars = False  # the driver shows one tqdm bar
    # Ray Data's INFO records (each dataset's start, plan and end) are routine, and so is
    # its warning that the progress bars it would draw are off
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    ds = ray.data.read_webdataset(
        shards,
        # decode inside the read task (CPU); a corrupt image becomes a counted skip
        decoder=functools.partial(decode_sample, preprocess=spec.preprocess),
        suffixes=wanted_member,
        override_num_blocks=len(shards),
    )
    with warnings.catch_warnings():
        # Ray 2.60 names no parameter for max_restarts and deprecates passing it
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        ds = ds.map_batches(
            EmbedImages,
            fn_constructor_kwargs={
                "spec": spec,
                "use_gpu": use_gpu,
                "precision": precision,
                "threads": max(1, int(cpus_per_worker)),
            },
            compute=ActorPoolStrategy(size=num_workers),
            batch_size=batch_size,
            batch_format="numpy",
            num_gpus=1 if use_gpu else 0,
            num_cpus=1 if use_gpu else cpus_per_worker,
            # an encoder actor that dies ends the extract, whose rerun reuses the finished
            # shards, rather than being restarted: Ray announces the restart policy of an
            # actor with constructor arguments in the object store as an error line on every
            # run (ray-project/ray#53727)
            max_restarts=0,
        )
    yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)
