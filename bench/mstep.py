"""Seconds of one M-step at K clusters in D dimensions (1,000 clusters of 128-D: ImageNet at MoCo's size).

Usage: OMP_NUM_THREADS=2 python bench/mstep.py --k 1000 --d 128 [--n 128000] [--reps 3]
       [--device auto|cpu|cuda] [--set KEY=VALUE ...] [--json OUT.json]

A Search is set up on a generated mixture of K clusters (``make_mixture``, N rows),
initialised from the true labels (no k-means), and given the hard statistics of those
labels as the soft statistics and of a random halving of each cluster as the subcluster
statistics (every subcluster non-empty, so no restart). Then, best of ``--reps``, what an
epoch's ``seconds_mstep`` counts: :meth:`Search.m_step` and the refresh of the mixture's
Cholesky factors (CPU seconds of this process on the CPU, wall seconds on a GPU); and its parts: the prior's refit (``prior_fit``), the MAP parameters of
the clusters and the subclusters' means (``map``, written over the last M-step's covariances, as the
M-step writes them; the subclusters' covariances are computed where read) and the mixture's factors
(``factors``, written over the last M-step's, as the M-step writes them). The M-step writes each
block of covariances just before it factors it, so it reads them from cache where ``factors``
reads them from memory: its seconds are less than the parts' sum.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepdpm_core.bayes import map_estimate, posterior_mean  # noqa: E402
from deepdpm_core.config import Config, parse_overrides  # noqa: E402
from deepdpm_core.data import make_mixture  # noqa: E402
from deepdpm_core.runtime import device_clock  # noqa: E402
from deepdpm_core.training import start_fit  # noqa: E402
from deepdpm_core.training.fit_context import partition_stats  # noqa: E402


def best_of(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """The fewest seconds of ``reps`` calls of ``fn`` (after one untimed call): wall seconds
    on a GPU, this process's CPU seconds on the CPU (what other jobs on a shared machine do
    not inflate; the same as wall seconds on a quiet machine with one thread)."""
    fn()
    clock = time.process_time if device.type == "cpu" else partial(device_clock, device)
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


def time_mstep(n: int, d: int, k: int, reps: int, device: str, seed: int = 0,
               overrides: dict | None = None) -> dict:
    """Seconds of the M-step and its parts at K = ``k`` in ``d`` dimensions (module docstring),
    with the config ``overrides`` (e.g. ``prior.covariance_type``)."""
    x, y = make_mixture(n, d, k, random_state=seed)
    cfg = Config().with_overrides({"seed": seed, "device": device, "small_data.max_rows": 0, **(overrides or {})})
    search = start_fit(cfg, torch.from_numpy(x))
    labels = torch.from_numpy(y).to(search.device)
    search.initialize(labels)
    assert search.n_clusters == k, "every cluster must own a row: raise --n"
    half = torch.randint(2, (n,), generator=torch.Generator().manual_seed(seed)).to(search.device)
    soft, _ = partition_stats(search.ctx, labels, k)
    sub, _ = partition_stats(search.ctx, 2 * labels + half, 2 * k)
    assert sub.n_rows == 2 * k, "every subcluster must own a row: raise --n"

    def mstep() -> None:
        search.m_step(soft, sub)  # the mixture's refresh included

    def factors() -> None:
        search.mixture = search.state.mixture(recycled=search.mixture)  # as the M-step makes them

    dev = search.device
    return {
        "n": n, "d": d, "k": k, "device": str(dev), "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "mstep_seconds": best_of(mstep, reps, dev),
        "parts_seconds": {
            "prior_fit": best_of(lambda: search.prior_fit.fit(soft), reps, dev),
            "map": best_of(lambda: (map_estimate(search.prior_fit.prior, soft, out=search.mixture.covariances),
                                    posterior_mean(search.prior_fit.prior, sub)), reps, dev),
            "factors": best_of(factors, reps, dev),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=None, help="rows (default 128 per cluster)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. prior.covariance_type=auto")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args()
    overrides = parse_overrides(args.set)
    t = time.perf_counter()
    out = time_mstep(args.n or 128 * args.k, args.d, args.k, args.reps, args.device, args.seed, overrides)
    out["overrides"] = overrides
    out["bench_seconds"] = time.perf_counter() - t
    print(f"M-step at K = {out['k']}, D = {out['d']} on {out['device']} ({out['threads']} threads): "
          f"{out['mstep_seconds']:.3f} s; parts: "
          + ", ".join(f"{name} {s:.3f} s" for name, s in out["parts_seconds"].items()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
