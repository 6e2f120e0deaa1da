"""The MLflow options of the tracked commands (``fit``, ``extract``).

Kept out of :mod:`pipeline.tracking.run_tracker`, which imports the search and so torch: the CLI
builds every command's options at each start, and a command that runs without torch in
its own process (the driver of a folder ``predict``) stays without it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_EXPERIMENT = "deepdpm"
#: alias that ``--register-model NAME`` points at the new version (``models:/NAME@champion``;
#: MLflow reserves ``latest``)
DEFAULT_MODEL_ALIAS = "champion"


def add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tracking-uri``, ``--experiment``, ``--run-name``, ``--no-tracking``."""
    group = parser.add_argument_group(
        "MLflow tracking", "needs the mlflow extra (pip install \"deepdpm[mlflow]\"): without it "
        "a run is not tracked, and asking for tracking is an error")
    group.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the per-user store "
        "~/.local/share/deepdpm/mlflow.db, $XDG_DATA_HOME/deepdpm where that is set)",
    )
    group.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="MLflow experiment name")
    group.add_argument("--run-name", help="MLflow run name (default: the --output folder's name)")
    group.add_argument("--no-tracking", action="store_true", help="do not log to MLflow")


def tracking_on(args: argparse.Namespace) -> bool:
    """Whether a tracked command (``fit``, ``extract``) logs its run to MLflow.

    Not with ``--no-tracking``, nor without MLflow (the ``mlflow`` extra), unless the command
    asks for tracking (``--tracking-uri``, ``$MLFLOW_TRACKING_URI``, ``--experiment``,
    ``--run-name``, ``--register-model``): that is an error naming the extra.

    Raises
    ------
    MissingExtraError
        Tracking asked for and MLflow not installed.
    """
    from pipeline.extras import installed, require

    if args.no_tracking:
        return False
    if installed("mlflow"):
        return True
    asked = [flag for flag, given in (
        ("--tracking-uri", args.tracking_uri),
        ("$MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI")),
        ("--experiment", args.experiment != DEFAULT_EXPERIMENT),
        ("--run-name", args.run_name),
        ("--register-model", getattr(args, "register_model", None)),
    ) if given]  # fmt: skip
    if asked:
        require(f"MLflow tracking ({asked[0]})", "mlflow", note="or pass --no-tracking")
    return False


def default_run_name(args: argparse.Namespace) -> str | None:
    """``--run-name``, else the name of the ``--output`` folder (None without either)."""
    if args.run_name:
        return args.run_name
    output = getattr(args, "output", None) or getattr(args, "resume", None)
    return Path(output).resolve().name if output else None


def add_registry_arguments(parser: argparse.ArgumentParser) -> None:
    """``--register-model NAME``, ``--model-alias ALIAS``."""
    group = parser.add_argument_group("MLflow model registry")
    group.add_argument(
        "--register-model",
        metavar="NAME",
        help="register the fit's MLflow model as a new version of NAME",
    )
    group.add_argument(
        "--model-alias",
        default=DEFAULT_MODEL_ALIAS,
        metavar="ALIAS",
        help=f"alias moved to that version: models:/NAME@ALIAS (default {DEFAULT_MODEL_ALIAS})",
    )


__all__ = ["DEFAULT_EXPERIMENT", "DEFAULT_MODEL_ALIAS", "add_registry_arguments",
           "add_tracking_arguments", "default_run_name", "tracking_on"]
