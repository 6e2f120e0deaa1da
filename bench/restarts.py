"""Seconds of the principal-axis split of the clusters whose subclusters restart after the
first epoch of ``bench/scale.py`` (the same data, settings and seed), against a full
eigendecomposition of the same covariances, and the variance the split's axes leave
unexplained.

Usage: OMP_NUM_THREADS=1 python bench/restarts.py [--n 200000] [--d 128] [--k 1000] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepdpm_core.moves.surgery as surgery  # noqa: E402
from deepdpm_core.config import Config  # noqa: E402
from deepdpm_core.data import make_mixture  # noqa: E402
from deepdpm_core.moves.initial import principal_split  # noqa: E402
from deepdpm_core.training import start_fit  # noqa: E402


def restarted_clusters(n: int, d: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Means and covariances of the clusters restarted in the M-step of bench/scale.py's epoch."""
    x, _ = make_mixture(n, d, k, imbalance=1.0, min_weight=0.1 / k, random_state=0)
    cfg = Config().with_overrides({
        "seed": 0, "device": "cpu", "init.n_clusters": k, "schedule.warmup_epochs": 0, "moves.split": False,
        "moves.merge": False, "init.kmeans_iters": 5, "small_data.max_rows": 0})
    search = start_fit(cfg, torch.from_numpy(x))
    search.initialize()
    seen = []

    def recording(means: torch.Tensor, covariances: torch.Tensor):
        seen.append((means.clone(), covariances.clone()))
        return principal_split(means, covariances)

    surgery.principal_split = recording  # the epoch's restarts call it through surgery
    try:
        search.step_epoch()
    finally:
        surgery.principal_split = principal_split
    return seen[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    means, covs = restarted_clusters(args.n, args.d, args.k)

    def best(fn) -> float:
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    split_s = best(lambda: principal_split(means, covs))
    eigh_s = best(lambda: torch.linalg.eigh(covs))
    _, _, v, _ = principal_split(means, covs)
    top = torch.linalg.eigvalsh(covs)[:, -1]
    lost = float(((top - torch.einsum("ki,kij,kj->k", v, covs, v)) / top).max())
    print(f"{len(covs)} restarts of D = {args.d}, {torch.get_num_threads()} thread(s), best of {args.reps}: "
          f"principal_split {split_s:.3f} s, a full eigh of the same covariances {eigh_s:.3f} s; "
          f"largest share of the top variance left unexplained {lost:.1e}")


if __name__ == "__main__":
    main()
