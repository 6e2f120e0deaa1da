"""DeepDPM: deep clustering with an unknown number of clusters (Ronen et al., CVPR 2022).

The method only: pure, single-process, no Ray and no MLflow. See :class:`DeepDPM`.
"""

from deepdpm_core.config import Config, load_config
from deepdpm_core.errors import CheckpointError, ConfigError, DataError, DeepDPMError
from deepdpm_core.estimator import DeepDPM

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "DeepDPM",
    "DeepDPMError",
    "load_config",
]
