"""Typed, frozen run configuration: pydantic models whose fields carry their bounds.

Every hyperparameter of the method lives here, as a field of a frozen model whose
``description`` is the one description of the key (README's table of knobs is tested
against it); ``cluster_configs/default.yaml`` lists every key at its default (a test keeps
the YAML and these defaults identical). Unknown keys, values of the wrong type and values out of bounds raise
:class:`ConfigError` naming the dotted key (:func:`~deepdpm_core.config.schema.from_dict`),
so a typo never silently falls back to a default. YAML files and ``--set`` overrides are
read by :mod:`deepdpm_core.config.loading`.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationError

from deepdpm_core.config.sections import (
    AEConfig,
    DataConfig,
    EmbedConfig,
    EStepConfig,
    InitConfig,
    ModelConfig,
    MovesConfig,
    OptimConfig,
    PriorConfig,
    ScheduleConfig,
    Section,
    SmallDataConfig,
    seed_in_range,
)
from deepdpm_core.errors import ConfigError


class Config(Section):
    """The whole run configuration.

    Sections: ``data`` (input transform), ``prior``, ``init``, ``model``, ``optim``, ``schedule``, ``moves``, ``estep``, ``small_data``, ``ae``
    (autoencoder, alternation), ``embed`` (UMAP);
    plus ``seed`` (all randomness of a fit derives from it) and ``device``.
    """

    seed: Annotated[int, AfterValidator(seed_in_range)] = Field(
        0, description="all randomness of a fit (k-means sample, nets, Hastings coins)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto | cpu | cuda (auto: CUDA when present)")
    data: DataConfig = Field(default_factory=DataConfig)
    prior: PriorConfig = Field(default_factory=PriorConfig)
    init: InitConfig = Field(default_factory=InitConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    moves: MovesConfig = Field(default_factory=MovesConfig)
    estep: EStepConfig = Field(default_factory=EStepConfig)
    small_data: SmallDataConfig = Field(default_factory=SmallDataConfig)
    ae: AEConfig = Field(default_factory=AEConfig)
    embed: EmbedConfig = Field(default_factory=EmbedConfig)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain-dict form (what YAML and checkpoints store)."""
        return self.model_dump()

    def flat(self) -> dict[str, Any]:
        """Flattened ``{"prior.alpha": 10.0, ...}`` form (MLflow params)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}{k}.", v)
            else:
                out[prefix[:-1]] = value

        walk("", self.to_dict())
        return out

    def with_overrides(self, overrides: dict[str, Any]) -> Config:
        """Return a copy with dotted-key overrides (``{"prior.alpha": 1.0}``) applied."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            node = data
            parts = dotted.split(".")
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    raise _unknown_key(dotted)
                node = node[part]
            if parts[-1] not in node or isinstance(node[parts[-1]], dict):
                raise _unknown_key(dotted)
            node[parts[-1]] = value
        return from_dict(data)


def config_sections() -> list[str]:
    """Names of the config's sections (``data``, ``prior``, ...)."""
    return [name for name, field in Config.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, Section)]


#: keys of earlier versions whose values are now constants of the code that uses them (each
#: named, with why, where it is used): a config naming one is an error that says so, and the
#: config a model file or checkpoint of those versions stored drops them (:func:`from_stored`)
FIXED_KEYS = frozenset({
    "data.auto_max_participation", "data.auto_min_std_ratio", "prior.weight_pseudocount", "init.seeding",
    "model.sub_hidden", "optim.base_batch_size", "optim.max_batch_size", "optim.steps_per_epoch",
    "schedule.min_epochs", "moves.merge_neighbours", "moves.valley_min_points", "moves.valley_bandwidth",
    "moves.birth_kmeans_iters", "small_data.warmup_epochs", "small_data.move_every", "small_data.distil_lr",
    "small_data.distil_agreement", "small_data.distil_max_steps", "ae.weight_decay", "ae.input_scaling",
    "embed.metric", "prior.covariance_floor", "prior.coarsening_per_parameter", "moves.min_subcluster_size",
    "moves.prune_empty", "moves.prune_small", "moves.split_valley", "moves.merge_valley", "moves.birth_parts",
    "moves.exact_valley", "schedule.freeze_epochs", "schedule.patience", "schedule.settled_spread",
    "schedule.settled_band",
})

#: characters of a value an error message shows at most
_SHOWN_CHARS = 120


def _shown(value: Any) -> str:
    """``repr(value)`` for an error message, bounded: nested and long values are elided
    (``[[1, 2, ...], ...]``) without walking them, so a huge value costs nothing to show."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict = 3, 6, 6, 6
    short.maxstring = short.maxother = short.maxlong = _SHOWN_CHARS
    text = short.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _unknown_key(dotted: str) -> ConfigError:
    """The error for an unknown key, naming the closest known dotted key if any:
    ``unknown config key 'prior.sigma_scal' (did you mean prior.sigma_scale?)``, or saying
    that a key of :data:`FIXED_KEYS` is no longer a setting."""
    import difflib

    if dotted in FIXED_KEYS:
        return ConfigError(f"unknown config key '{dotted}' (no longer a setting: its value is fixed)")
    known = [*Config().flat(), *config_sections()]
    close = difflib.get_close_matches(str(dotted), known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"unknown config key '{dotted}'{hint}")


def _nested(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with dotted keys (``{"prior.alpha": 1.0}``, as ``--set`` names them) as
    nested mappings (``{"prior": {"alpha": 1.0}}``); a key given twice is an error."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        *sections, leaf = str(key).split(".")
        node = out
        for i, name in enumerate(sections):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{'.'.join(sections[:i + 1])}' is given as a "
                                  f"value and as a section")
        if isinstance(value, dict):
            value = _nested(value)
            if isinstance(node.get(leaf), dict):
                clash = set(node[leaf]) & set(value)
                if clash:
                    raise ConfigError(f"config key '{key}.{sorted(clash)[0]}' is given twice")
                value = {**node[leaf], **value}
        elif leaf in node:
            raise ConfigError(f"config key '{key}' is given twice")
        node[leaf] = value
    return out


_MESSAGES = {
    "greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}",
    "less_than_equal": "must be <= {le}", "less_than": "must be < {lt}",
    "int_type": "must be an integer", "float_type": "must be a number", "bool_type": "must be true or false",
    "string_type": "must be a string", "finite_number": "must be a finite number",
    "model_type": "must be a mapping", "tuple_type": "must be a list",
    "too_short": "must hold at least {min_length} item(s)",
}


def _dotted(loc: tuple[Any, ...]) -> str:
    """The dotted key of a pydantic error location: field names and list indices only,
    without the tags pydantic adds for the members of a union (``float``, ``literal[...]``)."""
    model: Any = Config
    key = ""
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif isinstance(model, type) and issubclass(model, BaseModel) and part in model.model_fields:
            key += f".{part}" if key else part
            model = model.model_fields[part].annotation
    return key


def _config_error(exc: ValidationError) -> ConfigError:
    """One line for the first thing wrong: an unknown key first (with the closest known
    key), else the first bad value (for a union, as its first member reads it)."""
    errors = exc.errors(include_url=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        *section, name = extra[0]["loc"]
        return _unknown_key(".".join([*filter(None, [_dotted(tuple(section))]), str(name)]))
    first = errors[0]
    key = _dotted(first["loc"])
    if first["type"] == "value_error":
        text = str(first["ctx"]["error"])
        return ConfigError(text if text.startswith("config key") else f"config key '{key}' {text}, got {_shown(first['input'])}")
    if first["type"] == "literal_error":
        text = f"must be one of {first['ctx']['expected'].replace(' or ', ', ')}"
    else:
        text = _MESSAGES.get(first["type"], first["msg"].lower()).format(**first.get("ctx", {}))
    return ConfigError(f"config key '{key}' {text}, got {_shown(first['input'])}")


def from_dict(data: dict[str, Any] | None) -> Config:
    """Build a :class:`Config` from a mapping, nested or with dotted keys
    (``{"prior.alpha": 1.0}``), rejecting unknown keys and bad values.

    Raises
    ------
    ConfigError
        One line naming the dotted key.
    """
    if data is None:
        return Config()
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(_nested(data))
    except ValidationError as exc:
        raise _config_error(exc) from None


def from_stored(data: dict[str, Any]) -> Config:
    """:func:`from_dict` of the nested config a model file or checkpoint stored, less the
    keys of :data:`FIXED_KEYS` (an earlier version wrote them; their values are now fixed).

    Raises
    ------
    ConfigError
        As :func:`from_dict`.
    """
    if not isinstance(data, dict):
        return from_dict(data)
    kept = {name: ({k: v for k, v in value.items() if f"{name}.{k}" not in FIXED_KEYS}
                   if isinstance(value, dict) else value) for name, value in data.items()}
    return from_dict(kept)


__all__ = [
    "FIXED_KEYS",
    "AEConfig",
    "Config",
    "DataConfig",
    "EStepConfig",
    "EmbedConfig",
    "InitConfig",
    "ModelConfig",
    "MovesConfig",
    "OptimConfig",
    "PriorConfig",
    "ScheduleConfig",
    "SmallDataConfig",
    "config_sections",
    "from_dict",
    "from_stored",
]
