"""Search failure or model preference: the fit's partition beside peers' hard partitions.

``partition_evidence`` scores any partition by the model's own ln p(X, z) (the prior fitted
to it). Against the true classes alone, a fit that scores higher looks like the model's
choice; but the classes of overlapping clusters are no hard partition the model could
prefer. Here, for each family of ``bench/k_battery.py`` (seed ``--seed``, its quick-battery
N), the hard partitions of scikit-learn's ``GaussianMixture`` (full, ``n_init=2``) with
K = 2 .. 2·true K components (those it can fit) are scored too: where one scores above
DeepDPM's own partition (``DeepDPM(random_state=seed)``) by more than :data:`MARGIN_NATS`,
the search stopped short of what its model prefers. Δ ln p is each partition's score minus
the classes'; BIC is the mixture's.

Each mixture's responsibilities r (N, K) are also scored softly (:func:`soft_score`): ln p(X, z)
at their expected statistics (n_k = Σ_i r_ik, and the weighted sums), the prior fitted to them,
plus their entropy H(r) = −Σ r ln r, the zeroth-order collapsed variational approximation of
ln p(X) (Teh, Newman & Welling, NeurIPS 2007). A hard partition scores the same either way; two
overlapping clusters pay, in the hard score, for the labels of the rows they share, which the
soft score gives back as entropy. "Soft K" is the peer with the highest soft score.

    OMP_NUM_THREADS=1 python bench/peer_partitions.py --families 'blobs15*' overlap30-2d table-degenerate wine-raw \\
        breast-cancer-raw digits-raw table-classification n2d umap curved --json bench/results/peer_partitions.json

The Markdown table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.special import xlogy
from sklearn.mixture import GaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from k_battery import FAMILIES, QUICK_N, objective  # noqa: E402

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.bayes.partition_evidence import weighted_evidence  # noqa: E402
from deepdpm_core.config import Config  # noqa: E402
from deepdpm_core.data import nmi  # noqa: E402

#: a peer's partition must score this much more than the fit's to show a search failure: the
#: same partition found by both scores alike up to rounding ("positive" evidence, 2 ln B > 2)
MARGIN_NATS = 1.0


def soft_score(X: np.ndarray, resp: np.ndarray) -> float:
    """ln p(X, z) at the expected statistics of the responsibilities ``resp`` (N, K), the prior
    fitted to them as :func:`~deepdpm_core.bayes.partition_evidence` fits it, plus H(resp)
    (module docstring). Components holding less than one row's mass are left out: ln Γ(n_k)
    of the partition prior grows without bound as n_k falls below 1."""
    resp = resp[:, resp.sum(0) >= 1.0]
    point, group = np.nonzero(resp > 0)
    joint = weighted_evidence(torch.as_tensor(np.asarray(X), dtype=torch.float64), point, group,
                              resp[point, group], Config()).log_joint
    return joint - float(xlogy(resp, resp).sum())


def compare(name: str, seed: int) -> dict:
    """DeepDPM's partition and ``GaussianMixture``'s of 2 .. 2K components on ``name``."""
    family = FAMILIES[name]
    X, y = family.make(QUICK_N.get(name, family.ns[0]), seed)
    true_k = len(np.unique(y))
    classes = objective(X, y, {})

    def delta(labels: np.ndarray) -> float:
        return objective(X, labels, {}) - classes

    fit = DeepDPM(random_state=seed).fit(X)
    peers = []
    for k in range(2, 2 * true_k + 1):
        try:
            gmm = GaussianMixture(k, n_init=2, random_state=seed).fit(X)
        except ValueError as err:  # a component's covariance collapsed (constant columns, few rows)
            peers.append({"k": k, "error": str(err).split(" because ")[0]})
            continue
        labels = gmm.predict(X)
        peers.append({"k": k, "delta_log_p": delta(labels), "soft_delta_log_p": soft_score(X, gmm.predict_proba(X)) - classes,
                      "bic": float(gmm.bic(X)), "nmi": nmi(y, labels)})
        print(f"{name} GaussianMixture K {k}: delta ln p {peers[-1]['delta_log_p']:.0f}", file=sys.stderr)
    return {"family": name, "n": len(y), "seed": seed, "true_k": true_k,
            "deepdpm": {"k": int(len(np.unique(fit.labels_))), "delta_log_p": delta(fit.labels_),
                        "nmi": nmi(y, fit.labels_)},
            "peers": peers}


def table(records: list[dict]) -> str:
    """One row per family: DeepDPM's K, Δ ln p and NMI; the best-scoring peer partition's; BIC's K."""
    lines = ["| family | true K | DeepDPM K, Δ ln p, NMI | best GaussianMixture partition: K, Δ ln p, NMI | BIC K "
             "| soft K | verdict |",
             "|---|---:|---|---|---:|---:|---|"]
    for r in records:
        fitted = [p for p in r["peers"] if "error" not in p]
        own = r["deepdpm"]
        cells = [r["family"], str(r["true_k"]), f"{own['k']}, {own['delta_log_p']:+,.0f}, {own['nmi']:.3f}"]
        if fitted:
            best = max(fitted, key=lambda p: p["delta_log_p"])
            stopped = best["delta_log_p"] > own["delta_log_p"] + MARGIN_NATS
            cells += [f"{best['k']}, {best['delta_log_p']:+,.0f}, {best['nmi']:.3f}",
                      str(min(fitted, key=lambda p: p["bic"])["k"]),
                      str(max(fitted, key=lambda p: p["soft_delta_log_p"])["k"]),
                      "search stopped short" if stopped else "model's choice"]
        else:
            cells += ["— (no mixture fitted)", "—", "—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["blobs15*"], help="names or patterns of k_battery's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    names = [n for n in FAMILIES if any(fnmatch.fnmatch(n, p) for p in args.families)]
    records = [compare(name, args.seed) for name in names]
    print(table(records))
    if args.json:
        command = "python bench/peer_partitions.py " + " ".join(map(shlex.quote, argv or sys.argv[1:]))
        args.json.write_text(json.dumps({"command": command, "records": records}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
