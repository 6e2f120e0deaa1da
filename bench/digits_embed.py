"""Benchmark: scikit-learn digits (raw 8x8 pixels) -> embed -> DeepDPM, against peers.

For each feature space (raw pixels, PCA, UMAP, AE, AE+UMAP = n2d) it times the embedding
and a DeepDPM fit and reports K, NMI, ARI and ACC. Peers run on the same features in the
same process: k-means given the true K (an unfair advantage, as in the paper's Table 3)
and scikit-learn's variational Dirichlet-process GMM (another method that infers K).
The last row is the AE <-> DeepDPM alternation on the raw pixels. DeepDPM fits UMAP
layouts (umap, ae-umap) with the n2d recipe's prior (``--umap-config``), the rest with the
defaults.

    OMP_NUM_THREADS=2 python bench/digits_embed.py               # paper's AE (500-500-2000)
    python bench/digits_embed.py --pretrain-epochs 50 --methods pca ae-umap   # quicker

Prints a Markdown table; ``--json FILE`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans
from sklearn.datasets import load_digits
from sklearn.mixture import BayesianGaussianMixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.config import (
    Config,  # noqa: E402
    load_config,  # noqa: E402
)
from deepdpm_core.data import clustering_scores  # noqa: E402
from deepdpm_core.features import (
    embed,  # noqa: E402
    fit_alternating,  # noqa: E402
)


def peers(E: np.ndarray, y: np.ndarray, seed: int) -> dict[str, dict[str, float]]:
    """k-means with the true K and a Dirichlet-process GMM (max 30 components) on ``E``."""
    out = {}
    start = time.perf_counter()
    km = KMeans(n_clusters=len(np.unique(y)), n_init=10, random_state=seed).fit_predict(E)
    out["kmeans_trueK"] = {
        **clustering_scores(y, km), "K": len(np.unique(y)), "s": time.perf_counter() - start
    }
    start = time.perf_counter()
    dpgmm = BayesianGaussianMixture(
        n_components=30,
        weight_concentration_prior_type="dirichlet_process",
        max_iter=500,
        random_state=seed,
    ).fit(E)
    labels = dpgmm.predict(E)
    out["dpgmm"] = {
        **clustering_scores(y, labels), "K": len(np.unique(labels)), "s": time.perf_counter() - start
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods", nargs="+", default=["raw", "pca", "umap", "ae", "ae-umap", "alternate"]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pretrain-epochs", type=int, default=200)
    parser.add_argument("--hidden", default="500,500,2000", help="AE hidden sizes")
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--umap-config", type=Path,
                        default=Path(__file__).resolve().parent.parent / "cluster_configs" / "n2d.yaml",
                        help="config of the DeepDPM fits on UMAP layouts (default: cluster_configs/n2d.yaml)")
    args = parser.parse_args()

    X, y = load_digits(return_X_y=True)
    X = X.astype(np.float32)
    config = Config().with_overrides(
        {
            "seed": args.seed,
            "ae.pretrain_epochs": args.pretrain_epochs,
            "ae.hidden": [int(h) for h in args.hidden.split(",")],
        }
    )
    umap_config = load_config(args.umap_config).with_overrides({"seed": args.seed})
    rows = []
    for method in args.methods:
        start = time.perf_counter()
        if method == "alternate":
            result = fit_alternating(X, config, alternations=args.alternations)
            total = time.perf_counter() - start
            first, last = result.steps[0], result.steps[-1]
            ae_s = sum(s.ae_seconds for s in result.steps)
            fit_s = sum(s.cluster_seconds for s in result.steps)
            rows.append(
                {
                    "features": f"AE<->DeepDPM x{len(result.steps) - 1}"
                    f" (K {'->'.join(str(s.n_clusters) for s in result.steps)})",
                    "embed_s": ae_s,
                    "fit_s": fit_s,
                    "K": last.n_clusters,
                    **clustering_scores(y, last.labels),
                    "nmi_step0": clustering_scores(y, first.labels)["nmi"],
                    "total_s": total,
                    **_peer_cols(peers(result.embedding, y, args.seed), clustering_scores(y, last.labels)),
                }
            )
            continue
        E = X if method == "raw" else embed(X, method, config).embedding
        embed_s = time.perf_counter() - start
        start = time.perf_counter()
        model = DeepDPM(config=umap_config if "umap" in method else config).fit(E)
        fit_s = time.perf_counter() - start
        scores = clustering_scores(y, model.labels_)
        rows.append(
            {
                "features": f"{method} ({E.shape[1]}-d)",
                "embed_s": embed_s,
                "fit_s": fit_s,
                "K": model.n_clusters_,
                **scores,
                "total_s": embed_s + fit_s,
                **_peer_cols(peers(E, y, args.seed), scores),
            }
        )
        print(f"done: {rows[-1]['features']}", file=sys.stderr, flush=True)

    print(
        f"\ndigits (N=1797, D=64, 10 classes), seed {args.seed}, AE {args.hidden} x "
        f"{args.pretrain_epochs} epochs; DeepDPM K init 1, defaults; on UMAP layouts "
        f"{args.umap_config.name} (Psi = {umap_config.prior.sigma_scale:g} I)\n"
    )
    print(
        "| features | embed s | DeepDPM s | K | NMI | ARI | ACC | k-means (true K) NMI "
        "| DP-GMM K / NMI | NMI ratio vs k-means | vs DP-GMM |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['features']} | {r['embed_s']:.1f} | {r['fit_s']:.1f} | {r['K']} | {r['nmi']:.3f} "
            f"| {r['ari']:.3f} | {r['acc']:.3f} | {r['kmeans_nmi']:.3f} | {r['dpgmm_K']} / "
            f"{r['dpgmm_nmi']:.3f} | {r['ratio_kmeans']:.2f} | {r['ratio_dpgmm']:.2f} |"
        )
    if any("nmi_step0" in r for r in rows):
        for r in rows:
            if "nmi_step0" in r:
                print(f"\nalternation: NMI {r['nmi_step0']:.3f} (step 0) -> {r['nmi']:.3f} (final)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _peer_cols(peer: dict[str, dict[str, float]], ours: dict[str, float]) -> dict[str, float]:
    return {
        "kmeans_nmi": peer["kmeans_trueK"]["nmi"],
        "dpgmm_nmi": peer["dpgmm"]["nmi"],
        "dpgmm_K": peer["dpgmm"]["K"],
        "ratio_kmeans": ours["nmi"] / peer["kmeans_trueK"]["nmi"],
        "ratio_dpgmm": ours["nmi"] / peer["dpgmm"]["nmi"],
    }


if __name__ == "__main__":
    sys.exit(main())
