"""What ``deepdpm extract`` leaves in its output folder: one Parquet file per shard whose
schema metadata holds its manifest entry (counts, skipped keys, encoder), the
``_manifest.json`` rebuilt from those entries, and the run's :class:`ExtractReport`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from deepdpm_core.errors import DataError
from pipeline.io.table_writing import features_table, write_parquet_atomic

MANIFEST_NAME = "_manifest.json"
#: Parquet schema-metadata key holding a shard's manifest entry
SHARD_META_KEY = b"deepdpm.extract"


@dataclass
class ExtractReport:
    """What :func:`~pipeline.extract.ray_pipeline.extract_features` did (``to_dict()`` is JSON-able; ``metrics()`` for MLflow).

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
            "shards_total": self.shards_total, "shards_done": self.shards_done,
            "shards_reused": self.shards_reused, "shards_failed": len(self.shards_failed),
            "images_read": self.images_read, "images_embedded": self.images_embedded,
            "images_skipped": self.images_skipped, "seconds": self.seconds,
            "seconds_to_first_batch": self.seconds_to_first_batch,
            "images_per_s": self.images_per_s,
        }


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


class ShardAssembler:
    """Collects pipeline rows per source shard and writes each shard once it is complete."""

    def __init__(self, expected: dict[str, int], outputs: dict[str, Path], dim: int, encoder: dict,
                 unread: dict[str, list[dict]] | None = None):
        self.expected = expected
        #: shard -> ``{"key", "reason"}`` of the samples the reader passes over (links)
        self.unread = unread or {}
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
        cols = {k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0)
                for k in ("key", "label", "ok", "error")}
        emb = (np.concatenate([p["embedding"] for p in parts]) if parts
               else np.zeros((0, self.dim), np.float32))
        order = np.argsort(cols["key"].astype(str), kind="stable")
        ok = cols["ok"][order].astype(bool)
        keys, labels, errors = cols["key"][order], cols["label"][order], cols["error"][order]
        skipped = sorted([{"key": str(k), "reason": str(e)}
                          for k, e in zip(keys[~ok], errors[~ok], strict=True)]
                         + self.unread.get(shard, []), key=lambda s: s["key"])
        entry = {
            "shard": shard, "output": self.outputs[shard].name, "read": len(order) + len(
                self.unread.get(shard, [])),
            "embedded": int(ok.sum()), "skipped": len(skipped), "skipped_keys": skipped,
            "encoder": self.encoder, "dim": self.dim,
        }
        table = features_table(emb[order][ok].reshape(-1, self.dim), keys[ok],
                               labels[ok].astype(np.int64))
        table = table.replace_schema_metadata({SHARD_META_KEY: json.dumps(entry).encode()})
        write_parquet_atomic(table, self.outputs[shard])
        return entry

    def incomplete(self) -> list[dict]:
        return [{"shard": s,
                 "reason": f"expected {self.expected[s]} samples, received {self.received[s]}"}
                for s in self.parts]


def same_encoder(stored: dict | None, current: dict) -> bool:
    """Same embeddings? Weights compare by content (sha256), so a moved checkpoint matches."""

    def comparable(identity: dict) -> dict:
        return {k: v for k, v in identity.items()
                if not (k == "weights" and "weights_sha256" in identity)}

    return stored is not None and comparable(stored) == comparable(current)


def build_manifest(entries: dict[str, dict], failed: list[dict], encoder: dict, dim: int) -> dict:
    shards = [entries[s] for s in sorted(entries)]
    return {
        "encoder": encoder, "dim": dim,
        "totals": {"shards": len(shards), "read": sum(e["read"] for e in shards),
                   "embedded": sum(e["embedded"] for e in shards),
                   "skipped": sum(e["skipped"] for e in shards)},
        "failed_shards": failed, "shards": shards,
    }
