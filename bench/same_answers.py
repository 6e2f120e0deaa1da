"""Answers a refactor must not change: labels, K path, epoch records and MLflow metrics of
seeded fits, bit for bit.

Runs, in the checkout given (``--checkout``, default this one), one thread: the estimator
at its defaults on the labelled 4-D blobs of ``tests/system/test_fit_modes.py`` (exact EM)
and with the net search (``small_data.max_rows=0``); at its defaults on three sets of
``bench/k_suite.py`` (wine-std, blobs2d-overlap, table-degenerate) and on blobs2d-50
(quick, K = 50: the top-m E-step); the net search on blobs16 with ``estep.dense_max_k=4,
estep.top_m=3``; and ``deepdpm fit`` with the fit-modes settings (this tree's
``cluster_configs/local.yaml`` whatever the checkout) and a sqlite MLflow store (the logged
metrics, timings left out). Prints a table; ``--against`` compares with the
JSON of another checkout and exits 1 if any answer differs.

    git worktree add /tmp/before <commit>
    OMP_NUM_THREADS=1 python bench/same_answers.py --checkout /tmp/before --json /tmp/before.json
    OMP_NUM_THREADS=1 python bench/same_answers.py --json /tmp/after.json --against /tmp/before.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TIMINGS = ("seconds", "epoch_seconds", "fit_seconds")
#: the recipe of ``deepdpm fit``, this tree's for every checkout: the answers then differ by code alone
RECIPE = Path(__file__).resolve().parent.parent / "cluster_configs" / "local.yaml"


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def _blobs() -> tuple[np.ndarray, np.ndarray]:
    """tests/system/test_fit_modes.py's data: 3 labelled blobs in 4-D, 300 rows."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 4)) * 8
    y = np.repeat(np.arange(3), 100)
    return (centres[y] + rng.normal(size=(300, 4))).astype(np.float32), y


def estimator_fits(k_suite) -> dict[str, dict]:
    from deepdpm_core import DeepDPM

    X, _ = _blobs()
    runs = [("blobs-4d", X, {}), ("blobs-4d nets", X, {"small_data__max_rows": 0, "schedule__max_epochs": 30})]
    runs += [(name, k_suite.DATASETS[name](0)[0], {}) for name in ("wine-std", "blobs2d-overlap", "table-degenerate")]
    runs.append(("blobs2d-50 quick", k_suite.blobs2d_50(0, quick=True)[0], {}))
    runs.append(("blobs16 top-m nets", k_suite.DATASETS["blobs16"](0)[0],
                 {"estep__dense_max_k": 4, "estep__top_m": 3, "small_data__max_rows": 0,
                  "schedule__max_epochs": 30}))
    out = {}
    for name, data, params in runs:
        model = DeepDPM(random_state=0, **params).fit(data)
        out[name] = {"K": model.n_clusters_, "labels": _digest(model.labels_.astype(np.int64)),
                     "proba": _digest(model.predict_proba(data[:200]).astype(np.float64)),
                     "history": [{k: v for k, v in r.items() if not k.startswith("seconds")}
                                 for r in model.history_]}
    return out


def cli_fit(checkout: Path) -> dict:
    import mlflow
    import pyarrow.parquet as pq

    try:
        from pipeline.io.table_writing import features_table
    except ImportError:  # checkouts that build tables in pipeline/io/tables.py, or before pipeline/io/
        try:
            from pipeline.io.tables import features_table
        except ImportError:
            from pipeline.io import features_table
    X, y = _blobs()
    tmp = Path(tempfile.mkdtemp(prefix="same-answers-"))
    pq.write_table(features_table(X, np.arange(300), y), tmp / "d.parquet", row_group_size=150)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    sets = ["init.n_clusters=2", "schedule.warmup_epochs=3", "schedule.move_every=3", "schedule.max_epochs=15",
            "small_data.max_rows=0"]
    cmd = [sys.executable, "-m", "pipeline.cli", "fit", "--input", str(tmp / "d.parquet"), "--output", str(tmp / "out"),
           "--config", str(RECIPE), "--seed", "0", "--quiet",
           "--tracking-uri", uri, "--experiment", "same-answers", "--run-name", "fit",
           *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True)
    client = mlflow.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("same-answers").experiment_id])[0]
    metrics = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                       key=lambda m: m.step)]
               for key in sorted(run.data.metrics) if not key.startswith(TIMINGS)}
    labels = pq.read_table(tmp / "out" / "assignments.parquet").column("cluster").to_numpy()
    return {"K": int(labels.max()) + 1, "labels": _digest(labels), "metrics": metrics}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--json", type=Path, help="write the answers here")
    parser.add_argument("--against", type=Path, help="answers of another checkout to compare with")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    sys.path.insert(0, str(checkout))
    import torch

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("k_suite", checkout / "bench" / "k_suite.py")
    k_suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k_suite)
    answers = {**estimator_fits(k_suite), "deepdpm fit (MLflow metrics)": cli_fit(checkout)}
    answers = json.loads(json.dumps(answers))  # as a JSON file holds them (lists, not tuples)
    other = json.loads(args.against.read_text()) if args.against else {}
    print(f"{'fit':30s} {'K':>3s} {'labels':16s}" + ("  against" if other else ""))
    for name, got in answers.items():
        verdict = ("identical" if other.get(name) == got else "DIFFERS") if other else ""
        print(f"{name:30s} {got['K']:3d} {got['labels']:16s}  {verdict}")
    if args.json:
        args.json.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
    return int(bool(other) and any(other.get(name) != got for name, got in answers.items()))


if __name__ == "__main__":
    raise SystemExit(main())
