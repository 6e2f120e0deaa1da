"""The estimator's keyword parameters: which config keys a keyword names, and the config
they make.

:class:`~deepdpm_core.model.estimator.DeepDPM` takes any config key as a keyword
(``prior__alpha=1.0``, ``alpha=1.0``, ``prior={"alpha": 1.0}``); :func:`param_names` turns
each into its ``section__key`` parameters, checking the names only, and
:func:`resolve_config` builds the config from them, checking the values.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from deepdpm_core.config import Config, config_sections, from_dict, load_config
from deepdpm_core.errors import ConfigError

__all__ = ["param_names", "resolve_config"]


def _leaf_index() -> dict[str, list[str]]:
    """Leaf name -> dotted keys having it (for ``DeepDPM(alpha=1.0)`` shortcuts)."""
    index: dict[str, list[str]] = {}
    for dotted in Config().flat():
        index.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    return index


def param_names(key: str, value: Any) -> list[tuple[str, Any]]:
    """The ``section__key`` parameters (or ``seed``, ``device``) an override stands for.

    Overrides may be double-underscored (``prior__alpha=1.0``), dotted
    (``{"prior.alpha": 1.0}``), a whole section (``prior={"alpha": 1.0}``, one parameter
    per key) or an unambiguous leaf name (``alpha=1.0``). Only the names are checked
    here; values are checked when the config is built.

    Raises
    ------
    ConfigError
        An unknown or ambiguous name, with the closest known one.
    """
    dotted = key.replace("__", ".")
    if "." in dotted:
        if dotted not in Config().flat():
            # the config's own error for it, "unknown config key ... (did you mean ...?)"
            Config().with_overrides({dotted: value})
        return [(dotted.replace(".", "__"), value)]
    if dotted in config_sections():
        if not isinstance(value, dict):  # a section given as a non-mapping: fit names it
            return [(dotted, value)]
        return [pair for k, v in value.items() for pair in param_names(f"{dotted}.{k}", v)]
    leaves = _leaf_index()
    if len(leaves.get(dotted, [])) == 1:
        return [(leaves[dotted][0].replace(".", "__"), value)]
    if dotted in leaves:
        raise ConfigError(f"ambiguous parameter '{key}': use one of {', '.join(leaves[dotted])}")
    close = difflib.get_close_matches(dotted, [*leaves, *config_sections()], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(f"unknown parameter '{key}'{hint}")


def resolve_config(config: Config | dict | str | Path | None, overrides: dict[str, Any]) -> Config:
    """Combine a config (object, mapping, YAML path or None) with keyword overrides
    (named as :func:`param_names` accepts).

    Raises
    ------
    ConfigError
        An unknown key, a bad value or an unreadable config file.
    """
    if config is None:
        cfg = Config()
    elif isinstance(config, Config):
        cfg = config
    elif isinstance(config, dict):
        cfg = from_dict(config)
    elif isinstance(config, (str, Path)):
        cfg = load_config(config)
    else:
        raise ConfigError(
            f"config must be a Config, a mapping, a YAML path or None, got {config!r}")
    dotted: dict[str, Any] = {}
    for key, value in overrides.items():
        for name, v in param_names(key, value):
            if name in config_sections():  # a section that is not a mapping
                raise ConfigError(f"config key '{name}' must be a mapping, got {v!r}")
            dotted[name.replace("__", ".")] = v
    return cfg.with_overrides(dotted) if dotted else cfg
