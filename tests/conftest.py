"""Shared test set-up: quiet, single-threaded BLAS, no MLflow telemetry, and the tiers.

The folders are the tiers: ``core/<package>/`` the method, one folder per package of
deepdpm_core; ``pipeline/<package>/`` the pipeline in one process, one folder per package
of it (the fault suite and the CLI's edge cases at its top); ``system/`` Ray, MLflow
servers, container images and deployment files. Helpers live in ``support/``.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the per-user MLflow store of runs tracked without a tracking URI
# (pipeline.tracking.environment.default_store_folder): a fresh one, not the user's
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="deepdpm-tests-data-")
# MLflow runs a tracked command could not end (pipeline.tracking.pending_closes): the
# tests' own, not the user's
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="deepdpm-tests-state-")
#: the session's own folders, removed when it ends (:func:`pytest_unconfigure`)
_SESSION_FOLDERS = (os.environ["XDG_DATA_HOME"], os.environ["XDG_STATE_HOME"])
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


#: the tier of each top folder of tests/ (``pytest -m core`` runs the method's unit tests)
TIERS = ("core", "pipeline", "system")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with its tier, from the folder it lives in."""
    root = Path(__file__).parent
    for item in items:
        tier = Path(item.fspath).relative_to(root).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


#: the session's exit status, kept for :func:`pytest_unconfigure`
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Leave with the session's status once pytest has reported, skipping the interpreter's
    finalisation. This process has loaded two OpenMP runtimes (torch's and faiss's), a Ray
    driver and numba; one full run in three ended in SIGSEGV after the summary line, in
    their static destructors, with every test passed. The commands the tests start are
    separate processes and their exit codes are still checked. The session's temporary
    folders go first (the interpreter's exit handlers, skipped here, would not remove them
    either)."""
    for folder in _SESSION_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[0])
