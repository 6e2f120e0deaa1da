"""Seconds and work of one sparse E-step on the mixture of a data set's true classes.

Usage: OMP_NUM_THREADS=1 python bench/estep_work.py [--family sphere-1000|mixture] [--n 200000]
       [--reps 2] [--json OUT.json]

``sphere-1000`` (``bench/k_vs_n.py``: 1,000 clusters on the unit sphere of R^128, close
enough that the per-anchor bounds rule out no pair) or ``mixture`` (``make_mixture``,
1,000 separated Gaussian clusters in 128-D, as ``bench/scale.py``). The mixture is the MAP
of the true classes (``Search.initialize`` from the labels) and each row's anchor its own
class, as in a fit whose clusters have settled. Reported: the fewest seconds of ``--reps``
E-steps (:meth:`~deepdpm_core.estep.sparse_support.SparseEStep.log_responsibilities`, top
8), the (anchor, component) pairs left by the per-anchor bounds, the components a row is
scored against exactly (what the per-row bound leaves) and the support per row (components
with responsibility above float32's ε).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k_vs_n import FAMILIES  # noqa: E402

from deepdpm_core.config import Config  # noqa: E402
from deepdpm_core.data import make_mixture  # noqa: E402
from deepdpm_core.estep import GaussianMixture  # noqa: E402
from deepdpm_core.estep.pair_bounds import PairBounds  # noqa: E402
from deepdpm_core.estep.sparse_support import SparseEStep  # noqa: E402
from deepdpm_core.training import start_fit  # noqa: E402


def measure(family: str, n: int, reps: int) -> dict:
    """The E-step's seconds and work on ``family`` (module docstring)."""
    if family == "sphere-1000":
        x, y = FAMILIES["sphere-1000"][0](n, 0)
    else:
        x, y = make_mixture(n, 128, 1000, imbalance=1.0, min_weight=0.1 / 1000, random_state=0)
    search = start_fit(Config().with_overrides({"seed": 0, "device": "cpu"}), torch.from_numpy(x))
    search.initialize(torch.from_numpy(y).long())
    counts = {}
    exact_pairs = GaussianMixture.weighted_log_prob_pairs
    reachable = PairBounds.reachable_pairs

    def counted_exact(self, x, points, comps, *args, **kwargs):
        counts["exact_per_row"] = len(points) / len(x)
        return exact_pairs(self, x, points, comps, *args, **kwargs)

    def counted_pairs(self, *args, **kwargs):
        pairs = reachable(self, *args, **kwargs)
        counts["anchor_pairs"] = len(pairs[0])
        return pairs

    GaussianMixture.weighted_log_prob_pairs, PairBounds.reachable_pairs = counted_exact, counted_pairs
    times = []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            _, log_resp = SparseEStep(search.mixture).log_responsibilities(search.x, 8, anchors=search.anchors)
            times.append(time.perf_counter() - t)
    finally:  # the next family counts through the methods themselves, not a wrapper of a wrapper
        GaussianMixture.weighted_log_prob_pairs, PairBounds.reachable_pairs = exact_pairs, reachable
    return {"family": family, "n": n, "k": search.n_clusters, "d": search.dim, "threads": torch.get_num_threads(),
            "seconds": min(times), "all_seconds": times, "anchor_pairs": counts.get("anchor_pairs", 0),
            "exact_per_row": counts.get("exact_per_row", 0.0),
            "support_per_row": float(torch.isfinite(log_resp).sum()) / len(log_resp)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="+", choices=["sphere-1000", "mixture"], default=["sphere-1000", "mixture"])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    for family in args.family:
        r = measure(family, args.n, args.reps)
        print(f"{family}: {r['n']} x {r['d']}, K {r['k']}: E-step {r['seconds']:.2f} s; anchor pairs "
              f"{r['anchor_pairs']}, scored exactly {r['exact_per_row']:.2f} a row, support {r['support_per_row']:.2f}")
        results.append(r)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "torch": torch.__version__,
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
