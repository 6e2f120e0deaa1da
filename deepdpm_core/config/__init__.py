"""The typed run configuration and its loading from YAML files and overrides."""

from deepdpm_core.config.loading import load_config, parse_overrides
from deepdpm_core.config.schema import (
    Config,
    DataConfig,
    EStepConfig,
    InitConfig,
    MovesConfig,
    PriorConfig,
    ScheduleConfig,
    config_sections,
    from_dict,
)
from deepdpm_core.errors import ConfigError

__all__ = [
    "Config", "config_sections", "ConfigError", "DataConfig", "EStepConfig", "from_dict", "InitConfig", "load_config",
    "MovesConfig", "parse_overrides", "PriorConfig", "ScheduleConfig"
]
