"""Components, then clusters: which level of a merge hierarchy each objective picks.

For each family of ``bench/k_battery.py`` (seed 0, its ``--n``): M = max(20, N / 50) k-means
components in the fit's coordinates, the prior fitted to them (``fitted_log_joint``) and held,
then a greedy hierarchy: at each step the pair (each group with its 8 nearest means) whose
merge raises ln p(X, z) most, down to one group. Every level is scored by

* the exact joint ln p(X, z) (the model's own score, ``partition_evidence``), and
* the coarsened joint for c on a grid of 41 values from 10 to 10^6: the statistics and the
  counts of every group scaled by ζ = c/(c + N) (Miller & Dunson's coarsening, one ζ for the
  whole partition, as the fit's growth scores partitions).

The table gives the true K, the NMI of the hierarchy's level of the true K (is the truth in
the hierarchy at all?), the level the exact joint picks, the one c = 500 picks, and the level
that stays best over the longest run of ln c (its persistence, as HDBSCAN's excess of mass
picks clusters), counted over the c where every group keeps at least one point after
scaling (ζ N ≥ M), and the elbow of the exact joint against K (Miller & Dunson's calibration
read on the hierarchy, :func:`elbow`). A family whose truth is in the hierarchy and whose
picks miss it needs another objective, not another search.

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

from k_battery import FAMILIES  # noqa: E402
from k_suite import select  # noqa: E402
from k_vs_n import faiss_kmeans  # noqa: E402

from deepdpm_core.bayes import (  # noqa: E402
    NIWPrior,
    PriorFit,
    SuffStats,
    fitted_log_joint,
    grouped_stats,
    log_crp,
    log_marginal_likelihood,
)
from deepdpm_core.config import Config  # noqa: E402
from deepdpm_core.data import clustering_scores, fit_coordinates  # noqa: E402
from deepdpm_core.runtime import LocalCommunicator  # noqa: E402

#: merge candidates of a group: its nearest means
NEIGHBOURS = 8
#: the coarsening constants scored
C_GRID = np.geomspace(10.0, 1e6, 41)
#: the elbow's floor on a gain per cluster, as a fraction of the mean gain per cluster from
#: one group to the exact joint's level: next to that level the gains fall to zero by
#: construction, so a ratio against them would measure nearness to it, not an elbow
ELBOW_FLOOR = 0.1


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


def hierarchy(stats: SuffStats, prior: NIWPrior, alpha: float) -> list[list[list[int]]]:
    """The greedy merge path (module docstring): the groups of components at each level,
    from M groups down to one."""
    n, s1, s2 = stats.n.clone(), stats.s1.clone(), stats.s2.clone()
    alive = list(range(stats.n_rows))
    groups = {a: [a] for a in alive}
    marginal = log_marginal_likelihood(prior, stats).clone()
    levels = [[list(groups[a]) for a in alive]]
    while len(alive) > 1:
        index = torch.tensor(alive)
        means = s1[index] / n[index, None]
        dist = torch.cdist(means, means).fill_diagonal_(math.inf)
        near = dist.topk(min(NEIGHBOURS, len(alive) - 1), largest=False).indices
        pairs = sorted({(min(i, int(j)), max(i, int(j))) for i in range(len(alive)) for j in near[i]})
        a = index[[p[0] for p in pairs]]
        b = index[[p[1] for p in pairs]]
        union = SuffStats(n[a] + n[b], s1[a] + s1[b], s2[a] + s2[b])
        joined = log_marginal_likelihood(prior, union)
        # the change of ln p(X, z): the merge's Hastings ratio (paper Eq. 2, inverted)
        gain = (joined - marginal[a] - marginal[b] - math.log(alpha)
                + torch.lgamma(n[a] + n[b]) - torch.lgamma(n[a]) - torch.lgamma(n[b]))
        best = int(gain.argmax())
        ka, kb = int(a[best]), int(b[best])
        n[ka], s1[ka], s2[ka], marginal[ka] = n[ka] + n[kb], s1[ka] + s1[kb], s2[ka] + s2[kb], joined[best]
        groups[ka] += groups.pop(kb)
        alive.remove(kb)
        levels.append([list(groups[g]) for g in alive])
    return levels


def level_stats(stats: SuffStats, level: list[list[int]]) -> SuffStats:
    """The statistics of the groups of one level."""
    to = torch.empty(stats.n_rows, dtype=torch.long)
    for g, members in enumerate(level):
        to[members] = g
    return stats.regrouped(to, len(level))


def joint(stats: SuffStats, prior: NIWPrior, alpha: float, zeta: float = 1.0) -> float:
    """ln p(X, z) of groups with statistics ``stats``, coarsened by ``zeta``."""
    scaled = stats if zeta == 1.0 else stats.scaled(torch.full_like(stats.n, zeta))
    return log_crp(scaled.n.numpy(), alpha) + float(log_marginal_likelihood(prior, scaled).sum())


def elbow(ks: list[int], scores: list[float]) -> int:
    """The level where the gain per added group falls most: on the upper concave hull of
    (K, ln p(X, z)), the vertex at or below the exact joint's level whose incoming slope
    over its outgoing one (in magnitude, floored at ``ELBOW_FLOOR`` × the mean slope up to
    that level) is largest; the exact joint's level when the hull has no inner vertex.

    Parameters
    ----------
    ks : list of int
        K of each level.
    scores : list of float
        ln p(X, z) of each level.
    """
    order = np.argsort(ks)
    k, s = np.asarray(ks, dtype=np.float64)[order], np.asarray(scores, dtype=np.float64)[order]
    best = int(np.argmax(s))
    hull: list[int] = []
    for i in range(len(k)):
        while len(hull) >= 2 and ((s[hull[-1]] - s[hull[-2]]) * (k[i] - k[hull[-2]])
                                  <= (s[i] - s[hull[-2]]) * (k[hull[-1]] - k[hull[-2]])):
            hull.pop()
        hull.append(i)
    slope = np.diff(s[hull]) / np.diff(k[hull])
    floor = ELBOW_FLOOR * (s[best] - s[0]) / max(k[best] - k[0], 1.0)
    ratios = [(slope[j - 1] / max(abs(slope[j]), floor), hull[j]) for j in range(1, len(hull) - 1)
              if k[hull[j]] <= k[best]]
    return int(k[max(ratios)[1]]) if ratios else int(k[best])


def run(name: str, n: int | None, seed: int) -> dict:
    """The hierarchy of one family and each objective's level (module docstring)."""
    start = time.perf_counter()
    X, y = FAMILIES[name].make(n, seed)
    big_n, true_k = len(X), len(np.unique(y))
    m = min(max(20, big_n // 50), big_n // 2)
    stats, label, prior, alpha = components(X, m, seed)
    levels = hierarchy(stats, prior, alpha)
    per_level = [level_stats(stats, lv) for lv in levels]
    ks = [len(lv) for lv in levels]
    exact = [joint(st, prior, alpha) for st in per_level]
    picks = {}
    for c in C_GRID:
        zeta = c / (c + big_n)
        picks[float(c)] = ks[int(np.argmax([joint(st, prior, alpha, zeta) for st in per_level]))]
    runs: dict[int, int] = {}
    for c, k in picks.items():
        if c / (c + big_n) * big_n >= len(levels[0]):  # every group keeps a point after scaling
            runs[k] = runs.get(k, 0) + 1
    persistent = max(runs, key=runs.get) if runs else None

    def nmi_at(k: int) -> float:
        level = levels[ks.index(k)]
        to = np.empty(len(levels[0]), dtype=np.int64)
        for g, members in enumerate(level):
            to[members] = g
        return float(clustering_scores(y, to[label])["nmi"])

    c500 = picks[float(C_GRID[np.abs(C_GRID - 500.0).argmin()])]
    return {"family": name, "n": big_n, "d": X.shape[1], "true_k": true_k, "components": len(levels[0]),
            "nmi_at_true_k": nmi_at(true_k) if true_k in ks else None,
            "exact_k": ks[int(np.argmax(exact))], "c500_k": c500, "persistent_k": persistent,
            "persistent_nmi": nmi_at(persistent) if persistent else None,
            "elbow_k": elbow(ks, exact), "elbow_nmi": nmi_at(elbow(ks, exact)),
            "persistence": sorted(runs.items(), key=lambda kv: -kv[1])[:5],
            "k_by_c": {f"{c:.3g}": k for c, k in picks.items()}, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["grid100", "worms35-2d", "curved", "student"],
                        metavar="NAME|GLOB")
    parser.add_argument("--n", type=int, default=20_000, help="rows (tables: their own N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    records = []
    for name in select(FAMILIES, args.families):
        n = None if FAMILIES[name].ns == (None,) else (2048 if name.startswith("overlap") else args.n)
        rec = run(name, n, args.seed)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
