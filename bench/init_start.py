"""CPU seconds and k-means objective of a fit's start alone: the initial clusters.

Usage: OMP_NUM_THREADS=1 python bench/init_start.py --n 200000 --d 128 --k 1000
       [--seed 0] [--set init.points_per_cluster=64 ...] [--json]

On a generated imbalanced mixture (``make_mixture``, N rows, D dims, K true clusters),
:func:`~deepdpm_core.moves.initial_clusters` with ``init.n_clusters`` = K and the other
``init`` knobs at their defaults (or ``--set``): the sample drawn, k-means++ seeds, FAISS
k-means, every row to its nearest centre. Reports the process's CPU seconds
(``time.process_time``: all threads summed, so run one thread to read it as wall time), the
rows the k-means saw, the objective (mean squared distance of a row to the mean of its
initial cluster, float64) and the NMI of the initial labels against the true ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepdpm_core.config import Config, parse_overrides  # noqa: E402
from deepdpm_core.data import make_mixture, nmi  # noqa: E402
from deepdpm_core.moves.initial import initial_clusters, kmeans_sample_size  # noqa: E402
from deepdpm_core.runtime.communicator import LocalCommunicator  # noqa: E402


def objective(x: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Mean squared distance of a row to the mean of its cluster (float64)."""
    xd = x.double()
    counts = torch.bincount(labels, minlength=k).double().clamp_min(1)
    means = torch.zeros(k, x.shape[1], dtype=torch.float64).index_add_(0, labels, xd) / counts[:, None]
    return float((xd - means[labels]).square().sum(1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="init knobs, e.g. init.kmeans_iters=5")
    ap.add_argument("--json", action="store_true", help="last line: JSON of the results")
    args = ap.parse_args()
    init = Config().with_overrides({**parse_overrides(args.set), "init.n_clusters": args.k}).init
    x, y = make_mixture(args.n, args.d, args.k, imbalance=1.0, random_state=args.seed)
    xt = torch.from_numpy(x.astype(np.float32))
    t = time.process_time()
    labels, k = initial_clusters(xt, init, args.n, [args.n], LocalCommunicator(), np.random.default_rng(args.seed))
    out = {"n": args.n, "d": args.d, "k": k, "torch_threads": torch.get_num_threads(),
           "faiss_threads": faiss.omp_get_max_threads(), "cpu_seconds": time.process_time() - t,
           "kmeans_rows": kmeans_sample_size(args.n, k, init), "objective": objective(xt, labels, k),
           "nonempty": int((torch.bincount(labels, minlength=k) > 0).sum()), "nmi": nmi(y, labels.numpy())}
    print(f"{args.n} x {args.d}, K = {k}, threads torch {out['torch_threads']} / FAISS {out['faiss_threads']}: "
          f"{out['cpu_seconds']:.2f} CPU s, k-means on {out['kmeans_rows']} rows, objective {out['objective']:.3f}, "
          f"{out['nonempty']} clusters not empty, NMI {out['nmi']:.4f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
