"""Strict typed configs: every shipped YAML loads; bad keys and values are named."""

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from deepdpm_core.config import (
    FIXED_KEYS,
    Config,
    ConfigError,
    config_sections,
    from_dict,
    from_stored,
    load_config,
    parse_overrides,
)
from deepdpm_core.config.loading import load_yaml

ROOT = Path(__file__).parents[3]
CONFIGS = sorted((ROOT / "cluster_configs").glob("*.yaml"))


def _descriptions() -> dict[str, str]:
    """Each key's description in the schema, by dotted key."""
    out = {}
    for name, field in Config.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            out |= {f"{name}.{key}": sub.description for key, sub in section.model_fields.items()}
        else:
            out[name] = field.description
    return out


def test_every_key_is_described_in_the_schema_and_default_yaml_lists_them_at_their_defaults():
    assert set(_descriptions()) == set(Config().flat()) and all(_descriptions().values())
    path = CONFIGS[0].parent / "default.yaml"
    assert load_config(path) == Config()
    # every key is written out (a missing one would load as its default too), described
    # nowhere but in the schema: the file's one comment points there
    text = yaml.safe_load(path.read_text())
    written = {f"{section}.{key}" for section, keys in text.items() if isinstance(keys, dict) for key in keys}
    written |= {key for key, value in text.items() if not isinstance(value, dict)}
    assert written == set(Config().flat())
    lines = path.read_text().splitlines()
    assert "config/sections.py" in lines[0] and not any("#" in line for line in lines[1:])


def test_the_readme_knob_table_names_schema_keys_with_their_defaults():
    """README's table of knobs documents no key of its own: each row's key is a schema key,
    its default the schema's (read as ``--set`` would read it), what it does the schema's
    description, and every key its text names is one too."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if re.match(r"\| `[a-z_]+\.[a-z_]+` \| ", line)]
    assert len(rows) >= 10  # the table of knobs that move K, found
    defaults, dotted = Config().flat(), re.compile(rf"`((?:{'|'.join(config_sections())})\.[a-z_]+)`")
    for row in rows:
        key, default = (cell.strip().strip("`") for cell in row.split("|")[1:3])
        assert key in defaults, row
        assert row.split("|")[3].strip() == _descriptions()[key], row
        written = from_dict(parse_overrides([f"{key}={default}"])).flat()[key]
        assert written == defaults[key], f"README gives {key} = {default}, the schema {defaults[key]!r}"
        assert set(dotted.findall(row)) <= set(defaults), row


def test_a_key_whose_value_is_now_fixed_is_refused_as_such_but_dropped_from_stored_configs():
    assert not FIXED_KEYS & set(Config().flat())
    with pytest.raises(ConfigError) as info:
        from_dict({"moves": {"merge_neighbours": 3}})
    assert str(info.value) == "unknown config key 'moves.merge_neighbours' (no longer a setting: its value is fixed)"
    # what a model file or checkpoint of an earlier version stored: its config with those keys
    stored = Config().with_overrides({"prior.alpha": 2.0}).to_dict()
    for key in FIXED_KEYS:
        section, name = key.split(".")
        stored[section][name] = 1
    assert from_stored(stored) == Config().with_overrides({"prior.alpha": 2.0})
    with pytest.raises(ConfigError, match="unknown config key 'prior.alpah'"):
        from_stored({"prior": {"alpah": 1.0}})


#: the rules of K's search whose values are constants of the code that applies them
RULES_NOW_FIXED = [
    "prior.covariance_floor", "prior.coarsening_per_parameter", "moves.min_subcluster_size", "moves.prune_small",
    "moves.split_valley", "moves.merge_valley", "moves.birth_parts", "moves.exact_valley",
    "schedule.freeze_epochs", "schedule.patience", "schedule.settled_spread", "schedule.settled_band",
]


@pytest.mark.parametrize("key", RULES_NOW_FIXED)
def test_a_rule_of_the_search_is_no_longer_a_setting(key):
    message = f"unknown config key '{key}' (no longer a setting: its value is fixed)"
    with pytest.raises(ConfigError) as info:
        Config().with_overrides(parse_overrides([f"{key}=0.8"]))
    assert str(info.value) == message
    section, name = key.split(".")
    with pytest.raises(ConfigError) as info:
        from_dict(load_yaml(f"{section}:\n  {name}: null\n"))
    assert str(info.value) == message
    # the config a model file or checkpoint of an earlier version stored, which named it
    stored = Config().to_dict()
    stored[section][name] = None
    assert from_stored(stored) == Config()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), Config)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"prior": {"alpah": 1.0}}, "unknown config key 'prior.alpah'"),
        ({"optimizer": {}}, "unknown config key 'optimizer'"),
        ({"optim": {"batch_size": 1.5}}, "optim.batch_size"),
        ({"prior": {"psi": "diag"}}, "prior.psi"),
        ({"prior": {"alpha": -1}}, "prior.alpha"),
        ({"moves": {"split": "yes"}}, "moves.split"),
        ({"prior": 3}, "prior"),
        ({"prior": {"alpha": float("inf")}}, "'prior.alpha' must be a finite number"),
        ({"prior": {"kappa": "inf"}}, "'prior.kappa' must be a finite number"),
        ({"optim": {"lr_cluster": float("nan")}}, "'optim.lr_cluster' must be a finite number"),
        ({"prior": {"nu": "1e400"}}, "'prior.nu' must be a finite number"),
        ({"seed": -1}, "'seed' must be in [0, 2**31)"),
        ({"embed": {"min_dist": 5.0}}, "'embed.min_dist' must be <= 1, got 5.0"),
        ({"embed": {"n_neighbors": 1}}, "'embed.n_neighbors' must be >= 2, got 1"),
        ({"seed": 2**40}, "'seed' must be in [0, 2**31)"),
        ({"schedule.max_epoch": 3}, "unknown config key 'schedule.max_epoch' (did you mean "
                                    "schedule.max_epochs?)"),
        # pruning clusters too small to split, under either of its former names, is no setting
        ({"moves": {"prune_empty": False}}, "unknown config key 'moves.prune_empty' (no longer a setting"),
        ({"schedule.max_epochs": 3, "schedule": {"max_epochs": 4}},
         "config key 'schedule.max_epochs' is given twice"),
        ({"seed": 1, "seed.x": 2}, "config key 'seed' is given as a value and as a section"),
    ],
)
def test_bad_configs_name_the_key(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(data)


def test_dotted_keys_in_a_mapping_are_sections():
    """``{"prior.alpha": 1}`` is ``{"prior": {"alpha": 1}}``, as ``--set`` names keys."""
    cfg = from_dict({"schedule.max_epochs": 3, "prior": {"alpha": 2.0}, "prior.nu": None})
    assert cfg.schedule.max_epochs == 3 and cfg.prior.alpha == 2.0 and cfg.prior.nu is None
    assert cfg == from_dict({"schedule": {"max_epochs": 3}, "prior": {"alpha": 2.0, "nu": None}})


def test_overrides_and_yaml_scalars(tmp_path):
    cfg = Config().with_overrides(parse_overrides(["prior.sigma_scale=5e-3", "moves.merge=false",
                                                   "optim.batch_size=256", "prior.nu=null"]))
    assert cfg.prior.sigma_scale == 0.005 and cfg.moves.merge is False
    assert cfg.optim.batch_size == 256 and cfg.prior.nu is None
    with pytest.raises(ConfigError, match="unknown config key 'prior.sigma'"):
        Config().with_overrides({"prior.sigma": 1})
    bad = tmp_path / "bad.yaml"
    bad.write_text("prior: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(bad)
    assert "\n" not in str(err.value)  # the CLI prints it as one line
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    assert Config().flat()["prior.alpha"] == 10.0
