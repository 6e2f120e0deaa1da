"""Peak memory of ``deepdpm predict`` over a 1M x 128 feature table with a K = 1000 model.

Rows:

* Ray Data over a folder of Parquet files (``--files`` of them): the command as a user
  runs it (a new local Ray cluster, ``--num-workers`` model actors);
* the in-process single-file path on the same rows as one Parquet file, for comparison.

Memory is sampled every 0.1 s over the command's whole process tree (the driver, the Ray
processes it starts, read-task workers and model actors): the peak of the summed RSS and
of the summed PSS (proportional set size: shared pages, e.g. Ray's object store in
/dev/shm, counted once over the processes that map them), and the largest single process.

The data: 1000 Gaussian clusters in 128-D. The model: K = 1000 in the published format,
built from a labelled 50k-row sample (:func:`build_model`).

Run: ``OMP_NUM_THREADS=1 python bench/predict_memory.py [--rows 1000000] [--json]``
(writes ``bench/results/predict_memory.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deepdpm_core.atomic_files import write_json_atomic  # noqa: E402
from pipeline.io.table_writing import features_table  # noqa: E402

MIB = 2**20
#: how Ray names a model actor's process (setproctitle)
MODEL_ACTOR = "ray::MapWorker(MapBatches(PredictRowGroups))"
#: a run that takes longer failed (a cluster that lost its processes waits forever)
TIMEOUT_S = 1200


def cluster_rows(n: int, dim: int, k: int, seed: int, chunk: int = 100_000):
    """(X float32 (m, dim), y int64 (m,)) chunks of n rows of k Gaussian clusters."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 4.0, (k, dim)).astype(np.float32)
    for start in range(0, n, chunk):
        y = rng.integers(0, k, min(chunk, n - start))
        yield centres[y] + rng.normal(size=(len(y), dim)).astype(np.float32), y


def write_data(folder: Path, single: Path, n: int, dim: int, k: int, files: int) -> np.ndarray:
    """``files`` Parquet files in ``folder`` and the same rows as one file ``single``;
    returns a labelled 50k-row subsample for the model."""
    folder.mkdir(parents=True)
    per_file = -(-n // files)
    sample, writers, row = [], {}, 0
    with pq.ParquetWriter(single, features_table(np.zeros((0, dim)), [], None).schema) as whole:
        for X, y in cluster_rows(n, dim, k, seed=0):
            keys = np.arange(row, row + len(X))
            table = features_table(X, keys, y)
            whole.write_table(table)
            lo = 0
            while lo < len(X):  # a chunk may span two files
                f = (row + lo) // per_file
                hi = min(len(X), (f + 1) * per_file - row)
                if f not in writers:
                    writers[f] = pq.ParquetWriter(folder / f"part-{f:03d}.parquet", table.schema)
                writers[f].write_table(table.slice(lo, hi - lo))
                lo = hi
            if sum(len(s) for s, _ in sample) < 50_000:
                sample.append((X[:10_000], y[:10_000]))
            row += len(X)
    for w in writers.values():
        w.close()
    return np.concatenate([s for s, _ in sample]), np.concatenate([t for _, t in sample])


def build_model(X: np.ndarray, y: np.ndarray, k: int, path: Path, steps: int = 300) -> tuple[int, float]:
    """A K = ``k`` model in the published format (``FittedModel.save``), built in seconds.

    A DeepDPM fit of K = 1000 takes an hour here, and a short one ends with fewer
    clusters (K counts the clusters that own points). So the parts are made from the
    labelled sample directly: global-scale coordinates of the rows, cluster means, unit
    covariances and weights from the labels, and the clustering net (the paper's D-50-K)
    trained ``steps`` Adam steps on the labels with cross-entropy. ``DeepDPM.load`` reads
    it as any fitted model; K is the net's width, ``k``.
    """
    import torch

    from deepdpm_core.config import Config
    from deepdpm_core.data import FeatureCoordinates
    from deepdpm_core.model import FittedModel
    from deepdpm_core.nets import ClusterNet

    start = time.perf_counter()
    x = torch.as_tensor(X, dtype=torch.float64)
    dim = x.shape[1]
    centre, unit = x.mean(0), float(x.var(0).mean().sqrt())
    ones = torch.ones(dim, dtype=torch.float64)
    coords = FeatureCoordinates("none", centre, ones / unit, unit, x.std(0))
    xt = coords.apply(x).float()
    labels = torch.as_tensor(y)
    counts = torch.bincount(labels, minlength=k).double()
    means = torch.zeros(k, dim, dtype=torch.float64).index_add_(0, labels, xt.double())
    means /= counts.clamp(min=1)[:, None]
    config = Config().with_overrides({"init.n_clusters": k})
    net = ClusterNet(dim, config.model.hidden, k, torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    rng = torch.Generator().manual_seed(1)
    for _ in range(steps):
        rows = torch.randint(len(xt), (1024,), generator=rng)
        loss = torch.nn.functional.cross_entropy(net(xt[rows]), labels[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    covariances = torch.eye(dim, dtype=torch.float64).expand(k, dim, dim).clone()
    model = FittedModel(config, coords, net.eval().requires_grad_(False), means, covariances,
                        torch.log((counts + 1) / (counts + 1).sum()), [], len(xt))
    model.save(path)
    return model.n_clusters, time.perf_counter() - start


def _tree(root: int) -> list[int]:
    """``root`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in bytes; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024
                      for line in fh if line.split(":")[0] in ("Rss", "Pss")}
        return fields.get("Rss", 0), fields.get("Pss", 0)
    except (OSError, ValueError):
        return 0, 0


def _name(pid: int) -> str:
    """A process's command line, shortened (``ray::MapWorker(...)``, ``.../raylet``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::"):
        return first[:60]
    rest = " ".join(a.decode(errors="replace") for a in argv[1:3])
    return f"{Path(first).name} {rest}"[:60]


def run_measured(argv: list[str], env: dict[str, str]) -> dict:
    """Run ``argv``, sampling its process tree's memory; its ``--json`` result and peaks."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    peak = {"rss_sum": 0, "pss_sum": 0, "rss_max_process": 0, "processes": 0, "driver_actors": 0}
    at_peak: list[dict] = []  # the processes when the PSS sum peaked
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            pids = _tree(proc.pid)
            per = [_memory(pid) for pid in pids]
            peak["rss_sum"] = max(peak["rss_sum"], sum(r for r, _ in per))
            working = [r for pid, (r, _) in zip(pids, per, strict=True)
                       if pid == proc.pid or _name(pid).startswith(MODEL_ACTOR)]
            peak["driver_actors"] = max(peak["driver_actors"], sum(working))
            if sum(p for _, p in per) > peak["pss_sum"]:
                peak["pss_sum"] = sum(p for _, p in per)
                at_peak[:] = [{"process": _name(pid), "rss_mib": round(r / MIB),
                               "pss_mib": round(p / MIB)} for pid, (r, p) in zip(pids, per, strict=True)]
            peak["rss_max_process"] = max(peak["rss_max_process"], max(r for r, _ in per))
            peak["processes"] = max(peak["processes"], len(per))
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"seconds": round(seconds, 1), "result": json.loads(out.strip().splitlines()[-1]),
            "peak_rss_sum_mib": round(peak["rss_sum"] / MIB),
            "peak_pss_sum_mib": round(peak["pss_sum"] / MIB),
            "peak_rss_max_process_mib": round(peak["rss_max_process"] / MIB),
            "peak_rss_driver_and_model_actors_mib": round(peak["driver_actors"] / MIB),
            "processes": peak["processes"],
            "at_peak": sorted(at_peak, key=lambda p: -p["pss_mib"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--files", type=int, default=8, help="Parquet files of the folder")
    parser.add_argument("--batch-size", type=int, default=4096,
                        help="deepdpm predict --batch-size (default: its default)")
    parser.add_argument("--num-workers", type=int, default=1, help="model actors")
    parser.add_argument("--output", default=str(REPO / "bench" / "results" / "predict_memory.json"))
    parser.add_argument("--workdir", help="keep the data and the model in this folder (reused by "
                        "a later run) instead of a temporary one")
    parser.add_argument("--json", action="store_true", help="print the raw JSON line too")
    args = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("OMP_NUM_THREADS", "1")
    with contextlib.ExitStack() as stack:
        tmp = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory()))
        data_s = model_s = None
        if not (tmp / "model.pt").exists():  # a --workdir of an earlier run has them
            t0 = time.perf_counter()
            X, y = write_data(tmp / "features", tmp / "all.parquet", args.rows, args.dim, args.k,
                              args.files)
            data_s = round(time.perf_counter() - t0, 1)
            k, model_s = build_model(X, y, args.k, tmp / "model.pt")
            model_s = round(model_s, 1)
            del X, y
        else:
            from deepdpm_core import DeepDPM

            k = DeepDPM.load(tmp / "model.pt").n_clusters_
        shutil.rmtree(tmp / "predicted", ignore_errors=True)
        (tmp / "all-predicted.parquet").unlink(missing_ok=True)
        cli = [sys.executable, "-m", "pipeline.cli", "predict", "--model", str(tmp / "model.pt"),
               "--batch-size", str(args.batch_size), "--json"]
        ray_run = run_measured([*cli, "--input", str(tmp / "features"), "--output",
                                str(tmp / "predicted"), "--num-workers", str(args.num_workers),
                                "--no-progress"], env)
        single = run_measured([*cli, "--input", str(tmp / "all.parquet"), "--output",
                               str(tmp / "all-predicted.parquet")], env)
        assert ray_run["result"]["n_rows"] == single["result"]["n_rows"] == args.rows
    record = {
        "rows": args.rows, "dim": args.dim, "k": k, "files": args.files,
        "batch_size": args.batch_size, "num_workers": args.num_workers,
        "omp_num_threads": env["OMP_NUM_THREADS"], "cpus": os.cpu_count(),
        "seconds_data": data_s, "seconds_model": model_s,
        "ray_folder": ray_run, "in_process_file": single,
    }
    print(f"deepdpm predict, {args.rows:,} x {args.dim} in {args.files} files, K = {k}, "
          f"--batch-size {args.batch_size}; peaks in MiB")
    print(f"{'path':<34}{'driver+actors RSS':>18}{'all RSS':>9}{'all PSS':>9}{'procs':>7}{'time':>8}")
    for name, run in ((f"Ray Data, {args.num_workers} model actor(s)", ray_run),
                      ("in process, one file", single)):
        print(f"{name:<34}{run['peak_rss_driver_and_model_actors_mib']:>18}"
              f"{run['peak_rss_sum_mib']:>9}{run['peak_pss_sum_mib']:>9}{run['processes']:>7}"
              f"{run['seconds']:>7.0f}s")
    write_json_atomic(record, args.output)
    if args.json:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
