"""A command that writes a folder refuses an existing folder of the user's (files none of
which it wrote) unless ``--overwrite``, and with it leaves the user's files."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.fit.outputs import FIT_STATE, RUN_OUTPUTS
from pipeline.io.table_writing import features_table, write_parquet_atomic

SHORT = ["--no-tracking", "--quiet", "--set", "schedule.max_epochs=2"]


@pytest.fixture
def notes(tmp_path) -> Path:
    """A folder of the user's: one text file."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    return folder


@pytest.fixture
def rows(tmp_path) -> Path:
    X = np.random.default_rng(0).normal(size=(200, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", X)
    return tmp_path / "x.npy"


def _refusal(err: str, folder: Path, command: str) -> bool:
    return err == (f"deepdpm {command}: error: --output {folder} is a folder of other files "
                   f"(notes.txt), not an output of deepdpm {command}: pass --overwrite to write "
                   "into it (its files are kept), or choose another --output\n")


def test_fit_refuses_a_folder_of_the_users_and_overwrite_keeps_its_files(notes, rows, capsys):
    assert main(["fit", "--input", str(rows), "--output", str(notes), *SHORT]) == 2
    assert _refusal(capsys.readouterr().err, notes, "fit")
    assert [p.name for p in notes.iterdir()] == ["notes.txt"]
    assert main(["fit", "--input", str(rows), "--output", str(notes), *SHORT, "--overwrite"]) == 0
    assert (notes / "notes.txt").read_text() == "mine\n" and (notes / "model.pt").is_file()
    # its own folder now: a fit there is refused as one that replaces a fit
    assert main(["fit", "--input", str(rows), "--output", str(notes), *SHORT]) == 2
    assert "already holds a fit" in capsys.readouterr().err


def test_demo_shards_and_a_folder_predict_refuse_a_folder_of_the_users(notes, rows, tmp_path,
                                                                      capsys):
    assert main(["demo", "--output", str(notes), "--no-ray", "--no-tracking"]) == 2
    assert _refusal(capsys.readouterr().err, notes, "demo")
    (tmp_path / "images").mkdir()
    assert main(["shards", "--input", str(tmp_path / "images"), "--output", str(notes)]) == 2
    assert _refusal(capsys.readouterr().err, notes, "shards")
    assert main(["fit", "--input", str(rows), "--output", str(tmp_path / "fit"), *SHORT]) == 0
    (tmp_path / "tables").mkdir()
    write_parquet_atomic(features_table(np.load(rows), np.arange(200).astype(str), None),
                         tmp_path / "tables" / "a.parquet")
    assert main(["predict", "--model", str(tmp_path / "fit" / "model.pt"), "--input",
                 str(tmp_path / "tables"), "--output", str(notes), "--no-progress"]) == 2
    assert _refusal(capsys.readouterr().err, notes, "predict")
    assert [p.name for p in notes.iterdir()] == ["notes.txt"]


def test_every_entry_of_a_fit_marks_its_folder_as_a_fit():
    from pipeline.commands.fit import FIT_ENTRIES

    for name in RUN_OUTPUTS | FIT_STATE:
        assert any(fnmatch.fnmatchcase(name, pattern) for pattern in FIT_ENTRIES), name
