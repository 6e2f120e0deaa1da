"""Fault injection at the edges: mounted volumes, links in input folders, odd tables,
broken tracking records and leftovers of killed commands.

Each test function belongs to one guarantee of ``docs/reliability.md``. Tests that mount a
tmpfs run as root where mounting is permitted and are skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli import main
from pipeline.io.input_fingerprint import input_fingerprint
from pipeline.io.run_folder import remove_leftovers
from pipeline.io.tables import read_features

REPO = Path(__file__).resolve().parents[2]
#: a fit of a few seconds on 2 CPU cores
QUICK_FIT = ["--config", str(REPO / "cluster_configs" / "local.yaml"), "--no-tracking", "--quiet"]


def _csv(path: Path, seed: int, n: int = 300, header: str | None = "a,b,c") -> Path:
    """Three well-separated 3-D blobs as a CSV (``header`` None: no header line)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, 3)) * 10
    X = np.concatenate([c + rng.normal(size=(n // 3, 3)) for c in centres])
    lines = [header] if header is not None else []
    lines += [",".join(f"{v:.6f}" for v in row) for row in X]
    path.write_text("\n".join(lines) + "\n")
    return path


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


def _deepdpm(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(result: subprocess.CompletedProcess | tuple[int, str], *parts: str) -> bool:
    """Exit 2 and one line on stderr naming ``parts`` (no traceback)."""
    code, err = ((result.returncode, result.stderr) if isinstance(result, subprocess.CompletedProcess)
                 else result)
    lines = [line for line in err.splitlines() if line.strip()]
    return (code == 2 and len(lines) == 1 and "Traceback" not in err
            and all(p in lines[0] for p in parts))


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """``deepdpm ARGV`` in this process: its exit code and stderr, as the program gives them
    (an exception that escapes ``main`` is a traceback and exit code 1)."""
    import traceback

    try:
        code = main(argv)
    except Exception:
        return 1, capsys.readouterr().err + traceback.format_exc()
    return code, capsys.readouterr().err


@contextlib.contextmanager
def _tmpfs(folder: Path, root: Path) -> Iterator[Path]:
    """A fresh tmpfs mounted at ``folder`` (created) while the block runs; skips the test
    where mounting is not permitted, and always unmounts it, also where a faulty publish
    moved it elsewhere under ``root``."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        with open("/proc/self/mountinfo") as info:
            points = [line.split(" ")[4] for line in info]
        for point in sorted(points, key=len, reverse=True):
            if point == str(root) or point.startswith(f"{root}/"):
                subprocess.run(["umount", "-l", point], check=False)


# -- publishing never crosses a mount ----------------------------------------------------

def test_overwrite_never_empties_a_volume_mounted_inside_the_output_folder(tmp_path, capsys):
    a, b = _csv(tmp_path / "A.csv", 0), _csv(tmp_path / "B.csv", 1)
    out = tmp_path / "o"
    assert _cli(["fit", "--input", str(a), "--output", str(out), *QUICK_FIT], capsys)[0] == 0
    with _tmpfs(out / "data", tmp_path) as volume:
        (volume / "f").write_text("keep")
        code, err = _cli(["fit", "--input", str(b), "--output", str(out), *QUICK_FIT, "--overwrite"], capsys)
        assert (volume / "f").read_text() == "keep", err
        assert os.path.ismount(volume)
        assert code == 0, err
        assert json.loads((out / "summary.json").read_text())["input"] == str(b)
        assert "mount point" in err  # said before the fit
        assert sorted(p.name for p in tmp_path.iterdir()) == ["A.csv", "B.csv", "o"]
        assert not list(out.glob(".staging-*"))


def test_an_output_folder_that_is_a_mount_point_publishes_and_keeps_its_other_files(tmp_path, capsys):
    a, b = _csv(tmp_path / "A.csv", 0), _csv(tmp_path / "B.csv", 1)
    with _tmpfs(tmp_path / "out", tmp_path) as out:
        code, err = _cli(["fit", "--input", str(a), "--output", str(out), *QUICK_FIT], capsys)
        assert code == 0, err
        assert json.loads((out / "summary.json").read_text())["input"] == str(a)
        (out / "notes.txt").write_text("mine")
        code, err = _cli(["fit", "--input", str(b), "--output", str(out), *QUICK_FIT, "--overwrite"], capsys)
        assert code == 0, err
        assert json.loads((out / "summary.json").read_text())["input"] == str(b)
        assert (out / "notes.txt").read_text() == "mine"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["A.csv", "B.csv", "out"]
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


# -- folder inputs never follow links ----------------------------------------------------

def _parquet_folder(folder: Path, n: int = 300) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    X = np.concatenate([c + rng.normal(size=(n // 3, 3)) for c in rng.normal(size=(3, 3)) * 10])
    for i, part in enumerate(np.array_split(X, 2)):
        pq.write_table(pa.table({c: part[:, j] for j, c in enumerate("abc")}),
                       folder / f"part-{i}.parquet")
    return folder


@pytest.mark.parametrize("link", ["loop", "outside", "file"])
def test_a_folder_input_never_follows_a_link_out_of_it_or_into_a_loop(tmp_path, link):
    folder = _parquet_folder(tmp_path / "F")
    elsewhere = _parquet_folder(tmp_path / "elsewhere")
    target = {"loop": Path("."), "outside": elsewhere,
              "file": elsewhere / "part-0.parquet"}[link]
    name = "zz.parquet" if link == "file" else "sub"
    (folder / name).symlink_to(target)
    result = _deepdpm("fit", "--input", str(folder), "--output", str(tmp_path / "o"), *QUICK_FIT)
    assert _one_line_error(result, str(folder / name), "link"), result.stderr
    assert not (tmp_path / "o").exists()


def test_the_fingerprint_of_a_folder_covers_exactly_the_files_a_fit_reads(tmp_path):
    folder = _parquet_folder(tmp_path / "F")
    (folder / "README").write_text("rows of a, b, c")
    (folder / "_SUCCESS").write_text("")
    (folder / "notes.txt").write_text("not read")
    assert sorted(input_fingerprint(folder)["files"]) == ["part-0.parquet", "part-1.parquet"]
    assert read_features(folder).X.shape == (300, 3)  # a README beside the tables is no table


# -- odd tables: a correct result or one line --------------------------------------------

def test_a_headerless_csv_with_a_byte_order_mark_keeps_its_first_row(tmp_path):
    plain = _csv(tmp_path / "plain.csv", 0, header=None)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    table = read_features(bom)
    assert table.X.shape == (300, 3)
    np.testing.assert_array_equal(table.X, read_features(plain).X)


@pytest.mark.parametrize("case", ["csv a,a,b", "label named twice", "parquet duplicates",
                                  "latin-1 header", "64-bit ids", "feature chosen twice",
                                  "all-empty column", "beyond float32"])
def test_odd_tables_are_refused_in_one_line_naming_the_column(tmp_path, capsys, case):
    extra: list[str] = []
    if case == "csv a,a,b":
        data, named = tmp_path / "t.csv", "'a'"
        data.write_text("a,a,b\n" + "1,2,3\n" * 50)
    elif case == "label named twice":
        data, named = tmp_path / "t.csv", "'label'"
        data.write_text("label,x,label\n" + "1,2,1\n" * 50)
    elif case == "parquet duplicates":
        data, named = tmp_path / "t.parquet", "'x'"
        pq.write_table(pa.Table.from_arrays([pa.array([1.0] * 50)] * 2, names=["x", "x"]), data)
    elif case == "latin-1 header":
        data, named = tmp_path / "t.csv", "UTF-8"
        data.write_bytes(b"caf\xe9,b\n" + b"1,2\n" * 50)
    elif case == "64-bit ids":
        data, named = tmp_path / "t.csv", "--key id"
        data.write_text("id,b\n" + "".join(f"{2**62 + i},{i}\n" for i in range(50)))
    elif case == "feature chosen twice":
        data, named = tmp_path / "t.csv", "'a'"
        data.write_text("a,b\n" + "1,2\n" * 50)
        extra = ["--features", "a,a"]
    elif case == "all-empty column":
        data, named = tmp_path / "t.csv", "'b'"
        data.write_text("a,b,c\n" + "".join(f"{i},,{i % 7}\n" for i in range(50)))
    else:
        data, named = tmp_path / "t.csv", "'a'"
        data.write_text("a,b\n" + "1,2\n" * 20 + "1e39,2\n" + "1,2\n" * 29)
    result = _cli(["fit", "--input", str(data), "--output", str(tmp_path / "o"), *QUICK_FIT, *extra],
                  capsys)
    assert _one_line_error(result, str(data), named)


# -- tracking records are bounded and typed ----------------------------------------------

@pytest.mark.parametrize("state", ["link to /dev/null", "loop of links"])
def test_a_finished_tracked_fit_exits_0_whatever_lies_at_the_pending_closes_path(tmp_path, state):
    data = _csv(tmp_path / "A.csv", 0)
    pending = tmp_path / "state" / "deepdpm" / "pending_closes"
    pending.parent.mkdir(parents=True)
    if state == "link to /dev/null":
        pending.symlink_to("/dev/null")
    else:
        pending.symlink_to(pending.parent / "other")
        (pending.parent / "other").symlink_to(pending)
    result = _deepdpm("fit", "--input", str(data), "--output", str(tmp_path / "o"), "--config",
                      str(REPO / "cluster_configs" / "local.yaml"), "--quiet",
                      "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                      XDG_STATE_HOME=str(tmp_path / "state"))
    assert result.returncode == 0, result.stderr
    assert "K=" in result.stdout
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["n_samples"] == 300


def test_unreadable_pending_close_records_are_set_aside_and_never_block_the_others(
        tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    from pipeline.tracking.pending_closes import close_pending, pending_dir, record_pending

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("edges")).info.run_id
    record_pending(uri, run_id, "KILLED", "its command was killed", None)
    folder = pending_dir()
    valid = {"tracking_uri": uri, "status": "KILLED", "reason": "r", "end_time_ms": None}
    (folder / "0-no-run-id.json").write_text(json.dumps(valid))
    (folder / "1-owner.json").write_text(json.dumps({**valid, "run_id": "x" * 32,
                                                     "owner": "garbage"}))
    (folder / "2-huge.json").write_text(" " * (1 << 20) + json.dumps({**valid, "run_id": "y"}))
    (folder / "3-zero.json").symlink_to("/dev/zero")
    os.mkfifo(folder / "4-fifo.json")
    bad = ["0-no-run-id.json", "1-owner.json", "2-huge.json", "3-zero.json", "4-fifo.json"]
    ended: list[str] = []
    closer = threading.Thread(target=lambda: ended.extend(close_pending(client, uri)), daemon=True)
    started = time.monotonic()
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "a record blocked the closes"
    assert time.monotonic() - started < 30
    assert ended == [run_id]
    assert client.get_run(run_id).info.status == "KILLED"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{name}.bad" for name in bad)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == len(bad)
    assert all(any(name in line for line in warnings) for name in bad)


# -- leftovers of killed commands --------------------------------------------------------

def test_the_next_writer_removes_the_temporary_files_atomic_writes_leave(tmp_path):
    from deepdpm_core.atomic_files import atomic_path

    out = tmp_path / "predictions.parquet"
    folder = tmp_path / "run"
    folder.mkdir()
    leftovers = []
    for final in (out, folder / "summary.json"):
        with pytest.raises(KeyboardInterrupt), atomic_path(final) as tmp:
            leftovers.append(tmp)
            raise KeyboardInterrupt
    for tmp in leftovers:  # what a kill -9 mid-write leaves: the file under atomic_path's name
        tmp.write_text("half")
    kept = [tmp_path / ".predictions.parquet.notes.tmp", folder / "mine.tmp"]
    for path in kept:
        path.write_text("mine")
    (folder / ".staging-4242").mkdir()  # a killed publish inside a mounted output folder
    assert all(p.exists() for p in leftovers)
    remove_leftovers(out)
    remove_leftovers(folder)
    assert not any(p.exists() for p in leftovers)
    assert not (folder / ".staging-4242").exists()
    assert all(p.exists() for p in kept)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """A finished fit of a 300 x 3 CSV (its folder; the CSV beside it as ``A.csv``)."""
    root = tmp_path_factory.mktemp("fitted")
    data = _csv(root / "A.csv", 0)
    assert main(["fit", "--input", str(data), "--output", str(root / "run"), *QUICK_FIT]) == 0
    return root / "run"


@pytest.mark.parametrize("damage", ["config a list", "1-D weight", "wrong shape",
                                    "mixture of another K"])
def test_a_model_file_with_a_valid_archive_but_a_malformed_state_is_refused_in_one_line(
        fitted, tmp_path, capsys, damage):
    import torch

    from deepdpm_core import DeepDPM
    from deepdpm_core.errors import CheckpointError

    state = torch.load(fitted / "model.pt", weights_only=True)
    net = dict(state["cluster_net"])
    if damage == "config a list":
        state["config"] = [1, 2]
    elif damage == "1-D weight":
        net["hidden.weight"] = torch.zeros(5)
    elif damage == "wrong shape":
        net["out.bias"] = torch.zeros(len(net["out.bias"]) + 2)
    else:
        state["means"] = torch.zeros(len(net["out.bias"]) + 2, state["means"].shape[1])
    state["cluster_net"] = net
    model = tmp_path / "model.pt"
    torch.save(state, model)
    try:
        DeepDPM.load(model)
        refused = "loaded"
    except Exception as exc:  # which exception it is, is the assertion
        refused = f"{type(exc).__name__}: {exc}"
    assert refused.startswith(CheckpointError.__name__) and "malformed state" in refused, refused
    if damage != "mixture of another K":  # predict reads the net, not the mixture
        result = _cli(["predict", "--model", str(model), "--input", str(fitted.parent / "A.csv"),
                       "--output", str(tmp_path / "p.parquet")], capsys)
        assert _one_line_error(result, str(model), "malformed state")


def test_report_of_a_malformed_summary_is_one_line(fitted, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(fitted, run)
    summary = json.loads((run / "summary.json").read_text())
    summary.update(cluster_sizes="many", metrics=3, n_clusters=[1])
    (run / "summary.json").write_text(json.dumps(summary))
    result = _cli(["report", str(run), "-o", str(tmp_path / "r.html")], capsys)
    assert _one_line_error(result, str(run), "summary.json")
    assert not (tmp_path / "r.html").exists()


def test_an_output_inside_its_own_input_folder_is_refused_in_one_line(tmp_path, capsys):
    folder = _parquet_folder(tmp_path / "F")
    result = _cli(["fit", "--input", str(folder), "--output", str(folder / "run"), *QUICK_FIT],
                  capsys)
    assert _one_line_error(result, "inside the --input folder")
    assert sorted(p.name for p in folder.iterdir()) == ["part-0.parquet", "part-1.parquet"]


def test_a_fit_that_cannot_fit_in_memory_is_refused_before_it_starts_naming_the_knob(tmp_path):
    import resource

    import psutil

    # the default config (init.n_clusters auto: K = 10 at 400 rows, full covariances) with
    # D x D float64 covariances whose one copy alone takes twice the memory available now
    available = psutil.virtual_memory().available
    dim = int(np.ceil(np.sqrt(2 * available / (8 * 10))))
    data = tmp_path / "wide.npy"
    np.save(data, np.random.default_rng(0).normal(size=(400, dim)).astype(np.float32))

    def bounded() -> None:  # a fit that tries anyway fails, not the machine
        resource.setrlimit(resource.RLIMIT_AS, (available // 2, available // 2))

    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "fit", "--input", str(data),
                             "--output", str(tmp_path / "o"), "--no-tracking", "--quiet"],
                            env=_env(),
                            capture_output=True, text=True, timeout=600, preexec_fn=bounded)
    assert _one_line_error(result, str(data), "prior.covariance_type=diag", "GiB"), result.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["fifo input", "predict over its input", "escape sequences"])
def test_small_hostile_arguments_get_one_line_at_once(fitted, tmp_path, case):
    data = fitted.parent / "A.csv"
    if case == "fifo input":
        fifo = tmp_path / "rows.csv"
        os.mkfifo(fifo)
        argv, named = ["fit", "--input", str(fifo), "--output", str(tmp_path / "o"), *QUICK_FIT], str(fifo)
    elif case == "predict over its input":
        copy = tmp_path / "A.csv"
        shutil.copy(data, copy)
        argv = ["predict", "--model", str(fitted / "model.pt"), "--input", str(copy), "--output",
                str(copy), "--overwrite"]
        named = "--input"
    else:
        table = tmp_path / "rows\x1b]0;owned\x07\x1b[2J.csv"  # named to retitle a terminal
        table.write_text("")
        argv, named = ["fit", "--input", str(table), "--output", str(tmp_path / "o"), *QUICK_FIT], "\\x1b"
    try:
        result = _deepdpm(*argv, timeout=60)
    except subprocess.TimeoutExpired:
        result = subprocess.CompletedProcess(argv, -1, "", "still running after 60 s")
    assert _one_line_error(result, named), result.stderr
    assert "\x1b" not in result.stderr
    if case == "predict over its input":
        assert (tmp_path / "A.csv").read_bytes() == data.read_bytes()


def test_a_resumable_fit_stores_the_fingerprint_of_the_bytes_it_fitted_while_the_file_is_replaced(
        tmp_path):
    import hashlib

    data = tmp_path / "rows.csv"
    rows = _csv(tmp_path / "base.csv", 0).read_text().splitlines()[1:]
    versions: dict[int, bytes] = {}

    def version(v: int) -> bytes:  # the same rows, keyed by the version that wrote them
        return ("key,a,b,c\n" + "".join(f"v{v}-{i},{r}\n" for i, r in enumerate(rows))).encode()

    versions[0] = version(0)
    data.write_bytes(versions[0])
    stop = threading.Event()

    def replace_every_few_ms() -> None:  # as a writer that replaces the file atomically
        v = 0
        while not stop.is_set():
            v += 1
            versions[v] = version(v)
            (tmp_path / "next.csv").write_bytes(versions[v])
            os.replace(tmp_path / "next.csv", data)
            time.sleep(0.004)

    writer = threading.Thread(target=replace_every_few_ms, daemon=True)
    writer.start()
    try:
        result = _deepdpm("fit", "--input", str(data), "--output", str(tmp_path / "o"), *QUICK_FIT,
                          "--checkpoint-every", "5")
    finally:
        stop.set()
        writer.join()
    assert result.returncode == 0, result.stderr
    assert len(versions) > 10  # the file was replaced many times during the fit
    keys = pq.read_table(tmp_path / "o" / "assignments.parquet", columns=["key"]).column("key")
    fitted = {int(k.split("-")[0][1:]) for k in keys.to_pylist()}
    assert len(fitted) == 1
    stored = json.loads((tmp_path / "o" / "fit_request.json").read_text())["input_fingerprint"]
    assert stored["sha256"] == hashlib.sha256(versions[fitted.pop()]).hexdigest()


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(fitted, tmp_path, capsys):
    rows = _csv(tmp_path / "many.csv", 1, n=60_000)  # the fit's columns: predicted at once
    with _tmpfs(tmp_path / "small", tmp_path) as small:
        subprocess.run(["mount", "-o", "remount,size=64k", str(small)], check=True)
        out = small / "p.parquet"
        result = _cli(["predict", "--model", str(fitted / "model.pt"), "--input", str(rows),
                       "--output", str(out)], capsys)
        assert _one_line_error(result, str(out), "No space left"), result
        assert list(small.iterdir()) == []
