"""DeepDPM: deep clustering with an unknown number of clusters (Ronen et al., CVPR 2022).

The method only: pure, single-process, no Ray and no MLflow. See :class:`DeepDPM`.
"""

from deepdpm_core.config import Config
from deepdpm_core.config_loading import load_config
from deepdpm_core.errors import CheckpointError, ConfigError, DataError, DeepDPMError

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
    # the estimator pulls in torch; import it on first use so `deepdpm --help` stays light
    if name == "DeepDPM":
        from deepdpm_core.estimator import DeepDPM

        return DeepDPM
    raise AttributeError(f"module 'deepdpm_core' has no attribute {name!r}")
