"""The base install and its extras: ``pip install deepdpm`` fits and predicts local files
without Ray, MLflow, the image packages or UMAP, and every command path that needs a
missing extra says in one line which to install (exit code 2, no traceback).

A missing package is simulated in a child process by ``sys.modules[name] = None``, which
makes ``import name`` fail and ``importlib.util.find_spec(name)`` find nothing, as when it
is not installed; ``.ci/bare_install.sh`` checks a real bare install.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

#: the top-level modules of the extras (ray, mlflow, extract, umap)
ABSENT = ("ray", "mlflow", "webdataset", "torchvision", "umap")

#: runs ``deepdpm ARGS`` with the modules of argv[1] (comma-separated) not importable
CHILD = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from pipeline.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _deepdpm(cwd: Path, *args: str, absent=ABSENT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, ",".join(absent), *args], cwd=cwd,
                          env=env or _env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """x.npy (3 blobs in 3-D), a Parquet folder, and a stored Ray fit request."""
    root = tmp_path_factory.mktemp("extras")
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(c, 0.3, (100, 3)) for c in (0.0, 4.0, 8.0)]).astype(np.float32)
    np.save(root / "x.npy", X)
    (root / "folder").mkdir()
    (root / "folder" / "part-0.parquet").write_bytes(b"")
    (root / "ray_run").mkdir()
    request = {"input": str(root / "x.npy"), "output": str(root / "ray_run"), "config": {},
               "mode": "ray", "num_workers": 2, "tracking": False}
    (root / "ray_run" / "fit_request.json").write_text(json.dumps(request))
    return root


# (arguments, the extras the one line names)
CASES = [
    (["fit", "--input", "x.npy", "--output", "out", "--num-workers", "2"], "ray"),
    (["fit", "--input", "x.npy", "--output", "out", "--ray-address", "auto"], "ray"),
    (["fit", "--resume", "ray_run"], "ray"),
    (["fit", "--input", "x.npy", "--output", "out", "--tracking-uri", "sqlite:///m.db"], "mlflow"),
    (["fit", "--input", "x.npy", "--output", "out", "--register-model", "m"], "mlflow"),
    (["predict", "--model", "runs:/0123/model", "--input", "x.npy", "--output", "p.parquet"],
     "mlflow"),
    (["predict", "--model", "model.pt", "--input", "folder", "--output", "pred"], "ray"),
    (["report", "0123456789abcdef0123456789abcdef"], "mlflow"),
    (["embed", "--input", "x.npy", "--output", "e.parquet", "--method", "umap"], "umap"),
    (["embed", "--input", "x.npy", "--output", "e.parquet", "--method", "ae-umap"], "umap"),
    (["shards", "--input", "images", "--output", "shards"], "extract"),
    (["extract", "--shards", "shards", "--output", "features"], "extract"),
    (["demo", "--output", "demo"], "umap,extract,mlflow"),
    (["demo", "--output", "demo", "--no-ray", "--no-tracking"], "umap"),
]


@pytest.mark.parametrize(("args", "extras"), CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_a_path_that_needs_a_missing_extra_says_which_in_one_line(files, args, extras):
    done = _deepdpm(files, *args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"deepdpm {args[0]}: error: ")
    assert f'pip install "deepdpm[{extras}]"' in lines[0]
    assert not (files / "out").exists() and not (files / "m.db").exists()


def test_the_message_names_only_what_is_missing(files):
    done = _deepdpm(files, "extract", "--shards", "shards", "--output", "features",
                    absent=("torchvision",))
    assert done.returncode == 2
    assert done.stderr == ('deepdpm extract: error: extracting image features needs torchvision, '
                           'which is not installed: pip install "deepdpm[extract]"\n')


def test_fit_and_predict_run_without_any_extra(files, tmp_path):
    """The estimator and ``deepdpm fit``/``predict`` on a file, Ray, MLflow, webdataset,
    torchvision and UMAP unimportable: not tracked (no MLflow store, no warning), and none
    of them loaded."""
    script = CHILD.replace("from pipeline.cli import main\nsys.exit(main(sys.argv[2:]))\n", """
import numpy as np
from deepdpm_core import DeepDPM
from pipeline.cli import main

X = np.load(sys.argv[2])
model = DeepDPM(random_state=0, schedule__max_epochs=6).fit(X)
assert model.predict(X).shape == (len(X),)
assert main(["fit", "--input", sys.argv[2], "--output", "run", "--quiet",
             "--set", "schedule.max_epochs=6"]) == 0
assert main(["predict", "--model", "run/model.pt", "--input", sys.argv[2],
             "--output", "pred.parquet"]) == 0
loaded = sorted(n for n, m in sys.modules.items()
                if m is not None and n.split(".")[0] in sys.argv[1].split(","))
print("loaded:", loaded, file=sys.stderr)
sys.exit(1 if loaded else 0)
""")
    done = subprocess.run([sys.executable, "-c", script, ",".join(ABSENT), str(files / "x.npy")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "loaded: []" in done.stderr
    assert "MLflow" not in done.stderr and "warning" not in done.stderr, done.stderr
    assert (tmp_path / "run" / "assignments.parquet").is_file()
    assert (tmp_path / "pred.parquet").is_file()
    assert not (tmp_path / "mlflow.db").exists()


# -- in process: which runs are tracked -------------------------------------------------


def _tracking_args(*argv: str) -> argparse.Namespace:
    from pipeline.tracking.options import add_registry_arguments, add_tracking_arguments

    parser = argparse.ArgumentParser()
    add_tracking_arguments(parser)
    add_registry_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def no_mlflow(monkeypatch):
    from pipeline import extras

    real = extras.importable
    monkeypatch.setattr(extras, "importable", lambda m: m != "mlflow" and real(m))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_a_run_is_tracked_where_mlflow_is_installed(monkeypatch):
    from pipeline.tracking.options import tracking_on

    assert tracking_on(_tracking_args())
    assert not tracking_on(_tracking_args("--no-tracking"))


@pytest.mark.parametrize("argv", [[], ["--no-tracking"], ["--no-tracking", "--tracking-uri", "x"]])
def test_without_mlflow_a_run_is_not_tracked_unless_asked_for(no_mlflow, argv):
    from pipeline.tracking.options import tracking_on

    assert not tracking_on(_tracking_args(*argv))


@pytest.mark.parametrize("argv", [["--tracking-uri", "sqlite:///m.db"], ["--experiment", "e"],
                                  ["--run-name", "r"], ["--register-model", "m"], ["env"]])
def test_without_mlflow_asking_for_tracking_names_the_extra(no_mlflow, monkeypatch, argv):
    from pipeline.extras import MissingExtraError
    from pipeline.tracking.options import tracking_on

    if argv == ["env"]:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5000")
        argv = []
    with pytest.raises(MissingExtraError, match=r'pip install "deepdpm\[mlflow\]" '
                                                r"\(or pass --no-tracking\)$"):
        tracking_on(_tracking_args(*argv))


def test_require_lists_the_missing_distributions(monkeypatch):
    from pipeline import extras

    monkeypatch.setattr(extras, "importable", lambda m: m not in ("umap", "PIL", "ray"))
    extras.require("x", "mlflow")  # installed: nothing to say
    with pytest.raises(extras.MissingExtraError) as info:
        extras.require("the demo", "umap", "extract", "mlflow")
    assert str(info.value) == ('the demo needs umap-learn, pillow and ray, which are not '
                               'installed: pip install "deepdpm[umap,extract]"')
    assert isinstance(info.value, extras.DeepDPMError)


# -- the declared extras -----------------------------------------------------------------


def test_the_base_install_leaves_every_extra_out():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("[")[0] for d in project["dependencies"]}
    assert base.isdisjoint({"ray", "mlflow", "webdataset", "torchvision", "umap-learn"})
    extras = project["optional-dependencies"]
    from pipeline.extras import EXTRA_MODULES

    assert set(EXTRA_MODULES) | {"gpu", "all", "dev"} == set(extras)
    assert extras["all"] == [f"deepdpm[{','.join(EXTRA_MODULES)}]"]
    assert "deepdpm[all]" in extras["dev"]
