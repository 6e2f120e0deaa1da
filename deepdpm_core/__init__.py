"""DeepDPM: deep clustering with an unknown number of clusters (Ronen et al., CVPR 2022).

The method only: pure, single-process, no Ray and no MLflow. See :class:`DeepDPM`.
"""

from deepdpm_core.config import Config, load_config
from deepdpm_core.errors import CheckpointError, ConfigError, DataError, DeepDPMError

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "DeepDPMError",
    "load_config",
]
