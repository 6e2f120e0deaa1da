"""K suite: DeepDPM's defaults against a DP-GMM, k-means given K and HDBSCAN, on many data.

For each data set and seed, in one process on the same data: DeepDPM with its defaults
(``DeepDPM(random_state=seed)``, plus any ``--set`` overrides, which apply to DeepDPM
only) and three peers: scikit-learn's ``BayesianGaussianMixture`` (Dirichlet process, full
covariances, ``max(20, 2 K)`` components capped at 50 and at N / 5, ``max_iter=500``),
``KMeans`` given the true K (``n_init=10``) and ``HDBSCAN`` with its defaults. HDBSCAN
labels the rows it leaves out -1 (noise): its K counts the other clusters only, while its
NMI, ARI and ln p(X, z) treat the noise as one more cluster (its share is printed beside K).
Each run reports the K found, NMI, ARI and seconds. A peer that raises is recorded with
its error (the table says so) and the run goes on. Above 20,000 rows BGM-DP is skipped
("—" in the table; only blobs2d-100 at full size): it took 58 s at 20,000 x 2 and grows
with N, where HDBSCAN took 8 s (144 s at 100,000 x 2; in 128-D its time grows as N^2:
11 s at 4000 rows, minutes a seed at imbalanced128's 20,000).

Data sets (``--datasets`` takes these names or globs such as ``'blobs16*'``):

* ``digits-pca10``, ``digits-umap10``, ``digits-aeumap10``: scikit-learn digits (pixels
  scaled to [0, 1]) -> PCA-10, UMAP-10 (n_neighbors 20, min_dist 0, as n2d) and
  autoencoder -> UMAP-10 (n2d; the paper's 500-500-2000-10 AE, ``--ae-epochs`` epochs).
* ``wine-std``, ``breast-cancer-std``, ``iris-std``: scikit-learn's sets, standardised;
  ``wine-raw``, ``breast-cancer-raw``, ``digits-raw``: in their raw units (features spanning
  0.001 .. 1000; raw pixels, some constant).
* ``blobs16`` (7 unequal blobs in 16-D, centres >= 30 apart, std 1), ``sphere128`` (10
  clusters on the unit sphere of R^128, like contrastive features), ``imbalanced128``
  (10 full-covariance Gaussians in 128-D, N = 20000, Dirichlet(0.5) weights floored at
  0.5 %) and ``blobs512`` (5 blobs in 512-D, 400 points each: fewer points than
  dimensions), each also times 1e-3 (``@1e-3``) and 1e3 (``@1e3``).
* Sets of the kinds DeepDPM's defaults fail on (each builder's docstring says why):
  ``blobs2d-dense`` (15 blobs of 40 in 2-D, 8 crowding a dense centre), ``blobs2d-overlap``
  (15 overlapping blobs, 5000 x 2), ``blobs2d-unequal`` (7 blobs of 30 .. 220 points,
  anisotropic), ``blobs2d-50`` (50 blobs of 150 points, the layout of the A3 set, 7,500 x 2),
  ``blobs2d-100`` (100 blobs on a jittered grid, 100,000 x 2), ``blobs128-40`` (40 blobs of
  75 points in 128-D: fewer points a cluster than dimensions, 4 clusters an initial one),
  ``table-degenerate`` (2000 x 13: a constant column, binary columns, 10 % duplicate rows,
  a class of 3 rows), ``table-mixed-units`` (4 clusters in 13-D, features x 0.1 .. 1000) and
  ``table-classification`` (scikit-learn's ``make_classification``: 10 anisotropic Gaussian
  clusters in 7 informative features, 3 redundant ones and 2 of noise, 5,000 x 12).

``--quick`` shrinks the large generated sets (sphere128, imbalanced128, blobs512, blobs16,
blobs2d-overlap to 2000 rows, blobs2d-100 to 20,000); the others are small already.

The seed drives everything random in a row: the methods, the UMAP / AE embeddings of the
digits and the draw of the generated sets (seed s gives another draw of the same
recipe); the scikit-learn sets and the PCA of digits do not depend on it.

Targets (the last column, DeepDPM rows): every generated set (all but scikit-learn's), K
within max(1, 10 %) of the truth at every seed (rounded down: 1 up to K = 19, 10 at
K = 100); digits UMAP and AE-UMAP, K in 9..11 at every seed and mean NMI >= 0.90; every set,
mean NMI >= the best peer's (BGM's, k-means-given-K's, HDBSCAN's) - 0.02 (the margin is
printed). Every row also gives, per seed, ln p(X, z) of the method's partition minus that
of the true classes under DeepDPM's own model (each partition with the prior fitted to
it), and DeepDPM's records in ``--json`` add its ln p(X, z) minus the best of the classes'
and the peers' partitions' (``log_joint_vs_best``, ``best_partition``). Where a target
fails the verdict says, for that target, which failure it is: a "search failure" where a
partition that meets it (the classes; for K a peer's with K in range, for NMI a peer's of
higher NMI) scores higher than DeepDPM's (at the seeds named), or "the model prefers
DeepDPM's answer" where none does (no search under this model would meet the target).
It also names any other partition that scores higher, though it misses the target too.

DeepDPM's seconds cell also gives its seconds over BGM-DP's on that set, and the footer
its total over every set with N <= 10,000 against BGM-DP's on the same sets.

    OMP_NUM_THREADS=2 python bench/k_suite.py --json /tmp/k_suite.json > /tmp/k_suite.md
    python bench/k_suite.py --datasets 'blobs16*' iris-std --seeds 0 --quick
    python bench/k_suite.py --datasets 'digits-*' --set prior.sigma_scale=0.05
    python bench/k_suite.py --datasets 'blobs2d-*' 'table-*' '*-raw' --seeds 0 --quick

The Markdown table goes to stdout, progress to stderr; ``--json FILE`` writes every
per-seed result and the command line (after each data set, atomically). SIGTERM or
Ctrl-C stops the run: the data sets finished so far are still reported (exit status 130).
Torch uses ``OMP_NUM_THREADS`` threads. Nothing is cached: each run embeds and draws anew.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shlex
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch
from sklearn.cluster import HDBSCAN, KMeans
from sklearn.datasets import (
    load_breast_cancer,
    load_digits,
    load_iris,
    load_wine,
    make_blobs,
    make_classification,
)
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import BayesianGaussianMixture
from sklearn.preprocessing import StandardScaler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.atomic_files import write_json_atomic  # noqa: E402
from deepdpm_core.bayes import partition_evidence  # noqa: E402
from deepdpm_core.config import (
    Config,  # noqa: E402
    parse_overrides,  # noqa: E402
)
from deepdpm_core.data import (
    clustering_scores,  # noqa: E402
    make_mixture,  # noqa: E402
)
from deepdpm_core.errors import ConfigError  # noqa: E402
from deepdpm_core.features import embed  # noqa: E402

Dataset = tuple[np.ndarray, np.ndarray, str]
"""(X [N, D] float32 or float64, true labels [N], one-line description)."""

METHODS = ("DeepDPM", "BGM-DP", "k-means (true K)", "HDBSCAN")
NOISE = -1
"""HDBSCAN's label of the rows it leaves out of every cluster."""
PEER_MAX_N = {"BGM-DP": 20_000}
"""Peers not run on data sets of more rows (their cells read "—"): BGM-DP took 58 s at
blobs2d-100's quick 20,000 x 2 (154 iterations, one thread) and grows with N, minutes a seed
at 100,000; HDBSCAN took 8 s there and 144 s at 100,000 x 2, so it runs everywhere."""
TIE_NATS = 0.01
"""Partitions whose ln p(X, z) differ by no more than this score the same (rounding)."""
SCALES = {"1e-3": 1e-3, "1e3": 1e3}
GENERATED = ("blobs16", "sphere128", "imbalanced128", "blobs512")
HARD = ("blobs2d-dense", "blobs2d-overlap", "blobs2d-unequal", "blobs2d-50", "blobs2d-100",
        "blobs128-40", "table-degenerate", "table-mixed-units", "table-classification")
BLOB_SIZES = (30, 120, 250, 360, 600, 800, 1000)
UNEQUAL_SIZES = (30, 50, 80, 110, 140, 170, 220)
QUICK_BLOB_SIZES = (20, 40, 60, 80, 100, 120, 140)
UMAP_SETS = ("digits-umap10", "digits-aeumap10")
DEFAULT_AE_EPOCHS = 40
QUICK_AE_EPOCHS = 2


# ------------------------------------------------------------------------------- data sets
def digits(seed: int, method: str, ae_epochs: int) -> Dataset:
    """scikit-learn digits, pixels / 16, embedded in 10-D by ``method`` (pca, umap, ae-umap)."""
    X, y = load_digits(return_X_y=True)
    config = Config().with_overrides({"seed": seed, "ae.pretrain_epochs": ae_epochs,
                                      "embed.n_neighbors": 20, "embed.min_dist": 0.0})
    start = time.perf_counter()
    E = embed((X / 16.0).astype(np.float32), method, config, dim=10).embedding
    detail = f", AE {ae_epochs} epochs" if method == "ae-umap" else ""
    return E, y, f"digits pixels/16 -> {method} 10-d{detail} ({time.perf_counter() - start:.1f} s)"


def standardised(seed: int, loader: Callable, name: str) -> Dataset:
    """A scikit-learn toy set, each feature standardised (``seed`` is unused: fixed data)."""
    del seed
    X, y = loader(return_X_y=True)
    return StandardScaler().fit_transform(X), y, f"sklearn {name}, StandardScaler"


def blobs16(seed: int, quick: bool = False) -> Dataset:
    """7 isotropic blobs (std 1) of unequal sizes in 16-D, centres re-drawn until >= 30 apart."""
    rng = np.random.default_rng(seed)
    sizes = QUICK_BLOB_SIZES if quick else BLOB_SIZES
    while True:
        centres = rng.uniform(-40.0, 40.0, size=(len(sizes), 16))
        gaps = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
        if gaps[np.triu_indices(len(sizes), 1)].min() >= 30.0:
            break
    X, y = make_blobs(n_samples=list(sizes), centers=centres, cluster_std=1.0,
                      random_state=int(rng.integers(2**31)))
    return X.astype(np.float32), y, f"make_blobs sizes {'/'.join(map(str, sizes))}, std 1"


def blobs512(seed: int, quick: bool = False) -> Dataset:
    """5 isotropic blobs (std 1) in 512-D, N = 2000 (``make_blobs`` centres in [-10, 10]^512):
    fewer points per cluster (400) than dimensions."""
    n = 1000 if quick else 2000
    X, y = make_blobs(n_samples=n, centers=5, n_features=512, random_state=seed)
    return X.astype(np.float32), y, f"make_blobs {n} points, 5 centres, std 1"


def imbalanced128(seed: int, quick: bool = False) -> Dataset:
    """``make_mixture`` in 128-D, K = 10, Dirichlet(0.5) weights floored at 0.5 %.

    At seeds 0, 1 and 2 the smallest weight is 0.50, 0.50 and 0.60 % (about 100 points).
    """
    n = 4000 if quick else 20_000
    X, y = make_mixture(n, 128, 10, imbalance=0.5, min_weight=0.005, random_state=seed)
    return X, y, f"make_mixture Dirichlet(0.5) weights >= 0.5 %, smallest {np.bincount(y).min()} pts"


def sphere128(seed: int, quick: bool = False) -> Dataset:
    """10 clusters on the unit sphere of R^128: unit centre + N(0, 0.1^2 I), row-normalised.

    Like L2-normalised contrastive (MoCo) features: a point's cosine to its own centre is
    about 0.65, to another centre about 0 +- 0.1. Dirichlet(5) weights.
    """
    rng = np.random.default_rng(seed)
    n, k, dim = (1500 if quick else 6000), 10, 128
    centres = rng.normal(size=(k, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    y = rng.choice(k, size=n, p=rng.dirichlet(np.full(k, 5.0)))
    X = centres[y] + rng.normal(0.0, 0.1, size=(n, dim))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return X.astype(np.float32), y, "unit centres + N(0, 0.01 I), rows L2-normalised"


def raw(seed: int, loader: Callable, name: str) -> Dataset:
    """A scikit-learn toy set in its raw units (``seed`` is unused: fixed data).

    Hard because one global scale fits no feature: wine's features span 0.1 .. 1000,
    breast cancer's 0.001 .. 1000, and digits' raw pixels (0 .. 16) include constant columns.
    """
    del seed
    X, y = loader(return_X_y=True)
    return X.astype(np.float64), y, f"sklearn {name}, raw units"


def _spread(rng: np.random.Generator, n: int, inner: float, outer: float, gap: float) -> np.ndarray:
    """``n`` points uniform in the 2-D annulus ``inner`` <= r <= ``outer``, each >= ``gap`` from
    the others (drawn one at a time; starts over after 1000 rejections in a row)."""
    points: list[np.ndarray] = []
    misses = 0
    while len(points) < n:
        r, angle = np.sqrt(rng.uniform(inner**2, outer**2)), rng.uniform(0.0, 2 * np.pi)
        p = np.array([r * np.cos(angle), r * np.sin(angle)])
        if all(np.linalg.norm(p - q) >= gap for q in points):
            points.append(p)
            misses = 0
        elif (misses := misses + 1) > 1000:
            points, misses = [], 0
    return np.stack(points)


def blobs2d_dense(seed: int, quick: bool = False) -> Dataset:
    """15 isotropic blobs of 40 points in 2-D (std 0.3), 8 of them crowding a dense centre.

    8 centres in the disc r <= 3, >= 1.8 apart (6 std); 7 in the ring 10 <= r <= 25, >= 8
    apart. The blobs are distinct (k-means given K: NMI 0.997 .. 1.0 at seeds 0 .. 3), but
    the crowd is small against the data's spread, so a prior sized to the whole set sees
    one cluster there. Already small: ``quick`` keeps it.
    """
    del quick
    rng = np.random.default_rng(seed)
    centres = np.concatenate([_spread(rng, 8, 0.0, 3.0, 1.8), _spread(rng, 7, 10.0, 25.0, 8.0)])
    y = np.repeat(np.arange(15), 40)
    X = centres[y] + rng.normal(0.0, 0.3, size=(len(y), 2))
    return X.astype(np.float32), y, "15 x 40 points, 8 centres in r <= 3 (>= 1.8 apart), 7 in 10..25; std 0.3"


def blobs2d_overlap(seed: int, quick: bool = False) -> Dataset:
    """15 overlapping blobs in 2-D: ``make_blobs`` with centres in [-10, 10]^2, std 1, N = 5000.

    Many centres lie within 2 std of another, so neighbours merge into one bump: K is barely
    identifiable and every method trades K against fit. ``quick``: N = 2000.
    """
    n = 2000 if quick else 5000
    X, y = make_blobs(n_samples=n, centers=15, n_features=2, center_box=(-10.0, 10.0),
                      cluster_std=1.0, random_state=seed)
    return X.astype(np.float32), y, f"make_blobs {n} points, 15 centres in [-10, 10]^2, std 1"


def blobs2d_unequal(seed: int, quick: bool = False) -> Dataset:
    """7 blobs in 2-D of unequal size (30 .. 220 points, N = 800) and shape: axis stds drawn
    in 0.3 .. 2, turned by a random angle (anisotropic full covariances).

    Centres re-drawn in [-25, 25]^2 until each pair is >= 4 (largest std of each) apart, so
    k-means given K separates them (NMI 1.0); a single prior scale fits neither the thin nor
    the wide blobs. Already small: ``quick`` keeps it.
    """
    del quick
    rng = np.random.default_rng(seed)
    k = len(UNEQUAL_SIZES)
    stds = rng.uniform(0.3, 2.0, size=(k, 2))
    angle = rng.uniform(0.0, np.pi, size=k)
    turn = np.stack([np.stack([np.cos(angle), -np.sin(angle)], -1),
                     np.stack([np.sin(angle), np.cos(angle)], -1)], 1)  # (k, 2, 2)
    reach = stds.max(axis=1)
    pairs = np.triu_indices(k, 1)
    while True:
        centres = rng.uniform(-25.0, 25.0, size=(k, 2))
        gaps = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
        if (gaps >= 4.0 * (reach[:, None] + reach[None]))[pairs].all():
            break
    y = np.repeat(np.arange(k), UNEQUAL_SIZES)
    X = centres[y] + np.einsum("nij,nj->ni", turn[y], rng.normal(size=(len(y), 2)) * stds[y])
    return (X.astype(np.float32), y,
            f"sizes {'/'.join(map(str, UNEQUAL_SIZES))}, axis stds 0.3..2, random rotations")


def blobs2d_50(seed: int, quick: bool = False) -> Dataset:
    """50 blobs of 150 points in 2-D (N = 7,500), the layout of Kärkkäinen and Fränti's A3
    set: centres on an 8 x 7 grid of pitch 10 (the first 50 nodes) jittered by N(0, 1)
    per axis, isotropic stds 1.6 x U(0.7, 1.3) per blob.

    Neighbours are ~5 std apart, so every blob is its own bump (k-means given K: NMI
    0.98), but a cluster that holds several blobs has no good two-way cut: the Gaussian
    model prefers one cluster to any split of a 2 x 4 block of blobs into two halves,
    though it prefers the eight blobs by far. Already small: ``quick`` keeps it.
    """
    del quick
    rng = np.random.default_rng(seed)
    k, per = 50, 150
    grid = np.array([(i % 8, i // 8) for i in range(k)], dtype=np.float64) * 10.0
    centres = grid + rng.normal(0.0, 1.0, size=grid.shape)
    stds = 1.6 * rng.uniform(0.7, 1.3, size=k)
    y = np.repeat(np.arange(k), per)
    X = centres[y] + rng.normal(size=(len(y), 2)) * stds[y, None]
    return X.astype(np.float32), y, f"50 x {per} points, jittered 8 x 7 grid (pitch 10), std 1.6 x 0.7..1.3"


def blobs2d_100(seed: int, quick: bool = False) -> Dataset:
    """100 isotropic blobs (std 1) in 2-D, 1000 points each (N = 100,000; ``quick``: 200
    each, N = 20,000), centres on a 10 x 10 grid of pitch 10 jittered by up to 1.5 per axis.

    Neighbouring centres are >= 7 std apart, so the blobs are separable (k-means given K:
    NMI 0.9999 at the quick size); the hard part is K = 100 itself, and N.
    """
    rng = np.random.default_rng(seed)
    per = 200 if quick else 1000
    grid = np.stack(np.meshgrid(np.arange(10.0), np.arange(10.0)), -1).reshape(-1, 2) * 10.0
    centres = grid + rng.uniform(-1.5, 1.5, size=grid.shape)
    y = np.repeat(np.arange(100), per)
    X = centres[y] + rng.normal(0.0, 1.0, size=(len(y), 2))
    return X.astype(np.float32), y, f"100 x {per} points, jittered 10 x 10 grid (pitch 10), std 1"


def blobs128_40(seed: int, quick: bool = False) -> Dataset:
    """40 isotropic blobs (std 1) in 128-D, 75 points each, N = 3000 (``make_blobs`` centres
    in [-10, 10]^128): each of the 10 initial k-means clusters holds about 4 blobs, and the
    prior fitted to those wide clusters makes every cut of them cost more than it explains
    (before the growth step: K 2/2/2). Already small: ``quick`` keeps it."""
    del quick
    X, y = make_blobs(n_samples=3000, centers=40, n_features=128, cluster_std=1.0,
                      center_box=(-10.0, 10.0), random_state=seed)
    return X.astype(np.float32), y, "make_blobs 3000 points, 40 centres in [-10, 10]^128, std 1"


def table_degenerate(seed: int, quick: bool = False) -> Dataset:
    """A real-looking table, N = 2000 x 13, with the defects of real data.

    ``make_blobs`` in 10-D (centres in [-8, 8]^10, std 1), classes of 800, 550, 400, 247 and
    **3** rows; then a constant column (7.0), a binary column (class parity, 10 % flipped),
    a near-binary one (1 for 97 % of rows, else 0, plus N(0, 0.01^2)), and 10 % duplicate
    rows (200 rows of the four large classes overwritten by copies of 200 others). A
    constant feature has no spread to scale by, duplicates make zero-variance groups, and
    the 3-row class is below any sensible cluster size. Already small: ``quick`` keeps it.
    """
    del quick
    rng = np.random.default_rng(seed)
    sizes = [800, 550, 400, 247, 3]
    blobs, y = make_blobs(n_samples=sizes, n_features=10, centers=None, center_box=(-8.0, 8.0),
                          cluster_std=1.0, random_state=int(rng.integers(2**31)))
    n = len(y)
    parity = (y % 2 == 0).astype(np.float64)
    binary = np.where(rng.random(n) < 0.1, 1.0 - parity, parity)
    near = (rng.random(n) < 0.97) + rng.normal(0.0, 0.01, size=n)
    X = np.column_stack([blobs, np.full(n, 7.0), binary, near])
    large = np.flatnonzero(y != len(sizes) - 1)
    source = rng.choice(large, n // 10, replace=False)
    target = rng.choice(np.setdiff1d(large, source), n // 10, replace=False)
    X[target], y[target] = X[source], y[source]
    return (X.astype(np.float32), y, f"10-d blobs + constant, binary, near-binary columns; "
            f"{n // 10} duplicate rows; class sizes {'/'.join(map(str, np.bincount(y)))}")


def table_mixed_units(seed: int, quick: bool = False) -> Dataset:
    """4 isotropic blobs in 13-D (``make_blobs``, centres in [-4, 4]^13, std 1; 400, 300,
    200 and 100 rows), each feature then multiplied by one of 10^(-1 .. 3) (13 factors
    spaced evenly in log, shuffled): like scikit-learn's wine in raw units.

    Standardised, k-means given K separates the clusters (NMI 1.0); in these units the
    x1000 features drown the rest (k-means NMI 0.56 .. 0.73). Already small: ``quick`` keeps it.
    """
    del quick
    rng = np.random.default_rng(seed)
    X, y = make_blobs(n_samples=[400, 300, 200, 100], n_features=13, centers=None,
                      center_box=(-4.0, 4.0), cluster_std=1.0, random_state=int(rng.integers(2**31)))
    factors = np.logspace(-1.0, 3.0, 13)
    rng.shuffle(factors)
    return (X * factors).astype(np.float32), y, "13-d blobs, features x 0.1 .. 1000 (log-spaced, shuffled)"


def table_classification(seed: int, quick: bool = False) -> Dataset:
    """``make_classification``'s benchmark table: 5 classes of 2 Gaussian clusters each, at
    the vertices of a hypercube (side 4) in 7 informative features, each cluster with its own
    random covariance; 3 features that are linear combinations of those and 2 of noise;
    5,000 x 12, 500 rows a cluster, rows shuffled. The true labels are the 10 clusters (class
    = cluster mod 5). Already small: ``quick`` keeps it."""
    del quick
    rng = np.random.default_rng(seed)
    X, _ = make_classification(n_samples=5000, n_features=12, n_informative=7, n_redundant=3,
                               n_classes=5, n_clusters_per_class=2, class_sep=2.0, flip_y=0.0,
                               shuffle=False, random_state=int(rng.integers(2**31)))
    y = np.repeat(np.arange(10), 500)  # unshuffled, make_classification lists cluster by cluster
    order = rng.permutation(len(y))
    return X[order].astype(np.float32), y[order], "make_classification: 10 clusters, 7 informative + 3 redundant + 2 noise features"


def rescaled(seed: int, base: Callable[[int], Dataset], factor: float, label: str) -> Dataset:
    """``base(seed)`` with X multiplied by ``factor`` (same dtype)."""
    X, y, description = base(seed)
    return (X * factor).astype(X.dtype), y, f"{description}; x {label}"


def make_datasets(quick: bool = False,
                  ae_epochs: int | None = None) -> dict[str, Callable[[int], Dataset]]:
    """Name -> builder(seed) -> (X, y, description), in the suite's order.

    ``quick`` shrinks the generated sets (and the AE's epochs unless ``ae_epochs`` is given).
    """
    epochs = ae_epochs if ae_epochs is not None else (QUICK_AE_EPOCHS if quick else DEFAULT_AE_EPOCHS)
    out: dict[str, Callable[[int], Dataset]] = {
        "digits-pca10": partial(digits, method="pca", ae_epochs=epochs),
        "digits-umap10": partial(digits, method="umap", ae_epochs=epochs),
        "digits-aeumap10": partial(digits, method="ae-umap", ae_epochs=epochs),
        "wine-std": partial(standardised, loader=load_wine, name="wine"),
        "breast-cancer-std": partial(standardised, loader=load_breast_cancer, name="breast_cancer"),
        "iris-std": partial(standardised, loader=load_iris, name="iris"),
        "wine-raw": partial(raw, loader=load_wine, name="wine"),
        "breast-cancer-raw": partial(raw, loader=load_breast_cancer, name="breast_cancer"),
        "digits-raw": partial(raw, loader=load_digits, name="digits"),
    }
    generators = {"blobs16": blobs16, "imbalanced128": imbalanced128, "sphere128": sphere128,
                  "blobs512": blobs512}
    for name in GENERATED:
        out[name] = partial(generators[name], quick=quick)
        for label, factor in SCALES.items():
            out[f"{name}@{label}"] = partial(rescaled, base=out[name], factor=factor, label=label)
    hard = {"blobs2d-dense": blobs2d_dense, "blobs2d-overlap": blobs2d_overlap,
            "blobs2d-unequal": blobs2d_unequal, "blobs2d-50": blobs2d_50, "blobs2d-100": blobs2d_100,
            "blobs128-40": blobs128_40, "table-degenerate": table_degenerate,
            "table-mixed-units": table_mixed_units,
            "table-classification": table_classification}
    for name in HARD:
        out[name] = partial(hard[name], quick=quick)
    return out


DATASETS = make_datasets()


def select(names: dict[str, Callable], patterns: list[str]) -> list[str]:
    """Names matching any of ``patterns`` (exact names or globs), in the suite's order."""
    unknown = [p for p in patterns if not fnmatch.filter(names, p)]
    if unknown:
        raise SystemExit(f"no data set matches {', '.join(unknown)}; known: {', '.join(names)}")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


# --------------------------------------------------------------------------------- methods
def peer_fits(X: np.ndarray, true_k: int, seed: int) -> dict[str, Callable[[], np.ndarray]]:
    """The peers' fits, by name: each a call that returns one label per row of ``X``."""
    n_components = min(max(20, 2 * true_k), 50, max(true_k, len(X) // 5))
    return {
        "BGM-DP": lambda: BayesianGaussianMixture(
            n_components=n_components, weight_concentration_prior_type="dirichlet_process",
            covariance_type="full", max_iter=500, random_state=seed).fit(X).predict(X),
        "k-means (true K)": lambda: KMeans(n_clusters=true_k, n_init=10,
                                           random_state=seed).fit_predict(X),
        # the defaults; copy=True (the default from scikit-learn 1.10) leaves X as it is
        "HDBSCAN": lambda: HDBSCAN(copy=True).fit_predict(X),
    }


def score(method: str, seed: int, labels: np.ndarray, y: np.ndarray, X: np.ndarray,
          config: Config, truth: float, seconds: float) -> dict:
    """The record of one fit's ``labels``: K (distinct labels other than HDBSCAN's noise,
    ``NOISE``), NMI, ARI and ACC (noise counted as one more cluster), seconds, and ln p(X, z)
    and its excess over the classes' ``truth`` (noise scored as one more group). HDBSCAN's
    record also counts its noise rows (``noise``)."""
    scores = clustering_scores(y, labels)
    log_joint = partition_evidence(X, labels, config).log_joint
    record = {"method": method, "seed": seed, "k": len(np.unique(labels[labels != NOISE])),
              "nmi": scores["nmi"], "ari": scores["ari"], "acc": scores["acc"], "seconds": seconds,
              "log_joint": log_joint, "log_joint_vs_truth": log_joint - truth}
    if method == "HDBSCAN":
        record["noise"] = int((labels == NOISE).sum())
    return record


def not_run(method: str, seed: int, **why: str) -> dict:
    """The record of a peer that did not give labels: ``skipped`` or ``error`` says why."""
    return {"method": method, "seed": seed, "k": None, "nmi": None, "ari": None, "acc": None,
            "seconds": None, "log_joint": None, "log_joint_vs_truth": None, **why}


def run_methods(X: np.ndarray, y: np.ndarray, seed: int, overrides: dict,
                peers: dict[str, Callable[[], np.ndarray]] | None = None) -> Iterator[dict]:
    """Fit each method in turn; yield its record (``method``, ``seed``, ``k``, ``nmi``,
    ``ari``, ``acc``, ``seconds``, ``log_joint``, ``log_joint_vs_truth``; :func:`score`) as
    soon as it is done.

    ``log_joint_vs_truth`` is ln p(X, z) of the method's partition minus that of the true
    classes, each under DeepDPM's model with the prior fitted to it
    (:func:`~deepdpm_core.bayes.partition_evidence.partition_evidence`): above 0 the model
    prefers the method's answer to the classes; below 0 a search could have done better.

    ``peers`` replaces :func:`peer_fits` (tests). A peer that raises gives a record with
    ``error`` (the exception) and no scores, and the run goes on; a peer above its row
    limit (``PEER_MAX_N``) is not run: its record has ``skipped``. DeepDPM's errors propagate.
    """
    true_k = len(np.unique(y))
    config = DeepDPM(**overrides).get_config()
    truth = partition_evidence(X, y, config).log_joint
    fits = {"DeepDPM": lambda: DeepDPM(random_state=seed, **overrides).fit(X).labels_,
            **(peers if peers is not None else peer_fits(X, true_k, seed))}
    for method, fit in fits.items():
        if len(X) > PEER_MAX_N.get(method, len(X)):
            yield not_run(method, seed, skipped=f"N > {PEER_MAX_N[method]:,}")
            continue
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)  # BGM at max_iter is a result
                labels = np.asarray(fit())
            record = score(method, seed, labels, y, X, config, truth, time.perf_counter() - start)
        except Exception as exc:  # a peer's failure is one of its results
            if method == "DeepDPM":
                raise
            record = {**not_run(method, seed, error=f"{type(exc).__name__}: {exc}"),
                      "seconds": time.perf_counter() - start}
        yield record


def best_partition_gap(seed_records: list[dict]) -> tuple[float, str]:
    """DeepDPM's ln p(X, z) minus the best of the true classes' and every peer's that gave
    labels, at one seed, and which partition that best is ("classes" or a peer's name).

    Below 0 (by more than ``TIE_NATS``) some partition the model scores higher was there to
    find: a search failure; otherwise the model prefers DeepDPM's answer to all of them.
    """
    ours = next(r for r in seed_records if r["method"] == "DeepDPM")
    best, name = 0.0, "classes"  # the classes' ln p(X, z) minus their own
    for r in seed_records:
        if r["method"] != "DeepDPM" and r["log_joint_vs_truth"] is not None \
                and r["log_joint_vs_truth"] > best:
            best, name = r["log_joint_vs_truth"], r["method"]
    return ours["log_joint_vs_truth"] - best, name


# ---------------------------------------------------------------------------------- report
def k_tolerance(true_k: int) -> int:
    """How far DeepDPM's K may be from the truth on a generated set: max(1, 10 %), whole."""
    return max(1, int(0.1 * true_k))


def _done(rows: list[dict]) -> list[dict]:
    """The records that have scores (not skipped, no error)."""
    return [r for r in rows if r["k"] is not None]


def targets(name: str, true_k: int, rows: dict[str, list[dict]]) -> tuple[bool, str]:
    """Whether the suite's targets (module docstring) hold for DeepDPM on data set ``name``, and why."""
    ours = rows["DeepDPM"]
    ks = [r["k"] for r in ours]
    nmi = float(np.mean([r["nmi"] for r in ours]))
    checks = []  # (passed, what, which peer records meet the target)
    if name.split("@")[0] in GENERATED + HARD:
        tol = k_tolerance(true_k)
        checks.append((all(abs(k - true_k) <= tol for k in ks), f"K {true_k - tol}..{true_k + tol}",
                       lambda r, tol=tol: abs(r["k"] - true_k) <= tol))
    if name in UMAP_SETS:
        checks.append((all(9 <= k <= 11 for k in ks), "K 9..11", lambda r: 9 <= r["k"] <= 11))
        checks.append((nmi >= 0.90, "NMI>=0.90", lambda r: False))
    peer_nmis = {m: float(np.mean([r["nmi"] for r in _done(rows[m])])) for m in METHODS[1:] if _done(rows[m])}
    if peer_nmis:
        margin = nmi - max(peer_nmis.values())
        checks.append((margin >= -0.02, f"NMI vs best peer {margin:+.3f}",
                       lambda r: peer_nmis.get(r["method"], -1.0) > nmi))
    ok = all(passed for passed, _, _ in checks)
    explained: set[tuple[str, int]] = set()
    # a failed target says which failure it is: the search's (a partition that meets it
    # scores higher) or the model's
    text = "; ".join(f"{what} ok" if passed else f"{what} FAIL ({_failure(rows, meets, explained)})"
                     for passed, what, meets in checks)
    others = [r for r in ours if r.get("log_joint_vs_best", 0.0) < -TIE_NATS
              and (r["best_partition"], r["seed"]) not in explained]
    if not ok and others:
        text += "; higher-scoring partitions that miss the targets too: " + ", ".join(
            f"{r['best_partition']}'s by {-r['log_joint_vs_best']:.0f} at seed {r['seed']}" for r in others)
    return ok, f"{'yes' if ok else 'NO'}: {text}"


def _failure(rows: dict[str, list[dict]], meets: Callable[[dict], bool], explained: set) -> str:
    """A failed target's verdict: "search failure" naming, per seed, the best-scoring
    partition that meets the target (the classes, or a peer's record for which ``meets``
    holds) where it scores above DeepDPM's, else the model's preference. Adds the
    (partition, seed) pairs it names to ``explained``."""
    found = []
    for i, ours in enumerate(rows["DeepDPM"]):
        rivals = [("classes", 0.0)] + [
            (m, rows[m][i]["log_joint_vs_truth"]) for m in METHODS[1:]
            if i < len(rows[m]) and rows[m][i]["k"] is not None and meets(rows[m][i])]
        best, score = max(rivals, key=lambda rival: rival[1])
        if score - ours["log_joint_vs_truth"] > TIE_NATS:
            explained.add((best, ours["seed"]))
            found.append(("the classes score" if best == "classes" else f"{best}'s partition scores")
                         + f" {score - ours['log_joint_vs_truth']:.0f} higher at seed {ours['seed']}")
    if found:
        return "search failure: " + ", ".join(found)
    return "the model prefers DeepDPM's answer to the classes' and to every peer's that meets it"


def _k_cell(method: str, rows: list[dict]) -> str:
    """K's mean (per seed); HDBSCAN's also its noise share."""
    ks = [r["k"] for r in rows]
    cell = f"{np.mean(ks):.3g} ({'/'.join(map(str, ks))})"
    if method == "HDBSCAN":
        cell += f" + noise {100 * np.mean([r['noise'] / r['n'] for r in rows]):.1f} %"
    return cell


def seconds_ratio(datasets: list[dict], records: list[dict], max_n: int = 10_000) -> str:
    """DeepDPM's total seconds over the data sets with N <= ``max_n`` on which BGM-DP ran
    at every seed, against BGM-DP's on the same sets, in one sentence."""
    names = [d["name"] for d in datasets if d["n"] <= max_n and all(
        r["seconds"] is not None and "error" not in r
        for r in records if r["dataset"] == d["name"] and r["method"] == "BGM-DP")]
    total = {m: sum(r["seconds"] for r in records if r["dataset"] in names and r["method"] == m)
             for m in ("DeepDPM", "BGM-DP")}
    if not names:
        return f"No data set with N <= {max_n:,} and BGM-DP at every seed: no seconds to compare."
    ratio = f"{total['DeepDPM'] / total['BGM-DP']:.2f}" if total["BGM-DP"] > 0 else "n/a"
    return (f"Seconds over the {len(names)} data sets with N <= {max_n:,} (all seeds): DeepDPM "
            f"{total['DeepDPM']:.1f}, BGM-DP {total['BGM-DP']:.1f}; DeepDPM / BGM-DP = {ratio}.")


def table(datasets: list[dict], records: list[dict]) -> str:
    """The Markdown table: one row per (data set, method), means over the seeds."""
    lines = [
        "| data set | N | D | true K | method | K mean (per seed) | NMI | ARI "
        "| ln p(X, z) − classes' (per seed) | seconds | DeepDPM targets; peers' notes |",
        "|---|---:|---:|---:|---|---|---:|---:|---|---:|---|",
    ]
    passed = 0
    for ds in datasets:
        rows = {m: [r for r in records if r["dataset"] == ds["name"] and r["method"] == m]
                for m in METHODS}
        ok, verdict = targets(ds["name"], ds["true_k"], rows)
        passed += ok
        bgm = _done(rows["BGM-DP"])
        for method in METHODS:
            rs = _done(rows[method])
            lead = f"| {ds['name']} | {ds['n']} | {ds['d']} | {ds['true_k']} | {method} "
            notes = "; ".join(f"seed {r['seed']}: {r.get('skipped') or r.get('error')}"
                              for r in rows[method] if r["k"] is None)
            if not rs:  # skipped or failed at every seed
                mark = "—" if all("skipped" in r for r in rows[method]) else "error"
                lines.append(f"{lead}| {mark} | {mark} | {mark} | {mark} | {mark} | {notes} |")
                continue
            seconds = f"{np.mean([r['seconds'] for r in rs]):.1f}"
            if method == "DeepDPM" and len(bgm) == len(rs) and sum(r["seconds"] for r in bgm) > 0:
                seconds += f" ({sum(r['seconds'] for r in rs) / sum(r['seconds'] for r in bgm):.1f}× BGM)"
            lines.append(
                f"{lead}| {_k_cell(method, rs)} "
                f"| {np.mean([r['nmi'] for r in rs]):.3f} | {np.mean([r['ari'] for r in rs]):.3f} "
                f"| {'/'.join(format(r['log_joint_vs_truth'], '+.0f') for r in rs)} "
                f"| {seconds} | {verdict if method == 'DeepDPM' else notes} |"
            )
    lines.append(f"\nDeepDPM's targets hold on {passed} of {len(datasets)} data sets.")
    lines.append(seconds_ratio(datasets, records))
    return "\n".join(lines)


def _stop(signum: int, frame: object) -> None:
    """SIGTERM handler: stop like Ctrl-C, so the finished data sets are still reported."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["*"], metavar="NAME|GLOB")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for DeepDPM only, e.g. prior.sigma_scale=0.05")
    parser.add_argument("--ae-epochs", type=int, default=None,
                        help=f"AE pretraining epochs of digits-aeumap10 (default {DEFAULT_AE_EPOCHS}, "
                        f"{QUICK_AE_EPOCHS} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller generated sets and a 2-epoch AE (for tests)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="write every per-seed result and the command line to FILE "
                        "(rewritten after each data set)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    try:
        overrides = parse_overrides(args.set)
        DeepDPM(**overrides).get_config()  # an unknown key or a bad value fails here, before any fit
    except ConfigError as exc:
        parser.error(f"--set: {exc}")
    builders = make_datasets(args.quick, args.ae_epochs)
    names = select(builders, args.datasets)
    report = {
        "command": shlex.join(["python", *(sys.argv if argv is None else [__file__, *argv])]),
        "threads": torch.get_num_threads(), "seeds": args.seeds, "overrides": overrides,
        "quick": args.quick, "complete": False, "datasets": [], "records": [],
    }
    datasets, records = report["datasets"], report["records"]

    signal.signal(signal.SIGTERM, _stop)
    try:
        for name in names:
            start = time.perf_counter()
            info: dict = {"name": name, "descriptions": []}
            for seed in args.seeds:
                X, y, description = builders[name](seed)
                info.update(n=len(X), d=X.shape[1], true_k=len(np.unique(y)))
                info["descriptions"].append(description)
                print(f"{name} seed {seed}: {len(X)} x {X.shape[1]}, K {info['true_k']}; "
                      f"{description}", file=sys.stderr, flush=True)
                seed_records = []
                for rec in run_methods(X, y, seed, overrides):
                    seed_records.append({"dataset": name, "n": len(X), "d": X.shape[1],
                                         "true_k": info["true_k"], **rec})
                    print(f"  {rec['method']:18s} " + (
                        f"K {rec['k']:3d}  NMI {rec['nmi']:.3f}  ARI {rec['ari']:.3f}  "
                        f"{rec['seconds']:7.1f} s" if rec["k"] is not None else
                        f"{rec.get('skipped') or rec.get('error')}"), file=sys.stderr, flush=True)
                gap, best = best_partition_gap(seed_records)
                seed_records[0].update(log_joint_vs_best=gap, best_partition=best)
                print(f"  DeepDPM's ln p(X, z) - the best of the classes' and peers' ({best}): "
                      f"{gap:+.1f}", file=sys.stderr, flush=True)
                records.extend(seed_records)
            info["wall_seconds"] = time.perf_counter() - start
            print(f"{name}: {info['wall_seconds']:.1f} s in all", file=sys.stderr, flush=True)
            datasets.append(info)
            if args.json:
                write_json_atomic(report, args.json)
        report["complete"] = True
    except KeyboardInterrupt:
        print(f"stopped: {len(datasets)} of {len(names)} data sets done", file=sys.stderr)

    print(f"seeds {' '.join(map(str, args.seeds))}; DeepDPM defaults"
          f"{' with ' + ' '.join(args.set) if args.set else ''}; BGM-DP full covariances; "
          f"k-means given the true K; HDBSCAN defaults (noise one more cluster); "
          f"{torch.get_num_threads()} torch thread(s)\n")
    print(table(datasets, records))
    print("\nwall seconds per data set (embedding and all fits, all seeds): "
          + ", ".join(f"{d['name']} {d['wall_seconds']:.0f}" for d in datasets))
    if not report["complete"]:
        print(f"\nSTOPPED EARLY: {len(datasets)} of {len(names)} data sets done; not finished: "
              + ", ".join(names[len(datasets):]))
    if args.json:
        write_json_atomic(report, args.json)
    return 0 if report["complete"] else 130


if __name__ == "__main__":
    sys.exit(main())
