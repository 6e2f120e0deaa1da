"""``deepdpm demo``: the whole pipeline on data that ships with the install (no downloads).

scikit-learn's digits rendered as PNGs → webdataset shards → ``extract`` (pixels, Ray
Data) → ``embed`` (UMAP, the paper's n2d features) → ``fit`` (K unknown) → ``predict``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def bundled_recipe(name: str) -> Path:
    """``cluster_configs/<name>`` of the source checkout (editable install), else the copy
    a wheel installs inside the package (``pipeline/cluster_configs``, see pyproject)."""
    package = Path(__file__).resolve().parents[1]
    source = package.parent / "cluster_configs" / name
    return source if source.is_file() else package / "cluster_configs" / name


#: the fit's recipe: the demo clusters a UMAP embedding
N2D_RECIPE = bundled_recipe("n2d.yaml")

HELP = "run shards → extract → embed → fit → predict on scikit-learn's digits (no downloads)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="deepdpm-demo", help="working directory (default: ./deepdpm-demo)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--config", type=Path, default=N2D_RECIPE,
                        help="YAML config of the embed and fit steps (default: cluster_configs/n2d.yaml)")
    parser.add_argument("--no-ray", action="store_true",
                        help="skip the image stages (shards/extract): embed the digits array directly")


def _step(name: str, path: Path | str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {name:8s} -> {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from sklearn.datasets import load_digits

    from deepdpm_core import DeepDPM
    from deepdpm_core.config import load_config
    from deepdpm_core.embedding import embed
    from deepdpm_core.metrics import clustering_scores
    from pipeline.fitting import write_fit_outputs
    from pipeline.io import FeatureTable, features_table, read_features, write_parquet_atomic

    cfg = load_config(args.config).with_overrides({"seed": args.seed})  # fail before any work
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.no_ray:
        digits = load_digits()
        table = FeatureTable(digits.data.astype(np.float32) / 16.0, digits.target.astype(np.int64),
                             np.array([f"digit_{i:04d}" for i in range(len(digits.target))], dtype=object))
    else:
        from pipeline.extract import extract_features
        from pipeline.shards import digits_image_folder, write_shards

        images = digits_image_folder(out / "images")
        _step("images", images, t0)
        shards = out / "shards"
        write_shards(images, shards, shard_size=500, progress=False)
        _step("shards", shards, t0)
        features = out / "features"
        extract_features(shards, features, encoder="pixels", num_workers=1, progress=False)
        _step("extract", features, t0)
        table = read_features(features)
    emb = embed(table.X, "umap", cfg, dim=10).embedding
    emb_path = out / "embedding.parquet"
    write_parquet_atomic(features_table(emb, table.keys, table.labels), emb_path)
    _step("embed", emb_path, t0)
    emb_table = FeatureTable(emb, table.labels, table.keys)
    t_fit = time.perf_counter()
    model = DeepDPM(cfg).fit(emb, progress=True)
    fit_seconds = time.perf_counter() - t_fit
    summary = write_fit_outputs(out / "fit", model, emb_table, fit_seconds, emb_path)
    _step("fit", out / "fit", t0)
    pred = model.predict(emb)
    _step("predict", out / "fit" / "assignments.parquet", t0)
    scores = clustering_scores(table.labels, pred)
    true_k = len(np.unique(table.labels))
    print(f"digits: {len(pred)} images, K found = {summary['n_clusters']} (true K = {true_k}), "
          f"NMI={scores['nmi']:.3f} ARI={scores['ari']:.3f} ACC={scores['acc']:.3f}, "
          f"fit {fit_seconds:.1f}s, total {time.perf_counter() - t0:.1f}s")
    print(f"K over epochs: {out / 'fit' / 'k_over_epochs.png'}")
    return 0
