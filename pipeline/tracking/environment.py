"""Where runs are tracked and what describes the machine and code of a run."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

#: file name of the default tracking store, created in the working directory
#: (MLflow 3 refuses the old ``./mlruns`` file store for new runs)
DEFAULT_TRACKING_DB = "mlflow.db"


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The tracking URI a run uses: ``uri``, else ``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///<cwd>/mlflow.db``.

    The default is made absolute so that Ray workers, whose working directory is not
    the driver's, write to the same database.
    """
    if uri:
        return uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return "sqlite:///" + str(Path.cwd().resolve() / DEFAULT_TRACKING_DB)


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
