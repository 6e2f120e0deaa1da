"""``deepdpm demo``: the whole pipeline on data that ships with the install (no downloads).

scikit-learn's digits rendered as PNGs → webdataset shards → ``extract`` (pixels, Ray
Data) → ``embed`` (UMAP, the paper's n2d features) → ``fit`` (K unknown) → ``predict`` →
``report`` (``DIR/report.html``), the fit tracked as an MLflow run in ``DIR/mlflow.db``. A
rerun reuses the data stages an earlier demo finished with the same settings
(``DIR/demo_stages.json``; docs/reliability.md, "A second demo reuses only what an earlier
one finished"); ``--overwrite`` redoes every stage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.io.results import add_json_argument, shown_path


def bundled_recipe(name: str) -> Path:
    """``cluster_configs/<name>`` of the source checkout (editable install), else the copy
    a wheel installs inside the package (``pipeline/cluster_configs``, see pyproject)."""
    package = Path(__file__).resolve().parents[1]
    source = package.parent / "cluster_configs" / name
    return source if source.is_file() else package / "cluster_configs" / name


#: the fit's recipe: the demo clusters a UMAP embedding
N2D_RECIPE = bundled_recipe("n2d.yaml")

#: where ``mlflow ui`` serves by default: the demo names its run's page there
MLFLOW_UI = "http://127.0.0.1:5000"

HELP = ("run shards → extract → embed → fit → predict → report on scikit-learn's digits, tracked "
        "in MLflow (no downloads)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="deepdpm-demo", help="working directory (default: ./deepdpm-demo)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--config", type=Path, default=N2D_RECIPE,
                        help="YAML config of the embed and fit steps (default: cluster_configs/n2d.yaml)")
    parser.add_argument("--no-ray", action="store_true",
                        help="skip the image stages (shards/extract): embed the digits array directly")
    parser.add_argument("--no-tracking", action="store_true",
                        help="no MLflow run (default: one in OUTPUT/mlflow.db)")
    parser.add_argument("--overwrite", action="store_true",
                        help="redo every stage (default: reuse the images, shards, features and "
                             "embedding an earlier demo in OUTPUT finished with the same settings)")
    add_json_argument(parser)


def _step(name: str, path: Path | str, t0: float, reused: bool = False) -> None:
    note = " (reused)" if reused else ""
    print(f"[{time.perf_counter() - t0:6.1f}s] {name:8s} -> {shown_path(path)}{note}",
          file=sys.stderr)


class DemoStages:
    """The data stages earlier demos finished in one folder, each with the settings it ran
    with (its key), in ``OUTPUT/demo_stages.json``. A stage's key holds the key of the
    stage before it, so a redone stage is never followed by one built from its old output.

    Parameters
    ----------
    out : Path
        The demo's folder.
    fresh : bool
        Forget every finished stage (``--overwrite``).
    """

    FILE = "demo_stages.json"

    def __init__(self, out: Path, fresh: bool) -> None:
        self.path = out / self.FILE
        self.done: dict[str, Any] = {}
        if not fresh and self.path.is_file():
            try:
                self.done = json.loads(self.path.read_text())
            except ValueError:  # unreadable: every stage is redone, and the file rewritten
                self.done = {}
        self.reused: list[str] = []

    def reusable(self, name: str, key: dict, output: Path) -> bool:
        """True when ``name`` finished with ``key`` and its ``output`` is still there; else
        the stage is forgotten until :meth:`finished` (a rerun killed mid-stage redoes it)."""
        if self.done.get(name) == key and output.exists():
            self.reused.append(name)
            return True
        if self.done.pop(name, None) is not None:
            self._write()
        return False

    def finished(self, name: str, key: dict) -> None:
        """Record that ``name`` has written all its output with ``key``."""
        self.done[name] = key
        self._write()

    def _write(self) -> None:
        from deepdpm_core.atomic_files import write_json_atomic

        write_json_atomic(self.done, self.path)


#: what a demo writes into its folder: one of them there makes the folder a demo's (a rerun)
DEMO_ENTRIES = (DemoStages.FILE, "images", "shards", "features", "embedding.parquet", "fit",
                "report.html", "mlflow.db", "mlartifacts")


def run(args: argparse.Namespace) -> int:
    from deepdpm_core.config import load_config
    from pipeline.extras import require

    # before torch and scikit-learn load, so that a missing extra or a wrong --config is
    # answered at once
    require("the demo", "umap", *([] if args.no_ray else ["extract"]),
            *([] if args.no_tracking else ["mlflow"]),
            note=None if args.no_ray and args.no_tracking
            else 'with --no-ray --no-tracking: pip install "deepdpm[umap]"')
    cfg = load_config(args.config).with_overrides({"seed": args.seed})
    from pipeline.io.existing_outputs import refuse_foreign_folder

    refuse_foreign_folder(args.output, args.overwrite, DEMO_ENTRIES, "demo")

    import numpy as np
    from sklearn.datasets import load_digits

    from deepdpm_core import DeepDPM
    from deepdpm_core.data import clustering_scores
    from deepdpm_core.progress_bars import epoch_bar
    from pipeline.fit.epoch_scores import EpochLabelScores
    from pipeline.fit.outputs import write_fit_outputs
    from pipeline.fit.runner import data_variance_summary, run_epochs, start_job
    from pipeline.io.results import print_result
    from pipeline.io.table_writing import features_table, write_parquet_atomic
    from pipeline.io.tables import FeatureTable, read_features
    from pipeline.report.html_report import render_report, write_report
    from pipeline.report.run_data import load_run_dir
    from pipeline.tracking.fit_runs import log_fit_outputs
    from pipeline.tracking.run_tracker import RunTracker

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    tracking_uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    t0 = time.perf_counter()
    stages = DemoStages(out, fresh=args.overwrite)
    shards = None
    if args.no_ray:
        source = {"digits": "load_digits().data / 16"}
        features = None
    else:
        images, shards, features = out / "images", out / "shards", out / "features"
        images_key = {"digits": "load_digits() as PNGs", "scale": 4}
        reused = stages.reusable("images", images_key, images)
        if not reused:
            from pipeline.extract.shards import digits_image_folder

            digits_image_folder(images, scale=4)
            stages.finished("images", images_key)
        _step("images", images, t0, reused)
        shards_key = {"images": images_key, "shard_size": 500}
        reused = stages.reusable("shards", shards_key, shards)
        if not reused:
            from pipeline.extract.shards import write_shards

            write_shards(images, shards, shard_size=500, overwrite=True, progress=False)
            stages.finished("shards", shards_key)
        _step("shards", shards, t0, reused)
        source = {"shards": shards_key, "encoder": "pixels"}
        reused = stages.reusable("features", source, features)
        if not reused:
            from pipeline.extract.ray_pipeline import extract_features

            # extract reuses the files of a folder by their encoder alone: they may be of
            # other shards
            shutil.rmtree(features, ignore_errors=True)
            extract_features(shards, features, encoder="pixels", num_workers=1, progress=False)
            stages.finished("features", source)
        _step("extract", features, t0, reused)
    emb_path = out / "embedding.parquet"
    emb_key = {"input": source, "method": "umap", "dim": 10, "embed": cfg.to_dict()["embed"],
               "seed": cfg.seed}
    reused = stages.reusable("embedding", emb_key, emb_path)
    if reused:
        emb_table = read_features(emb_path)
    else:
        if features is None:
            digits = load_digits()
            table = FeatureTable(digits.data.astype(np.float32) / 16.0,
                                 digits.target.astype(np.int64),
                                 np.array([f"digit_{i:04d}" for i in range(len(digits.target))],
                                          dtype=object))
        else:
            table = read_features(features)
        from deepdpm_core.features import embed

        emb_table = FeatureTable(embed(table.X, "umap", cfg, dim=10).embedding, table.labels,
                                 table.keys)
        write_parquet_atomic(features_table(emb_table.X, emb_table.keys, emb_table.labels),
                             emb_path)
        stages.finished("embedding", emb_key)
    _step("embed", emb_path, t0, reused)
    if stages.reused:
        *rest, last = stages.reused
        names = f"{', '.join(rest)} and {last}" if rest else last
        print(f"reused the {names} of an earlier demo in {shown_path(out)} (--overwrite redoes them)",
              file=sys.stderr)
    emb = emb_table.X
    with RunTracker(tracking_uri, "deepdpm-demo", enabled=not args.no_tracking,
                    run_name=out.resolve().name,
                    artifact_location=(out / "mlartifacts").resolve().as_uri()) as tracker:
        # the epoch loop of every fit, with its per-epoch scores, tracking and diagnostics
        search = start_job(cfg, emb, tracker, emb_path, command="demo")
        fit_seconds = run_epochs(search, [], tracker,
                                 EpochLabelScores.for_labels(emb, emb_table.labels, seed=cfg.seed),
                                 progress=epoch_bar)
        model = DeepDPM.from_search(search)
        summary = write_fit_outputs(out / "fit", model, emb_table, fit_seconds, emb_path,
                                    extra=data_variance_summary(search))
        _step("fit", out / "fit", t0)
        pred = model.predict(emb)
        _step("predict", out / "fit" / "assignments.parquet", t0)
        report = write_report(render_report(load_run_dir(out / "fit"), shards), out / "report.html")
        _step("report", report, t0)
        log_fit_outputs(tracker, out / "fit")
        tracker.log_artifacts([report])
    run_id = None if args.no_tracking else tracker.run_id
    run_page = None if args.no_tracking else tracker.run_page(MLFLOW_UI)
    scores = clustering_scores(emb_table.labels, pred)
    true_k = len(np.unique(emb_table.labels))
    lines = [
        f"digits: {len(pred)} images, K found = {summary['n_clusters']} (true K = {true_k}), "
        f"NMI={scores['nmi']:.3f} ARI={scores['ari']:.3f} ACC={scores['acc']:.3f}, "
        f"fit {fit_seconds:.1f}s, total {time.perf_counter() - t0:.1f}s",
        f"report:  {shown_path(report)}",
        f"plots:   {shown_path(out / 'fit')}/*.png",
    ]
    if run_id:
        lines.append(f"MLflow:  run {run_id} in {tracking_uri} "
                     f"(to browse: mlflow ui --backend-store-uri {tracking_uri}, then {run_page})")
    print_result(args, lines, {
        "output": shown_path(out), "n_clusters": summary["n_clusters"], "true_k": true_k,
        "metrics": scores, "fit_seconds": round(fit_seconds, 3), "report": shown_path(report),
        "fit": shown_path(out / "fit"), "mlflow_tracking_uri": tracking_uri if run_id else None,
        "mlflow_run_id": run_id, "mlflow_run_page": run_page, "reused": stages.reused,
    })  # fmt: skip
    return 0
