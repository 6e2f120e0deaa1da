"""One DeepDPM epoch vs one FAISS k-means iteration at ImageNet-like scale.

Usage: OMP_NUM_THREADS=2 python bench/scale.py --n 200000 --d 64 --k 200 [--json] [--fit]
       [--device auto|cpu|cuda]

In one run, on one generated imbalanced mixture (N points, D dims, K true clusters):

* DeepDPM: a Search initialised with K clusters (k-means, ``init.kmeans_iters`` 5 unless
  ``--set`` says otherwise; timed apart, ``bench/init_start.py`` times it alone), then ONE full
  epoch timed — forward, backward, E-step targets, all statistics and the M-step
  (``schedule.warmup_epochs=0`` so the M-step runs; splits/merges off so no move);
  the E-step targets alone are timed too (from the initial clusters as anchors, as in
  the epoch), with the size of their support; ``--epochs E`` times E − 1 more epochs
  (moves still off) and reports their median, the cost once the nets are trained;
* FAISS k-means on the same data and K, every point used (no subsampling):
  ``--kmeans-iters`` iterations timed, divided by their number;
* on the CPU, the *floor* (:func:`time_floor`): the arithmetic no implementation of the
  paper's epoch avoids, each part timed with PyTorch's fastest kernel on the same data;
* peak RSS of the process (``ru_maxrss``, data generation included), and on CUDA the
  peak GPU memory held by tensors.

DeepDPM runs on ``--device`` (default ``auto``: CUDA when present); FAISS k-means always
runs on the CPU (``faiss-cpu``, all threads), so on a GPU the ratio compares a GPU epoch
with a CPU iteration.

``--fit`` also runs a full fit (default schedule, moves on, from ``--init-k`` clusters)
and reports the K found and the NMI. The machine is shared: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepdpm_core.config import (
    Config,  # noqa: E402
    parse_overrides,  # noqa: E402
)
from deepdpm_core.data import (
    make_mixture,  # noqa: E402
    nmi,  # noqa: E402
)
from deepdpm_core.estep import SparseEStep  # noqa: E402
from deepdpm_core.model import FittedModel  # noqa: E402
from deepdpm_core.runtime import EPOCH_PHASES, device_clock  # noqa: E402
from deepdpm_core.training import start_fit  # noqa: E402
from deepdpm_core.training.fit_context import SUB_HIDDEN  # noqa: E402


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def time_epoch(x: np.ndarray, k: int, seed: int, overrides: dict, epochs: int = 1,
               device: str = "auto") -> dict[str, float]:
    """Seconds of the first full training epoch with M-step at K clusters (init not timed),
    and the median of the ``epochs`` − 1 after it (nets trained, anchors from the E-step)."""
    cfg = Config().with_overrides({
        "seed": seed, "device": device, "init.n_clusters": k, "schedule.warmup_epochs": 0,
        "moves.split": False, "moves.merge": False, "init.kmeans_iters": 5,
        "small_data.max_rows": 0,  # the nets' epoch at any --n (small data would run exact EM)
        **overrides,
    })
    search = start_fit(cfg, torch.from_numpy(x))
    dev = search.device
    t = device_clock(dev)
    search.initialize()
    init_s = device_clock(dev) - t
    m = search.estep.support(search.n_clusters)
    t = device_clock(dev)
    _, log_resp = SparseEStep(search.mixture).log_responsibilities(search.x, m, anchors=search.anchors)
    support = float(torch.isfinite(log_resp).sum()) / len(log_resp)
    estep_s = device_clock(dev) - t
    t = device_clock(dev)
    record = search.step_epoch()
    epoch_s = device_clock(dev) - t
    later = []
    for _ in range(epochs - 1):
        t = device_clock(dev)
        search.step_epoch()
        later.append(device_clock(dev) - t)
    assert record["splits_accepted"] == record["merges_accepted"] == 0 and search.n_clusters == k
    return {"epoch_seconds": epoch_s, "later_epoch_seconds": float(np.median(later)) if later else None,
            "estep_seconds": estep_s, "init_seconds": init_s,
            # the timed epoch's own record: where its seconds went
            "epoch_phase_seconds": {k.removeprefix("seconds_"): v for k, v in record.items()
                                    if k.startswith("seconds_")},
            "device": str(dev), "precision": search.precision, "k_epoch": search.n_clusters,
            "top_m": m, "batch_size": search.batch_size, "steps": search.ctx.n_steps(search.config)[1],
            "estep_support_per_point": support}


def time_kmeans(x: np.ndarray, k: int, iters: int, seed: int) -> float:
    """Seconds per FAISS k-means iteration over all N points (no subsampling)."""
    km = faiss.Kmeans(x.shape[1], k, niter=iters, seed=seed, verbose=False,
                      max_points_per_centroid=x.shape[0] // k + 1)
    t = time.perf_counter()
    km.train(x)
    return (time.perf_counter() - t) / iters


def time_floor(x: np.ndarray, k: int, batch: int, hidden: int, sub_hidden: int, steps: int,
               seed: int, reps: int = 3) -> dict[str, float]:
    """Seconds of the arithmetic no implementation of the paper's epoch avoids, each part
    done the fastest way PyTorch has, best of ``reps`` (a lower bound, not a DeepDPM run).

    On the CPU, for N rows in batches of ``batch``: the nets' matrix products as plain
    float32 GEMMs (clustering net D-H-K forward and backward; the subclustering nets as
    if all K shared one D-H_sub-2 net); log-softmax over K forward and backward (Eq. 6's
    loss needs both); fused Adam over the nets' parameters, ``steps`` steps; each point's
    Gaussian log-density under one cluster (one triangular solve, N·D²/2, float32); and
    two float64 scatter-matrix products (soft and subcluster statistics, N·D² each).
    """
    g = torch.Generator().manual_seed(seed)
    xt = torch.from_numpy(x)
    n, d = xt.shape

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    w1, w2, s1, s2 = rand(d, hidden), rand(hidden, k), rand(d, sub_hidden), rand(sub_hidden, 2)

    def nets() -> None:
        for s in range(0, n, batch):
            xb = xt[s : s + batch]
            h, hs = xb @ w1, xb @ s1
            gl, gs = h @ w2, hs @ s2  # stand-ins of the gradients, same shapes
            dh, dhs = gl @ w2.T, gs @ s2.T
            h.T @ gl, xb.T @ dh, hs.T @ gs, xb.T @ dhs

    logits = rand(batch, k).requires_grad_()
    grad = torch.zeros(batch, k)
    grad[:, :8] = -1.0 / 8  # a slot target's gradient

    def softmax() -> None:
        for _ in range(0, n, batch):
            torch.log_softmax(logits, 1).backward(grad)

    params = [torch.nn.Parameter(rand(*shape)) for shape in
              ((d, hidden), (hidden,), (hidden, k), (k,), (k, d, sub_hidden), (k, sub_hidden),
               (k, sub_hidden, 2), (k, 2))]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.Adam(params, lr=1e-4, fused=True)

    def optimizer() -> None:
        for _ in range(steps):
            adam.step()

    chol = torch.linalg.cholesky(torch.cov(xt[:4096].T) + torch.eye(d))

    def log_density() -> None:
        for s in range(0, n, 4096):
            torch.linalg.solve_triangular(chol, xt[s : s + 4096].T, upper=False).square().sum(0)

    def statistics() -> None:
        for _ in range(2):
            for s in range(0, n, 4096):
                x64 = xt[s : s + 4096].double()
                x64.T @ x64

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    return {"nets_gemm": best(nets), "log_softmax": best(softmax), "adam": best(optimizer),
            "log_density": best(log_density), "statistics": best(statistics)}


def full_fit(x: np.ndarray, y: np.ndarray, init_k: int, seed: int, overrides: dict,
             device: str = "auto") -> dict:
    cfg = Config().with_overrides({"seed": seed, "device": device, "init.n_clusters": init_k, **overrides})

    def progress(rec: dict) -> None:  # one line per epoch on stderr: a long fit shows it is alive
        print(f"fit epoch {rec['epoch']:3d}: K = {rec['n_clusters']:4d}, {rec['seconds']:6.1f} s, "
              f"peak RSS {peak_rss_mb():.0f} MiB", file=sys.stderr, flush=True)

    search = start_fit(cfg, torch.from_numpy(x))
    t = device_clock(search.device)
    search.initialize()
    print(f"fit initialised with K = {search.n_clusters} in {device_clock(search.device) - t:.1f} s",
          file=sys.stderr, flush=True)
    search.fit(callbacks=[progress])
    seconds = device_clock(search.device) - t
    labels = FittedModel.from_search(search).predict_assignments(torch.from_numpy(x))[0].numpy()
    return {"fit_k": search.n_clusters, "fit_nmi": nmi(y, labels), "fit_seconds": seconds,
            "fit_epochs": search.epoch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--k", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kmeans-iters", type=int, default=5)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for the DeepDPM runs, e.g. estep.top_m=4")
    ap.add_argument("--epochs", type=int, default=1,
                    help="epochs timed at K (default 1); >1 also reports the median of the later ones")
    ap.add_argument("--fit", action="store_true", help="also run a full fit (K found, NMI)")
    ap.add_argument("--init-k", type=int, default=None, help="initial K of --fit (default: --k)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="where DeepDPM runs (default: CUDA when present); k-means is on the CPU")
    ap.add_argument("--json", action="store_true", help="last line: JSON of the results")
    args = ap.parse_args()
    overrides = parse_overrides(args.set)
    x, y = make_mixture(args.n, args.d, args.k, imbalance=1.0, min_weight=0.1 / args.k,
                        random_state=args.seed)
    out = {"n": args.n, "d": args.d, "k": args.k, "threads": torch.get_num_threads(),
           "data_rss_mb": peak_rss_mb()}
    out.update(time_epoch(x, args.k, args.seed, overrides, args.epochs, args.device))
    out["kmeans_iter_seconds"] = time_kmeans(x, args.k, args.kmeans_iters, args.seed)
    out["ratio"] = out["epoch_seconds"] / out["kmeans_iter_seconds"]
    if out["device"] == "cpu":  # the floor is a CPU reference
        model = Config().with_overrides(overrides).model
        out["floor_seconds"] = time_floor(x, args.k, out["batch_size"], model.hidden, SUB_HIDDEN,
                                          out["steps"], args.seed)
        out["floor_ratio"] = sum(out["floor_seconds"].values()) / out["kmeans_iter_seconds"]
    if args.fit:
        out.update(full_fit(x, y, args.init_k or args.k, args.seed, overrides, args.device))
    out["peak_rss_mb"] = peak_rss_mb()
    if torch.cuda.is_available():
        out["gpu_name"] = torch.cuda.get_device_name()
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / (1 << 20)
    print(f"data: {args.n} x {args.d}, K = {args.k}, DeepDPM on {out['device']} "
          f"({out['precision']} nets), {out['threads']} CPU threads, "
          f"batch {out['batch_size']}, E-step support at most {out['top_m']} of {out['k_epoch']} clusters "
          f"(clusters per point with r^E above float32 eps: {out['estep_support_per_point']:.2f})")
    print(f"{'what':36s} {'seconds':>9s} {'/ k-means iter':>15s}")
    rows = [("FAISS k-means, one iteration", out["kmeans_iter_seconds"]),
            ("start (k-means, first parameters)", out["init_seconds"]),
            ("DeepDPM epoch (train + M-step)", out["epoch_seconds"]),
            *((f"  {name}", out["epoch_phase_seconds"][phase]) for phase, name in EPOCH_PHASES),
            ("E-step targets, from k-means labels", out["estep_seconds"]),
            (f"DeepDPM later epochs, median of {args.epochs - 1}", out["later_epoch_seconds"])]
    for name, seconds in rows:
        if seconds is not None:
            print(f"{name:36s} {seconds:9.3f} {seconds / out['kmeans_iter_seconds']:15.2f}")
    if "floor_seconds" in out:
        print(f"{'floor: what no implementation avoids':36s} "
              f"{out['floor_ratio'] * out['kmeans_iter_seconds']:9.3f} {out['floor_ratio']:15.2f}")
        for part, seconds in out["floor_seconds"].items():
            print(f"  {part:34s} {seconds:9.3f} {seconds / out['kmeans_iter_seconds']:15.2f}")
    if args.fit:
        print(f"full fit: K = {out['fit_k']} (true {args.k}), NMI = {out['fit_nmi']:.3f}, "
              f"{out['fit_epochs']} epochs, {out['fit_seconds']:.1f} s")
    print(f"peak RSS: {out['peak_rss_mb']:.0f} MiB"
          + (f", peak GPU memory {out['peak_gpu_mb']:.0f} MiB" if "peak_gpu_mb" in out else ""))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
