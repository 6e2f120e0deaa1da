"""Idle threads that sleep instead of spinning, for machines shared with other work.

An OpenMP runtime's idle threads spin-wait before they sleep (libgomp: a spin count; Intel's
libiomp: ``KMP_BLOCKTIME``, 200 ms), taking time from the working threads of a busy machine
(docs/benchmarks.md, "A default fit on a busy machine, before and after idle threads
sleep"). Each runtime reads its settings once, when loaded, so they must be set before the
first import of torch, numpy's BLAS, scikit-learn or numba; a value the user set is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

#: OpenMP runtimes: idle threads sleep at once (libgomp: OMP_WAIT_POLICY; Intel: KMP_BLOCKTIME)
OPENMP_PASSIVE: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
#: numba (UMAP): the ``workqueue`` layer, whose idle workers block on a condition variable
#: (its ``omp`` layer is an OpenMP runtime; ``tbb`` is no dependency of deepdpm). Set by
#: the ``deepdpm`` command only: ``workqueue`` is not thread-safe (numba ends the process
#: when two threads launch parallel regions at once), as a program importing deepdpm_core
#: may do.
NUMBA_PASSIVE: dict[str, str] = {"NUMBA_THREADING_LAYER": "workqueue"}


def set_defaults(
    variables: Mapping[str, str], environ: MutableMapping[str, str] = os.environ
) -> dict[str, str]:
    """Set each of ``variables`` in ``environ`` where it is not set yet.

    Parameters
    ----------
    variables : Mapping[str, str]
        Name -> default value, e.g. :data:`OPENMP_PASSIVE`.
    environ : MutableMapping[str, str], default os.environ

    Returns
    -------
    dict[str, str]
        The value of each of ``variables`` now in ``environ`` (the user's where set).
    """
    return {name: environ.setdefault(name, value) for name, value in variables.items()}


__all__ = ["NUMBA_PASSIVE", "OPENMP_PASSIVE", "set_defaults"]
