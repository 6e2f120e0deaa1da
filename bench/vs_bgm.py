"""DeepDPM vs scikit-learn's DP-GMM (BayesianGaussianMixture) on one UMAP-like mixture.

Usage: OMP_NUM_THREADS=2 python bench/vs_bgm.py [--n 70000] [--d 10] [--k 10] [--seed 0]

Both see the same data in the same run; the table gives K, NMI/ARI/ACC, seconds and the
time ratio (this machine is shared, so ratios are what to compare).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.mixture import BayesianGaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.data import clustering_scores, make_mixture  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=70_000)
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-k", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="last line: JSON of the results")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    # UMAP-like: compact, elongated, unequal clusters well apart in a low-D space
    X, y = make_mixture(args.n, args.d, args.k, imbalance=2.0, min_weight=0.02,
                        separation=8.0, elongation=6.0, random_state=args.seed)
    rows = []
    t = time.perf_counter()
    model = DeepDPM(random_state=args.seed, init__n_clusters=args.init_k).fit(X)
    rows.append(("DeepDPM", model.n_clusters_, clustering_scores(y, model.labels_),
                 time.perf_counter() - t, len(model.history_)))
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning at max_iter is part of the result
        bgm = BayesianGaussianMixture(n_components=30, weight_concentration_prior_type="dirichlet_process",
                                      covariance_type="full", random_state=args.seed).fit(X)
    labels = bgm.predict(X)
    rows.append(("BayesianGaussianMixture(30, DP, full)", len(np.unique(labels)),
                 clustering_scores(y, labels), time.perf_counter() - t, bgm.n_iter_))
    base = rows[1][3]
    print(f"data: {args.n} x {args.d}, true K = {args.k} (seed {args.seed})")
    print(f"{'method':40s} {'K':>4s} {'NMI':>6s} {'ARI':>6s} {'ACC':>6s} {'seconds':>8s} {'time/BGM':>9s} {'epochs|iters':>12s}")
    for name, k, s, sec, it in rows:
        print(f"{name:40s} {k:4d} {s['nmi']:6.3f} {s['ari']:6.3f} {s['acc']:6.3f} {sec:8.1f} {sec / base:9.2f} {it:12d}")
    if args.json:
        print(json.dumps({name: {"k": k, **s, "seconds": sec} for name, k, s, sec, _ in rows}))


if __name__ == "__main__":
    main()
