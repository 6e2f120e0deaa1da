"""``deepdpm fit --num-workers 2`` as a user runs it: the command in a subprocess, with
the local Ray cluster it starts for itself.

- its stderr holds the project's lines and the progress bar, nothing of Ray's, Ray
  Train's or faiss's routine output, no colour codes, whole epoch counts;
- Ctrl-C (SIGINT to the command's process group, as a terminal sends it) stops every
  worker at the end of the epoch under way: exit code 130, one line naming the
  ``--resume`` command, the checkpoint of that epoch kept, no staging folder; and
  ``--resume`` then ends exactly as the uninterrupted fit.

Each test runs real Ray fits (about a minute each on 2 busy cores: most of it Ray
starting its cluster and workers).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
#: K = 4 in 15 epochs (of at most 30) on :func:`_mixture`, a checkpoint every 2
FIT = [
    "--num-workers", "2", "--config", str(REPO / "cluster_configs" / "local.yaml"), "--seed", "0",
    "--set", "init.n_clusters=2", "--set", "schedule.warmup_epochs=3",
    "--set", "schedule.move_every=3", "--set", "schedule.max_epochs=30",
    "--set", "small_data.max_rows=0",  # the nets' epochs (the Ray path of large data), long enough to stop
    "--checkpoint-every", "2", "--no-tracking",
]
#: what must not reach a Ray fit's stderr (the lines Ray, Ray Train and faiss print by
#: default; colour codes; fractional epoch counts such as ``7.00/30``)
NOISE = {
    "faiss's import log": re.compile(r"faiss|swigfaiss"),
    "Ray Train's reports": re.compile(r"Reporting training result|Checkpoint successfully created"),
    "a core worker's log line": re.compile(r"core_worker\.cc|max_restarts"),
    "Ray's INFO lines": re.compile(r"Started a local Ray instance|View the dashboard|INFO"),
    "a worker's prefix": re.compile(r"\((?:\w+ )?pid="),
    "Ray Train's own Ctrl-C": re.compile(r"Gracefully aborting"),
    "colour codes": re.compile("\x1b\\["),
    "a fractional count": re.compile(r"\d\.\d+/\d+"),
}


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
           "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0",
           # token auth with a token of this session, never the machine's ~/.ray/auth_token
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)  # the command starts its own cluster
    return env


def _lines(stderr: str) -> list[str]:
    """stderr as shown, line by line (each ``\\r`` redraws the bar); no blank lines."""
    return [s for s in re.split(r"[\r\n]", stderr) if s.strip()]


def _noise(stderr: str) -> dict[str, list[str]]:
    """The lines of ``stderr`` that are noise, by kind; and any line not the project's."""
    lines = _lines(stderr)
    found = {kind: [s for s in lines if pattern.search(s)] for kind, pattern in NOISE.items()}
    found["not the project's"] = [s for s in lines if not s.startswith("deepdpm")]
    return {kind: lines[:3] for kind, lines in found.items() if lines}


def _history(run: Path) -> list[dict]:
    """Every epoch's record without its timings."""
    summary = json.loads((run / "summary.json").read_text())
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in summary["history"]]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    """4 unit Gaussians on corners of a 4-D cube of side 12, 200 rows each (.npy)."""
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0, 0, 0], [12, 0, 0, 0], [0, 12, 12, 0], [12, 12, 0, 12]], float)
    X = np.concatenate([c + rng.normal(size=(200, 4)) for c in centres]).astype(np.float32)
    path = tmp_path_factory.mktemp("data") / "mixture.npy"
    np.save(path, X[rng.permutation(len(X))])
    return path


@pytest.fixture(scope="module")
def whole(mixture, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The uninterrupted fit, with its progress bar."""
    out = tmp_path_factory.mktemp("whole") / "run"
    fit = subprocess.run([sys.executable, "-m", "pipeline.cli", "fit", "--input", str(mixture),
                          "--output", str(out), *FIT], env=_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stderr[-3000:]
    return out, fit


def test_a_ray_fits_stderr_holds_only_its_own_lines_and_bar(whole):
    out, fit = whole
    assert fit.stdout.startswith("K=4 epochs=15 ") and fit.stdout.rstrip().endswith(f"-> {out}")
    assert _noise(fit.stderr) == {}, fit.stderr[-3000:]
    # the bar, drawn by Ray's driver for rank 0, as a fit in this process draws its own
    bars = _lines(fit.stderr)
    assert bars and all(s.startswith("deepdpm fit K=") for s in bars), bars[:5]
    assert re.search(r"stopped: K settled after 15 epochs .*100%.* 15/15 ", bars[-1]), bars[-1]


def test_ctrl_c_stops_a_ray_fit_at_an_epoch_end_resumably_and_resume_ends_as_the_whole_fit(
        whole, mixture, tmp_path):
    reference = whole[0]
    run, err_path = tmp_path / "run", tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        fit = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "fit", "--input",
                                str(mixture), "--output", str(run), *FIT],
                               env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                               start_new_session=True)  # its own process group, as in a terminal
        deadline = time.monotonic() + 300
        while not list((run / "ray_train").glob("checkpoint_*")):  # 2 epochs done
            assert fit.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.05)
        os.killpg(fit.pid, signal.SIGINT)  # Ctrl-C: the command and the cluster it started
        t0 = time.monotonic()
        out, _ = fit.communicate(timeout=120)
        seconds = time.monotonic() - t0
    stderr = err_path.read_text()
    print(f"SIGINT to exit: {seconds:.2f} s")
    assert fit.returncode == 130 and out == b"", stderr[-3000:]
    assert _noise(stderr) == {}, stderr[-3000:]
    lines = _lines(stderr)
    interrupted = [s for s in lines if "interrupted" in s]
    assert len(interrupted) == 1 and lines[-1] == interrupted[0], lines[-5:]
    stopped_at = int(re.fullmatch(
        rf"deepdpm fit: interrupted after epoch (\d+): deepdpm fit --resume {re.escape(str(run))} "
        "continues it", interrupted[0]).group(1))
    # the epoch under way at the Ctrl-C: no more than a few (of about a second each) after
    # the first checkpoint (epoch 2), far from the 15 of the whole fit
    assert 2 <= stopped_at <= 8, stopped_at
    # the epoch under way, then Ray's shutdown of its cluster (about 1.4 s) takes most of it
    assert seconds < 10
    # the request and Ray Train's checkpoints, whose latest is of that epoch; nothing else,
    # here or beside the folder (no staging folder)
    assert sorted(p.name for p in run.iterdir()) == ["fit_request.json", "ray_train"]
    snapshot = json.loads((run / "ray_train" / "checkpoint_manager_snapshot.json").read_text())
    assert snapshot["latest_checkpoint_result"]["metrics"]["epoch"] == stopped_at
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "stderr.txt"]

    resumed = subprocess.run([sys.executable, "-m", "pipeline.cli", "fit", "--resume", str(run),
                              "--quiet"], env=_env(), cwd=REPO, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr == ""  # --quiet: nothing at all
    # the same K, losses, moves and scores in every epoch, and the same labels
    assert _history(run) == _history(reference)
    assert pq.read_table(run / "assignments.parquet").equals(
        pq.read_table(reference / "assignments.parquet"))
    assert json.loads((run / "summary.json").read_text())["resumed_from_epoch"] == stopped_at


#: a driver whose fit thread still waits inside Ray (as after a Ctrl-C, while Ray Train
#: winds down) when the fit returns and its cluster is shut down
WAITING_DRIVER = """
import threading, time
from pathlib import Path
import ray
from pipeline.fit import ray as ray_fit
from pipeline.ray_cluster.local import connect_ray

assert connect_ray(None) == "local"

@ray.remote(num_cpus=0)
def winding_down():
    time.sleep(3)
    return "wound down"

class Run:
    def fit(self):
        self.result = ray.get(winding_down.remote())

run = Run()
fit = ray_fit._StoppableFit(run, Path("."))
fit._thread = threading.Thread(target=fit._fit, daemon=True)
fit._thread.start()
time.sleep(1)  # the thread is blocked in ray.get
ray_fit._shut_down_ray(fit)
assert ray.is_initialized()  # not under the waiting thread
fit.wait()
ray_fit._winding_down.join(60)
assert fit._error is None, repr(fit._error)
print(run.result, ray.is_initialized())
"""


def test_a_cluster_is_shut_down_only_once_the_fit_thread_has_left_ray():
    """ray.shutdown() under a thread blocked in ray.get frees the core worker it waits in
    (the process then dies of SIGSEGV, or the wait fails): the shutdown waits for it."""
    done = subprocess.run([sys.executable, "-c", WAITING_DRIVER], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["wound", "down", "False"], done.stdout
