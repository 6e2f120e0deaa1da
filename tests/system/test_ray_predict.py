"""``deepdpm predict`` over a folder of Parquet files: Ray Data, the model in an actor pool.

One local Ray cluster for the module (``ray.init(address="local", num_cpus=2)``). The
data: three labelled blobs in 4-D split over three Parquet files in several row groups
(one of them in a subfolder, one without labels), each compared row for row with the
in-process single-file predict.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shlex
import shutil
import stat
from pathlib import Path

# Ray reads its auth mode once, when it is first imported: token auth with a token of
# this session, never the machine's ~/.ray/auth_token.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from deepdpm_core import DeepDPM  # noqa: E402
from deepdpm_core.errors import ConfigError  # noqa: E402
from pipeline.cli import build_parser, main  # noqa: E402
from pipeline.io.input_fingerprint import file_sha256  # noqa: E402
from pipeline.io.table_writing import features_table  # noqa: E402
from pipeline.predict.files import is_complete  # noqa: E402
from tests.support.ray_cluster import local_ray  # noqa: E402

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
#: input files (relative names) and their rows of the blobs
FILES = {"a.parquet": slice(0, 400), "b.parquet": slice(400, 700), "part/c.parquet": slice(700, 900)}


def _blobs(n_per: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.concatenate([rng.normal(c, 0.3, (n_per, 4)) for c in (0.0, 3.0, 6.0)])
    y = np.repeat(np.arange(3), n_per)
    order = rng.permutation(len(X))
    return X[order].astype(np.float32), y[order]


@pytest.fixture(scope="module")
def ray_session():
    # as the cluster deepdpm predict starts itself: worker logs stay in Ray's files
    with local_ray(include_dashboard=False, log_to_driver=False):
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    X, _ = _blobs()
    path = tmp_path_factory.mktemp("run") / "model.pt"
    DeepDPM(random_state=0, init__n_clusters=3, schedule__max_epochs=4).fit(X).save(path)
    return path


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    """a.parquet (keys, labels with nulls), b.parquet, part/c.parquet (no label values)."""
    X, y = _blobs()
    y = y.copy()
    y[:40:4] = -1  # null labels
    folder = tmp_path_factory.mktemp("features")
    for name, rows in FILES.items():
        keys = np.array([f"img-{i}" for i in range(rows.start, rows.stop)], dtype=object)
        labels = None if name.startswith("part/") else y[rows]
        (folder / name).parent.mkdir(exist_ok=True)
        pq.write_table(features_table(X[rows], keys, labels), folder / name, row_group_size=128)
    return folder


def _predict(*argv: str, capsys) -> dict:
    capsys.readouterr()  # what earlier calls printed
    assert main(["predict", *argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def _in_process(model: Path, file: Path, out: Path) -> pa.Table:
    assert main(["predict", "--model", str(model), "--input", str(file), "--output", str(out),
                 "--overwrite"]) == 0
    return pq.read_table(out)


def _assert_same_rows(got: pa.Table, want: pa.Table) -> None:
    """Same columns, types and rows; confidences equal to float32 round-off (other batches)."""
    assert got.schema.remove_metadata() == want.schema.remove_metadata()
    assert len(got) == len(want)
    for name in want.column_names:
        if name == "confidence":
            np.testing.assert_allclose(got[name].to_numpy(), want[name].to_numpy(), rtol=1e-6)
        else:
            assert got[name].equals(want[name]), name


@pytest.fixture(scope="module")
def predicted(ray_session, model, features, tmp_path_factory):
    """The folder predicted by two actors (half a CPU each), small batches, umask 027."""
    out = tmp_path_factory.mktemp("predicted") / "out"
    old = os.umask(0o027)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["predict", "--model", str(model), "--input", str(features), "--output",
                         str(out), "--batch-size", "64", "--num-workers", "2",
                         "--cpus-per-worker", "0.5", "--json", "--no-progress"]) == 0
    finally:
        os.umask(old)
    return out, json.loads(printed.getvalue())


def test_folder_predict_equals_the_in_process_predict_row_for_row(predicted, model, features, tmp_path):
    predicted, result = predicted
    assert result["files_predicted"] == list(FILES) and result["files_skipped"] == []
    assert result["n_rows"] == 900 and result["n_files"] == 3
    assert sorted(str(p.relative_to(predicted)) for p in predicted.rglob("*")
                  if p.is_file()) == sorted(FILES)
    for name in FILES:
        got = pq.read_table(predicted / name)
        _assert_same_rows(got, _in_process(model, features / name, tmp_path / "one.parquet"))
        assert got["key"][0].as_py() == f"img-{FILES[name].start}"
        assert ("label" in got.column_names) == (not name.startswith("part/"))
        assert stat.S_IMODE((predicted / name).stat().st_mode) == 0o640  # 0o666 less the umask
    assert pq.read_table(predicted / "a.parquet")["label"].null_count == 10


def test_uneven_row_groups_come_back_whole_and_in_order(ray_session, model, tmp_path, capsys):
    """Files of several uneven row groups (and an empty one), more work items than actors:
    each output is its file's rows in order, whatever order the row groups finish in."""
    X, y = _blobs()
    folder = tmp_path / "uneven"
    folder.mkdir()
    for name, sizes in {"u.parquet": [300, 7, 0, 150, 93], "v.parquet": [1, 299, 50]}.items():
        table = features_table(X[: sum(sizes)], np.array([f"{name}-{i}" for i in range(sum(sizes))], dtype=object),
                               y[: sum(sizes)])
        with pq.ParquetWriter(folder / name, table.schema) as writer:
            at = 0
            for size in sizes:
                writer.write_table(table.slice(at, size), row_group_size=max(size, 1))
                at += size
        assert pq.ParquetFile(folder / name).metadata.num_row_groups == len(sizes)
    out = tmp_path / "out"
    result = _predict("--model", str(model), "--input", str(folder), "--output", str(out),
                      "--batch-size", "64", "--num-workers", "2", "--cpus-per-worker", "0.5", capsys=capsys)
    assert result["files_predicted"] == ["u.parquet", "v.parquet"] and result["n_rows"] == 900
    for name in ("u.parquet", "v.parquet"):
        _assert_same_rows(pq.read_table(out / name), _in_process(model, folder / name, tmp_path / "one.parquet"))


def test_a_rerun_redoes_only_the_deleted_file_and_ignores_a_killed_runs_temp_file(
        predicted, model, features, tmp_path, capsys):
    predicted, _ = predicted
    out = tmp_path / "out"
    shutil.copytree(predicted, out)
    kept = {name: (out / name).stat().st_mtime_ns for name in FILES if name != "b.parquet"}
    (out / "b.parquet").unlink()
    # what a run killed while writing b.parquet leaves: half of a Parquet file, temp-named
    whole = (predicted / "b.parquet").read_bytes()
    (out / ".b.parquet.k1ll3d.tmp").write_bytes(whole[: len(whole) // 2])
    result = _predict("--model", str(model), "--input", str(features), "--output", str(out),
                      capsys=capsys)
    assert result["files_predicted"] == ["b.parquet"]
    assert result["files_skipped"] == ["a.parquet", "part/c.parquet"] and result["n_rows"] == 300
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert not list(out.rglob("*.tmp"))
    _assert_same_rows(pq.read_table(out / "b.parquet"),
                      _in_process(model, features / "b.parquet", tmp_path / "b.parquet"))
    # nothing left to do: no Ray pipeline runs at all
    again = _predict("--model", str(model), "--input", str(features), "--output", str(out),
                     capsys=capsys)
    assert again["files_predicted"] == [] and again["n_rows"] == 0


def test_only_a_whole_output_of_the_same_model_counts_as_done(predicted, model, tmp_path):
    predicted, _ = predicted
    digest = file_sha256(model)
    done = predicted / "a.parquet"
    assert is_complete(done, 400, digest)
    assert not is_complete(done, 401, digest)  # the input grew
    # outputs are renamed into place whole: a file without a footer is someone else's,
    # replaced only on --overwrite
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(done.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="was not written by deepdpm predict: pass --overwrite"):
        is_complete(cut, 400, digest)
    assert not is_complete(tmp_path / "absent.parquet", 400, digest)


def _one_line_error(capsys, *argv: str) -> str:
    assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]  # Ray Data logs a failed pipeline above it


def test_bad_input_folders_are_one_line_errors(ray_session, model, features, predicted, tmp_path,
                                               capsys):
    predicted, _ = predicted
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no tables here")
    err = _one_line_error(capsys, "--model", str(model), "--input", str(empty), "--output",
                          str(tmp_path / "o1"))
    assert err.startswith("deepdpm predict: error: ") and "without .parquet files" in err

    wrong_d = tmp_path / "wrong_d"
    shutil.copytree(features, wrong_d)
    X = np.zeros((5, 6), np.float32)
    pq.write_table(features_table(X, np.arange(5), np.zeros(5)), wrong_d / "d.parquet")
    err = _one_line_error(capsys, "--model", str(model), "--input", str(wrong_d), "--output",
                          str(tmp_path / "o2"))
    assert "d.parquet: embeddings have 6 features, the model expects 4" in err

    unlabelled = tmp_path / "columns"
    unlabelled.mkdir()
    shutil.copy(features / "a.parquet", unlabelled / "a.parquet")
    pq.write_table(pq.read_table(features / "b.parquet").drop_columns(["label"]),
                   unlabelled / "b.parquet")
    err = _one_line_error(capsys, "--model", str(model), "--input", str(unlabelled), "--output",
                          str(tmp_path / "o3"))
    assert "differ in their columns" in err

    named = tmp_path / "string_labels"
    named.mkdir()
    table = pq.read_table(features / "a.parquet")
    labels = pa.array([f"class {v}" for v in table.column("label").to_pylist()])
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", labels),
                   named / "a.parquet")
    err = _one_line_error(capsys, "--model", str(model), "--input", str(named), "--output",
                          str(tmp_path / "o4"))
    assert "column 'label' must hold integers, got string" in err

    err = _one_line_error(capsys, "--model", str(tmp_path / "other.pt"), "--input", str(features),
                          "--output", str(predicted))
    assert "other.pt" in err  # a model file that is not there
    other = tmp_path / "other.pt"
    other.write_bytes(model.read_bytes() + b"\0")  # another model file (its digest differs)
    err = _one_line_error(capsys, "--model", str(other), "--input", str(features), "--output",
                          str(predicted))
    assert "holds predictions of another model" in err

    # rows only an actor sees: a NaN in the second row group of one file
    nan = tmp_path / "nan"
    nan.mkdir()
    X, _ = _blobs(n_per=100)
    X[200, 1] = np.nan
    pq.write_table(features_table(X, np.arange(len(X)), None), nan / "x.parquet",
                   row_group_size=128)
    err = _one_line_error(capsys, "--model", str(model), "--input", str(nan), "--output",
                          str(tmp_path / "o4"), "--no-progress")
    assert err == f"deepdpm predict: error: {nan / 'x.parquet'} has 1 row(s) with NaN or inf values (rows 200)"
    assert not (tmp_path / "o4" / "x.parquet").exists() and not list((tmp_path / "o4").rglob("*.tmp"))


def _docs_block(heading: str) -> str:
    """The first ```bash block after ``heading`` in docs/distributed.md."""
    text = (REPO / "docs" / "distributed.md").read_text()
    after = text[text.index(heading):]
    return re.search(r"```bash\n(.*?)```", after, re.DOTALL)[1]


def test_the_documented_example_runs(ray_session, model, tmp_path, monkeypatch, capsys):
    """The commands of docs/distributed.md, as written, on a folder of files without keys."""
    monkeypatch.chdir(tmp_path)
    Path("runs/x").mkdir(parents=True)
    shutil.copy(model, "runs/x/model.pt")
    X, y = _blobs(n_per=50)
    for i, rows in enumerate((slice(0, 90), slice(90, 150))):
        Path("features").mkdir(exist_ok=True)
        table = features_table(X[rows], np.arange(rows.stop - rows.start), y[rows])
        pq.write_table(table.drop_columns(["key"]), f"features/part-{i}.parquet")
    commands = [shlex.split(line) for line in _docs_block("## Batch predict over a folder")
                .replace("\\\n", " ").splitlines() if line.startswith("deepdpm ")]
    assert commands and all(c[1] == "predict" for c in commands)
    for argv in commands:
        assert main(argv[1:]) == 0, argv
    capsys.readouterr()
    out = Path(commands[0][commands[0].index("--output") + 1])
    for i in range(2):
        got = pq.read_table(out / f"part-{i}.parquet")
        want = _in_process(model, Path(f"features/part-{i}.parquet"), tmp_path / "one.parquet")
        _assert_same_rows(got, want)
        assert got["key"].to_pylist()[:2] == ["0", "1"]  # row numbers, as the single-file path


def test_the_kuberay_predict_job_uses_its_workers():
    (job,) = [d for d in yaml.safe_load_all((REPO / "k8s" / "rayjob-predict.yaml").read_text())
              if d and d["kind"] == "RayJob"]
    argv = shlex.split(job["spec"]["entrypoint"].replace("$DATA_ROOT", "/mnt/data"))
    args = build_parser().parse_args(argv[1:])
    assert args.command == "predict" and not args.input.endswith(".parquet")
    assert not args.output.endswith(".parquet")  # a folder: one file per input file
    (workers,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert args.num_workers == workers["replicas"]
    cpus = float(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    # one actor per worker (two do not fit on one), and CPUs left there to read
    assert cpus / 2 < args.cpus_per_worker <= cpus - 1
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
