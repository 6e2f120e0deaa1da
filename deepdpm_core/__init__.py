"""DeepDPM: deep clustering with an unknown number of clusters (Ronen et al., CVPR 2022).

The method only: pure, single-process, no Ray and no MLflow. See :class:`DeepDPM`.
"""

# First, before anything loads an OpenMP runtime: idle threads sleep instead of spinning
# (deepdpm_core.idle_threads). This only helps where deepdpm_core is imported before
# torch, numpy or scikit-learn; the deepdpm command does so.
from deepdpm_core.idle_threads import OPENMP_PASSIVE, set_defaults

set_defaults(OPENMP_PASSIVE)

import logging  # noqa: E402

# faiss tells at INFO how its import went ("Loading faiss with AVX512 support.", then
# "No module named 'faiss.swigfaiss_avx512'" for a build without it): routine, but shown
# wherever INFO records are (a Ray Train worker's root logger). Its warnings still show.
if logging.getLogger("faiss.loader").level == logging.NOTSET:
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)

from deepdpm_core.errors import CheckpointError, ConfigError, DataError, DeepDPMError  # noqa: E402

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "DeepDPM",
    "DeepDPMError",
    "load_config",
]


def __getattr__(name: str):
    # imported on first use, so that `import deepdpm_core` (and every command's answer to a
    # wrong path) stays light: the estimator pulls in torch, the config pydantic
    if name == "DeepDPM":
        from deepdpm_core.model import DeepDPM

        return DeepDPM
    if name in ("Config", "load_config"):
        import deepdpm_core.config

        return getattr(deepdpm_core.config, name)
    raise AttributeError(f"module 'deepdpm_core' has no attribute {name!r}")
