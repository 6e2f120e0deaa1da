"""Where runs are tracked and what describes the machine and code of a run."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

#: file name of the default tracking store (MLflow 3 refuses the old ``./mlruns`` file
#: store for new runs), in :func:`default_store_folder`
DEFAULT_TRACKING_DB = "mlflow.db"
#: the folder beside a SQLite store that holds its runs' artifacts
ARTIFACTS_FOLDER = "mlartifacts"


def default_store_folder() -> Path:
    """Where runs are tracked unless told otherwise: one store per user, never the working
    directory, ``$XDG_DATA_HOME/deepdpm`` (by default ``~/.local/share/deepdpm``)."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home).expanduser().resolve() / "deepdpm"


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The tracking URI a run uses: ``uri``, else ``$MLFLOW_TRACKING_URI``, else the
    per-user store ``sqlite:///<default_store_folder()>/mlflow.db``.

    The default is absolute, so that Ray workers, whose working directory is not the
    driver's, write to the same database; its folder is created on use.
    """
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return "sqlite:///" + str(default_store_folder() / DEFAULT_TRACKING_DB)


def make_store_folder(tracking_uri: str | None) -> None:
    """Create the folder of a SQLite store's database (SQLite creates the file, not its
    folder); nothing for other stores."""
    prefix = "sqlite:///"
    if tracking_uri and tracking_uri.startswith(prefix):
        Path(tracking_uri[len(prefix):]).expanduser().parent.mkdir(parents=True, exist_ok=True)


def sqlite_artifact_location(tracking_uri: str | None) -> str | None:
    """For a SQLite store, the artifact root of the experiments it creates: the folder
    ``mlartifacts`` beside the database (MLflow's own default is ``./mlruns`` in the
    working directory). None for other stores (a server decides)."""
    prefix = "sqlite:///"
    if not tracking_uri or not tracking_uri.startswith(prefix):
        return None
    database = Path(tracking_uri[len(prefix):]).expanduser().resolve()
    return (database.parent / ARTIFACTS_FOLDER).as_uri()


def git_commit(start: str | Path | None = None) -> str | None:
    """Commit of the code being run: ``$DEEPDPM_GIT_COMMIT`` (set in container images)
    or ``git rev-parse HEAD`` of the checkout this package lives in; None when unknown."""
    env = os.environ.get("DEEPDPM_GIT_COMMIT")
    if env:
        return env
    where = Path(start) if start is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def gpu_description() -> str:
    """Name and count of the CUDA devices, or ``"none"``."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return f"{n}x {torch.cuda.get_device_name(0)}"
    except Exception:  # a broken CUDA install must not stop a run from being tagged
        return "unknown"
    return "none"


def environment_tags(input_path: str | Path | None = None, command: str = "fit") -> dict[str, str]:
    """Run tags: input path, host, GPU, and MLflow's own source tags (the run's "Source" in
    the UI: ``deepdpm COMMAND`` and the git commit)."""
    tags = {
        "host": platform.node(),
        "gpu": gpu_description(),
        "python": platform.python_version(),
        "mlflow.source.name": f"deepdpm {command}",
        "mlflow.source.type": "LOCAL",
    }
    if input_path is not None:
        tags["input"] = str(input_path)
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags
