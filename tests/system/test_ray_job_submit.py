"""`ray job submit` of a tiny `deepdpm fit` to a Ray cluster started on this machine.

The `ray job submit` path of docs/deploy.md, for real: `ray start --head` (job server =
dashboard, token auth on, every port chosen here, its own temp dir), then `ray job submit
--working-dir <repo>` of `python -m pipeline.cli fit`, then the outputs the job wrote are
checked.

Never attaches to another cluster (no RAY_ADDRESS is inherited, all ports are fresh)
and never runs `ray stop` (which stops every Ray process of the machine, other users'
included): the head runs with `--block` and is stopped through its own process; any
process left that names our temp dir is then ended by pid.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
FIT_COMMAND = REPO / "pipeline" / "commands" / "fit.py"

pytestmark = pytest.mark.ray
needs_fit = pytest.mark.skipif(
    not FIT_COMMAND.exists(),
    reason="`deepdpm fit` (pipeline/commands/fit.py) is not on this branch yet",
)

# Uploaded with the job: the package and its configs. Files in .gitignore are left out
# by Ray already; these are tracked but not needed to run a job.
WORKING_DIR_EXCLUDES = ["tests/", "bench/", "k8s/", "docker/", "*.md"]


@dataclass
class RayHead:
    dashboard: str  # job server address for `ray job submit --address`
    env: dict[str, str]  # environment with this cluster's token
    temp_dir: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    beside_python = Path(sys.executable).parent / "ray"
    return str(beside_python) if beside_python.exists() else (shutil.which("ray") or "ray")


def _get(url: str, token: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (our unique temp dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def _stop(head: subprocess.Popen, temp_dir: Path) -> None:
    """Stop the head we started: SIGTERM lets `ray start --block` shut its node down."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
    for pid in _processes_mentioning(str(temp_dir)):  # e.g. workers that outlived the raylet
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head():
    # a short path: Ray's unix sockets live under it and must stay below 108 bytes
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-deepdpm-", dir="/tmp"))
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS="1",
        MLFLOW_DISABLE_TELEMETRY="true",
    )
    dashboard_port = _free_port()
    ports = {
        "--port": _free_port(),
        "--dashboard-port": dashboard_port,
        "--node-manager-port": _free_port(),
        "--object-manager-port": _free_port(),
        "--metrics-export-port": _free_port(),
        "--dashboard-agent-listen-port": _free_port(),
        "--dashboard-agent-grpc-port": _free_port(),
        "--runtime-env-agent-port": _free_port(),
    }
    command = [_ray_cli(), "start", "--head", "--block", "--num-cpus=2", "--num-gpus=0"]
    command += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", "--disable-usage-stats"]
    command += [f"--temp-dir={temp_dir}"] + [f"{flag}={port}" for flag, port in ports.items()]
    log = temp_dir / "ray-start.log"
    with log.open("wb") as out:
        head = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 180
        while _get(f"{dashboard}/api/jobs/", token) != 200:
            if head.poll() is not None:
                pytest.fail(f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"the job server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield RayHead(dashboard=dashboard, env=env, temp_dir=temp_dir)
    finally:
        _stop(head, temp_dir)


def _ray(head: RayHead, *args: str, env: dict[str, str] | None = None, timeout: int = 120):
    return subprocess.run(
        [_ray_cli(), *args],
        env=env or head.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _job_info(head: RayHead, submission_id: str) -> dict:
    """The job server's record of one job (REST API of `ray job status`)."""
    request = urllib.request.Request(
        f"{head.dashboard}/api/jobs/{submission_id}",
        headers={"Authorization": f"Bearer {head.env['RAY_AUTH_TOKEN']}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_the_job_server_refuses_a_wrong_token(ray_head):
    wrong = dict(ray_head.env, RAY_AUTH_TOKEN=secrets.token_hex(32))
    result = _ray(ray_head, "job", "list", f"--address={ray_head.dashboard}", env=wrong)
    assert result.returncode != 0
    assert "Authentication failed" in result.stdout + result.stderr


def _mixture(path: Path, seed: int = 0) -> int:
    """Three well-separated 2-D Gaussian blobs, 150 points each; returns N."""
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [8.0, 0.0], [0.0, 8.0]])
    X = np.concatenate([c + rng.normal(size=(150, 2)) for c in centres]).astype(np.float32)
    np.save(path, X)
    return len(X)


@needs_fit
@pytest.mark.parametrize(
    "workers",
    [
        pytest.param([], id="in-the-driver"),
        # Ray Train on the job's cluster: `--ray-address auto` finds it through the
        # RAY_ADDRESS the job server gives the driver; 2 DDP workers use both CPUs
        pytest.param(["--num-workers", "2", "--ray-address", "auto", "--quiet"], id="two-workers"),
    ],
)
def test_ray_job_submit_runs_a_tiny_fit(ray_head, tmp_path, workers):
    n = _mixture(tmp_path / "mixture.npy")
    output = tmp_path / "run"
    submission_id = f"deepdpm-fit-{uuid.uuid4().hex[:8]}"
    runtime_env = {
        "excludes": WORKING_DIR_EXCLUDES,
        "env_vars": {"OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"},
    }
    fit = ["python", "-m", "pipeline.cli", "fit", "--input", str(tmp_path / "mixture.npy")]
    fit += ["--output", str(output), "--config", "cluster_configs/local.yaml", "--seed", "0"]
    fit += ["--no-tracking", *workers]
    started = time.monotonic()
    result = _ray(
        ray_head,
        "job",
        "submit",
        f"--address={ray_head.dashboard}",
        f"--submission-id={submission_id}",
        f"--working-dir={REPO}",
        f"--runtime-env-json={json.dumps(runtime_env)}",
        "--",
        *fit,
        timeout=600,
    )
    logs = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, logs
    print(f"ray job submit of the tiny fit: {time.monotonic() - started:.1f} s")

    job = _job_info(ray_head, submission_id)
    assert job["status"] == "SUCCEEDED", job
    assert job["runtime_env"]["working_dir"].startswith("gcs://_ray_pkg_"), job["runtime_env"]

    summary = json.loads((output / "summary.json").read_text())
    assert summary["n_clusters"] >= 1 and summary["epochs"] >= 1, summary
    assignments = pq.read_table(output / "assignments.parquet").to_pydict()
    assert len(assignments["cluster"]) == n
    assert len(set(assignments["cluster"])) == summary["n_clusters"]
    assert (output / "model.pt").stat().st_size > 0
    if workers:  # the job's driver started no cluster of its own: it used the job's
        assert summary["num_workers"] == 2
        assert any((output / "ray_train").glob("checkpoint_2*"))
        assert "Started a local Ray instance" not in logs
