"""The rough edges a new user hits: file modes, warnings under the
progress bar, stdout/stderr/--json, refusing to overwrite a fit, bare ``deepdpm``,
"did you mean", the demo's report and MLflow run, plots, Ray's token-auth noise."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main

REPO = Path(__file__).resolve().parents[2]

#: a fit that takes seconds
QUICK = ["--set", "schedule.max_epochs=6", "--no-tracking", "--quiet"]


@pytest.fixture
def blobs(tmp_path: Path) -> Path:
    """Three labelled blobs in 4-D as an .npz (X, y)."""
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(c, 0.3, (80, 4)) for c in (0.0, 3.0, 6.0)]).astype(np.float32)
    path = tmp_path / "blobs.npz"
    np.savez(path, X=X, y=np.repeat(np.arange(3), 80))
    return path


def _files(*roots: Path) -> list[Path]:
    found = []
    for root in roots:
        found += [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    return found


# -- 1. output files honour the umask ------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_output_file_honours_the_umask(tmp_path, blobs, umask, capsys):
    run, pred, html = tmp_path / "run", tmp_path / "pred.parquet", tmp_path / "report.html"
    emb = tmp_path / "emb.parquet"
    old = os.umask(umask)
    try:
        assert main(["fit", "--input", str(blobs), "--output", str(run), *QUICK]) == 0
        assert main(["predict", "--model", str(run / "model.pt"), "--input", str(blobs),
                     "--output", str(pred)]) == 0
        assert main(["report", str(run), "--output", str(html)]) == 0
        assert main(["embed", "--input", str(blobs), "--output", str(emb), "--method", "pca",
                     "--dim", "2"]) == 0
    finally:
        os.umask(old)
    files = _files(run, pred, html, emb)
    names = {p.name for p in files}
    for expected in ("summary.json", "assignments.parquet", "model.pt", "config.yaml",
                     "k_over_epochs.png", "cluster_sizes.png"):
        assert expected in names
    want = 0o666 & ~umask
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(want)}, modes


def test_atomic_path_gives_the_mode_open_would(tmp_path):
    from deepdpm_core.atomic_files import atomic_path

    old = os.umask(0o002)
    try:
        with atomic_path(tmp_path / "a.txt") as tmp:
            tmp.write_text("x")
        with open(tmp_path / "b.txt", "w") as fh:
            fh.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o664
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == stat.S_IMODE(
        (tmp_path / "b.txt").stat().st_mode)


# -- 2. what is printed during a fit gets its own line ---------------------------------------


def _segments(text: str) -> list[str]:
    """What a terminal would show line by line, ``\\r`` redraws split apart."""
    return re.split(r"[\r\n]", text)


def test_lines_printed_during_a_fit_do_not_land_on_the_progress_bar(capsys):
    from deepdpm_core import DeepDPM

    logger = logging.getLogger("deepdpm.test_cli_edges")
    handler = logging.StreamHandler(sys.stderr)  # capsys's stderr, as a console handler is
    logger.addHandler(handler)
    logger.propagate = False

    def talk(record: dict) -> None:
        if record["epoch"] == 2:
            print("deepdpm: warning: printed mid-fit", file=sys.stderr)
            logger.warning("logged mid-fit")
            warnings.warn("warned mid-fit", UserWarning, stacklevel=1)

    X = np.random.default_rng(0).normal(size=(200, 3)).astype(np.float32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            # Python's own showwarning (pytest records warnings instead): sys.stderr at call time
            warnings.showwarning = lambda message, category, filename, lineno, file=None, \
                line=None: sys.stderr.write(
                    warnings.formatwarning(message, category, filename, lineno, line))
            DeepDPM(max_epochs=5).fit(X, callbacks=[talk], progress=True)
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "deepdpm fit" in err  # the bar was drawn
    segments = _segments(err)
    assert "deepdpm: warning: printed mid-fit" in segments, err
    assert "logged mid-fit" in segments, err
    assert any(s.endswith("UserWarning: warned mid-fit") for s in segments), err
    # each message starts a line of its own: never after the bar's "]"
    assert not re.search(r"\](deepdpm: warning|logged|[^\r\n]*UserWarning)", err), err
    assert sys.stderr is not None and "DummyTqdmFile" not in type(sys.stderr).__name__


def test_the_diagnostics_warning_of_a_fit_is_on_its_own_line(tmp_path, blobs, capsys):
    # from one cluster a huge sigma_scale keeps K at 1: the diagnostics warn while the bar
    # is drawn
    argv = ["fit", "--input", str(blobs), "--output", str(tmp_path / "run"), "--no-tracking",
            "--set", "init.n_clusters=1",
            "--set", "schedule.max_epochs=10", "--set", "prior.sigma_scale=100",
            "--set", "schedule.warmup_epochs=1", "--set", "schedule.move_every=1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "deepdpm: warning: The fit ended with one cluster (K = 1)" in err
    assert any(s.startswith("deepdpm: warning: The fit ended with one cluster")
               for s in _segments(err)), err
    assert "]deepdpm" not in err


# -- 3. results on stdout, logs on stderr, --json -------------------------------------------


def _deepdpm(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``deepdpm ARGV`` as a user runs it (a new process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PYTHONPATH": str(REPO)}  # this tree's code, whatever is installed
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_fit_prints_its_result_on_stdout_and_logs_on_stderr(tmp_path, blobs):
    done = _deepdpm("fit", "--input", str(blobs), "--output", "run", "--no-tracking",
                    "--set", "schedule.max_epochs=6", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    # the output as an absolute path, though given relative to the working directory
    run = re.escape(str((tmp_path / "run").resolve()))
    assert re.fullmatch(rf"K=\d+ epochs=6 time=[\d.]+s nmi=[\d.]+ ari=[-\d.]+ acc=[\d.]+ -> {run}",
                        lines[0]), lines
    assert "deepdpm fit" in done.stderr  # the progress bar
    assert not any(line.startswith("K=") for line in _segments(done.stderr)), done.stderr


def test_json_prints_one_object_on_stdout(tmp_path, blobs):
    done = _deepdpm("fit", "--input", str(blobs), "--output", "run", "--no-tracking", "--json",
                    "--set", "schedule.max_epochs=6", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # the whole of stdout is one JSON object
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result["command"] == "fit" and result["output"] == str((tmp_path / "run").resolve())
    assert result["n_clusters"] == summary["n_clusters"] and result["epochs"] == 6
    assert set(result["metrics"]) == {"nmi", "ari", "acc"} and result["mlflow_run_id"] is None
    assert all(Path(path).is_absolute() and Path(path).is_file() for path in result["files"].values())

    done = _deepdpm("predict", "--model", "run/model.pt", "--input", str(blobs),
                    "--output", "pred.parquet", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["command"] == "predict" and result["n_rows"] == 240
    assert result["n_clusters"] == summary["n_clusters"]
    assert result["output"] == str((tmp_path / "pred.parquet").resolve())
    assert result["model"] == str((tmp_path / "run" / "model.pt").resolve())
    assert "assigned" not in done.stderr and "pred.parquet" not in done.stderr  # stdout only


def test_report_embed_shards_and_predict_results_on_stdout(tmp_path, blobs, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--input", str(blobs), "--output", str(run), *QUICK]) == 0
    assert capsys.readouterr().out.strip().endswith(f"-> {run}")
    assert main(["predict", "--model", str(run / "model.pt"), "--input", str(blobs),
                 "--output", str(tmp_path / "p.parquet")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("assigned 240 rows to ") and out.strip().endswith("p.parquet")
    html = tmp_path / "r.html"
    assert main(["report", str(run), "--output", str(html), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == {"command": "report", "output": str(html), "source": str(run),
                      "n_clusters": result["n_clusters"], "metrics": result["metrics"]}
    emb = tmp_path / "e.parquet"
    assert main(["embed", "--input", str(blobs), "--output", str(emb), "--method", "pca",
                 "--dim", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["command"] == "embed" and (result["n_rows"], result["dim"]) == (240, 2)


# -- 4. a fit never silently replaces another -----------------------------------------------


def test_fit_refuses_an_output_that_holds_a_fit_unless_overwrite(tmp_path, blobs, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")  # a folder of the user's: written into only with --overwrite
    argv = ["fit", "--input", str(blobs), "--output", str(run), *QUICK]
    assert main(argv) == 2
    assert "is a folder of other files (notes.txt)" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    first = (run / "summary.json").read_bytes()
    capsys.readouterr()

    assert main([*argv, "--seed", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"deepdpm fit: error: --output {run} already holds a fit (summary.json, model.pt, "
        "assignments.parquet): pass --overwrite to replace it, or choose another --output\n")
    assert (run / "summary.json").read_bytes() == first

    assert main([*argv, "--seed", "1", "--overwrite"]) == 0
    assert json.loads((run / "summary.json").read_text())["config"]["seed"] == 1
    assert (run / "notes.txt").read_text() == "mine"

    assert main([*argv, "--overwrite", "--resume", str(run)]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_fit_into_the_checkpoints_of_a_distributed_fit_points_to_resume(tmp_path, blobs, capsys):
    from pipeline.fit.checkpoints import TRAIN_DIR

    run = tmp_path / "run"
    (run / TRAIN_DIR).mkdir(parents=True)
    (run / TRAIN_DIR / "checkpoint_manager_snapshot.json").write_text("{}")
    assert main(["fit", "--input", str(blobs), "--output", str(run), *QUICK]) == 2
    err = capsys.readouterr().err
    assert f"holds checkpoints of an earlier fit: continue it with --resume {run}" in err
    assert "--overwrite" in err and len(err.splitlines()) == 1


def test_a_request_names_its_mode_and_one_without_is_refused(tmp_path, blobs, capsys):
    from pipeline.fit.request import FitRequest

    with pytest.raises(TypeError, match="'mode'"):  # no mode is anyone's default
        FitRequest(input=str(blobs), output=str(tmp_path / "out"), config={})
    assert FitRequest(input=str(blobs), output=str(tmp_path / "out"), config={}, mode="local").num_workers == 1
    # a request stored before requests named their mode: --resume refuses it in one line
    run = tmp_path / "run"
    run.mkdir()
    (run / "fit_request.json").write_text(json.dumps({"input": str(blobs), "output": str(run), "config": {}}))
    assert main(["fit", "--resume", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is not a valid fit request" in err and "'mode'" in err and len(err.splitlines()) == 1


def test_overwrite_removes_the_checkpoints_a_distributed_fit_would_restore(tmp_path, blobs,
                                                                            monkeypatch):
    from deepdpm_core.errors import ConfigError
    from pipeline.fit import ray as ray_fit
    from pipeline.fit.checkpoints import TRAIN_DIR
    from pipeline.fit.request import FitRequest

    run = tmp_path / "run"
    (run / TRAIN_DIR).mkdir(parents=True)
    (run / TRAIN_DIR / "checkpoint_manager_snapshot.json").write_text("{}")
    request = FitRequest(input=str(blobs), output=str(run), config={}, mode="ray", num_workers=2,
                         tracking=False, quiet=True)

    class Stop(Exception):
        pass

    def stop(address):  # the request was accepted: Ray would start now
        raise Stop

    monkeypatch.setattr(ray_fit, "connect_ray", stop)
    with pytest.raises(ConfigError, match="--overwrite"):
        ray_fit.run_ray_fit(request)
    assert (run / TRAIN_DIR).is_dir()
    with pytest.raises(Stop):
        ray_fit.run_ray_fit(request.with_(overwrite=True))
    assert not (run / TRAIN_DIR).exists()


# -- 5. bare deepdpm lists its commands; unknown keys suggest the closest --------------------


def test_bare_deepdpm_prints_its_commands(tmp_path):
    done = _deepdpm(cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: deepdpm")
    for command in ("demo", "shards", "extract", "embed", "fit", "predict", "report"):
        assert re.search(rf"^\s+{command}\s+\S", done.stderr, re.M), done.stderr
    assert "required" not in done.stderr  # not argparse's bare "arguments are required"


def test_version_prints_the_installed_version(tmp_path):
    from importlib.metadata import version

    done = _deepdpm("--version", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"deepdpm {version('deepdpm')}\n", "")


def test_unknown_config_keys_suggest_the_closest(tmp_path, blobs, capsys):
    from deepdpm_core import DeepDPM
    from deepdpm_core.config import Config, from_dict
    from deepdpm_core.errors import ConfigError

    code = main(["fit", "--input", str(blobs), "--output", str(tmp_path / "o"), "--no-tracking",
                 "--set", "prior.sigma_scal=0.1"])
    assert code == 2
    assert capsys.readouterr().err == ("deepdpm fit: error: unknown config key 'prior.sigma_scal' "
                                       "(did you mean prior.sigma_scale?)\n")
    for build, message in [
        (lambda: from_dict({"prior": {"sigma_scal": 1.0}}),
         "unknown config key 'prior.sigma_scal' (did you mean prior.sigma_scale?)"),
        (lambda: from_dict({"schedul": {}}), "unknown config key 'schedul' (did you mean schedule?)"),
        (lambda: Config().with_overrides({"schedul.max_epochs": 3}),
         "unknown config key 'schedul.max_epochs' (did you mean schedule.max_epochs?)"),
        (lambda: Config().with_overrides({"zzz": 3}), "unknown config key 'zzz'"),
        (lambda: DeepDPM(alpah=1.0), "unknown parameter 'alpah' (did you mean alpha?)"),
        (lambda: DeepDPM(prior__sigma_scal=1.0),
         "unknown config key 'prior.sigma_scal' (did you mean prior.sigma_scale?)"),
        (lambda: DeepDPM(xyz=1.0), "unknown parameter 'xyz'"),
    ]:
        with pytest.raises(ConfigError) as info:
            build()
        assert str(info.value) == message


def test_a_config_naming_a_key_whose_value_is_now_fixed_is_refused(tmp_path, blobs, capsys):
    # e.g. the config.yaml of a fit by an earlier version, which wrote every key
    old = tmp_path / "old.yaml"
    old.write_text("prior:\n  alpha: 10.0\nmoves:\n  merge_neighbours: 3\n")
    code = main(["fit", "--input", str(blobs), "--output", str(tmp_path / "o"), "--no-tracking",
                 "--config", str(old)])
    assert code == 2
    assert capsys.readouterr().err == (f"deepdpm fit: error: {old}: unknown config key 'moves.merge_neighbours' "
                                       "(no longer a setting: its value is fixed)\n")
    assert not (tmp_path / "o").exists()
    # a rule of the search, in a recipe or set on the command line
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("schedule:\n  max_epochs: 60\n  patience: 4\n")
    assert main(["fit", "--input", str(blobs), "--output", str(tmp_path / "o"), "--no-tracking",
                 "--config", str(recipe)]) == 2
    assert capsys.readouterr().err == (f"deepdpm fit: error: {recipe}: unknown config key 'schedule.patience' "
                                       "(no longer a setting: its value is fixed)\n")
    assert main(["fit", "--input", str(blobs), "--output", str(tmp_path / "o"), "--no-tracking",
                 "--set", "moves.split_valley=0.8"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("unknown config key 'moves.split_valley' (no longer a setting: its value is fixed)\n")
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_a_fixed_prior_scale_no_cluster_can_have_is_refused_in_one_line(tmp_path, capsys):
    # features of order 1e-25 and a prior spread of 1e300 (squared units): 1e350 times the data's
    # variance, past float64; it failed in an eigendecomposition with a traceback
    data = tmp_path / "tiny.npy"
    np.save(data, np.random.default_rng(0).normal(size=(300, 4)) * 1e-25)
    code = main(["fit", "--input", str(data), "--output", str(tmp_path / "o"), *QUICK,
                 "--set", "prior.sigma_scale=1e300"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "prior.sigma_scale=1e+300 is inf times the features' mean variance" in err
    assert "prior.sigma_scale=auto" in err


# -- 6. a wrong path or config key is answered at once, in one line, leaving nothing --------

#: a bound with headroom on a loaded machine; measured 0.2 s idle (it was 3 s with torch,
#: scikit-learn and MLflow imported before the arguments were read)
ANSWER_AT_ONCE_S = 2.0


def test_a_wrong_input_path_is_answered_at_once_in_one_line(tmp_path, blobs):
    start = time.perf_counter()
    done = _deepdpm("fit", "--input", "nope.npy", "--output", "runs/x", cwd=tmp_path)
    seconds = time.perf_counter() - start
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "deepdpm fit: error: input not found: nope.npy\n"
    assert seconds < ANSWER_AT_ONCE_S, f"{seconds:.2f} s"

    start = time.perf_counter()
    done = _deepdpm("fit", "--input", str(blobs), "--output", "runs/x", "--set", "prior.alpah=1",
                    cwd=tmp_path)
    seconds = time.perf_counter() - start
    assert done.returncode == 2
    assert done.stderr == ("deepdpm fit: error: unknown config key 'prior.alpah' "
                           "(did you mean prior.alpha?)\n")
    assert seconds < ANSWER_AT_ONCE_S, f"{seconds:.2f} s"

    # every command checks its arguments and paths before its heavy imports and first write
    for argv, message in [
        (["embed", "--input", "nope.npy", "--output", "e.parquet", "--method", "pca"],
         "input not found: nope.npy"),
        (["predict", "--model", "nope.pt", "--input", str(blobs), "--output", "p/x.parquet"],
         "model not found: nope.pt"),
        (["predict", "--model", "nope.pt", "--input", str(blobs), "--output", "p/x.parquet",
          "--num-workers", "2"],
         f"--num-workers and --ray-address apply to a folder --input; {blobs} is a file "
         "(predicted in this process)"),
        (["extract", "--shards", "nope", "--output", "f"], "no .tar shards found at nope"),
        (["shards", "--input", "nope", "--output", "s"], "input folder not found: nope"),
        (["report", "nope"], "'nope' is neither a fit output directory nor an MLflow run id"),
        (["demo", "--config", "nope.yaml", "--output", "d"],
         "cannot read config nope.yaml: No such file or directory"),
        (["fit", "--input", str(blobs), "--output", "o", "--bogus"],
         "unrecognized arguments: --bogus (see deepdpm fit --help)"),
        (["embed", "--input", str(blobs), "--output", "e.parquet"],
         "the following arguments are required: --method (see deepdpm embed --help)"),
    ]:
        done = _deepdpm(*argv, cwd=tmp_path)
        assert (done.returncode, done.stderr) == (2, f"deepdpm {argv[0]}: error: {message}\n")
    # no output folder, lock file or MLflow database for a command that was refused
    assert [p.name for p in tmp_path.iterdir()] == ["blobs.npz"]


# -- 8. no token-auth announcements from the local Ray cluster a command starts ---------------

_LOCAL_RAY = """
import sys
import ray
from ray._raylet import AuthenticationMode, get_authentication_mode
from pipeline.extract.ray_pipeline import ensure_ray

if sys.argv[1] == "ours":
    ensure_ray()  # what extract (and, alike, a distributed fit) does without an address
else:
    ray.init(address="local", num_cpus=1, include_dashboard=False)
print("token" if get_authentication_mode() == AuthenticationMode.TOKEN else "off", flush=True)
ray.shutdown()
"""


@pytest.mark.ray
def test_a_local_ray_cluster_starts_without_token_auth_announcements(tmp_path):
    def start(how: str) -> tuple[subprocess.CompletedProcess, Path]:
        home = tmp_path / how  # no ~/.ray/auth_token yet: Ray makes one
        home.mkdir()
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
        env.update(HOME=str(home), OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
                   PYTHONPATH=str(REPO))
        done = subprocess.run([sys.executable, "-c", _LOCAL_RAY, how], cwd=home, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done, home / ".ray" / "auth_token"

    plain, plain_token = start("plain")  # what Ray prints on its own
    assert "Token authentication is enabled" in plain.stderr, plain.stderr
    assert "Generated new authentication token" in plain.stderr, plain.stderr
    ours, token = start("ours")
    assert ours.stdout.strip() == plain.stdout.strip() == "token"  # token auth is still on,
    assert token.stat().st_size > 0 and plain_token.stat().st_size > 0  # with a token Ray made,
    assert "Token authentication is enabled" not in ours.stderr, ours.stderr  # not announced
    assert "authentication token" not in ours.stderr, ours.stderr


def test_too_few_rows_are_refused_in_the_same_words_in_this_process_and_on_ray(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32))
    errors = []
    for flags in ([], ["--num-workers", "2"]):  # refused before any Ray cluster starts
        assert main(["fit", "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "out"),
                     "--no-tracking", "--set", "init.n_clusters=20", *flags]) == 2
        errors.append(capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1])
    assert errors[0] == errors[1] == f"{tmp_path / 'x.npy'} has 10 rows, fewer than the 20 needed (initial clusters)"
