"""Tables with redundant columns: scikit-learn's ``make_classification`` beside peers.

Each seed draws one table: 5–10 Gaussian clusters (2–5 classes of 1–2 clusters each, at the
vertices of a hypercube in 4–9 informative features, each with its own covariance), 3
redundant columns (linear combinations of the informative ones) and 2 of noise, 500–3,000
rows. The true labels are the generating clusters. In the same process on the same data:
``DeepDPM(random_state=0)``, scikit-learn's ``BayesianGaussianMixture`` (Dirichlet process,
full covariances, 3 K components, ``reg_covar=1e-3``, since its default fails on the
singular covariance) and k-means given the true K.

    OMP_NUM_THREADS=1 python bench/redundant_tables.py --json bench/results/redundant_tables.json

The Markdown table goes to stdout; ``--json FILE`` writes every fit and the command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans
from sklearn.datasets import make_classification
from sklearn.mixture import BayesianGaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.atomic_files import write_json_atomic  # noqa: E402
from deepdpm_core.data import clustering_scores  # noqa: E402


def table(seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """One ``make_classification`` table with 3 redundant and 2 noise columns; X, clusters."""
    rng = np.random.default_rng(seed)
    n_classes, per_class = int(rng.integers(2, 6)), int(rng.integers(1, 3))
    k = n_classes * per_class
    informative = int(rng.integers(max(3, int(np.ceil(np.log2(k))) + 1), 10))
    n = int(rng.integers(500, 3000))
    X, _ = make_classification(n_samples=n, n_features=informative + 5, n_informative=informative,
                               n_redundant=3, n_classes=n_classes, n_clusters_per_class=per_class,
                               class_sep=2.0, flip_y=0.0, shuffle=False, random_state=seed)
    # unshuffled, the rows come cluster by cluster, the first n mod k clusters one row larger
    y = np.repeat(np.arange(k), [n // k + (i < n % k) for i in range(k)])
    return X.astype(np.float32), y, f"{n} x {informative + 5}, K {k}"


def timed(methods: dict[str, Callable[[], np.ndarray]]) -> dict[str, tuple[np.ndarray, float]]:
    """Each method's labels and seconds, its warnings silenced."""
    out = {}
    for name, fit in methods.items():
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            labels = fit()
        out[name] = (labels, time.perf_counter() - t)
    return out


def fits(X: np.ndarray, k: int) -> dict[str, tuple[np.ndarray, float]]:
    """label arrays of each method, with seconds."""
    return timed({
        "DeepDPM": lambda: DeepDPM(random_state=0).fit(X).labels_,
        "BGM-DP": lambda: BayesianGaussianMixture(
            n_components=3 * k, weight_concentration_prior_type="dirichlet_process",
            max_iter=300, reg_covar=1e-3, random_state=0).fit(X).predict(X),
        "k-means (true K)": lambda: KMeans(k, n_init=3, random_state=0).fit_predict(X)})


def run(seeds: list[int], draw: Callable[[int], tuple[np.ndarray, np.ndarray, str]],
        fit_all: Callable[[np.ndarray, int], dict]) -> list[dict]:
    """Draw each seed's table, fit it with every method, print a Markdown row per fit and
    return the records."""
    records = []
    print("| seed | table | method | K | NMI | seconds |\n|---:|---|---|---:|---:|---:|")
    for seed in seeds:
        X, y, shape = draw(seed)
        k = len(np.unique(y))
        for method, (labels, seconds) in fit_all(X, k).items():
            scores = clustering_scores(y, labels)
            records.append({"seed": seed, "table": shape, "true_k": k, "method": method,
                            "k": int(len(np.unique(labels))), **scores, "seconds": seconds})
            print(f"| {seed} | {shape} | {method} | {records[-1]['k']} | {scores['nmi']:.3f} | {seconds:.1f} |",
                  flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    records = run(args.seeds, table, fits)
    if args.json:
        write_json_atomic({"command": shlex.join(sys.argv), "records": records}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
