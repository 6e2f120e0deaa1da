"""K against N: DeepDPM's defaults on non-Gaussian clusters at growing N, beside peers.

Real embeddings (UMAP, t-SNE, contrastive features) have clusters that are not Gaussian:
curved, heavy-tailed, skewed. Under a Gaussian DP mixture the evidence for splitting such a
cluster grows with its number of points, so the exact posterior's K grows with N. Each
family below is one fixed distribution of 10 clusters, drawn at every N of ``--n``, so K
should not move with N (10 clusters, unless the name says otherwise):

* ``student``: 10 clusters in 10-D, each an affine map of Student-t noise (3 degrees of
  freedom): heavy tails.
* ``curved``: 10 banana-shaped clusters in 10-D (a Gaussian bent along a random plane).
* ``umap``: scikit-learn's digits embedded by UMAP in 10-D (n_neighbors 20, min_dist 0,
  as n2d), each class resampled to N by a smooth kernel density (Gaussian kernels of half
  Scott's bandwidth): a real UMAP layout at any N.
* ``n2d``: real images through the n2d recipe at N rows: scikit-learn's digits upsampled
  to 16×16, each row a random affine copy of one (rotation ±15°, scale 0.85–1.15, shear,
  shift ±1.5 px, blur, contrast, pixel noise), then PCA to 50 dims and UMAP to 10
  (n_neighbors 20, min_dist 0) of those N rows: the n2d pipeline of the paper's image sets.
* ``sphere``: 10 clusters on the unit sphere of R^64 with anisotropic spread, rows
  L2-normalised (like contrastive features).
* ``sphere-1000``: the same with 1,000 clusters in R^128, the shape of MoCo's L2-normalised
  128-D ImageNet features; meant for N = 1.28M (1,280 rows a cluster), run alone:
  ``--families sphere-1000 --n 1280000``.

For each (family, N, seed), in one process on the same data: ``DeepDPM(random_state=seed)``
(plus any ``--set``), k-means given the true K (scikit-learn's ``KMeans``, ``n_init=3``; FAISS's
``Kmeans`` with 3 restarts of 25 iterations for a family of more than 100 clusters, where
scikit-learn's takes hours) and scikit-learn's
``BayesianGaussianMixture`` (Dirichlet process, full covariances, 20 components) where N ≤
``--bgm-max-n``. Targets (DeepDPM rows): K within ±10 % of the family's K at every seed and mean NMI ≥
k-means' − 0.02.

    OMP_NUM_THREADS=1 python bench/k_vs_n.py --json bench/results/k_vs_n.json > /tmp/k_vs_n.md
    python bench/k_vs_n.py --families student --n 2000 --seeds 0     # a quick look
    python bench/k_vs_n.py --families sphere-1000 --n 1280000 --epoch-log --json FILE  # (a GPU)

The Markdown table goes to stdout, progress to stderr; ``--json FILE`` writes every run and
the command line (rewritten after each one).
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import faiss
import numpy as np
import torch
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import BayesianGaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.atomic_files import write_json_atomic  # noqa: E402
from deepdpm_core.config import (
    Config,  # noqa: E402
    parse_overrides,  # noqa: E402
)
from deepdpm_core.data import clustering_scores  # noqa: E402
from deepdpm_core.errors import ConfigError  # noqa: E402
from deepdpm_core.features import embed  # noqa: E402

N_CLUSTERS = 10
DEFAULT_N = (2000, 20000, 70000, 200000)


def _centres(rng: np.random.Generator, dim: int, min_gap: float) -> np.ndarray:
    """10 centres uniform in [-8, 8]^dim, re-drawn until every pair is ``min_gap`` apart."""
    while True:
        centres = rng.uniform(-8.0, 8.0, size=(N_CLUSTERS, dim))
        gaps = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
        if gaps[np.triu_indices(N_CLUSTERS, 1)].min() >= min_gap:
            return centres


def student(n: int, seed: int, dim: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Affine maps of Student-t (3 dof) noise around centres >= 7 apart; (n, 10), (n,)."""
    rng = np.random.default_rng(seed)
    centres = _centres(rng, dim, 7.0)
    y = rng.integers(N_CLUSTERS, size=n)
    maps = rng.normal(size=(N_CLUSTERS, dim, dim)) * (0.8 / np.sqrt(dim)) + 0.5 * np.eye(dim)
    noise = 0.7 * rng.standard_t(3.0, size=(n, dim))
    return (centres[y] + np.einsum("nij,nj->ni", maps[y], noise)).astype(np.float32), y


def curved(n: int, seed: int, dim: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Bananas: u ~ N(0, diag(1.6², 0.4², ...)), u1 += 0.6 (u0² − 1.6²), rotated at random
    around centres >= 8 apart; (n, 10), (n,)."""
    rng = np.random.default_rng(seed)
    centres = _centres(rng, dim, 8.0)
    y = rng.integers(N_CLUSTERS, size=n)
    rotations = np.linalg.qr(rng.normal(size=(N_CLUSTERS, dim, dim)))[0]
    u = rng.normal(size=(n, dim)) * np.r_[1.6, np.full(dim - 1, 0.4)]
    u[:, 1] += 0.6 * (u[:, 0] ** 2 - 1.6**2)
    return (centres[y] + np.einsum("nij,nj->ni", rotations[y], u)).astype(np.float32), y


def umap_digits(n: int, seed: int, cache: dict = {}) -> tuple[np.ndarray, np.ndarray]:  # noqa: B006
    """digits -> UMAP-10 (embedded once per seed), each class resampled to n rows in all
    by Gaussian kernels of covariance h²·cov(class), h half of Scott's factor; (n, 10), (n,)."""
    if seed not in cache:
        X, y = load_digits(return_X_y=True)
        config = Config().with_overrides({"seed": seed, "embed.n_neighbors": 20, "embed.min_dist": 0.0})
        layout = embed((X / 16.0).astype(np.float32), "umap", config, dim=10).embedding
        cache[seed] = (np.asarray(layout, dtype=np.float64), y)
    layout, labels = cache[seed]
    rng = np.random.default_rng(seed + 100)
    pick = rng.integers(len(layout), size=n)
    X, y = layout[pick].copy(), labels[pick]
    dim = layout.shape[1]
    for c in np.unique(labels):
        members = layout[labels == c]
        h = 0.5 * len(members) ** (-1.0 / (dim + 4))
        chol = np.linalg.cholesky(np.cov(members.T) * h * h + 1e-9 * np.eye(dim))
        rows = y == c
        X[rows] += rng.normal(size=(int(rows.sum()), dim)) @ chol.T
    return X.astype(np.float32), y


def n2d_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n random affine copies of digits' images (16×16), PCA-50, UMAP-10; (n, 10), (n,)."""
    from scipy import ndimage
    from sklearn.decomposition import PCA

    X, y = load_digits(return_X_y=True)
    images = np.stack([ndimage.zoom(x.reshape(8, 8) / 16.0, 2, order=1) for x in X])
    rng = np.random.default_rng(seed)
    pick = rng.integers(len(X), size=n)
    rows = np.empty((n, 256), np.float32)
    centre = np.array([7.5, 7.5])
    for i, j in enumerate(pick):
        angle, scale, shear = np.deg2rad(rng.uniform(-15, 15)), rng.uniform(0.85, 1.15), rng.uniform(-0.2, 0.2)
        rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        A = rotation @ np.array([[1.0, shear], [0.0, 1.0]]) / scale
        image = ndimage.affine_transform(images[j], A, offset=centre - A @ centre + rng.uniform(-1.5, 1.5, 2),
                                         order=1)
        image = ndimage.gaussian_filter(image, rng.uniform(0.0, 0.8)) * rng.uniform(0.8, 1.2)
        rows[i] = (image + rng.normal(0, 0.05, image.shape)).ravel()
    pca = PCA(50, random_state=seed).fit_transform(rows).astype(np.float32)
    config = Config().with_overrides({"seed": seed, "embed.n_neighbors": 20, "embed.min_dist": 0.0})
    return np.asarray(embed(pca, "umap", config, dim=10).embedding, dtype=np.float32), y[pick]


def sphere(n: int, seed: int, dim: int = 64, k: int = N_CLUSTERS) -> tuple[np.ndarray, np.ndarray]:
    """k unit centres plus noise of per-direction scale 0.08 + 0.25·U⁴, rows L2-normalised;
    (n, dim), (n,)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    y = rng.integers(k, size=n)
    scales = 0.08 + 0.25 * rng.random(size=(k, dim)) ** 4
    X = centres[y] + rng.normal(size=(n, dim)) * scales[y]
    return (X / np.linalg.norm(X, axis=1, keepdims=True)).astype(np.float32), y


# name -> (data(n, seed), true K)
FAMILIES: dict[str, tuple[Callable[[int, int], tuple[np.ndarray, np.ndarray]], int]] = {
    "student": (student, N_CLUSTERS), "curved": (curved, N_CLUSTERS),
    "umap": (umap_digits, N_CLUSTERS), "n2d": (n2d_digits, N_CLUSTERS), "sphere": (sphere, N_CLUSTERS),
    "sphere-1000": (functools.partial(sphere, dim=128, k=1000), 1000)}


def faiss_kmeans(X: np.ndarray, k: int, seed: int) -> np.ndarray:
    """FAISS k-means on every row, best of 3 restarts of 25 iterations; labels (n,)."""
    kmeans = faiss.Kmeans(X.shape[1], k, niter=25, nredo=3, seed=seed + 1,
                          max_points_per_centroid=1 << 30)
    kmeans.train(np.ascontiguousarray(X, dtype=np.float32))
    return kmeans.index.search(np.ascontiguousarray(X, dtype=np.float32), 1)[1][:, 0]


def checked_overrides(parser: argparse.ArgumentParser, items: list[str]) -> dict:
    """DeepDPM's config overrides from ``--set KEY=VALUE`` items, checked before any fit
    (an unknown key or a bad value ends the run through ``parser.error``)."""
    try:
        overrides = parse_overrides(items)
        DeepDPM(**overrides).get_config()
    except ConfigError as exc:
        parser.error(f"--set: {exc}")
    return overrides


def log_epoch(record: dict) -> None:
    """One stderr line per epoch of a DeepDPM fit: epoch, K, seconds."""
    print(f"  epoch {record['epoch']:3d} K {record['n_clusters']:4d} {record['seconds']:6.2f} s",
          file=sys.stderr, flush=True)


def run_one(X: np.ndarray, y: np.ndarray, k: int, seed: int, overrides: dict,
            bgm: bool, epoch_log: bool = False) -> Iterator[dict]:
    """DeepDPM, k-means given the true ``k`` and (if ``bgm``) BGM on (X, y): one record per
    method, yielded as each finishes; ``epoch_log`` prints DeepDPM's epochs to stderr.
    DeepDPM's record also holds its epochs and K after each change (``k_path``)."""

    def deepdpm() -> tuple[np.ndarray, dict]:
        model = DeepDPM(random_state=seed, **overrides).fit(X, callbacks=[log_epoch] if epoch_log else None)
        ks = [h["n_clusters"] for h in model.history_]
        return model.labels_, {"epochs": len(ks),
                               "k_path": [k for i, k in enumerate(ks) if i == 0 or k != ks[i - 1]]}

    def kmeans() -> tuple[np.ndarray, dict]:
        if k > 100:
            return faiss_kmeans(X, k, seed), {}
        return KMeans(k, n_init=3, random_state=seed).fit_predict(X), {}

    def bgm_dp() -> tuple[np.ndarray, dict]:
        return BayesianGaussianMixture(
            n_components=20, weight_concentration_prior_type="dirichlet_process",
            covariance_type="full", max_iter=500, random_state=seed).fit(X).predict(X), {}

    fits: dict[str, Callable[[], tuple[np.ndarray, dict]]] = {"DeepDPM": deepdpm, "k-means (true K)": kmeans}
    if bgm:
        fits["BGM-DP"] = bgm_dp
    for method, fit in fits.items():
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            labels, extra = fit()
        seconds = time.perf_counter() - start
        scores = clustering_scores(y, np.asarray(labels))
        yield {"method": method, "k": len(np.unique(labels)), "nmi": scores["nmi"],
               "ari": scores["ari"], "seconds": seconds, **extra}


def table(records: list[dict]) -> str:
    """One row per (family, N, method): K per seed, mean NMI, mean seconds, DeepDPM's targets."""
    lines = ["| family | N | method | K (per seed) | NMI | seconds | DeepDPM targets |",
             "|---|---:|---|---|---:|---:|---|"]
    keys = list(dict.fromkeys((r["family"], r["n"]) for r in records))
    passed = 0
    for family, n in keys:
        rows = [r for r in records if r["family"] == family and r["n"] == n]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        mean = {m: float(np.mean([r["nmi"] for r in rows if r["method"] == m])) for m in methods}
        ks = [r["k"] for r in rows if r["method"] == "DeepDPM"]
        true_k = FAMILIES[family][1]
        k_ok = all(abs(k - true_k) <= 0.1 * true_k for k in ks)
        margin = mean["DeepDPM"] - mean["k-means (true K)"]
        ok = k_ok and margin >= -0.02
        passed += ok
        verdict = (f"{'yes' if ok else 'NO'}: K ±10 % {'ok' if k_ok else 'FAIL'}; "
                   f"NMI vs k-means {margin:+.3f}")
        for m in methods:
            rs = [r for r in rows if r["method"] == m]
            lines.append(f"| {family} | {n} | {m} | {'/'.join(str(r['k']) for r in rs)} | {mean[m]:.3f} "
                         f"| {np.mean([r['seconds'] for r in rs]):.1f} | {verdict if m == 'DeepDPM' else ''} |")
    lines.append(f"\nDeepDPM's targets hold on {passed} of {len(keys)} (family, N) rows.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES),
                        default=[name for name, (_, k) in FAMILIES.items() if k == N_CLUSTERS])
    parser.add_argument("--n", nargs="+", type=int, default=list(DEFAULT_N))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--bgm-max-n", type=int, default=20000,
                        help="run BGM only up to this N (its time grows fastest)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for DeepDPM only, e.g. prior.coarsening=null")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    parser.add_argument("--epoch-log", action="store_true",
                        help="print each DeepDPM epoch (K, seconds) to stderr")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    overrides = checked_overrides(parser, args.set)
    report = {"command": shlex.join(["python", *(sys.argv if argv is None else [__file__, *argv])]),
              "threads": torch.get_num_threads(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "overrides": overrides, "records": []}
    for family in args.families:
        for n in args.n:
            for seed in args.seeds:
                make, k = FAMILIES[family]
                X, y = make(n, seed)
                for rec in run_one(X, y, k, seed, overrides, n <= args.bgm_max_n, args.epoch_log):
                    report["records"].append({"family": family, "n": n, "seed": seed, **rec})
                    print(f"{family} N {n} seed {seed} {rec['method']:17s} K {rec['k']:3d} "
                          f"NMI {rec['nmi']:.3f} {rec['seconds']:6.1f} s", file=sys.stderr, flush=True)
                    if args.json:
                        write_json_atomic(report, args.json)
    print(f"DeepDPM defaults{' with ' + ' '.join(args.set) if args.set else ''}; "
          f"{torch.get_num_threads()} torch thread(s)\n")
    print(table(report["records"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
