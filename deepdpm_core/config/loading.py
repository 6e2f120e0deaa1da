"""Config files and overrides: bounded YAML loading into a :class:`~deepdpm_core.config.Config`.

A config file is read with a ``SafeLoader`` that refuses deep nesting and alias bombs
before any value is built, then checked key by key (:func:`~deepdpm_core.config.from_dict`);
``--set key=value`` overrides are YAML scalars read the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from deepdpm_core.config.schema import Config, from_dict
from deepdpm_core.errors import ConfigError

#: nodes a YAML document may expand to once its aliases are followed (a config has ~100)
MAX_YAML_NODES = 10_000
#: nesting a YAML document may have (a config has 3 levels; the composer recurses per level)
MAX_YAML_DEPTH = 50


class _BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a document nested deeper than
    :data:`MAX_YAML_DEPTH`, or whose aliases expand it beyond :data:`MAX_YAML_NODES`
    nodes (a "billion laughs" bomb: 1 KB of nested aliases that mean 10⁹ strings) or
    refer to themselves, before any value is built."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise ConfigError(f"YAML is nested more than {MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes under ``node`` with every alias expanded, memoised per node (an alias is the
    same node object), so the count costs one visit per distinct node."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError("YAML refers to itself (a recursive alias); write the value out")
    open_nodes.add(key)
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_YAML_NODES:
            raise ConfigError(f"YAML expands to more than {MAX_YAML_NODES} values through its "
                              "aliases (&anchor/*alias); write the config out without them")
    open_nodes.discard(key)
    sizes[key] = total
    return total


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` with bounded nesting and alias expansion.

    Raises
    ------
    ConfigError
        Nested deeper than :data:`MAX_YAML_DEPTH`, or aliases that expand beyond
        :data:`MAX_YAML_NODES` values or refer to themselves.
    yaml.YAMLError
        Not valid YAML.
    """
    return yaml.load(text, Loader=_BoundedSafeLoader)  # noqa: S506 - a SafeLoader


def load_config(path: str | Path) -> Config:
    """Load a YAML config file strictly (:func:`load_yaml`; unknown keys are errors).

    Parameters
    ----------
    path : str or Path
        A YAML file such as ``cluster_configs/default.yaml``. Missing keys keep
        their defaults.

    Returns
    -------
    Config
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    try:
        data = load_yaml(text)
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    except yaml.YAMLError as exc:
        # one line: PyYAML's message spans several, with a caret under the column
        raise ConfigError(f"config {path} is not valid YAML: {' '.join(str(exc).split())}") from exc
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Parse CLI ``key=value`` strings; values are YAML scalars (``1e-3``, ``true``, ``null``)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got '{item}'")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = load_yaml(raw)
        except ConfigError as exc:
            raise ConfigError(f"--set {key}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key}: cannot parse value '{raw}'") from exc
    return out
