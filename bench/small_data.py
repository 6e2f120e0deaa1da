"""Small data: the exact-EM search against the net search and BGM, in one run.

For each data set of ``bench/k_suite.py`` with N <= 10,000 that is named, and each seed,
in one process on the same data: DeepDPM at its defaults (exact EM up to
``small_data.max_rows`` rows, the net fitted at the end), DeepDPM with
``small_data.max_rows=0`` (the paper's net search at every N, the default before) and
scikit-learn's ``BayesianGaussianMixture`` as ``bench/k_suite.py`` runs it. Prints K, NMI
and seconds of each, and the totals with their ratios; the machine may be busy, so compare
the ratios of one run.

    OMP_NUM_THREADS=1 python bench/small_data.py --json bench/results/small_data.json
    python bench/small_data.py --datasets iris-std wine-std --seeds 0
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import normalized_mutual_info_score
from sklearn.mixture import BayesianGaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k_suite import DATASETS, select  # noqa: E402

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.atomic_files import write_json_atomic  # noqa: E402

DEFAULT_SETS = ["iris-std", "wine-std", "breast-cancer-std", "digits-pca10", "blobs16", "blobs512",
                "sphere128", "blobs2d-dense", "blobs2d-overlap", "blobs2d-unequal", "table-degenerate",
                "table-mixed-units"]
METHODS = ("DeepDPM exact EM (default)", "DeepDPM nets (max_rows 0)", "BGM-DP")


def fits(X: np.ndarray, true_k: int, seed: int) -> dict:
    """Label makers of the three methods (BGM as ``bench/k_suite.py`` configures it)."""
    n_components = min(max(20, 2 * true_k), 50, max(true_k, len(X) // 5))
    return {
        METHODS[0]: lambda: DeepDPM(random_state=seed).fit(X).labels_,
        METHODS[1]: lambda: DeepDPM(random_state=seed, small_data__max_rows=0).fit(X).labels_,
        METHODS[2]: lambda: BayesianGaussianMixture(
            n_components=n_components, weight_concentration_prior_type="dirichlet_process",
            covariance_type="full", max_iter=500, random_state=seed).fit(X).predict(X),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=DEFAULT_SETS, metavar="NAME|GLOB")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", ConvergenceWarning)
    warnings.simplefilter("ignore", UserWarning)  # a fit ending at K = 1 is a result here
    DeepDPM(random_state=0).fit(np.random.default_rng(0).normal(size=(200, 2)))  # torch's one-off start-up
    records = []
    for name in select(DATASETS, args.datasets):
        for seed in args.seeds:
            X, y, _ = DATASETS[name](seed)
            if len(X) > 10_000:
                raise SystemExit(f"{name} has {len(X)} rows: this benchmark is for N <= 10,000")
            true_k = len(np.unique(y))
            for method, make in fits(X, true_k, seed).items():
                start = time.perf_counter()
                labels = np.asarray(make())
                seconds = time.perf_counter() - start
                rec = {"dataset": name, "n": len(X), "d": X.shape[1], "true_k": true_k, "seed": seed,
                       "method": method, "k": len(np.unique(labels)),
                       "nmi": float(normalized_mutual_info_score(y, labels)), "seconds": seconds}
                records.append(rec)
                print(f"{name:18s} seed {seed} {method:28s} K {rec['k']:3d} NMI {rec['nmi']:.3f} "
                      f"{seconds:7.2f} s", file=sys.stderr, flush=True)
    print("| data set | N | D | true K | " + " | ".join(f"{m}: K, NMI, s" for m in METHODS) + " |")
    print("|---|---:|---:|---:|" + "---|" * len(METHODS))
    for name in dict.fromkeys(r["dataset"] for r in records):
        rows = [r for r in records if r["dataset"] == name]
        cells = []
        for method in METHODS:
            rs = [r for r in rows if r["method"] == method]
            cells.append(f"{'/'.join(str(r['k']) for r in rs)}, {np.mean([r['nmi'] for r in rs]):.3f}, "
                         f"{np.mean([r['seconds'] for r in rs]):.2f}")
        print(f"| {name} | {rows[0]['n']} | {rows[0]['d']} | {rows[0]['true_k']} | " + " | ".join(cells) + " |")
    total = {m: sum(r["seconds"] for r in records if r["method"] == m) for m in METHODS}
    print(f"\nSeconds in all: exact EM {total[METHODS[0]]:.1f}, nets {total[METHODS[1]]:.1f}, "
          f"BGM-DP {total[METHODS[2]]:.1f}; exact EM / BGM-DP = {total[METHODS[0]] / total[METHODS[2]]:.2f}, "
          f"nets / BGM-DP = {total[METHODS[1]] / total[METHODS[2]]:.2f}")
    if args.json:
        write_json_atomic({"command": shlex.join(["python", "bench/small_data.py", *(argv or sys.argv[1:])]),
                           "records": records, "seconds": total}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
