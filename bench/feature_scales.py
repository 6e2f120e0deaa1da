"""Tables whose features have their own scales: Ψ0 fitted per feature against Ψ0 = s·I.

Each seed draws one table: ``make_blobs`` with 3–12 clusters of their own spreads (std
0.5–2) in 4–29 features, 500–5,000 rows, then either (``units``) every feature multiplied by
its own factor 10^U(−1.5, 1.5), or (``noise``) half as many features of pure noise added, each
of spread 10^U(−1, 1). The true labels are the blobs. In the same process on the same data:
``DeepDPM(random_state=0)`` at its defaults (``prior.psi: fitted``), the same with
``prior.psi: identity`` (one scale s for every feature), scikit-learn's
``BayesianGaussianMixture`` (Dirichlet process, full covariances, 20 components) and k-means
given the true K.

    OMP_NUM_THREADS=1 python bench/feature_scales.py --json bench/results/feature_scales.json

The Markdown table goes to stdout; ``--json FILE`` writes every fit and the command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans
from sklearn.datasets import make_blobs
from sklearn.mixture import BayesianGaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redundant_tables import run, timed  # noqa: E402

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.atomic_files import write_json_atomic  # noqa: E402

KINDS = ("units", "noise")
METHODS = ("DeepDPM", "DeepDPM psi=identity", "BGM-DP", "k-means (true K)")


def table(seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """One table of kind ``KINDS[seed % 2]``; X (N, D) float32, blob labels (N,), a description."""
    rng = np.random.default_rng(seed)
    k, d, n = int(rng.integers(3, 13)), int(rng.integers(4, 30)), int(rng.integers(500, 5000))
    X, y = make_blobs(n, n_features=d, centers=k, cluster_std=rng.uniform(0.5, 2.0, k),
                      center_box=(-10.0, 10.0), random_state=seed)
    kind = KINDS[seed % 2]
    if kind == "units":
        X = X * 10 ** rng.uniform(-1.5, 1.5, d)
    else:
        X = np.hstack([X, rng.normal(size=(n, d // 2)) * 10 ** rng.uniform(-1.0, 1.0, d // 2)])
    return X.astype(np.float32), y, f"{kind}: {n} x {X.shape[1]}, K {k}"


def fits(X: np.ndarray, k: int) -> dict[str, tuple[np.ndarray, float]]:
    """label arrays of each method, with seconds."""
    return timed(dict(zip(METHODS, (
        lambda: DeepDPM(random_state=0).fit(X).labels_,
        lambda: DeepDPM(random_state=0, prior__psi="identity").fit(X).labels_,
        lambda: BayesianGaussianMixture(
            n_components=20, weight_concentration_prior_type="dirichlet_process",
            max_iter=300, random_state=0).fit(X).predict(X),
        lambda: KMeans(k, n_init=3, random_state=0).fit_predict(X)), strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(12)))
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    records = run(args.seeds, table, fits)
    print("\n| method | K exact | NMI (mean) | seconds (total) |\n|---|---:|---:|---:|")
    for method in METHODS:
        mine = [r for r in records if r["method"] == method]
        exact = sum(r["k"] == r["true_k"] for r in mine)
        print(f"| {method} | {exact} of {len(mine)} | {np.mean([r['nmi'] for r in mine]):.3f} | "
              f"{sum(r['seconds'] for r in mine):.1f} |")
    if args.json:
        write_json_atomic({"command": shlex.join(sys.argv), "records": records}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
