"""Idle OpenMP and numba threads sleep: the defaults are set before any runtime loads, in
the library, the command and the workers of the Ray cluster a command starts; a user's own
values win."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepdpm_core.idle_threads import NUMBA_PASSIVE, OPENMP_PASSIVE

REPO = Path(__file__).resolve().parents[3]
NAMES = [*OPENMP_PASSIVE, *NUMBA_PASSIVE]

_SHOW = """
import os, sys
{imports}
assert "torch" not in sys.modules and "numpy" not in sys.modules, "imported too early"
print(" ".join(os.environ.get(name, "-") for name in {names!r}))
"""


def _environment_after(imports: str, **env: str) -> list[str]:
    """The values of :data:`NAMES` in a new process after ``imports``."""
    clean = {k: v for k, v in os.environ.items() if k not in NAMES}
    done = subprocess.run([sys.executable, "-c", _SHOW.format(imports=imports, names=NAMES)],
                          env={**clean, "PYTHONPATH": str(REPO), **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_library_sets_the_openmp_defaults_before_torch_and_keeps_the_users():
    assert _environment_after("import deepdpm_core") == ["PASSIVE", "0", "-"]
    assert _environment_after("import deepdpm_core", OMP_WAIT_POLICY="ACTIVE",
                              KMP_BLOCKTIME="200") == ["ACTIVE", "200", "-"]


def test_the_command_sets_numbas_too():
    assert _environment_after("import pipeline.cli") == ["PASSIVE", "0", "workqueue"]
    assert _environment_after("import pipeline.cli", NUMBA_THREADING_LAYER="omp") == [
        "PASSIVE", "0", "omp"]


def test_the_workers_of_a_local_ray_cluster_get_them(monkeypatch):
    ray = pytest.importorskip("ray")
    from pipeline.ray_cluster import local as ray_local

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray_local, "_guard_cluster", lambda: None)
    for name in NAMES:  # set first: monkeypatch then restores what was there
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's
    ray_local.init_local_ray(runtime_env={"env_vars": {"PYTHONPATH": "/x"}}, num_cpus=1)
    (kwargs,) = calls
    assert kwargs["num_cpus"] == 1
    assert kwargs["runtime_env"]["env_vars"] == {
        "OMP_WAIT_POLICY": "ACTIVE", "KMP_BLOCKTIME": "0", "NUMBA_THREADING_LAYER": "workqueue",
        "PYTHONPATH": "/x"}
