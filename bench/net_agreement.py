"""The fitted net's labels against the fitted mixture's: what predictions lose to the net.

A fit's labels (``labels_``, ``predict``) come from the clustering net, fitted to the
mixture's responsibilities once K has settled. For each family of ``bench/k_battery.py`` at
its quick size, seed 0, one thread: ``DeepDPM(random_state=0)``, then K, the NMI against the
classes of the net's labels and of the mixture's MAP cluster of each row (the Gaussian
posterior under the fitted means, covariances and weights), the share of rows where the two
agree, the distillation's steps and the fit's seconds.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/net_agreement.py --jobs 2 \\
        --json bench/results/net_agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

#: the families measured: every quick-battery family whose fit ends in the net's distillation
FAMILIES = ("curve100", "grid100", "umap", "student", "curved", "sphere", "n2d", "worms35-2d", "worms35-64d",
            "blobs200-32d", "overlap10-2d", "overlap10-16d", "wine-raw", "breast-cancer-raw", "digits-raw",
            "table-degenerate", "table-mixed-units", "table-classification")


def measure(family: str) -> dict:
    """One fit of ``family`` at its quick size, seed 0 (module docstring)."""
    import k_battery
    import torch
    from sklearn.metrics import normalized_mutual_info_score as nmi

    from deepdpm_core import DeepDPM
    from deepdpm_core.estep.gmm import GaussianMixture

    spec = k_battery.FAMILIES[family]
    X, y = spec.make(k_battery.QUICK_N.get(family, spec.ns[0]), 0)
    start = time.perf_counter()
    model = DeepDPM(random_state=0).fit(X)
    seconds = time.perf_counter() - start
    fitted = model.model_
    rows = fitted.coords.apply(torch.from_numpy(np.asarray(X, dtype=np.float32))).to(fitted.means.dtype)
    mixture = GaussianMixture(fitted.means, fitted.covariances, fitted.log_weights)
    own = torch.cat([mixture.weighted_log_prob(b).argmax(1) for b in rows.split(8192)]).numpy()
    last = model.history_[-1]
    return {"family": family, "n": len(X), "k": int(model.n_clusters_), "nmi_net": float(nmi(y, model.labels_)),
            "nmi_mixture": float(nmi(y, own)), "agreement": float(np.mean(own == model.labels_)),
            "distil_steps": last.get("distil_steps"), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with ProcessPoolExecutor(args.jobs) as pool:
        records = list(pool.map(measure, args.families))
    print("| family | N | K | NMI, net's labels | NMI, mixture's | agreement | distil steps | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        print(f"| {r['family']} | {r['n']:,} | {r['k']} | {r['nmi_net']:.4f} | {r['nmi_mixture']:.4f} | "
              f"{r['agreement']:.4f} | {r['distil_steps']} | {r['seconds']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "records": records},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
