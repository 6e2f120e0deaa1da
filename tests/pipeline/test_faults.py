"""Fault injection: real processes killed at every step, concurrent runs, leftovers.

Each test function belongs to one guarantee of ``docs/reliability.md``.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from deepdpm_core.config.loading import MAX_YAML_DEPTH, MAX_YAML_NODES, load_config, parse_overrides
from deepdpm_core.errors import CheckpointError, ConfigError
from deepdpm_core.model.files import safe_load as load_checkpoint_file
from pipeline.cli import main
from pipeline.io.run_folder import remove_leftovers
from pipeline.io.table_writing import features_table
from tests.support.ray_cluster import local_ray

# Ray reads its auth mode when it is first imported (the tests below import it late): token
# auth with a token of this session, as in tests/system/test_ray_fit.py
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

REPO = Path(__file__).resolve().parents[2]
#: a fit of a few seconds on 2 CPU cores
QUICK_FIT = ["--config", str(REPO / "cluster_configs" / "local.yaml"), "--no-tracking", "--quiet"]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # tracked live from the first epoch: the outage tests act on runs while they log
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0",
            "DEEPDPM_TRACK_LIVE_AFTER_S": "0"}


def _deepdpm(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _blobs(path: Path, n: int, seed: int) -> Path:
    """Three well-separated 4-D Gaussian blobs with labels, as .npz."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, 4)) * 10
    X = np.concatenate([c + rng.normal(size=(n // 3, 4)) for c in centres]).astype(np.float32)
    np.savez(path, X=X, y=np.repeat(np.arange(3), n // 3))
    return path


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes); {} when it does not exist."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


# -- a run folder is never a mix of two runs ---------------------------------------------

@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished fit, plus an entry that no run writes (``notes/keep.txt``)."""
    root = tmp_path_factory.mktemp("earlier")
    out = root / "run"
    assert main(["fit", "--input", str(_blobs(root / "a.npz", 240, 0)), "--output", str(out),
                 "--set", "schedule.max_epochs=3", *QUICK_FIT]) == 0
    (out / "notes").mkdir()
    (out / "notes" / "keep.txt").write_text("mine")
    return out


@pytest.mark.parametrize("publish", ["exchange", "two-renames"])
def test_fit_killed_at_every_write_step_leaves_exactly_one_run(tmp_path, earlier_run, publish):
    """A re-fit killed (SIGKILL) at each file-system step of writing its outputs leaves
    the folder holding exactly the earlier run or exactly the new one (with the folder's
    other entries kept), no temporary file in it, and nothing that the next writer's
    clean-up cannot remove; a rerun after a kill mid-publish completes."""
    work, results = tmp_path / "work", tmp_path / "results"
    out = work / "run"
    shutil.copytree(earlier_run, out)
    earlier = _files(out)

    refit = ["--input", str(_blobs(tmp_path / "b.npz", 300, 1)), "--output", str(out),
             "--overwrite", "--set", "schedule.max_epochs=4", *QUICK_FIT]
    options = [] if publish == "exchange" else ["--no-exchange"]
    harness = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "fault_harness.py"), str(results), *options, "--",
         *refit], env=_env(), capture_output=True, text=True, timeout=900)
    assert harness.returncode == 0, harness.stderr
    new = _files(out)
    assert new.keys() == earlier.keys() and new["notes/keep.txt"] == b"mine"
    assert all(new[name] != earlier[name] for name in new if name != "notes/keep.txt")

    steps = sorted(p for p in results.iterdir() if p.name != "before")
    # 4 files, >= 5 plots, the publish (exchange or 2 renames, the link of notes/keep.txt)
    assert len(steps) >= 11

    if publish == "two-renames":
        # a rerun after the kill between the two renames (no folder at all) puts the
        # earlier run back, fits and publishes; nothing is left beside the folder
        middle = [step for step in steps if not (step / "run").exists()]
        worst = tmp_path / "worst"
        shutil.copytree(middle[0], worst, symlinks=True)
        assert main(["fit", *[str(worst / "run") if a == str(out) else a for a in refit]]) == 0
        again = _files(worst / "run")
        assert again.keys() == new.keys() and again["notes/keep.txt"] == b"mine"
        assert sorted(e.name for e in worst.iterdir()) == ["run"]
    seen, missing = set(), []
    for step in steps:
        left = step / "run"
        state = _files(left)
        if not left.exists():
            missing.append(step.name)  # only between the two renames of the fallback
        else:
            assert state in (earlier, new), f"killed before step {step.name}: a mix of two runs"
            assert not list(left.glob(".*.tmp")), step.name
            seen.add("earlier" if state == earlier else "new")
        for entry in step.iterdir():  # beside the folder: its lock, staging and old folders
            assert entry.name in ("run", ".run.lock") or entry.name.startswith(
                (".run.staging-", ".run.old-"))
        remove_leftovers(left)  # what the next writer does once it holds the lock
        assert sorted(e.name for e in step.iterdir()) == [".run.lock", "run"], step.name
        assert _files(left) in (earlier, new), step.name
    assert seen == {"earlier", "new"}
    assert len(missing) == (0 if publish == "exchange" else 1)


# -- one writer per output folder ----------------------------------------------------------

def _wait_for(predicate, timeout: float = 240.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holder_never_blocks(
        tmp_path, earlier_run):
    """While a fit writes a folder, a second fit or a predict into it fails at once
    with one line naming the first (exit 2, the folder untouched); after ``kill -9`` of
    the first, its lock does not block the next run, which completes."""
    out = tmp_path / "run"
    data = _blobs(tmp_path / "c.npz", 3000, 2)
    # no move rounds: nothing settles K, the fit runs to max_epochs
    long_fit = ["fit", "--input", str(data), "--output", str(out), "--set", "schedule.max_epochs=100000",
                "--set", "moves.split=false", "--set", "moves.merge=false", *QUICK_FIT]
    first = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *long_fit], env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".run.lock"
    try:
        _wait_for(lambda: lock.exists() and "deepdpm fit" in lock.read_text(), what="the lock")
        for second in (long_fit,
                       ["predict", "--model", str(earlier_run / "model.pt"), "--input", str(data),
                        "--output", str(out)]):
            refused = _deepdpm(*second)
            assert refused.returncode == 2, refused.stderr
            line, = refused.stderr.strip().splitlines()
            assert f"is being written by deepdpm fit (pid {first.pid} on " in line, line
        assert not out.exists() or not any(out.iterdir())  # the first is still fitting
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert lock.exists()  # left by the killed run, held by no one
    assert main([a if a != "schedule.max_epochs=100000" else "schedule.max_epochs=3" for a in long_fit]) == 0
    assert (out / "summary.json").exists() and not lock.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".run")) == []


def test_extract_killed_mid_shard_leaves_no_cluster_and_its_rerun_loses_and_repeats_nothing(
        tmp_path):
    """``deepdpm extract`` killed (SIGKILL) while it embeds: a second extract into the same
    folder meanwhile is refused naming it; every process of the local Ray cluster it
    started is gone within seconds of the kill; the rerun embeds each image exactly once
    and leaves no temporary file."""
    from pipeline.extract.shards import digits_image_folder, write_shards
    from pipeline.io.tables import read_features
    from pipeline.ray_cluster.guard import descendants, start_time

    shards = tmp_path / "shards"
    write_shards(digits_image_folder(tmp_path / "images"), shards, shard_size=300, progress=False)
    out = tmp_path / "features"
    extract = ["extract", "--shards", str(shards), "--output", str(out), "--encoder", "pixels",
               "--batch-size", "16", "--no-progress", "--no-tracking"]
    first = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *extract], env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def cluster() -> dict[int, int]:
            return descendants({first.pid: start_time(first.pid)})

        # embedding has begun once a guard watches the cluster and encoder actors run
        _wait_for(lambda: any("pipeline.ray_cluster.guard" in _cmdline(p) for p in cluster())
                  and any("MapWorker" in _cmdline(p) for p in cluster()), what="the encoders")
        other = _deepdpm(*extract, "--pixel-size", "4")
        assert other.returncode == 2
        assert f"being written by deepdpm extract (pid {first.pid} on " in other.stderr
        started = cluster()
        del started[first.pid]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert len(started) >= 5  # GCS, raylet, agents, the guard, encoder actors
    killed_at = time.monotonic()
    _wait_for(lambda: all(start_time(pid) != start for pid, start in started.items()),
              timeout=30, what="the cluster's processes to end")
    print(f"the local Ray cluster ended {time.monotonic() - killed_at:.1f} s after the kill")

    rerun = _deepdpm(*extract)
    assert rerun.returncode == 0, rerun.stderr
    keys = read_features(out).keys
    assert len(keys) == len(set(keys)) == 1797
    assert not list(out.glob(".*.tmp")) and not list(tmp_path.glob(".features.*"))


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# --------------------------------------------------- a single-process fit is resumable
#: local.yaml's prior with a short schedule: K = 4 in about 15 epochs
RESUMABLE_FIT = [
    "--config", str(REPO / "cluster_configs" / "local.yaml"), "--seed", "0",
    "--set", "init.n_clusters=2", "--set", "schedule.warmup_epochs=3",
    "--set", "schedule.move_every=3", "--set", "schedule.max_epochs=30", "--quiet", "--no-tracking",
]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    """4 unit Gaussians on corners of a 4-D cube of side 12, 200 labelled rows each (Parquet)."""
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0, 0, 0], [12, 0, 0, 0], [0, 12, 12, 0], [12, 12, 0, 12]], float)
    X = np.concatenate([c + rng.normal(size=(200, 4)) for c in centres])
    y = np.repeat(np.arange(4), 200)
    order = rng.permutation(len(X))
    path = tmp_path_factory.mktemp("faults") / "mixture.parquet"
    pq.write_table(features_table(X[order].astype(np.float32), np.arange(len(X)), y[order]), path)
    return path


def _history(run: Path) -> list[dict]:
    """Every epoch's record without its timings."""
    summary = json.loads((run / "summary.json").read_text())
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in summary["history"]]


def test_a_single_process_fit_killed_mid_fit_resumes_to_the_uninterrupted_result(mixture, tmp_path,
                                                                                  capsys):
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert main(["fit", "--input", str(mixture), "--output", str(whole), *RESUMABLE_FIT]) == 0
    fit = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "fit", "--input", str(mixture), "--output", str(run),
         *RESUMABLE_FIT, "--checkpoint-every", "2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "epoch_000004.pt").exists():
        assert fit.poll() is None, fit.communicate()
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.02)
    fit.send_signal(signal.SIGKILL)
    fit.communicate()
    assert fit.returncode == -signal.SIGKILL
    assert not (run / "summary.json").exists()  # stopped mid-fit
    stopped_at = max(int(p.stem.split("_")[1]) for p in (run / "checkpoints").glob("epoch_*.pt"))

    assert main(["fit", "--resume", str(run), "--quiet"]) == 0
    # the same K, losses, moves and per-epoch scores in every epoch, and the same labels
    assert len(_history(whole)) > stopped_at + 2
    assert _history(run) == _history(whole)
    assert pq.read_table(run / "assignments.parquet").equals(pq.read_table(whole / "assignments.parquet"))
    assert json.loads((run / "summary.json").read_text())["resumed_from_epoch"] == stopped_at
    # the same files, plus the request and the last 2 checkpoints (no temporary file)
    assert {p.name for p in run.iterdir()} == {p.name for p in whole.iterdir()} | {
        "fit_request.json", "checkpoints"}
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(kept) == 2 and all(name.startswith("epoch_") and name.endswith(".pt") for name in kept)

    capsys.readouterr()
    assert main(["fit", "--resume", str(run), "--num-workers", "2"]) == 2
    assert "holds a fit that ran in one process" in capsys.readouterr().err
    assert main(["fit", "--input", str(mixture), "--output", str(run), *RESUMABLE_FIT]) == 2
    assert f"holds checkpoints of an earlier fit: continue it with --resume {run}" in capsys.readouterr().err


def test_ctrl_c_stops_a_fit_at_an_epoch_end_resumably_and_resume_gives_the_same_labels(
        mixture, tmp_path):
    # a .npy without labels: the fit keeps no checkpoints of its own (no --checkpoint-every)
    X = pq.read_table(mixture).column("embedding").to_numpy(zero_copy_only=False)
    data = tmp_path / "mixture.npy"
    np.save(data, np.stack(X).astype(np.float32))
    whole, run = tmp_path / "whole", tmp_path / "run"
    shown = [arg for arg in RESUMABLE_FIT if arg != "--quiet"]  # the bar tells the epochs
    assert main(["fit", "--input", str(data), "--output", str(whole), *RESUMABLE_FIT]) == 0
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        fit = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "fit", "--input", str(data),
                                "--output", str(run), *shown],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=err)
        deadline = time.monotonic() + 300
        while not re.search(r"\| *[3-9]/\d+ ", err_path.read_text()):  # 3 epochs done
            assert fit.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, "no third epoch after 300 s"
            time.sleep(0.02)
        fit.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, _ = fit.communicate(timeout=60)
        seconds = time.monotonic() - t0
    print(f"SIGINT to exit: {seconds:.2f} s")
    assert fit.returncode == 130 and out == b""
    assert seconds < 10  # the epoch under way, the checkpoint and the exit (about 1 s)
    lines = [s for s in re.split(r"[\r\n]", err_path.read_text()) if s.strip()]
    interrupted = [s for s in lines if "interrupted" in s]
    assert len(interrupted) == 1 and lines[-1] == interrupted[0]
    stopped_at = int(re.fullmatch(
        rf"deepdpm fit: interrupted after epoch (\d+): deepdpm fit --resume {re.escape(str(run))} "
        "continues it", interrupted[0]).group(1))
    assert 3 <= stopped_at < len(_history(whole))
    # a checkpoint of the epoch it stopped at, the request, nothing else; no staging folder
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "fit_request.json"]
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"epoch_{stopped_at:06d}.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixture.npy", "run", "stderr.txt", "whole"]

    assert main(["fit", "--resume", str(run), "--quiet"]) == 0
    assert _history(run) == _history(whole)
    assert pq.read_table(run / "assignments.parquet").equals(pq.read_table(whole / "assignments.parquet"))
    assert json.loads((run / "summary.json").read_text())["resumed_from_epoch"] == stopped_at


def _kill_after_checkpoint(argv: list[str], run: Path, epoch: int = 4) -> None:
    """Start ``deepdpm fit argv`` and SIGKILL it once ``run`` holds the checkpoint of ``epoch``."""
    fit = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "fit", *argv], cwd=REPO, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / f"epoch_{epoch:06d}.pt").exists():
        assert fit.poll() is None, fit.communicate()
        assert time.monotonic() < deadline, f"no checkpoint of epoch {epoch} after 300 s"
        time.sleep(0.02)
    fit.send_signal(signal.SIGKILL)
    fit.communicate()


def _one_refusal(err: str, *parts: str) -> bool:
    return len(err.splitlines()) == 1 and "Traceback" not in err and all(p in err for p in parts)


def test_a_folder_holds_one_fit_overwrite_drops_the_old_and_resume_checks_what_it_continues(
        mixture, tmp_path, capsys):
    """A checkpointed fit killed and resumed, then ``fit --overwrite``
    with other input into its folder: the publish drops the old checkpoints and request
    with its outputs, and ``--resume`` refuses in one line (it resumed the old fit).
    ``--resume`` also refuses a changed input, a checkpoint of another fit, and a request
    beside a finished fit it does not belong to; a resumable overwrite killed mid-fit
    resumes its own fit."""
    run = tmp_path / "run"
    first = ["--input", str(mixture), "--output", str(run), *RESUMABLE_FIT, "--checkpoint-every", "2"]
    _kill_after_checkpoint(first, run)
    assert not (run / "summary.json").exists()
    assert main(["fit", "--resume", str(run), "--quiet"]) == 0
    assert (run / "fit_request.json").exists() and (run / "checkpoints").is_dir()

    other = _blobs(tmp_path / "other.npz", 600, 1)
    refit = ["fit", "--input", str(other), "--output", str(run), *RESUMABLE_FIT, "--overwrite"]
    assert main(refit) == 0
    newer = _files(run)
    assert "fit_request.json" not in newer and not any(n.startswith("checkpoints") for n in newer)
    assert json.loads(newer["summary.json"])["input"] == str(other)
    capsys.readouterr()
    assert main(["fit", "--resume", str(run), "--quiet"]) == 2
    assert _one_refusal(capsys.readouterr().err, "is not the output directory of a fit with checkpoints")
    assert _files(run) == newer

    # a resumable overwrite killed mid-fit: the folder still shows the finished fit, and
    # --resume continues the new one (its request and checkpoints), which replaces it
    second = ["--input", str(mixture), "--output", str(run), *RESUMABLE_FIT, "--checkpoint-every", "2",
              "--overwrite"]
    _kill_after_checkpoint(second, run)  # summary.json of the other fit is still there
    assert (run / "summary.json").read_bytes() == newer["summary.json"]
    assert main(["fit", "--resume", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    request = json.loads((run / "fit_request.json").read_text())
    assert summary["input"] == str(mixture) and summary["fit_id"] == request["fit_id"]
    assert summary["resumed_from_epoch"] is not None
    # resuming the finished fit gives it again
    assert main(["fit", "--resume", str(run), "--quiet"]) == 0
    assert _history(run) == [{k: v for k, v in r.items() if not k.startswith("seconds")}
                             for r in summary["history"]]

    # a request (and its checkpoints) beside a finished fit they do not belong to: what the
    # old --overwrite left
    mixed = tmp_path / "mixed"
    assert main(["fit", "--input", str(other), "--output", str(mixed), *RESUMABLE_FIT]) == 0
    shutil.copytree(run / "checkpoints", mixed / "checkpoints")
    shutil.copy(run / "fit_request.json", mixed / "fit_request.json")
    before = _files(mixed)
    capsys.readouterr()
    assert main(["fit", "--resume", str(mixed), "--quiet"]) == 2
    assert _one_refusal(capsys.readouterr().err, "holds a finished fit (summary.json) that is not the one")
    assert _files(mixed) == before

    # the input changed since the fit started (same size, other rows)
    data = tmp_path / "data.npy"
    np.save(data, np.stack(pq.read_table(mixture).column("embedding").to_numpy(
        zero_copy_only=False)).astype(np.float32))
    stopped = tmp_path / "stopped"
    _kill_after_checkpoint(["--input", str(data), "--output", str(stopped), *RESUMABLE_FIT,
                            "--checkpoint-every", "2"], stopped)
    X = np.load(data)
    np.save(data, X[::-1].copy())
    capsys.readouterr()
    assert main(["fit", "--resume", str(stopped), "--quiet"]) == 2
    assert _one_refusal(capsys.readouterr().err, f"its input {data} changed since it started",
                        "its content differs")
    np.save(data, X)
    # a checkpoint of another fit (same rows) put beside the request
    newest = max((stopped / "checkpoints").glob("epoch_*.pt"))
    shutil.copy(max((run / "checkpoints").glob("epoch_*.pt")), newest)
    assert main(["fit", "--resume", str(stopped), "--quiet"]) == 2
    assert _one_refusal(capsys.readouterr().err, f"checkpoint {newest} belongs to another fit")
    assert not (stopped / "summary.json").exists()


# ------------------------------------------------ every tracked run ends, outages included
def _runs(server) -> dict[str, dict]:
    """run name -> status, end time and deepdpm tags, read from the server's store."""
    import sqlite3

    with sqlite3.connect(f"file:{server.root / 'mlflow.db'}?mode=ro", uri=True) as con:
        runs = {uuid: {"name": name, "status": status, "end_time": end}
                for uuid, name, status, end in con.execute(
                    "select run_uuid, name, status, end_time from runs")}
        for uuid, key, value in con.execute(
                "select run_uuid, key, value from tags where key like 'deepdpm.%'"):
            runs[uuid][key] = value
        epochs = dict(con.execute("select run_uuid, count(*) from metrics where key = 'n_clusters' "
                                  "group by run_uuid"))
    return {r["name"]: {**r, "epochs": epochs.get(uuid, 0)} for uuid, r in runs.items()}


def _logged(server, name: str) -> int:
    """Epochs of the run ``name`` that reached the server."""
    return _runs(server).get(name, {}).get("epochs", 0)


def _outage_argv(server, data: Path, out: Path, name: str, epochs: int) -> list[str]:
    return ["fit", "--input", str(data), "--output", str(out), "--config",
            str(REPO / "cluster_configs" / "local.yaml"), "--seed", "0", "--quiet",
            "--set", f"schedule.max_epochs={epochs}", "--set", "moves.split=false", "--set", "moves.merge=false",
            "--tracking-uri", server.uri, "--experiment", "outage", "--run-name", name]


def _outage_fit(server, data: Path, out: Path, state: Path, name: str, epochs: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *_outage_argv(server, data, out, name, epochs)],
                            cwd=REPO, env={**_env(), "XDG_STATE_HOME": str(state)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _next_command(server, data: Path, out: Path, state: Path, name: str, monkeypatch) -> None:
    """A tracked fit of 3 epochs in this process (no start-up of a new one to wait for): the
    next command to ``server``, with ``state`` as its ``$XDG_STATE_HOME``."""
    from pipeline.tracking.client_settings import HTTP_ENV_DEFAULTS, QUIET_ENV_DEFAULTS

    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    for key, value in {**HTTP_ENV_DEFAULTS, **QUIET_ENV_DEFAULTS}.items():
        monkeypatch.setenv(key, value)  # what the command sets, undone after the test
    assert main(_outage_argv(server, data, out, name, epochs=3)) == 0


def _seconds_after_outputs(fit: subprocess.Popen, out: Path) -> float:
    """Wait for ``fit`` to exit (status 0); seconds from its summary.json to its exit."""
    deadline = time.monotonic() + 600
    while fit.poll() is None:
        assert time.monotonic() < deadline, "the fit did not end in 600 s"
        time.sleep(0.05)
    ended = time.time()
    assert fit.returncode == 0, fit.stderr.read()
    return ended - (out / "summary.json").stat().st_mtime


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """One real MLflow server on 127.0.0.1 for the tracked-run tests below (a start takes
    10-25 s on 2 cores); the outage test, the last of them, kills, restarts and freezes it."""
    from tests.support.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("tracking-server")).start()
    yield server
    server.kill()


def test_a_run_whose_command_is_killed_ends_killed_by_the_next_command_and_live_runs_are_left_alone(
        tracking_server, tmp_path, monkeypatch):
    """A tracked fit killed by SIGKILL (nothing of it left to end its run) has its run
    ended KILLED, saying so, by the next tracked command to the same real MLflow server on
    127.0.0.1; a command that ends while another one's run is live leaves that run
    RUNNING."""
    from pipeline.tracking.pending_closes import END_REASON_TAG

    server = tracking_server
    data = tmp_path / "c.npy"
    rng = np.random.default_rng(3)
    np.save(data, np.concatenate([c + rng.normal(size=(1000, 4)) for c in rng.normal(size=(3, 4)) * 10])
            .astype(np.float32))
    state = tmp_path / "state"
    fit = _outage_fit(server, data, tmp_path / "sigkilled", state, "sigkilled", epochs=100_000)
    try:
        _wait_for(lambda: _logged(server, "sigkilled") >= 5 or fit.poll() is not None,
                  what="5 epochs logged")
        assert fit.poll() is None, "the fit ended before the kill"
        _next_command(server, data, tmp_path / "beside", state, "beside", monkeypatch)
        assert _runs(server)["sigkilled"]["status"] == "RUNNING"  # its command still runs
    finally:
        fit.kill()
        fit.wait()
    _next_command(server, data, tmp_path / "after", state, "after", monkeypatch)
    runs = _runs(server)
    killed = runs["sigkilled"]
    assert killed["status"] == "KILLED" and killed["end_time"], killed
    assert killed[END_REASON_TAG].startswith(f"the command (pid {fit.pid}) was killed before it "
                                             "ended its run"), killed
    assert str(tmp_path / "sigkilled") in killed[END_REASON_TAG]
    assert runs["beside"]["status"] == runs["after"]["status"] == "FINISHED"
    assert not list((state / "deepdpm" / "pending_closes").glob("*.json"))


def test_a_tracked_run_ends_in_a_final_state_saying_why_also_when_its_server_was_killed_or_frozen(
        tracking_server, tmp_path, monkeypatch):
    """A real MLflow server on 127.0.0.1 is killed (SIGKILL to its process
    group) during a tracked fit, and frozen (SIGSTOP) near the end of another: each fit
    finishes with its outputs, exits within 15 s of writing them, and its run, left
    RUNNING, is ended FAILED (with the reason and the output folder) by the next tracked
    command once the server answers again. A run that ends normally is FINISHED, one
    stopped by Ctrl-C KILLED, each with its reason. The one server serves them all in
    turn: restarted on its store after the kill, resumed (SIGCONT) after the freeze."""
    from pipeline.tracking.pending_closes import END_REASON_TAG, OUTPUT_TAG

    data = tmp_path / "c.npy"
    rng = np.random.default_rng(2)
    np.save(data, np.concatenate([c + rng.normal(size=(1000, 4)) for c in rng.normal(size=(3, 4)) * 10])
            .astype(np.float32))
    state = tmp_path / "state"
    server = tracking_server
    try:
        # killed: after 20 of 300 epochs reached the server; frozen: 40 epochs before the end
        for how, epochs, at in (("killed", 300, 20), ("frozen", 100, 60)):
            out = tmp_path / how
            fit = _outage_fit(server, data, out, state, how, epochs=epochs)
            _wait_for(lambda h=how, n=at, f=fit: _logged(server, h) >= n or f.poll() is not None,
                      timeout=300, what=f"{at} epochs logged")
            assert fit.poll() is None, "the fit ended before the outage"
            os.killpg(server.proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            waited = _seconds_after_outputs(fit, out)
            print(f"{how} server: the fit exited {waited:.1f} s after writing its outputs")
            assert waited < 15, f"{how}: {waited:.1f} s after the outputs"
            assert json.loads((out / "summary.json").read_text())["epochs"] == epochs
            if how == "killed":
                server.proc.wait()
                server.start()  # the same store, port and artifacts
            else:
                os.killpg(server.proc.pid, signal.SIGCONT)
            _wait_for(server.healthy, timeout=120, what="the server to answer again")
            # the next tracked command to this server ends the run
            _next_command(server, data, tmp_path / f"{how}-after", state, f"{how}-after", monkeypatch)
            runs = _runs(server)
            run = runs[how]
            assert run["status"] == "FAILED" and run["end_time"], run
            assert run[END_REASON_TAG].startswith("tracking failed (") and str(out) in run[END_REASON_TAG]
            assert run[OUTPUT_TAG] == str(out)
            finished = runs[f"{how}-after"]
            assert finished["status"] == "FINISHED", finished
            assert finished[END_REASON_TAG] == f"finished; outputs in {tmp_path / f'{how}-after'}"
            assert not list((state / "deepdpm" / "pending_closes").glob("*.json"))

        fit = _outage_fit(server, data, tmp_path / "stopped", state, "stopped", epochs=300)
        _wait_for(lambda: _logged(server, "stopped") >= 5, what="5 epochs logged")
        fit.send_signal(signal.SIGINT)
        assert fit.wait(timeout=60) == 130
        run = _runs(server)["stopped"]
        assert run["status"] == "KILLED" and run[END_REASON_TAG].startswith("interrupted after epoch")
        assert run[OUTPUT_TAG] == str(tmp_path / "stopped")
    finally:
        server.kill()


# ------------------------------------------------- small hostile inputs stay small
def _alias_bomb(levels: int = 9) -> list[str]:
    """A "billion laughs" list: level i holds 9 aliases of level i - 1 (9**levels strings)."""
    items = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return items


def test_a_yaml_alias_bomb_fails_fast_in_one_short_line(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("seed:\n" + "".join(f"  - {item}\n" for item in _alias_bomb()))
    assert bomb.stat().st_size <= 1024
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_NODES} values through its aliases") as err:
        load_config(bomb)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 1.0 and peak < 20e6, (seconds, peak)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300

    with pytest.raises(ConfigError, match="through its aliases"):
        parse_overrides(["seed=[" + ", ".join(_alias_bomb()) + "]"])
    np.save(tmp_path / "x.npy", np.zeros((20, 2), dtype=np.float32))  # paths are checked first
    assert main(["fit", "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "out"),
                 "--config", str(bomb), "--no-tracking"]) == 2
    err_text = capsys.readouterr().err
    assert len(err_text.splitlines()) == 1 and "through its aliases" in err_text

    (tmp_path / "self.yaml").write_text("seed: &s [1, *s]\n")
    with pytest.raises(ConfigError, match="refers to itself"):
        load_config(tmp_path / "self.yaml")
    (tmp_path / "deep.yaml").write_text("seed: " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(ConfigError, match=f"nested more than {MAX_YAML_DEPTH} levels deep"):
        load_config(tmp_path / "deep.yaml")
    # a large value without aliases: the error shows its beginning only
    (tmp_path / "long.yaml").write_text("seed: [" + ", ".join(["9" * 60] * 3000) + "]\n")
    with pytest.raises(ConfigError, match=r"'seed' must be an integer, got \[9{60}, ") as err:
        load_config(tmp_path / "long.yaml")
    assert len(str(err.value)) < 300 and str(err.value).endswith("...")


# ------------------------------------------ a pickle that would run code is refused
class _RunsCommand:
    """Unpickled (unsafely), it calls ``os.system(command)``: the global ``posix.system``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _malicious_checkpoints(folder: Path, marker: Path) -> list[Path]:
    """The same payload as a raw pickle (protocols 2 and 5) and as a torch zip archive."""
    payload = {"format": "deepdpm-model/1", "state_dict": _RunsCommand(f"touch {marker}")}
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for protocol in (2, 5):
        paths.append(folder / f"raw{protocol}.pt")
        paths[-1].write_bytes(pickle.dumps(payload, protocol=protocol))
    paths.append(folder / "archive.pt")
    torch.save(payload, paths[-1])
    return paths


def _refused(err: str) -> bool:
    return (len(err.splitlines()) == 1 and "refused as unsafe" in err and "posix.system" in err
            and "weights_only=False" not in err and "Traceback" not in err)


def test_pickles_that_would_run_code_are_refused_naming_the_global(mixture, tmp_path, capsys):
    from ray.train import Checkpoint

    from pipeline.fit.checkpoints import CHECKPOINT_DIR, CHECKPOINT_FILE, load_ray_checkpoint
    from tests.support.image_data import encode_png, write_raw_shard

    marker = tmp_path / "code-ran"
    paths = _malicious_checkpoints(tmp_path / "evil", marker)
    # the payload is live: an unsafe load runs it
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))",
                    str(paths[0])], check=True)
    assert marker.exists()
    marker.unlink()

    shards = tmp_path / "shards"
    shards.mkdir()
    write_raw_shard(shards / "s-000000.tar", [
        {"__key__": "a", "png": encode_png(np.zeros((8, 8, 3), np.uint8)), "cls": b"0"}])
    run = tmp_path / "run"
    assert main(["fit", "--input", str(mixture), "--output", str(run), *RESUMABLE_FIT,
                 "--set", "schedule.max_epochs=2", "--checkpoint-every", "1"]) == 0
    capsys.readouterr()
    for path in paths:
        assert main(["predict", "--model", str(path), "--input", str(mixture),
                     "--output", str(tmp_path / "predicted.parquet")]) == 2
        assert _refused(capsys.readouterr().err)
        assert main(["extract", "--shards", str(shards), "--output", str(tmp_path / "features"),
                     "--encoder", "moco_v2", "--arch", "resnet18", "--weights", str(path),
                     "--no-tracking", "--no-progress"]) == 2
        assert _refused(capsys.readouterr().err)
        # fit --resume: a replaced single-process checkpoint, and a Ray Train checkpoint
        (run / CHECKPOINT_DIR / "epoch_000009.pt").write_bytes(path.read_bytes())
        assert main(["fit", "--resume", str(run), "--quiet"]) == 2
        assert _refused(capsys.readouterr().err)
        ray_checkpoint = tmp_path / "ray_checkpoint"
        ray_checkpoint.mkdir(exist_ok=True)
        (ray_checkpoint / CHECKPOINT_FILE).write_bytes(path.read_bytes())
        with pytest.raises(CheckpointError) as err:
            load_ray_checkpoint(Checkpoint.from_directory(str(ray_checkpoint)))
        assert _refused(str(err.value))
    assert not marker.exists()
    assert not (tmp_path / "predicted.parquet").exists()


class _Evaluates:
    """Unpickled (unsafely), it calls ``eval(source)``: the global ``builtins.eval``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self):
        return eval, (self.source,)


def test_a_refused_checkpoint_names_the_global_that_caused_it_not_the_tensors_beside_it(
        mixture, tmp_path, capsys):
    """A torch archive whose payload (``eval``) sits in a list after
    tensors, storages and an OrderedDict is refused naming ``builtins.eval`` alone."""
    marker = tmp_path / "code-ran"
    payload = {"format": "deepdpm-model/1",
               "state_dict": collections.OrderedDict(w=torch.zeros(3), b=torch.ones(2)),
               "extra": [torch.arange(4), _Evaluates(f"open({str(marker)!r}, 'w')")]}
    archive = tmp_path / "nested.pt"
    torch.save(payload, archive)
    for path in (archive, tmp_path / "raw.pt"):
        if path.name == "raw.pt":
            path.write_bytes(pickle.dumps(payload, protocol=2))
        with pytest.raises(CheckpointError) as err:
            load_checkpoint_file(path)
        named = re.search(r"refused as unsafe, .* the Python globals? (.*) it references",
                          str(err.value)).group(1).split(", ")
        # a raw pickle's tensors are rebuilt through torch.storage._load_from_bytes, itself
        # refused (it unpickles without weights_only)
        assert named == (["builtins.eval"] if path == archive
                         else ["torch.storage._load_from_bytes", "builtins.eval"]), named
        assert main(["predict", "--model", str(path), "--input", str(mixture),
                     "--output", str(tmp_path / "predicted.parquet")]) == 2
        err_text = capsys.readouterr().err
        assert len(err_text.splitlines()) == 1 and "builtins.eval it references" in err_text, err_text
    assert not marker.exists() and not (tmp_path / "predicted.parquet").exists()


def test_an_output_folder_the_user_may_not_write_is_refused_whatever_its_parent_allows(
        mixture, earlier_run, tmp_path, capsys):
    """``--output`` naming a folder of mode 555 in a writable folder is
    refused in one line naming its mode (the publish would have replaced it whole); so is
    a file of mode 444, for every command that writes one."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "keep.txt").write_text("mine")
    locked.chmod(0o555)
    page = tmp_path / "page.html"
    page.write_text("mine")
    page.chmod(0o444)
    try:
        for argv, output in (
                (["fit", "--input", str(mixture), "--output", str(locked), *RESUMABLE_FIT], locked),
                (["fit", "--input", str(mixture), "--output", str(locked), *RESUMABLE_FIT,
                  "--overwrite"], locked),
                (["predict", "--model", str(earlier_run / "model.pt"), "--input", str(mixture),
                  "--output", str(page), "--overwrite"], page),
                (["report", str(earlier_run), "--output", str(page), "--overwrite"], page)):
            assert main(argv) == 2
            mode = "555" if output == locked else "444"
            assert _one_refusal(capsys.readouterr().err, f"{output} is a ",
                                f"you may not write (mode {mode})")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["locked", "page.html"]
        assert _files(locked) == {"keep.txt": b"mine"} and page.read_text() == "mine"
        assert oct(locked.stat().st_mode & 0o777) == "0o555"
    finally:
        locked.chmod(0o755)
        page.chmod(0o644)


# ------------------------------------------------------ data errors are errors, not retries
#: local.yaml's fixed prior Ψ = 0.005·I (in the features' units) and a short schedule
LOCAL_SHORT = [
    "--config", str(REPO / "cluster_configs" / "local.yaml"), "--seed", "0",
    "--set", "init.n_clusters=3", "--set", "schedule.warmup_epochs=2",
    "--set", "schedule.move_every=2", "--set", "schedule.max_epochs=12", "--quiet",
]


@pytest.fixture(scope="module")
def degenerate(tmp_path_factory) -> Path:
    """4 rows repeated 150 times each (one copy of each moved by 0.5), times 1e25: at the
    prior's fixed scale every cluster would be degenerate without the covariance floor (the
    paper's model fails on them: ``tests/core/data/test_degenerate_data.py``)."""
    rng = np.random.default_rng(0)
    X = np.repeat(rng.normal(size=(4, 6)) * 6, 150, axis=0)
    X[::150] += 0.5
    path = tmp_path_factory.mktemp("degenerate") / "X.npy"
    np.save(path, (X * 1e25).astype(np.float32))
    return path


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster (2 CPUs) for the tests of this module that need one (the last
    ones): its workers' output stays out of the commands' stdout and stderr they check."""
    with local_ray(log_to_driver=False):
        yield


def test_duplicate_rows_far_from_a_fixed_prior_scale_fit(degenerate, tmp_path, capsys):
    # the covariance floor keeps each cluster's posterior positive-definite at local.yaml's
    # fixed prior, 1e27 times smaller than the clusters
    assert main(["fit", "--input", str(degenerate), "--output", str(tmp_path / "out"),
                 *LOCAL_SHORT, "--no-tracking"]) == 0
    capsys.readouterr()
    # at the defaults (the prior fitted to the clusters) the same rows fit into their 4 groups
    assert main(["fit", "--input", str(degenerate), "--output", str(tmp_path / "fitted"),
                 "--seed", "0", "--quiet", "--no-tracking", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_clusters"] == 4
    assert main(["fit", "--input", str(degenerate), "--output", str(tmp_path / "standard"),
                 *LOCAL_SHORT, "--no-tracking", "--set", "data.transform=standard"]) == 0
    # features near 1e25 fit in the fit's own coordinates, without float32 overflow warnings
    big = tmp_path / "big.npy"
    np.save(big, np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32) * 1e25)
    assert main(["fit", "--input", str(big), "--output", str(tmp_path / "big"), *LOCAL_SHORT,
                 "--no-tracking", "--set", "prior.sigma_scale=auto"]) == 0
    assert "overflow" not in capsys.readouterr().err


def test_a_data_error_on_ray_ends_the_run_without_retries(ray_session, degenerate, tmp_path):
    """A DataError every rank meets mid-fit (a covariance that fails on the data's clusters)
    ends a Ray fit at once, in one line: Ray Train, which retries whatever a worker raises,
    never sees it."""
    import sqlite3

    from deepdpm_core.errors import DataError
    from pipeline.cli import build_parser
    from pipeline.commands.fit import request_from_args
    from pipeline.fit import run_fit
    from tests.support.fault_hooks import DataErrorAt

    db = tmp_path / "mlflow.db"
    t0 = time.perf_counter()
    args = build_parser().parse_args([
        "fit", "--input", str(degenerate), "--output", str(tmp_path / "out"), *LOCAL_SHORT,
        "--num-workers", "2", "--max-failures", "3", "--tracking-uri", f"sqlite:///{db}",
        "--experiment", "data-error"])
    with pytest.raises(DataError) as info:
        run_fit(request_from_args(args), fault=DataErrorAt(3))
    seconds = time.perf_counter() - t0
    assert str(info.value).startswith("the fit failed numerically at epoch 3") and "\n" not in str(info.value)
    # one attempt (rank 0 tracks each attempt as an MLflow run), marked failed
    with sqlite3.connect(db) as con:
        assert con.execute("select status from runs").fetchall() == [("FAILED",)], seconds


# ------------------------- a Ray fit's publish keeps its checkpoints (clean up after failures)
def test_a_ray_fit_keeps_its_checkpoints_through_the_publish_and_prunes_unlisted_ones(
        ray_session, tmp_path):
    """A Ray fit (2 workers, a checkpoint every epoch) publishes its outputs with
    ``ray_train/`` and ``fit_request.json`` kept, at most the 2 checkpoints Ray Train
    lists, nothing left beside the folder; a checkpoint folder the snapshot does not list
    (what a driver killed right after a worker's upload leaves) is removed."""
    from pipeline.fit.checkpoints import TRAIN_DIR, checkpoint_dir_names, prune_checkpoints

    out = tmp_path / "run"
    assert main(["fit", "--input", str(_blobs(tmp_path / "a.npz", 240, 0)), "--output", str(out),
                 "--num-workers", "2", "--checkpoint-every", "1", "--set", "schedule.max_epochs=4",
                 *QUICK_FIT]) == 0
    train = out / TRAIN_DIR
    snapshot = json.loads((train / "checkpoint_manager_snapshot.json").read_text())
    listed = set(checkpoint_dir_names(snapshot))
    on_disk = {p.name for p in train.glob("checkpoint_*") if p.is_dir()}
    assert on_disk == listed and 1 <= len(listed) <= 2
    assert (out / "fit_request.json").exists() and (out / "summary.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "run"]

    orphan = train / "checkpoint_2000-01-01_00-00-00.000000"
    shutil.copytree(train / sorted(listed)[0], orphan)
    assert prune_checkpoints(out) == [orphan]
    assert {p.name for p in train.glob("checkpoint_*") if p.is_dir()} == listed


# --------------------------------------- existing outputs are replaced only on --overwrite
def test_predict_embed_report_and_extract_refuse_an_existing_output_unless_overwrite(
        ray_session, earlier_run, mixture, tmp_path, capsys):
    """An output that exists (a text file; a file that ``extract`` did not
    write) is refused in one line, exit 2, and left as it was; with ``--overwrite`` it is
    replaced by the new output in one rename."""
    from tests.support.image_data import encode_png, write_raw_shard

    def run(argv: list[str]) -> tuple[int, str]:
        code = main(argv)
        return code, capsys.readouterr().err

    def refused_then_replaced(argv: list[str], existing: Path) -> None:
        before = _files(existing) if existing.is_dir() else existing.read_bytes()
        code, err = run(argv)
        assert code == 2
        assert _one_refusal(err, "already exists: pass --overwrite to replace it"
                            if existing.is_file() else "was not written by deepdpm extract: pass "
                            "--overwrite"), err
        assert (_files(existing) if existing.is_dir() else existing.read_bytes()) == before
        code, err = run([*argv, "--overwrite"])
        assert code == 0, err
        assert not list(existing.parent.glob(f".{existing.name}.*.tmp"))

    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    refused_then_replaced(["predict", "--model", str(earlier_run / "model.pt"), "--input", str(mixture),
                           "--output", str(notes)], notes)
    assert pq.read_table(notes).num_rows == 800  # the text file became the predictions

    table = tmp_path / "embedded.parquet"
    table.write_text("mine\n")
    refused_then_replaced(["embed", "--input", str(mixture), "--output", str(table), "--method", "pca",
                           "--dim", "2", "--quiet"], table)
    assert pq.read_table(table).num_rows == 800

    page = tmp_path / "report.html"
    page.write_text("mine\n")
    refused_then_replaced(["report", str(earlier_run), "--output", str(page)], page)
    assert page.read_text().startswith("<!DOCTYPE html>")

    shards, features = tmp_path / "shards", tmp_path / "features"
    shards.mkdir()
    write_raw_shard(shards / "s-000000.tar", [
        {"__key__": f"k{i}", "png": encode_png(np.full((8, 8, 3), 30 * i, np.uint8)), "cls": b"0"}
        for i in range(3)])
    features.mkdir()
    (features / "s-000000.parquet").write_text("mine\n")
    refused_then_replaced(["extract", "--shards", str(shards), "--output", str(features), "--encoder",
                           "pixels", "--no-tracking", "--no-progress"], features)
    assert pq.read_table(features / "s-000000.parquet").num_rows == 3


# ------------------------------------------------------ extract counts every sample it skips
def test_extract_counts_and_lists_every_sample_it_skips_links_included(ray_session, tmp_path, capsys):
    """Samples whose image is a hard link or a symbolic link member are
    counted as read and listed as skipped with the reason; a missing image too."""
    import io
    import tarfile

    from pipeline.io.tables import read_features
    from tests.support.image_data import encode_png

    shards, features = tmp_path / "shards", tmp_path / "features"
    shards.mkdir()
    png = encode_png(np.full((8, 8, 3), 90, np.uint8))

    def regular(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    def link(tar: tarfile.TarFile, name: str, target: str, kind: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, target
        tar.addfile(info)

    with tarfile.open(shards / "s-000000.tar", "w") as tar:
        regular(tar, "a.png", png)
        regular(tar, "a.cls", b"0")
        link(tar, "b.png", "a.png", tarfile.LNKTYPE)       # a hard link alone
        link(tar, "c.png", "a.png", tarfile.SYMTYPE)       # a symbolic link alone
        link(tar, "d.png", "a.png", tarfile.LNKTYPE)       # a hard link beside a regular label
        regular(tar, "d.cls", b"1")
        regular(tar, "e.png", png)
    assert main(["extract", "--shards", str(shards), "--output", str(features), "--encoder", "pixels",
                 "--no-tracking", "--no-progress", "--json"]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((features / "_manifest.json").read_text())
    assert manifest["totals"] == {"shards": 1, "read": 5, "embedded": 2, "skipped": 3}
    skipped = {s["key"]: s["reason"] for s in manifest["shards"][0]["skipped_keys"]}
    assert sorted(skipped) == ["b", "c", "d"]
    assert "b.png is a hard link to a.png" in skipped["b"]
    assert "c.png is a symbolic link to a.png" in skipped["c"]
    assert skipped["d"]  # its label arrived, its image (a link) did not
    assert sorted(read_features(features).keys) == ["a", "e"]
    assert json.loads(out)["images_skipped"] == 3
