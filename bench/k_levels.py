"""Components, then clusters: which level of a merge hierarchy each objective picks.

For each family of ``bench/k_battery.py`` (seed 0, its ``--n``): M = max(20, N / 50) k-means
components in the fit's coordinates, the prior fitted to them (``fitted_log_joint``) and held,
then the greedy hierarchy of :func:`~deepdpm_core.bayes.merge_levels.merge_levels`: at each
step the pair (each group with its 8 nearest means) whose merge raises ln p(X, z) most, down to
one group. Every level is scored by

* the exact joint ln p(X, z) (the model's own score, ``partition_evidence``), and
* the coarsened joint for c on a grid of 41 values from 10 to 10^6: the statistics and the
  counts of every group scaled by ζ = c/(c + N) (Miller & Dunson's coarsening, one ζ for the
  whole partition, as the fit's growth scores partitions).

The table gives the true K, the NMI of the hierarchy's level of the true K (is the truth in
the hierarchy at all?), the level the exact joint picks, the one c = 500 picks, and the level
that stays best over the longest run of ln c (its persistence, as HDBSCAN's excess of mass
picks clusters), counted over the c where every group keeps at least one point after
scaling (ζ N ≥ M), and the elbow of the exact joint against K (Miller & Dunson's
calibration read on the hierarchy, :func:`~deepdpm_core.bayes.merge_levels.elbow_level`). A
family whose truth is in the hierarchy and whose picks miss it needs another objective, not
another search.

    OMP_NUM_THREADS=1 python bench/k_levels.py --families grid100 worms35-2d curved student \\
        overlap30-2d --n 20000 --json bench/results/k_levels.json

The Markdown table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k_battery import FAMILIES, QUICK_N  # noqa: E402
from k_suite import select  # noqa: E402
from k_vs_n import faiss_kmeans  # noqa: E402

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.bayes import (  # noqa: E402
    MergeLevels,
    NIWPrior,
    PriorFit,
    SuffStats,
    elbow_level,
    fitted_log_joint,
    grouped_stats,
    log_crp,
    log_marginal_likelihood,
    merge_levels,
)
from deepdpm_core.bayes.merge_levels import NEIGHBOURS  # noqa: E402
from deepdpm_core.config import Config  # noqa: E402
from deepdpm_core.data import clustering_scores, fit_coordinates  # noqa: E402
from deepdpm_core.runtime import LocalCommunicator  # noqa: E402

#: the coarsening constants scored
C_GRID = np.geomspace(10.0, 1e6, 41)


def components(X: np.ndarray, m: int, seed: int) -> tuple[SuffStats, np.ndarray, NIWPrior, float]:
    """``m`` k-means components of X in the fit's coordinates: their statistics, each row's
    component and the prior fitted to them (with α)."""
    config = Config()
    x = torch.as_tensor(X, dtype=torch.float64)
    coords, _, _ = fit_coordinates(x, config.data, LocalCommunicator(), torch.device("cpu"))
    xt = coords.apply(x)
    label = faiss_kmeans(xt.numpy().astype(np.float32), m, seed)
    stats = grouped_stats(xt, torch.arange(len(xt)), torch.as_tensor(label),
                          torch.ones(len(xt), dtype=torch.float64), m)
    keep = torch.nonzero(stats.n > 0).squeeze(1)
    label = np.searchsorted(keep.numpy(), label)
    stats = stats.rows(keep)
    prior_fit = PriorFit(config.prior, coords, torch.device("cpu"))
    fitted_log_joint(stats, prior_fit, config.prior.alpha)
    return stats, label, prior_fit.prior, config.prior.alpha


def coarsened_joints(stats: SuffStats, levels: MergeLevels, prior: NIWPrior, alpha: float,
                     zetas: np.ndarray) -> np.ndarray:
    """ln p(X, z) of every level with the statistics and counts scaled by each ζ, (Z, M):
    the first level's, then each merge's change (only the union's ln f is new)."""
    z = torch.as_tensor(zetas, dtype=torch.float64)[:, None]
    n, s1, s2 = stats.n.clone(), stats.s1.clone(), stats.s2.clone()
    unions = []
    for a, b in levels.merges:
        n[a], s1[a], s2[a] = n[a] + n[b], s1[a] + s1[b], s2[a] + s2[b]
        unions.append((float(n[a]), s1[a].clone(), s2[a].clone()))

    def scaled_marginals(st: SuffStats) -> torch.Tensor:  # (Z, R)
        return torch.stack([log_marginal_likelihood(prior, st.scaled(torch.full_like(st.n, float(f)))) for f in z])

    current = scaled_marginals(stats)
    union_n = torch.tensor([u[0] for u in unions], dtype=torch.float64)
    joined = scaled_marginals(SuffStats(union_n, torch.stack([u[1] for u in unions]),
                                        torch.stack([u[2] for u in unions]))) if unions else current[:, :0]
    counts = stats.n.clone()
    out = torch.empty(len(zetas), stats.n_rows, dtype=torch.float64)
    out[:, 0] = torch.tensor([log_crp((f * counts).numpy(), alpha) for f in z[:, 0]]) + current.sum(1)
    for t, (a, b) in enumerate(levels.merges):
        na, nb = z[:, 0] * counts[a], z[:, 0] * counts[b]
        out[:, t + 1] = (out[:, t] + joined[:, t] - current[:, a] - current[:, b] - math.log(alpha)
                         + torch.lgamma(na + nb) - torch.lgamma(na) - torch.lgamma(nb))
        current[:, a] = joined[:, t]
        counts[a] += counts[b]
    return out.numpy()


def fitted(X: np.ndarray, y: np.ndarray, seed: int, init_labels: np.ndarray | None = None) -> dict:
    """K, NMI and seconds of ``DeepDPM(random_state=seed)`` on X, from its default start or
    from ``init_labels``."""
    start = time.perf_counter()
    model = DeepDPM(random_state=seed).fit(X, init_labels=init_labels)
    return {"k": int(model.n_clusters_), "nmi": float(clustering_scores(y, model.predict(X))["nmi"]),
            "seconds": time.perf_counter() - start}


def run(name: str, n: int | None, seed: int, fit: bool = False) -> dict:
    """The hierarchy of one family and each objective's level (module docstring); with
    ``fit``, DeepDPM's fit from its default start and from the elbow's partition."""
    start = time.perf_counter()
    X, y = FAMILIES[name].make(n, seed)
    big_n, true_k = len(X), len(np.unique(y))
    m = min(max(20, big_n // 50), big_n // 2)
    stats, label, prior, alpha = components(X, m, seed)
    levels = merge_levels(stats, prior, alpha, NEIGHBOURS)
    ks = [int(k) for k in levels.n_groups]
    exact = levels.log_joint
    scores = coarsened_joints(stats, levels, prior, alpha, C_GRID / (C_GRID + big_n))
    picks = {float(c): ks[int(np.argmax(row))] for c, row in zip(C_GRID, scores, strict=True)}
    runs: dict[int, int] = {}
    for c, k in picks.items():
        if c / (c + big_n) * big_n >= ks[0]:  # every group keeps a point after scaling
            runs[k] = runs.get(k, 0) + 1
    persistent = max(runs, key=runs.get) if runs else None
    elbow = elbow_level(levels.n_groups, exact)

    def nmi_at(k: int) -> float:
        return float(clustering_scores(y, levels.labels(k)[label])["nmi"])

    c500 = picks[float(C_GRID[np.abs(C_GRID - 500.0).argmin()])]
    fits = {"default": fitted(X, y, seed), "elbow": fitted(X, y, seed, levels.labels(elbow)[label])} if fit else {}
    return {"fits": fits, "family": name, "n": big_n, "d": X.shape[1], "true_k": true_k, "components": ks[0],
            "nmi_at_true_k": nmi_at(true_k) if true_k in ks else None,
            "exact_k": ks[int(np.argmax(exact))], "c500_k": c500, "persistent_k": persistent,
            "persistent_nmi": nmi_at(persistent) if persistent else None,
            "elbow_k": elbow, "elbow_nmi": nmi_at(elbow),
            "persistence": sorted(runs.items(), key=lambda kv: -kv[1])[:5],
            "k_by_c": {f"{c:.3g}": k for c, k in picks.items()}, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["grid100", "worms35-2d", "curved", "student"],
                        metavar="NAME|GLOB")
    parser.add_argument("--n", type=int, default=20_000, help="rows (tables: their own N)")
    parser.add_argument("--quick", action="store_true",
                        help="each family at the quick battery's size (k_battery's QUICK_N), not --n")
    parser.add_argument("--fit", action="store_true",
                        help="also fit DeepDPM from its default start and from the elbow level's partition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    records = []
    for name in select(FAMILIES, args.families):
        n = None if FAMILIES[name].ns == (None,) else (2048 if name.startswith("overlap") else args.n)
        rec = run(name, QUICK_N.get(name, n) if args.quick else n, args.seed, args.fit)
        records.append(rec)
        print(f"{name}: true K {rec['true_k']}, exact {rec['exact_k']}, c=500 {rec['c500_k']}, "
              f"persistent {rec['persistent_k']}, elbow {rec['elbow_k']} ({rec['seconds']:.0f} s)", file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps({"command": shlex.join(["python", *sys.argv]), "records": records},
                                            indent=1) + "\n")
    print("| family | N | D | true K | components | NMI at true K | exact joint K | c = 500 K "
          "| persistent K (NMI) | elbow K (NMI) |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in records:
        at_true = f"{r['nmi_at_true_k']:.3f}" if r["nmi_at_true_k"] is not None else "—"
        pers = f"{r['persistent_k']} ({r['persistent_nmi']:.3f})" if r["persistent_k"] else "—"
        print(f"| {r['family']} | {r['n']} | {r['d']} | {r['true_k']} | {r['components']} | {at_true} "
              f"| {r['exact_k']} | {r['c500_k']} | {pers} | {r['elbow_k']} ({r['elbow_nmi']:.3f}) |")
    if args.fit:
        print("\n| family | N | true K | elbow K (NMI) | DeepDPM K, NMI, s | from the elbow: K, NMI, s |\n"
              "|---|---:|---:|---|---|---|")
        for r in records:
            cells = [f"{f['k']}, {f['nmi']:.3f}, {f['seconds']:.0f}" for f in (r["fits"]["default"], r["fits"]["elbow"])]
            print(f"| {r['family']} | {r['n']} | {r['true_k']} | {r['elbow_k']} ({r['elbow_nmi']:.3f}) | "
                  + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
