"""Ablations of the method's calibrated module constants, for the benches.

The numbers a user never changes are module constants, not config keys (docs/design.md);
to measure what one of them buys, a bench sets it for its own process with
``--constant deepdpm_core.moves.density_valleys.MERGE_VALLEY=1.01`` and records the value
beside its results. A constant is rebound by name in every loaded ``deepdpm_core`` module
that holds the same object (``from ... import NAME`` copies the binding), so its users see
the new value. A default argument captured when its function was defined is not changed:
set only constants whose users read the module's name when they run (the valley and
coarsening constants of :mod:`deepdpm_core.moves` are passed on from there).
"""

from __future__ import annotations

import ast
import importlib
import sys


def parse_constants(items: list[str]) -> dict[str, object]:
    """``["package.module.NAME=value", ...]`` as {"package.module.NAME": value}.

    The value is a Python literal (``1.01``, ``None``, ``(1, 2)``). Raises ValueError on a
    malformed item, a name that is not an attribute of its module, or a module outside
    ``deepdpm_core``.
    """
    out: dict[str, object] = {}
    for item in items:
        target, sep, text = item.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name or not name:
            raise ValueError(f"--constant {item!r}: expected deepdpm_core.module.NAME=VALUE")
        if module_name.split(".")[0] != "deepdpm_core":
            raise ValueError(f"--constant {item!r}: only deepdpm_core's constants can be set")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"--constant {item!r}: {text!r} is not a Python literal") from err
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"--constant {item!r}: no module {module_name}") from err
        if not hasattr(module, name):
            raise ValueError(f"--constant {item!r}: {module_name} has no {name}")
        out[target] = value
    return out


def set_constants(constants: dict[str, object]) -> list[str]:
    """Rebind each constant (:func:`parse_constants`' output) in its module and in every
    loaded ``deepdpm_core`` module that imported the same object under the same name;
    returns the ``module.NAME`` bindings changed."""
    changed = []
    for target, value in constants.items():
        module_name, _, name = target.rpartition(".")
        old = getattr(importlib.import_module(module_name), name)
        for loaded_name, module in list(sys.modules.items()):
            if (loaded_name == "deepdpm_core" or loaded_name.startswith("deepdpm_core.")) and \
                    getattr(module, name, None) is old and name in vars(module):
                setattr(module, name, value)
                changed.append(f"{loaded_name}.{name}")
    return changed
