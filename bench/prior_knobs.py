"""Which way each prior knob moves K (the directions :mod:`deepdpm_core.model.diagnostics` gives).

One knob at a time from the defaults, on three data sets the method did not make up:
6 well-separated and 12 overlapping Gaussian blobs (8-D) and sklearn's digits (PCA-16).
Prints K per variant, its ratio to the default's K in the same run, and the NMI against
the true labels.

    OMP_NUM_THREADS=1 python bench/prior_knobs.py            # ~5 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits, make_blobs
from sklearn.decomposition import PCA

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.config import from_dict  # noqa: E402
from deepdpm_core.data import nmi  # noqa: E402


def datasets() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (X (N, D) float32, true labels (N,)); digits pixels scaled to [0, 1]."""
    blobs6 = make_blobs(n_samples=3000, centers=6, n_features=8, cluster_std=1.0, random_state=0)
    blobs12 = make_blobs(n_samples=3000, centers=12, n_features=8, cluster_std=2.0, random_state=1)
    digits = load_digits()
    pcs = PCA(16, random_state=0).fit_transform(digits.data / 16.0)
    return {
        "blobs6 (K=6)": (blobs6[0].astype(np.float32), blobs6[1]),
        "blobs12 overlap (K=12)": (blobs12[0].astype(np.float32), blobs12[1]),
        "digits PCA-16 (K=10)": (pcs.astype(np.float32), digits.target),
    }


def variants(dim: int) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("default", {})]
    out += [(f"sigma_scale={s:g}", {"prior.sigma_scale": s}) for s in (1e-4, 1e-3, 0.05, 0.5, 5.0)]
    out += [(f"nu={nu}", {"prior.nu": float(nu)}) for nu in (dim + 10, 4 * dim, 20 * dim)]
    out += [(f"alpha={a:g}", {"prior.alpha": a}) for a in (0.01, 1000.0)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=80)
    args = parser.parse_args()
    base = from_dict({"device": "cpu", "schedule": {"max_epochs": args.max_epochs}})
    print(f"{'data':24} {'median var':>10} {'variant':20} {'K':>4} {'K/K_default':>11} {'NMI':>6} {'sec':>6}")
    for name, (X, y) in datasets().items():
        variance = float(np.median(X.var(axis=0)))
        k_default = None
        for label, overrides in variants(X.shape[1]):
            t0 = time.perf_counter()
            model = DeepDPM(base.with_overrides(overrides))
            model.fit(X)
            k = int(model.n_clusters_)
            k_default = k if k_default is None else k_default
            print(
                f"{name:24} {variance:10.3g} {label:20} {k:4d} {k / k_default:11.2f} "
                f"{nmi(y, model.labels_):6.3f} "
                f"{time.perf_counter() - t0:6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
