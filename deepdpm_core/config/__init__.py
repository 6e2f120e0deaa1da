"""The typed run configuration and its loading from YAML files and overrides."""

from deepdpm_core.config.loading import load_config, parse_overrides
from deepdpm_core.config.schema import (
    FIXED_KEYS,
    Config,
    DataConfig,
    EStepConfig,
    InitConfig,
    MovesConfig,
    PriorConfig,
    ScheduleConfig,
    config_sections,
    from_dict,
    from_stored,
)
from deepdpm_core.config.sections import check_row_count, searches_by_exact_em
from deepdpm_core.errors import ConfigError

__all__ = [
    "FIXED_KEYS", "check_row_count", "Config", "config_sections", "ConfigError", "DataConfig", "EStepConfig", "from_dict", "from_stored", "InitConfig", "load_config",
    "MovesConfig", "parse_overrides", "PriorConfig", "ScheduleConfig", "searches_by_exact_em"
]
