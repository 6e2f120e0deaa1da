"""A test session leaves no folder of its own in the temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_a_test_session_removes_its_temporary_folders(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/core/config/"
         "test_config.py::test_every_key_is_described_in_the_schema_and_default_yaml_lists_them_at_their_defaults"],
        cwd=Path(__file__).parents[2], env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(tmp_path.glob("deepdpm-tests-*")), sorted(p.name for p in tmp_path.iterdir())
