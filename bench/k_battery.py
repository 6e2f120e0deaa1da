"""K battery: DeepDPM's defaults beside k-means, a DP-GMM and HDBSCAN, one table.

Each family draws ``(n, seed) -> (X float32 [n, d], y [n])`` at its own Ns or ``--n``
(``--families`` takes names or globs such as ``'overlap*'``):

* few large non-Gaussian clusters, ``bench/k_vs_n.py``'s ``student``, ``curved``, ``sphere``,
  ``umap``, ``n2d``: N = 2k, 20k, 70k, 200k;
* many clusters (equal sizes): ``grid100``, 100 unit Gaussians on a 10 x 10 grid in 2-D,
  neighbours 4.2 apart (100k); ``curve100``, 100 unit Gaussians 6 apart along the arc of
  y = 30 sin(2 pi x / 200) (100k); ``worms35-2d``, 35 worms (quadratic Bezier curves of chord
  10, points uniform along the arc plus N(0, 0.3^2)) around a jittered grid >= 14 apart
  (100k); ``worms35-64d``, each worm in a random 2-D plane of R^64 around centres >= 16 apart,
  plus N(0, 0.05^2) in all dims (100k); ``blobs200-32d``, 200 unit Gaussians in 32-D, centres
  uniform in the smallest box where all are >= 6 apart (20k); k_vs_n's ``sphere-1000`` (200k);
* ``blobs15-2d-s{2,3,4}``: 15 Gaussians of random shapes in 2-D, 5,000 rows, centres >= 1.1
  apart, geometric mean standard deviation 0.4, 0.55, 0.7: overlap growing as in the S2-S4
  sets of Fränti & Virmajoki (2006);
* ``overlap{10,30,50}-{2,16,128}d``: two unit Gaussians of N / 2 rows (N = 2048) whose
  densities share 10, 30 or 50 % of their area, means -2 Phi^-1(ovl / 2) = 3.29, 2.07, 1.35 apart;
* tables, ``bench/k_suite.py``'s at their own N (``--n`` does not apply): ``wine-raw``,
  ``breast-cancer-raw``, ``digits-raw``, ``table-degenerate``, ``table-mixed-units``,
  ``table-classification``.

For each (family, N, seed), on the same data in one process: ``DeepDPM(random_state=seed)``
plus any ``--set``; k-means given the true K (``KMeans(n_init=3)``; FAISS, 3 restarts of 25
iterations, above 100 clusters); ``BayesianGaussianMixture`` (Dirichlet process, full
covariances, max(20, min(2K, K + 100)) components, at most max(K, N / 5), 500 iterations,
stopped after ``--bgm-max-seconds``: ``*`` in the table), not run where N x components x
(D^2 + 2000), about 6e-11 s an iteration per unit on one thread, exceeds ``--bgm-max-cost``;
HDBSCAN with ``min_cluster_size = max(5, N // (20 K))`` (a twentieth of the mean class: a
hint from the truth, like k-means'), not run above ``--hdbscan-max-n`` rows or N^2 D above
``--hdbscan-max-cost``, its K without the noise, its NMI with the noise as one cluster; and
where the true K <= 5, the K of the lowest BIC of ``GaussianMixture`` (full, K = 1..2K).

Verdicts (DeepDPM, per family and N): separated, curved or heavy-tailed families (all but
overlap and scikit-learn's tables), K within max(1, 10 %) of the truth at every seed and mean
NMI >= k-means' - 0.02; scikit-learn's tables (classes need not be clusters), the NMI target
alone; overlap, wherever BIC picks the true K at most seeds, the true K at >= 2 of 3 seeds.
For ``umap`` and ``n2d`` the true K is the class count; the layout itself may cut a class
into islands or join classes, so its count of valley-separated groups is left to the reader.

**Starts** (``--starts``): DeepDPM is fitted from each of ``default`` (``init.n_clusters:
auto``), ``10`` and ``3k`` (three times the true K) k-means clusters, and each of its
partitions is scored by the model's own objective, ln p(X, z) with the prior fitted to the
partition (``partition_evidence``), beside the true classes' score: a fit that scores below
the classes stopped short of them (a search failure), one that scores above them is what
the model prefers. The start table gives K, NMI and the score of each start, and whether the
starts agree (K within max(1, 10 %) of each other).

**Quick** (``--quick``): every family but ``sphere-1000`` at its most telling size
(``QUICK_N``, at most 70k rows), seed 0, from the three starts, BGM stopped after 60 s,
HDBSCAN up to N^2 D = 1e10: every family at once, so that a change of the method is measured
on all of them. ``--jobs J`` runs J families at a time, each in its own process (one torch
thread each); the run's wall and CPU seconds close its table (CPU seconds are what a busy
machine does not inflate).

    OMP_NUM_THREADS=1 python bench/k_battery.py --quick --jobs 2 --json bench/results/k_battery_quick.json
    OMP_NUM_THREADS=1 python bench/k_battery.py --families grid100 --json bench/results/k_battery_grid100.json
    python bench/k_battery.py --families 'overlap*' --set prior.coarsening=null
    python bench/k_battery.py --quick --constant deepdpm_core.moves.density_valleys.MERGE_VALLEY=1.01

``--constant`` sets one of the method's calibrated module constants for an ablation
(``bench/constants.py``): what the rule it holds buys, measured on every family at once.

The Markdown table goes to stdout, progress to stderr; ``--json FILE`` holds every record
and the command line (rewritten after each record). SIGTERM or Ctrl-C stops the run and
reports the records so far (exit status 130). Torch uses ``OMP_NUM_THREADS`` threads.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import resource
import shlex
import signal
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch
from sklearn.cluster import HDBSCAN, KMeans
from sklearn.exceptions import ConvergenceWarning
from sklearn.mixture import BayesianGaussianMixture, GaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from constants import parse_constants, set_constants  # noqa: E402
from k_suite import NOISE, k_tolerance, make_datasets, select  # noqa: E402
from k_vs_n import DEFAULT_N, checked_overrides, faiss_kmeans  # noqa: E402
from k_vs_n import FAMILIES as K_VS_N  # noqa: E402

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.atomic_files import write_json_atomic  # noqa: E402
from deepdpm_core.bayes import partition_evidence  # noqa: E402
from deepdpm_core.data import clustering_scores  # noqa: E402

Data = tuple[np.ndarray, np.ndarray]
BGM_MAX_ITER, BGM_CHUNK = 500, 25
#: ``--starts``' names: the initial clusters of each DeepDPM fit (``init.n_clusters``)
STARTS = ("default", "10", "3k")
#: --quick: the most telling size of each family (None: a table's own N), where the start
#: or N decided K at the defaults of the past: the few large clusters at 70k rows (student,
#: umap), the many small ones at 20k (one start: K 19 of 100 grid blobs, another 100)
QUICK_N: dict[str, int | None] = {
    "student": 70_000, "curved": 20_000, "sphere": 20_000, "umap": 70_000, "n2d": 20_000,
    "grid100": 20_000, "curve100": 20_000, "worms35-2d": 20_000, "worms35-64d": 20_000,
    "blobs200-32d": 20_000,
}
#: --quick leaves out ``sphere-1000``: its telling size is 200k rows (200 a class in 128-D; at
#: 50k, 50 a class, no start reaches the classes) and its start from 3 x K, 3,000 clusters,
#: takes longer than the rest of the quick battery
QUICK_SKIPS = ("sphere-1000",)
#: --quick: BGM's time limit (seconds) and HDBSCAN's largest N^2 D (20k rows in 64-D took
#: 100 s, 70k in 10-D 80 s)
QUICK_BGM_SECONDS, QUICK_HDBSCAN_COST = 60.0, 1e10


@dataclass(frozen=True)
class Family:
    """A family of data: ``make(n, seed)``, its default Ns (None: the set's own N) and the
    kind of its verdict: "separated", "overlap" or "real" (classes need not be clusters)."""

    make: Callable[[int | None, int], Data]
    ns: tuple[int | None, ...]
    kind: str


# ------------------------------------------------------------------------------- families
def grid100(n: int, seed: int) -> Data:
    """100 unit Gaussians on a 10 x 10 grid of spacing 4.2 in 2-D, equal sizes."""
    rng = np.random.default_rng(seed)
    centres = 4.2 * np.stack(np.meshgrid(np.arange(10), np.arange(10)), -1).reshape(-1, 2)
    y = rng.permutation(np.arange(n) % 100)
    return (centres[y] + rng.normal(size=(n, 2))).astype(np.float32), y


def curve100(n: int, seed: int, gap: float = 6.0) -> Data:
    """100 unit Gaussians ``gap`` apart along the arc of y = 30 sin(2 pi x / 200), equal sizes."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0.0, 99 * gap, 20_000)
    centres = _along(np.column_stack([x, 30.0 * np.sin(2 * np.pi * x / 200.0)]), gap * np.arange(100))
    y = rng.permutation(np.arange(n) % 100)
    return (centres[y] + rng.normal(size=(n, 2))).astype(np.float32), y


def _along(curve: np.ndarray, s: np.ndarray, fraction: bool = False) -> np.ndarray:
    """The points at arc lengths ``s`` (fractions of the whole if ``fraction``) along a 2-D
    polyline ``curve`` (m, 2)."""
    arc = np.r_[0.0, np.cumsum(np.linalg.norm(np.diff(curve, axis=0), axis=1))]
    s = s * arc[-1] if fraction else s
    return np.column_stack([np.interp(s, arc, curve[:, 0]), np.interp(s, arc, curve[:, 1])])


def _worm(rng: np.random.Generator, size: int, chord: float = 10.0, thickness: float = 0.3) -> np.ndarray:
    """``size`` points about the origin of one worm in 2-D: a quadratic Bezier curve of
    chord ``chord`` in a random direction, bent by up to chord / 2, points uniform along
    its arc plus N(0, thickness^2)."""
    angle = rng.uniform(0.0, 2 * np.pi)
    along, across = np.array([np.cos(angle), np.sin(angle)]), np.array([-np.sin(angle), np.cos(angle)])
    p0, p1, p2 = -chord / 2 * along, rng.uniform(-chord / 2, chord / 2) * across, chord / 2 * along
    t = np.linspace(0.0, 1.0, 512)[:, None]
    curve = (1 - t) ** 2 * p0 + 2 * (1 - t) * t * p1 + t**2 * p2
    points = _along(curve, rng.uniform(0.0, 1.0, size), fraction=True)
    return points + rng.normal(0.0, thickness, size=(size, 2))


def worms(n: int, seed: int, dim: int = 2, k: int = 35) -> Data:
    """``k`` worms (:func:`_worm`), equal sizes. In 2-D around the cells of a 6 x 6 grid of
    spacing 16 (jitter +-1); above, each in a random 2-D plane of R^dim around centres
    N(0, 2.5^2 I) >= 16 apart, plus N(0, 0.05^2) in every dim."""
    rng = np.random.default_rng(seed)
    if dim == 2:
        grid = 16.0 * np.stack(np.meshgrid(np.arange(6), np.arange(6)), -1).reshape(-1, 2)
        centres = grid[rng.permutation(36)[:k]] + rng.uniform(-1.0, 1.0, size=(k, 2))
    else:
        centres = rng.normal(0.0, 2.5, size=(k, dim))
        while _min_gap(centres) < 16.0:
            centres = rng.normal(0.0, 2.5, size=(k, dim))
    y = rng.permutation(np.arange(n) % k)
    X = np.empty((n, dim))
    for c in range(k):
        rows = np.flatnonzero(y == c)
        points = _worm(rng, len(rows))
        if dim > 2:
            plane = np.linalg.qr(rng.normal(size=(dim, 2)))[0]
            points = points @ plane.T + rng.normal(0.0, 0.05, size=(len(rows), dim))
        X[rows] = centres[c] + points
    return X.astype(np.float32), y


def _min_gap(centres: np.ndarray) -> float:
    """The smallest distance between two rows of ``centres``."""
    sq = (centres**2).sum(1)
    d2 = sq[:, None] + sq[None] - 2 * centres @ centres.T
    return float(np.sqrt(max(d2[np.triu_indices(len(centres), 1)].min(), 0.0)))


def blobs(n: int, seed: int, k: int = 200, dim: int = 32, gap: float = 6.0) -> Data:
    """``k`` unit Gaussians in ``dim``-D, equal sizes, centres uniform in [-L, L]^dim with
    the smallest L (from 2.1, steps of 5 %, a fresh draw each) where every pair is >= ``gap`` apart."""
    rng = np.random.default_rng(seed)
    half = 2.1
    while _min_gap(centres := rng.uniform(-half, half, size=(k, dim))) < gap:
        half *= 1.05
    y = rng.permutation(np.arange(n) % k)
    return (centres[y] + rng.normal(size=(n, dim))).astype(np.float32), y


def overlap(n: int, seed: int, share: float, dim: int) -> Data:
    """Two unit Gaussians of n / 2 rows in ``dim``-D whose densities share ``share`` of their
    area: means -2 Phi^-1(share / 2) apart along the first axis."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % 2)
    X = rng.normal(size=(n, dim))
    X[:, 0] += -2.0 * NormalDist().inv_cdf(share / 2) * y
    return X.astype(np.float32), y


def blobs15(n: int, seed: int, spread: float, k: int = 15, gap: float = 1.1, box: float = 8.0) -> Data:
    """``k`` Gaussians in 2-D as in the S sets of Fränti & Virmajoki (2006): centres uniform in
    [0, ``box``]^2 (the box widened by 5 % where a fresh draw finds no centres >= ``gap``
    apart in 1,000 tries), each covariance A Aᵀ + 0.3 I (A standard normal, 2 x 2) scaled to
    the geometric mean standard deviation ``spread``; sizes multinomial with equal shares."""
    rng = np.random.default_rng(seed)
    tries = 0
    while _min_gap(centres := rng.uniform(0.0, box, size=(k, 2))) < gap:
        tries += 1
        if tries % 1000 == 0:
            box *= 1.05
    sizes = rng.multinomial(n, np.full(k, 1.0 / k))
    parts = []
    for centre, size in zip(centres, sizes, strict=True):
        a = rng.normal(size=(2, 2))
        cov = a @ a.T + 0.3 * np.eye(2)
        cov *= spread**2 / np.sqrt(np.linalg.det(cov))
        parts.append(rng.multivariate_normal(centre, cov, size))
    y = np.repeat(np.arange(k), sizes)
    return np.vstack(parts).astype(np.float32), y


def table(name: str, n: int | None, seed: int) -> Data:
    """k_suite's set ``name`` at its own N (``n`` ignored)."""
    X, y, _ = make_datasets()[name](seed)
    return X.astype(np.float32), np.asarray(y)


TABLES = {"wine-raw": "real", "breast-cancer-raw": "real", "digits-raw": "real",
          "table-degenerate": "separated", "table-mixed-units": "separated",
          "table-classification": "separated"}
FAMILIES: dict[str, Family] = {
    **{name: Family(K_VS_N[name][0], DEFAULT_N, "separated")
       for name in ("student", "curved", "sphere", "umap", "n2d")},
    "grid100": Family(grid100, (100_000,), "separated"),
    "curve100": Family(curve100, (100_000,), "separated"),
    "worms35-2d": Family(worms, (100_000,), "separated"),
    "worms35-64d": Family(partial(worms, dim=64), (100_000,), "separated"),
    "blobs200-32d": Family(blobs, (20_000,), "separated"),
    "sphere-1000": Family(K_VS_N["sphere-1000"][0], (200_000,), "separated"),
    **{f"overlap{pct}-{dim}d": Family(partial(overlap, share=pct / 100, dim=dim), (2048,), "overlap")
       for pct in (10, 30, 50) for dim in (2, 16, 128)},
    **{f"blobs15-2d-{name}": Family(partial(blobs15, spread=spread), (5000,), "separated")
       for name, spread in (("s2", 0.4), ("s3", 0.55), ("s4", 0.7))},
    **{name: Family(partial(table, name), (None,), kind) for name, kind in TABLES.items()},
}


# -------------------------------------------------------------------------------- methods
def bgm_components(n: int, k: int) -> int:
    """BGM-DP's components at N = ``n`` and true K = ``k``: max(20, min(2k, k + 100)), at most max(k, n / 5)."""
    return min(max(20, min(2 * k, k + 100)), max(k, n // 5))


def bgm_dp(X: np.ndarray, k: int, seed: int, max_seconds: float) -> tuple[np.ndarray, dict]:
    """BGM-DP (module docstring) in warm-started chunks of ``BGM_CHUNK`` iterations, the same
    EM path as one fit, stopped after ``max_seconds``; labels and its iterations."""
    components = bgm_components(len(X), k)
    model = BayesianGaussianMixture(
        n_components=components, weight_concentration_prior_type="dirichlet_process",
        covariance_type="full", max_iter=BGM_CHUNK, warm_start=True, random_state=seed)
    start, iterations = time.perf_counter(), 0
    while True:
        labels = model.fit_predict(X)
        iterations += model.n_iter_
        extra = {"components": components, "iterations": iterations}
        if model.converged_ or iterations >= BGM_MAX_ITER:
            return labels, extra
        if time.perf_counter() - start > max_seconds:
            return labels, {**extra, "stopped": f"{max_seconds:.0f} s"}


def gmm_bic(X: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, dict]:
    """GaussianMixture (full, n_init=1) at K = 1..2k; the labels of the lowest BIC, every BIC."""
    fits = [GaussianMixture(j, covariance_type="full", random_state=seed).fit(X) for j in range(1, 2 * k + 1)]
    bics = [float(m.bic(X)) for m in fits]
    return fits[int(np.argmin(bics))].predict(X), {"bic": bics}


def start_clusters(start: str, true_k: int) -> int | str:
    """``init.n_clusters`` of the start named ``start`` (:data:`STARTS`)."""
    return {"default": "auto", "10": 10, "3k": 3 * true_k}[start]


def objective(X: np.ndarray, labels: np.ndarray, overrides: dict) -> float:
    """The model's score of the partition ``labels``: ln p(X, z) with the prior fitted to it
    (:func:`~deepdpm_core.bayes.partition_evidence`), under the fit's config."""
    config = DeepDPM(**overrides).get_config()
    return float(partition_evidence(X, labels, config).log_joint)


def deepdpm(X: np.ndarray, seed: int, overrides: dict, init_clusters: int | str) -> tuple[np.ndarray, dict]:
    """DeepDPM's labels from ``init_clusters`` initial clusters, epochs, K after each change
    (``k_path``), ``n_components_`` if any and the objective of its partition."""
    model = DeepDPM(random_state=seed, **{**overrides, "init__n_clusters": init_clusters}).fit(X)
    ks = [h["n_clusters"] for h in model.history_]
    extra = {"epochs": len(ks), "k_path": [k for i, k in enumerate(ks) if i == 0 or k != ks[i - 1]],
             "initial_k": ks[0] if ks else None}
    if getattr(model, "n_components_", None) is not None:
        extra["n_components"] = int(model.n_components_)
    return model.labels_, extra


def run_methods(X: np.ndarray, y: np.ndarray, seed: int, overrides: dict, args: argparse.Namespace):
    """Yield one record per method on (X, y) as each finishes: ``k``,
    ``nmi``, ``ari``, ``seconds`` and extras, or ``skipped`` / ``error`` (and no scores).
    DeepDPM gives one record per start of ``args.starts`` (``start``, ``log_joint``); the
    true classes one record (``log_joint``, no fit)."""
    n, d = X.shape
    k = len(np.unique(y))
    bgm_cost = n * bgm_components(n, k) * (d * d + 2000)
    fits = {
        **{("DeepDPM", start): partial(deepdpm, X, seed, overrides, start_clusters(start, k))
           for start in args.starts},
        "k-means (true K)": lambda: (faiss_kmeans(X, k, seed) if k > 100 else
                                     KMeans(k, n_init=3, random_state=seed).fit_predict(X), {}),
        "BGM-DP": lambda: bgm_dp(X, k, seed, args.bgm_max_seconds),
        "HDBSCAN": lambda: (HDBSCAN(min_cluster_size=max(5, n // (20 * k)), copy=True).fit_predict(X),
                            {"min_cluster_size": max(5, n // (20 * k))}),
        "GMM-BIC": lambda: gmm_bic(X, k, seed),
    }
    skip = {"BGM-DP": bgm_cost > args.bgm_max_cost and f"cost {bgm_cost:.1e} > {args.bgm_max_cost:.0e}",
            "HDBSCAN": (n > args.hdbscan_max_n and f"N > {args.hdbscan_max_n}") or (
                n * n * d > args.hdbscan_max_cost and f"N^2 D {n * n * d:.1e} > {args.hdbscan_max_cost:.0e}"),
            "GMM-BIC": k > 5 and "true K > 5"}
    yield {"method": "true classes", "k": k, "nmi": 1.0, "ari": 1.0, "seconds": 0.0,
           "log_joint": objective(X, y, overrides)}
    for key, fit in fits.items():
        method, start = key if isinstance(key, tuple) else (key, None)
        named = {"method": method, **({"start": start} if start else {})}
        if skip.get(method):
            yield {**named, "k": None, "nmi": None, "ari": None, "seconds": None, "skipped": skip[method]}
            continue
        start_time = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                labels, extra = fit()
            seconds = time.perf_counter() - start_time
        except Exception as exc:  # one failed fit is one result of the battery
            yield {**named, "k": None, "nmi": None, "ari": None,
                   "seconds": time.perf_counter() - start_time, "error": f"{type(exc).__name__}: {exc}"}
            continue
        labels = np.asarray(labels)
        scores = clustering_scores(y, labels)
        record = {**named, "k": len(np.unique(labels[labels != NOISE])), "nmi": scores["nmi"],
                  "ari": scores["ari"], "seconds": seconds, **extra}
        if method == "DeepDPM":
            record["log_joint"] = objective(X, labels, overrides)
        if method == "HDBSCAN":
            record["noise"] = float(np.mean(labels == NOISE))
        yield record


# --------------------------------------------------------------------------------- report
def _ran(rows: list[dict], method: str, start: str | None = None) -> list[dict]:
    """The records of ``method`` that have a K, in seed order (``--jobs`` workers finish in
    any order); DeepDPM's of one start only (``start``, or the first start of the records)."""
    ran = [r for r in rows if r["method"] == method and r["k"] is not None]
    if method == "DeepDPM":
        ran = [r for r in ran if r.get("start", "default") == (start or _first_start(rows))]
    return sorted(ran, key=lambda r: r["seed"])


def _first_start(rows: list[dict]) -> str | None:
    """The start of the first DeepDPM record: the one the targets are judged on."""
    return next((r.get("start", "default") for r in rows if r["method"] == "DeepDPM"), None)


def verdict(kind: str, true_k: int, rows: list[dict]) -> str:
    """DeepDPM's targets (module docstring) on the records of one (family, N), from its
    first start."""
    first, seeds = _first_start(rows), len({r["seed"] for r in rows})
    fits = [r for r in rows if r["method"] == "DeepDPM" and r.get("start", "default") == first]
    ours = [r for r in fits if r["k"] is not None]
    if not ours:
        return "NO: DeepDPM failed"
    ks = [r["k"] for r in fits]  # an error (K None) misses every target
    if kind == "overlap":
        bic = [r["k"] for r in _ran(rows, "GMM-BIC")]
        picks = "/".join(map(str, bic)) or "—"
        if 2 * sum(b == true_k for b in bic) <= len(bic):
            return f"BIC picks {picks}: no target"
        hits, need = sum(k == true_k for k in ks), math.ceil(2 * seeds / 3)
        return f"{'yes' if hits >= need else 'NO'}: true K at {hits} of {seeds} seeds (BIC {picks})"
    tol = k_tolerance(true_k)
    k_ok = kind == "real" or all(k is not None and abs(k - true_k) <= tol for k in ks)
    km = _ran(rows, "k-means (true K)")
    margin = np.mean([r["nmi"] for r in ours]) - (np.mean([r["nmi"] for r in km]) if km else 0.0)
    ok = k_ok and margin >= -0.02 and len(ours) == len(fits)
    k_part = "" if kind == "real" else f"K ±{tol} {'ok' if k_ok else 'FAIL'}; "
    return f"{'yes' if ok else 'NO'}: {k_part}NMI vs k-means {margin:+.3f}"


def _cells(rows: list[dict], method: str, k_col: bool = True) -> list[str]:
    """K (mean and per seed; ``*`` a BGM stopped at the time limit), NMI, seconds."""
    ran = _ran(rows, method)
    if not ran:
        return ["—"] * (3 if k_col else 2)
    ks = "/".join(f"{r['k']}{'*' if r.get('stopped') else ''}" for r in ran)
    k_cell = f"{np.mean([r['k'] for r in ran]):.1f} ({ks})"
    if method == "HDBSCAN":
        k_cell += f", {100 * np.mean([r['noise'] for r in ran]):.0f} % noise"
    cells = [f"{np.mean([r['nmi'] for r in ran]):.3f}", f"{np.mean([r['seconds'] for r in ran]):.1f}"]
    return [k_cell, *cells] if k_col else cells


def report_table(records: list[dict]) -> str:
    """One row per (family, N): each method's K, NMI and seconds, BIC's K and the verdict."""
    lines = ["| family | N | D | true K | DeepDPM K | NMI | s | k-means NMI | s | BGM-DP K | NMI | s "
             "| HDBSCAN K | NMI | s | BIC K | DeepDPM targets |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---|---|"]
    keys = list(dict.fromkeys((r["family"], r["n"]) for r in records))
    passed = 0
    for family, n in keys:
        rows = [r for r in records if (r["family"], r["n"]) == (family, n)]
        true_k = rows[0]["true_k"]
        note = verdict(FAMILIES[family].kind, true_k, rows)
        passed += note.startswith("yes")
        if family in ("umap", "n2d"):
            note += " (true K = classes; the layout's groups are the reader's count)"
        bic = "/".join(str(r["k"]) for r in _ran(rows, "GMM-BIC")) or "—"
        cells = [*_cells(rows, "DeepDPM"), *_cells(rows, "k-means (true K)", k_col=False),
                 *_cells(rows, "BGM-DP"), *_cells(rows, "HDBSCAN"), bic, note]
        lines.append(f"| {family} | {n} | {rows[0]['d']} | {true_k} | " + " | ".join(cells) + " |")
    lines.append(f"\nDeepDPM's targets hold on {passed} of {len(keys)} (family, N) rows; "
                 "* = BGM stopped at its time limit.")
    notes = dict.fromkeys(f"{r['method']} at {r['family']} N {r['n']}: {r.get('skipped') or r.get('error')}"
                          for r in records if r["k"] is None and r.get("skipped") != "true K > 5")
    if notes:
        lines.append("Not run or failed: " + "; ".join(notes) + ".")
    key = ("family", "n", "seed")
    bgm = {tuple(r[x] for x in key): r["seconds"] for r in _ran(records, "BGM-DP")}
    pairs = [(r["seconds"], bgm[tuple(r[x] for x in key)]) for r in _ran(records, "DeepDPM")
             if tuple(r[x] for x in key) in bgm]
    total = sum(r["seconds"] or 0.0 for r in records)
    ratio = (f"{sum(p[0] for p in pairs) / sum(p[1] for p in pairs):.2f} over the {len(pairs)} fits "
             "where BGM ran" if pairs else "— (BGM ran nowhere)")
    lines.append(f"Total fit seconds {total:.0f}; DeepDPM / BGM-DP seconds {ratio}.")
    return "\n".join(lines)


def start_table(records: list[dict]) -> str:
    """One row per (family, N) with DeepDPM from more than one start: each start's K (per
    seed), mean NMI, mean seconds and mean ln p(X, z) minus the true classes' (nats; > 0: the
    model prefers the fit's partition, < 0: the search stopped short of the classes), and
    whether the starts end within max(1, 10 %) of the true K of each other at every seed."""
    starts = list(dict.fromkeys(r["start"] for r in records if r["method"] == "DeepDPM"))
    if len(starts) < 2:
        return ""
    head = "".join(f" {s}: K | NMI | s | Δ ln p |" for s in starts)
    lines = ["| family | N | true K |" + head + " starts agree |",
             "|---|---:|---:|" + "---|---:|---:|---:|" * len(starts) + "---|"]
    keys = list(dict.fromkeys((r["family"], r["n"]) for r in records))
    agree = 0
    for family, n in keys:
        rows = [r for r in records if (r["family"], r["n"]) == (family, n)]
        truth = {r["seed"]: r["log_joint"] for r in rows if r["method"] == "true classes"}
        true_k, cells, by_seed = rows[0]["true_k"], [], {}
        for start in starts:
            ran = _ran(rows, "DeepDPM", start)
            for r in ran:
                by_seed.setdefault(r["seed"], []).append(r["k"])
            if not ran:
                cells += ["—"] * 4
                continue
            gaps = [r["log_joint"] - truth[r["seed"]] for r in ran if r["seed"] in truth]
            cells += ["/".join(str(r["k"]) for r in ran), f"{np.mean([r['nmi'] for r in ran]):.3f}",
                      f"{np.mean([r['seconds'] for r in ran]):.1f}", f"{np.mean(gaps):+.0f}" if gaps else "—"]
        tol = k_tolerance(true_k)
        ok = bool(by_seed) and all(len(ks) == len(starts) and max(ks) - min(ks) <= tol for ks in by_seed.values())
        agree += ok
        lines.append(f"| {family} | {n} | {true_k} | " + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |")
    lines.append(f"\nThe starts agree on {agree} of {len(keys)} (family, N) rows (K within ±max(1, 10 %) of "
                 "the true K of each other at every seed); Δ ln p: the fit's ln p(X, z) minus the true "
                 "classes', each with the prior fitted to it.")
    return "\n".join(lines)


def _stop(signum: int, frame: object) -> None:
    """SIGTERM handler: stop like Ctrl-C, so the finished records are still reported."""
    raise KeyboardInterrupt


def family_ns(name: str, args: argparse.Namespace) -> tuple[int | None, ...]:
    """The Ns a family runs at: its own, ``--n``, or with ``--quick`` its :data:`QUICK_N`."""
    family = FAMILIES[name]
    ns = family.ns if family.ns == (None,) or args.n is None else tuple(args.n)
    return (QUICK_N.get(name, ns[0]),) if args.quick else ns


def run_task(name: str, n: int | None, seed: int, overrides: dict, args: argparse.Namespace) -> list[dict]:
    """Every method's record on one (family, N, seed), progress on stderr as each finishes."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    set_constants(args.constants)  # in this process: a worker starts from the modules' own values
    X, y = FAMILIES[name].make(n, seed)
    base = {"family": name, "n": len(X), "d": X.shape[1], "true_k": len(np.unique(y)), "seed": seed}
    records = []
    for rec in run_methods(X, y, seed, overrides, args):
        records.append({**base, **rec})
        status = (f"K {rec['k']:4d} NMI {rec['nmi']:.3f} {rec['seconds']:7.1f} s"
                  if rec["k"] is not None else rec.get("skipped") or rec.get("error"))
        if "log_joint" in rec:
            status += f" ln p {rec['log_joint']:.1f}"
        method = rec["method"] + (f" from {rec['start']}" if "start" in rec else "")
        print(f"{name} N {len(X)} seed {seed} {method:22s} {status}", file=sys.stderr, flush=True)
    return records


def _each_task(tasks: list[tuple[str, int | None, int]], overrides: dict, args: argparse.Namespace):
    """Yield each task's records: in this process, or ``args.jobs`` at a time in worker
    processes (in the order they finish)."""
    if args.jobs <= 1:
        for task in tasks:
            yield run_task(*task, overrides, args)
        return
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_task, *task, overrides, args) for task in tasks]
        try:
            for future in as_completed(futures):
                yield future.result()
        except KeyboardInterrupt:
            for future in futures:
                future.cancel()
            raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["*"], metavar="NAME|GLOB")
    parser.add_argument("--n", nargs="+", type=int, default=None,
                        help="Ns for every family but the tables (default: each family's own)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default 0 1 2 (0 with --quick)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for DeepDPM only, e.g. prior.coarsening=null")
    parser.add_argument("--constant", nargs="*", default=[], metavar="deepdpm_core.MODULE.NAME=VALUE",
                        help="an ablation: a calibrated module constant set for DeepDPM (bench/constants.py), "
                             "e.g. deepdpm_core.moves.density_valleys.MERGE_VALLEY=1.01")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    parser.add_argument("--bgm-max-cost", type=float, default=5e10,
                        help="run BGM-DP only where N x components x (D^2 + 2000) is at most this")
    parser.add_argument("--bgm-max-seconds", type=float, default=600.0,
                        help="stop BGM-DP after this many seconds (its cell marked *)")
    parser.add_argument("--hdbscan-max-n", type=int, default=100_000)
    parser.add_argument("--hdbscan-max-cost", type=float, default=1e11,
                        help="run HDBSCAN only where N^2 x D is at most this")
    parser.add_argument("--starts", nargs="+", choices=STARTS, default=None,
                        help="DeepDPM's initial clusters, one fit each: init.n_clusters auto, 10, 3 x the "
                             "true K (default: default; all three with --quick)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="families run at a time, each in its own process (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="every family at its most telling size (QUICK_N), seed 0, the three starts, "
                             f"BGM stopped after {QUICK_BGM_SECONDS:.0f} s, HDBSCAN up to N^2 D = {QUICK_HDBSCAN_COST:.0e}")
    args = parser.parse_args(argv)
    args.starts = args.starts or (list(STARTS) if args.quick else ["default"])
    if args.quick:
        args.bgm_max_seconds = min(args.bgm_max_seconds, QUICK_BGM_SECONDS)
        args.hdbscan_max_cost = min(args.hdbscan_max_cost, QUICK_HDBSCAN_COST)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    overrides = checked_overrides(parser, args.set)
    try:
        args.constants = parse_constants(args.constant)
    except ValueError as err:
        parser.error(str(err))
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    names = select(FAMILIES, args.families)
    report = {"command": shlex.join(["python", *(sys.argv if argv is None else [__file__, *argv])]),
              "threads": torch.get_num_threads(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "overrides": overrides, "constants": args.constants, "seeds": seeds, "starts": args.starts,
              "quick": args.quick,
              "complete": False,
              "options": {k: getattr(args, k) for k in ("bgm_max_cost", "bgm_max_seconds",
                                                        "hdbscan_max_n", "hdbscan_max_cost")},
              "records": []}
    start = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)
    tasks = [(name, n, seed) for name in names if not (args.quick and name in QUICK_SKIPS)
             for n in family_ns(name, args) for seed in seeds]
    try:
        for records in _each_task(tasks, overrides, args):
            report["records"].extend(records)
            if args.json:
                write_json_atomic(report, args.json)
        report["complete"] = True
    except KeyboardInterrupt:
        print("stopped: reporting the records so far", file=sys.stderr)
    report["wall_seconds"] = time.perf_counter() - start
    # what a busy machine does not inflate; the --jobs workers are counted once they have ended
    report["cpu_seconds"] = sum(u.ru_utime + u.ru_stime for u in (
        resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))
    if args.json:
        write_json_atomic(report, args.json)
    print(f"seeds {' '.join(map(str, seeds))}; DeepDPM defaults"
          f"{' with ' + ' '.join(args.set + args.constant) if args.set or args.constant else ''}; "
          f"{torch.get_num_threads()} torch "
          f"thread(s); wall {report['wall_seconds']:.0f} s, CPU {report['cpu_seconds']:.0f} s\n")
    print(report_table(report["records"]))
    starts = start_table(report["records"])
    if starts:
        print(f"\nDeepDPM from each start ({', '.join(args.starts)}):\n\n{starts}")
    if not report["complete"]:
        print("\nSTOPPED EARLY: the table holds the records finished before the stop.")
    return 0 if report["complete"] else 130


if __name__ == "__main__":
    sys.exit(main())
