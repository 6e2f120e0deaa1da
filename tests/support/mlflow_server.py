"""A real ``mlflow server`` for tests (sqlite backend, artifacts in a temp dir).

Import the fixture into a test module::

    from tests.support.mlflow_server import mlflow_server  # noqa: F401

The server takes ~15 s to start on a 2-core machine, so the fixture is module-scoped.
:class:`MlflowServer` can also be used directly by a test that kills its own server.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

#: an empty, fully migrated store, copied from the first server of the session: creating
#: the schema is about half of a server's ~15-25 s start-up on 2 cores
_template_db: Path | None = None


def _copy_sqlite(src: Path, dst: Path) -> None:
    """Consistent copy of a sqlite database that another process has open."""
    source, dest = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        source.backup(dest)
    finally:
        source.close()
        dest.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """``mlflow server`` in its own process group on 127.0.0.1 and a free port.

    Parameters
    ----------
    root : Path
        Holds ``mlflow.db``, the artifact store and ``server.log``.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.artifacts = self.root / "artifacts"
        self.log_path = self.root / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> MlflowServer:
        global _template_db
        db = self.root / "mlflow.db"
        if _template_db is not None and not db.exists():
            _copy_sqlite(_template_db, db)
        env = dict(os.environ)
        env.update(MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{db}",
            "--artifacts-destination", str(self.artifacts),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            # own session: kill() takes uvicorn's children down with it
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log_path.read_text()[-2000:]}")
            if self.healthy():
                if _template_db is None:  # still empty: nothing has logged to it yet
                    template = Path(tempfile.mkdtemp(prefix="mlflow-template-")) / "mlflow.db"
                    _copy_sqlite(db, template)
                    _template_db = template
                return self
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(
            f"mlflow server not up in {timeout} s: {self.log_path.read_text()[-2000:]}"
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A running MLflow tracking server for the whole test module."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server")).start()
    yield server
    server.stop()


@pytest.fixture
def mlflow_env(monkeypatch):
    """Test-friendly MLflow environment: no telemetry, no inherited tracking URI, and
    the HTTP settings a tracked run exports restored after the test."""
    from pipeline.tracking.client_settings import HTTP_ENV_DEFAULTS

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key, value in HTTP_ENV_DEFAULTS.items():
        monkeypatch.setenv(key, value)
