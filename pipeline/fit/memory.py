"""Whether a fit fits in memory: checked from N, D, K and the covariance type before it starts.

A fit with full covariances holds D x D matrices in float64 for each cluster and each of
its two sub-clusters, with working copies (statistics, Cholesky factors, proposals); at
400 rows x 5,000 columns and K = 10 that is over 10 GB, which ended in an allocator
traceback mid-fit. :func:`check_fit_memory` refuses such a fit in one line naming the
knob that shrinks it (docs/reliability.md, "A fit that cannot fit in memory is refused
before it starts").
"""

from __future__ import annotations

from pathlib import Path

import psutil

from deepdpm_core import Config
from deepdpm_core.errors import DataError

#: float64 D x D (full) or D (diag) arrays held per cluster: the cluster's and its two
#: sub-clusters' covariances, each with about two working copies (statistics, factors)
ARRAYS_PER_CLUSTER = 6
#: bytes held per input value: the rows as float32 and their float64 coordinates, twice
BYTES_PER_VALUE = 24


def fit_memory_bytes(n_rows: int, n_features: int, n_clusters: int, covariance_type: str) -> int:
    """An estimate of the memory a fit of ``n_rows`` x ``n_features`` at ``n_clusters``
    clusters needs, in bytes (``covariance_type`` "diag" holds D values per cluster,
    "full" and "auto" D x D)."""
    per_cluster = n_features if covariance_type == "diag" else n_features * n_features
    return 8 * ARRAYS_PER_CLUSTER * n_clusters * per_cluster + BYTES_PER_VALUE * n_rows * n_features


def available_bytes() -> int:
    """The memory this process may still take: what the machine has available, less where
    a container's memory limit (cgroup v2 ``memory.max``) leaves less."""
    free = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free
    return free if limit == "max" else max(0, min(free, int(limit) - used))


def check_fit_memory(config: Config, n_rows: int, n_features: int, path: str | Path) -> None:
    """Refuse a fit on the CPU whose estimated memory (:func:`fit_memory_bytes`, at its
    initial K) exceeds what is available, naming the knob that shrinks it.

    Raises
    ------
    DataError
        One line: the estimate, what is available, and ``prior.covariance_type=diag``
        (or fewer initial clusters, or fewer features, where diagonal covariances do not
        suffice).
    """
    import torch

    from deepdpm_core.moves import initial_cluster_count

    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return  # the clusters live in GPU memory, which the fit checks as it allocates
    k = initial_cluster_count(config.init.n_clusters, n_rows, config.small_data.max_rows)
    need = fit_memory_bytes(n_rows, n_features, k, config.prior.covariance_type)
    have = available_bytes()
    if need <= have:
        return
    diag = fit_memory_bytes(n_rows, n_features, k, "diag")
    fix = ("--set prior.covariance_type=diag (a diagonal covariance per cluster)"
           if config.prior.covariance_type != "diag" and diag <= have
           else "fewer features (e.g. deepdpm embed, or PCA) or --set init.n_clusters=<fewer>")
    raise DataError(f"{path}: a fit of {n_rows} rows x {n_features} features at K = {k} "
                    f"({config.prior.covariance_type} covariances) needs about {need / 2**30:.1f} "
                    f"GiB and {have / 2**30:.1f} GiB is available: use {fix}")


__all__ = ["available_bytes", "check_fit_memory", "fit_memory_bytes"]
