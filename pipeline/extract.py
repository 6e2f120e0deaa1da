"""webdataset shards -> image embeddings in Parquet, with Ray Data.

Pipeline (one Ray Data dataset over every shard still to do)::

    read_webdataset, decoder = decode + resize/crop  [CPU read tasks, torch-free]
      -> encoder actor pool (ActorPoolStrategy)       [one actor per GPU, or per CPU slot]
      -> driver: rows grouped by source shard; a shard whose rows are all in is
         written as one Parquet file

Why the driver groups rows: Ray Data writes one file per *block*, and blocks of different
shards interleave, but a resumable, lossless run needs exactly one output per input
shard. The driver knows how many samples each shard holds (a cheap scan of the tar
headers before the run), so it writes ``<shard>.parquet`` atomically the moment the last
row of that shard arrives; a crash loses only shards in flight, and a rerun skips every
shard whose output exists. Each output carries its own counts and skipped keys in its
Parquet metadata, so ``_manifest.json`` can always be rebuilt from the outputs.

A sample whose image is missing or fails to decode is skipped and counted (with its
key and the reason), never fatal. Output rows are sorted by key, so the same input
gives the same files.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import os
import re
import tarfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from deepdpm_core.errors import ConfigError, DataError
from pipeline.encoder_choices import PRECISIONS
from pipeline.encoders import RANDOM_INIT_SEED, EncoderSpec, build_encoder, embed_numpy
from pipeline.io import features_table, write_json_atomic, write_parquet_atomic
from pipeline.preprocess import decode_sample, wanted_member

MANIFEST_NAME = "_manifest.json"
#: Parquet schema-metadata key holding a shard's manifest entry
SHARD_META_KEY = b"deepdpm.extract"
#: webdataset's sample grouping rule (same regex as webdataset and Ray's reader):
#: the key is the member name up to the first dot of its last path component
_SAMPLE_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_MANIFEST_EVERY_S = 30.0


@dataclass
class ExtractReport:
    """What :func:`extract_features` did (``to_dict()`` is JSON-able; ``metrics()`` for MLflow).

    ``images_*`` and ``seconds`` count this run only; ``totals`` counts every shard in
    ``output_dir``, including those done by earlier runs. ``seconds_to_first_batch`` is
    the start-up cost (Ray, actors, model loading) inside ``seconds``.
    """

    output_dir: str
    manifest: str
    encoder: dict
    dim: int
    shards_total: int = 0
    shards_done: int = 0
    shards_reused: int = 0
    shards_failed: list[dict] = field(default_factory=list)
    images_read: int = 0
    images_embedded: int = 0
    images_skipped: int = 0
    seconds: float = 0.0
    seconds_to_first_batch: float = 0.0
    images_per_s: float = 0.0
    totals: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def metrics(self) -> dict[str, float]:
        """Numeric fields of this run, flat (for ``mlflow.log_metrics``)."""
        return {
            "shards_total": self.shards_total,
            "shards_done": self.shards_done,
            "shards_reused": self.shards_reused,
            "shards_failed": len(self.shards_failed),
            "images_read": self.images_read,
            "images_embedded": self.images_embedded,
            "images_skipped": self.images_skipped,
            "seconds": self.seconds,
            "seconds_to_first_batch": self.seconds_to_first_batch,
            "images_per_s": self.images_per_s,
        }


# ----------------------------------------------------------------------------- inputs


def resolve_shards(shards: str | Path | Sequence[str | Path]) -> list[Path]:
    """Shard files named by a directory (its ``*.tar``), a glob, a file, or a list of these.

    Raises
    ------
    FileNotFoundError
        A name that matches no ``.tar`` file.
    ConfigError
        Two shards with the same file name (their outputs would collide).
    """
    items = [shards] if isinstance(shards, (str, Path)) else list(shards)
    found: list[Path] = []
    for item in items:
        text = str(item)
        if Path(text).is_dir():
            matches = sorted(Path(text).glob("*.tar"))
        elif glob.has_magic(text):
            matches = sorted(Path(p) for p in glob.glob(text) if p.endswith(".tar"))
        else:
            matches = [Path(text)] if Path(text).is_file() else []
        if not matches:
            raise FileNotFoundError(f"no .tar shards found at {text}")
        found.extend(p.resolve() for p in matches if not p.name.startswith("."))
    found = list(dict.fromkeys(found))
    names: dict[str, Path] = {}
    for path in found:
        if path.stem in names:
            raise ConfigError(
                f"two shards share the name {path.name} ({names[path.stem]} and {path}): "
                "outputs are named after shards, so extract them into separate --output folders"
            )
        names[path.stem] = path
    return found


def count_samples(shard: str | Path) -> int:
    """Number of webdataset samples in ``shard`` from its tar headers (data are seeked over).

    Raises
    ------
    DataError
        Not a readable tar, or a sample's files are not contiguous (webdataset needs them
        adjacent; Ray's reader would fail mid-run).
    """
    count, previous, seen = 0, None, set()
    try:
        file_size = os.path.getsize(shard)
        with tarfile.open(shard, "r:*") as tar:
            # tarfile stops quietly at a cut header, but a member whose data runs past the
            # end of the file would make the streaming reader fail mid-run: check it here
            plain = isinstance(tar.fileobj, io.BufferedReader)
            for member in tar:
                if plain and member.offset_data + member.size > file_size:
                    raise DataError(
                        f"{shard}: truncated tar file (member {member.name} is cut off)"
                    )
                match = _SAMPLE_NAME.match(member.name) if member.isreg() else None
                if match is None or match.group(1) == previous:
                    continue
                previous = match.group(1)
                if previous in seen:
                    raise DataError(
                        f"{shard}: files of sample '{previous}' are not contiguous in the tar "
                        "(webdataset needs them adjacent; rewrite it with `deepdpm shards`)"
                    )
                seen.add(previous)
                count += 1
            if plain and file_size - tar.offset < tarfile.BLOCKSIZE:
                # a complete tar ends with zero blocks; tarfile reads a cut header as the end
                raise DataError(f"{shard}: truncated tar file (no end-of-archive marker)")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataError(f"{shard}: not a readable tar file ({exc})") from exc
    return count


# ----------------------------------------------------------------------------- embed (actors)


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


# ----------------------------------------------------------------------------- outputs


def output_path(shard: Path, output_dir: Path) -> Path:
    """Where the features of ``shard`` go: ``output_dir/<shard stem>.parquet``."""
    return output_dir / f"{shard.stem}.parquet"


def read_shard_entry(path: str | Path) -> dict:
    """The manifest entry stored in an output file's Parquet metadata."""
    metadata = pq.read_schema(path).metadata or {}
    if SHARD_META_KEY not in metadata:
        raise DataError(
            f"{path} was not written by deepdpm extract (no '{SHARD_META_KEY.decode()}' metadata)"
        )
    return json.loads(metadata[SHARD_META_KEY])


class _ShardAssembler:
    """Collects pipeline rows per source shard and writes each shard once it is complete."""

    def __init__(self, expected: dict[str, int], outputs: dict[str, Path], dim: int, encoder: dict):
        self.expected = expected
        self.outputs = outputs
        self.dim = dim
        self.encoder = encoder
        self.parts: dict[str, list[dict[str, np.ndarray]]] = {s: [] for s in expected}
        self.received = dict.fromkeys(expected, 0)

    def add(self, batch: dict[str, np.ndarray]) -> list[dict]:
        """Take one batch; return the manifest entries of the shards it completed."""
        done = []
        for shard in np.unique(batch["shard"]):
            rows = batch["shard"] == shard
            shard = str(shard)
            if shard not in self.expected:
                raise RuntimeError(f"pipeline returned rows of an unknown shard {shard}")
            self.parts[shard].append({k: v[rows] for k, v in batch.items()})
            self.received[shard] += int(rows.sum())
            if self.received[shard] == self.expected[shard]:
                done.append(self.write(shard))
        return done

    def write(self, shard: str) -> dict:
        parts = self.parts.pop(shard)
        cols = {
            k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0)
            for k in ("key", "label", "ok", "error")
        }
        emb = (
            np.concatenate([p["embedding"] for p in parts])
            if parts
            else np.zeros((0, self.dim), np.float32)
        )
        order = np.argsort(cols["key"].astype(str), kind="stable")
        ok = cols["ok"][order].astype(bool)
        keys, labels, errors = cols["key"][order], cols["label"][order], cols["error"][order]
        entry = {
            "shard": shard,
            "output": self.outputs[shard].name,
            "read": len(order),
            "embedded": int(ok.sum()),
            "skipped": int((~ok).sum()),
            "skipped_keys": [
                {"key": str(k), "reason": str(e)}
                for k, e in zip(keys[~ok], errors[~ok], strict=True)
            ],
            "encoder": self.encoder,
            "dim": self.dim,
        }
        table = features_table(
            emb[order][ok].reshape(-1, self.dim), keys[ok], labels[ok].astype(np.int64)
        )
        table = table.replace_schema_metadata({SHARD_META_KEY: json.dumps(entry).encode()})
        write_parquet_atomic(table, self.outputs[shard])
        return entry

    def incomplete(self) -> list[dict]:
        return [
            {
                "shard": s,
                "reason": f"expected {self.expected[s]} samples, received {self.received[s]}",
            }
            for s in self.parts
        ]


def _same_encoder(stored: dict | None, current: dict) -> bool:
    """Same embeddings? Weights compare by content (sha256), so a moved checkpoint matches."""

    def comparable(identity: dict) -> dict:
        return {
            k: v
            for k, v in identity.items()
            if not (k == "weights" and "weights_sha256" in identity)
        }

    return stored is not None and comparable(stored) == comparable(current)


def _manifest(entries: dict[str, dict], failed: list[dict], encoder: dict, dim: int) -> dict:
    shards = [entries[s] for s in sorted(entries)]
    return {
        "encoder": encoder,
        "dim": dim,
        "totals": {
            "shards": len(shards),
            "read": sum(e["read"] for e in shards),
            "embedded": sum(e["embedded"] for e in shards),
            "skipped": sum(e["skipped"] for e in shards),
        },
        "failed_shards": failed,
        "shards": shards,
    }


# ----------------------------------------------------------------------------- driver


def ensure_ray(address: str | None = None) -> None:
    """Connect to Ray unless already connected: ``address``, else ``$RAY_ADDRESS`` (e.g. under
    ``ray job submit``), else a fresh local instance (never a stranger's cluster)."""
    import ray

    from pipeline.ray_local import init_local_ray

    if ray.is_initialized():
        return
    if address is None and not os.environ.get("RAY_ADDRESS"):
        address = "local"
    if address == "local":  # a cluster of its own: without Ray's token-auth announcements
        init_local_ray(include_dashboard=False, log_to_driver=True)
        return
    ray.init(address=address, include_dashboard=False, log_to_driver=True)


def extract_features(
    shards: str | Path | Sequence[str | Path],
    output_dir: str | Path,
    encoder: str | EncoderSpec = "pixels",
    *,
    weights: str | None = None,
    arch: str = "resnet50",
    head: bool = False,
    pixel_size: int = 8,
    l2_normalize: bool = False,
    batch_size: int = 256,
    num_workers: int = 1,
    use_gpu: bool = False,
    cpus_per_worker: float = 1.0,
    precision: str = "auto",
    ray_address: str | None = None,
    progress: bool = True,
) -> ExtractReport:
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
    spec = (
        encoder
        if isinstance(encoder, EncoderSpec)
        else EncoderSpec(encoder, weights, arch, head, pixel_size, l2_normalize)
    )
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
        if not out.exists():
            pending.append(shard)
            continue
        entry = read_shard_entry(out)
        if not _same_encoder(entry.get("encoder"), identity) or entry.get("dim") != dim:
            raise ConfigError(
                f"{out} holds features from another encoder ({entry.get('encoder')}); "
                "extract into a new --output folder"
            )
        entries[shard] = entry
    report = ExtractReport(
        output_dir=str(output_dir),
        manifest=str(output_dir / MANIFEST_NAME),
        encoder=identity,
        dim=dim,
        shards_total=len(paths),
        shards_reused=len(entries),
    )

    expected: dict[str, int] = {}
    for shard in pending:
        try:
            expected[shard] = count_samples(shard)
        except DataError as exc:
            report.shards_failed.append({"shard": shard, "reason": str(exc)})
    assembler = _ShardAssembler(expected, outputs, dim, identity)

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
            bar = tqdm(
                total=sum(expected[s] for s in todo),
                desc="extract",
                unit="img",
                disable=not progress,
            )
            for batch in _pipeline(
                todo,
                spec,
                batch_size,
                num_workers,
                use_gpu,
                cpus_per_worker,
                precision,
                ray_address,
            ):
                if not report.seconds_to_first_batch:  # Ray start, actor start, model load
                    report.seconds_to_first_batch = time.perf_counter() - start
                bar.update(len(batch["key"]))
                for entry in assembler.add(batch):
                    finish(entry)
                    bar.set_postfix(shards=f"{report.shards_done}/{len(todo)}")
                if time.perf_counter() - last_manifest > _MANIFEST_EVERY_S:
                    write_json_atomic(
                        _manifest(entries, report.shards_failed, identity, dim), report.manifest
                    )
                    last_manifest = time.perf_counter()
            bar.close()
            report.shards_failed.extend(assembler.incomplete())
    finally:
        manifest = _manifest(entries, report.shards_failed, identity, dim)
        write_json_atomic(manifest, report.manifest)
    report.totals = manifest["totals"]
    report.seconds = time.perf_counter() - start
    report.images_per_s = report.images_read / report.seconds if report.seconds > 0 else 0.0
    return report


def _pipeline(
    shards: list[str],
    spec: EncoderSpec,
    batch_size: int,
    num_workers: int,
    use_gpu: bool,
    cpus_per_worker: float,
    precision: str,
    ray_address: str | None,
):
    """Build and run the Ray Data pipeline; yields driver-side numpy batches."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    ensure_ray(ray_address)
    DataContext.get_current().enable_progress_bars = False  # the driver shows one tqdm bar
    ds = ray.data.read_webdataset(
        shards,
        # decode inside the read task (CPU); a corrupt image becomes a counted skip
        decoder=functools.partial(decode_sample, preprocess=spec.preprocess),
        suffixes=wanted_member,
        override_num_blocks=len(shards),
    )
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
    )
    yield from ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2)
