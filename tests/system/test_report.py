"""``deepdpm report`` renders a self-contained page whose every image is a valid PNG.

The run directory follows the ``deepdpm fit`` output contract (summary.json,
assignments.parquet); sample images come from real webdataset shards and from a plain
image directory; the run-id path downloads the same files from a real MLflow store.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from pipeline.cli import main
from pipeline.tracking.run_tracker import RunTracker
from tests.support.histories import named_rounds
from tests.support.mlflow_server import mlflow_env  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
#: cluster -> (size, colour of its images); cluster 3 is tiny
CLUSTERS = {0: (40, (220, 30, 30)), 1: (25, (30, 200, 30)), 2: (12, (30, 30, 220)), 3: (3, (240, 200, 0))}  # fmt: skip


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.alts: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.sources.append(attrs.get("src", ""))
            self.alts.append(attrs.get("alt", ""))
        for name in ("href", "src"):  # self-contained: nothing fetched from elsewhere
            assert not (attrs.get(name) or "").startswith(("http:", "https:", "file:", "/"))

    def handle_data(self, data):
        self.text.append(data)


def _parse(path: Path) -> tuple[_Images, list[Image.Image]]:
    parser = _Images()
    parser.feed(path.read_text(encoding="utf-8"))
    images = []
    for src in parser.sources:
        assert src.startswith("data:image/png;base64,"), src[:40]
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        img = Image.open(io.BytesIO(data))
        img.verify()  # a truncated or corrupt PNG raises here
        img = Image.open(io.BytesIO(data))
        assert img.format == "PNG" and img.width > 0 and img.height > 0
        images.append(img.convert("RGB"))
    return parser, images


def _history(n: int) -> list[dict]:
    ks = [1] * 5 + [3] * 5 + [5] * 5 + [4] * (n - 15)
    return [
        {
            "epoch": e, "n_clusters": ks[e], "loss_cluster": 1.0 / (e + 1),
            "loss_subcluster": 0.5 / (e + 1),
            "splits_accepted": int(e in (5, 10)) * 2, "merges_accepted": int(e == 15),
            "seconds": 0.2, "nmi": 0.05 * e / n, "ari": 0.04 * e / n, "acc": 0.5,
        }
        for e in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A fit output directory and the images its keys refer to (shards and a folder)."""
    root = tmp_path_factory.mktemp("run")
    out = root / "fit"
    out.mkdir()
    rng = np.random.default_rng(0)
    keys, clusters, conf, labels = [], [], [], []
    for k, (size, _) in CLUSTERS.items():
        for i in range(size):
            keys.append(f"c{k}/img{i:03d}")
            clusters.append(k)
            conf.append(rng.uniform(0.5, 1.0))
            labels.append(k if i % 5 else (k + 1) % 4)  # 80 % pure
    table = pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "cluster": pa.array(clusters, pa.int32()),
            "confidence": pa.array(conf, pa.float32()),
            "label": pa.array(labels, pa.int64()),
        }
    )
    pq.write_table(table, out / "assignments.parquet")
    summary = {
        "n_clusters": 4, "epochs": 20, "fit_seconds": 4.2, "history": _history(20),
        "metrics": {"nmi": 0.61, "ari": 0.52, "acc": 0.8}, "input": "features.parquet",
        "n_samples": len(keys), "n_features": 16,
        "config": {"prior": {"alpha": 10.0, "sigma_scale": 0.005, "nu": None}},
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))

    # images: the colour of the key's cluster, one shade darker for less confident ones
    shards = root / "shards"
    shards.mkdir()
    folder = root / "folder"
    writers = [wds.TarWriter(str(shards / f"shard-{i:05d}.tar")) for i in range(3)]
    order = rng.permutation(len(keys))  # shards are shuffled, as 'deepdpm shards' makes them
    for n, i in enumerate(order):
        colour = CLUSTERS[clusters[i]][1]
        img = Image.new("RGB", (48, 40), colour)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95)
        writers[n % 3].write({"__key__": keys[i], "jpg": buf.getvalue(), "cls": labels[i]})
        (folder / keys[i]).parent.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{keys[i]}.png")
    for w in writers:
        w.close()
    return root


def _strip_colours(images: list[Image.Image]) -> list[np.ndarray]:
    """Mean colour of the non-white pixels of each sample strip (narrow images)."""
    strips = [img for img in images if img.height <= 100]
    out = []
    for img in strips:
        px = np.asarray(img).reshape(-1, 3).astype(float)
        out.append(px[px.sum(axis=1) < 740].mean(axis=0))
    return out


@pytest.mark.parametrize("images", ["shards", "folder"])
def test_report_with_sample_images(run_dir, tmp_path, images):
    output = tmp_path / "report.html"
    code = main(
        ["report", str(run_dir / "fit"), "--output", str(output), "--images",
         str(run_dir / images), "--per-cluster", "5"]
    )  # fmt: skip
    assert code == 0
    parser, pngs = _parse(output)
    text = " ".join(parser.text)
    # K over epochs, moves, cluster sizes, losses, scores + one sample strip per cluster
    assert len(pngs) == 5 + len(CLUSTERS)
    for name in ("K over epochs", "Moves per epoch", "Cluster sizes", "Losses",
                 "NMI / ARI / ACC over epochs"):  # fmt: skip
        assert name in parser.alts
    assert "0.61" in text and "NMI" in text
    # strips come largest cluster first, each in its cluster's colour (keys were matched)
    colours = _strip_colours(pngs)
    by_size = sorted(CLUSTERS, key=lambda k: -CLUSTERS[k][0])
    for colour, k in zip(colours, by_size, strict=True):
        np.testing.assert_allclose(colour, CLUSTERS[k][1], atol=12)
    # 5 thumbnails for the big clusters, all 3 of the tiny one (96 px + 4 px gaps)
    widths = [img.width for img in pngs if img.height <= 100]
    assert widths[:3] == [5 * 96 + 4 * 4] * 3 and widths[3] < widths[0]


def test_report_without_images_or_labels(run_dir, tmp_path):
    fit = tmp_path / "fit"
    fit.mkdir()
    summary = json.loads((run_dir / "fit" / "summary.json").read_text())
    del summary["metrics"]
    summary["history"] = [
        {k: v for k, v in r.items() if k not in ("nmi", "ari", "acc")} for r in summary["history"]
    ]
    (fit / "summary.json").write_text(json.dumps(summary))
    table = pq.read_table(run_dir / "fit" / "assignments.parquet").drop_columns(["label"])
    pq.write_table(table, fit / "assignments.parquet")
    output = tmp_path / "r.html"
    assert main(["report", str(fit), "-o", str(output)]) == 0
    parser, pngs = _parse(output)
    assert len(pngs) == 4  # no scores plot either
    assert "No labels" in " ".join(parser.text)


def test_report_warns_about_a_stalled_fit(tmp_path):
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "n_clusters": 1,
                "history": named_rounds([
                    {
                        "epoch": e,
                        "n_clusters": 1,
                        "loss_cluster": 0.0,
                        "loss_subcluster": 1.0,
                        "splits_accepted": 0,
                        "merges_accepted": 0,
                        "seconds": 0.1,
                    }
                    for e in range(40)
                ]),
            }
        )  # fmt: skip
    )
    output = tmp_path / "r.html"
    assert main(["report", str(tmp_path), "-o", str(output)]) == 0
    parser, pngs = _parse(output)
    text = " ".join(parser.text)
    assert "The fit ended with one cluster (K = 1)" in text
    assert len(pngs) == 3  # no assignments: no cluster-size plot


def test_report_from_mlflow_run_id(run_dir, tmp_path, monkeypatch, mlflow_env):  # noqa: F811
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.chdir(tmp_path)  # artifacts of a sqlite store land under ./mlruns
    with RunTracker(uri, "report") as tracker:
        tracker.log_artifacts(
            [run_dir / "fit" / "summary.json", run_dir / "fit" / "assignments.parquet"]
        )
    assert not tracker.failed
    output = tmp_path / "r.html"
    code = main(["report", tracker.run_id, "--tracking-uri", uri, "-o", str(output)])
    assert code == 0
    parser, pngs = _parse(output)
    assert len(pngs) == 5
    assert f"MLflow run {tracker.run_id}" in " ".join(parser.text)


def test_bad_inputs_are_one_line_errors(run_dir, tmp_path):
    (tmp_path / "no_images").mkdir()
    (tmp_path / "afile.txt").write_text("x")
    cases = [
        [str(tmp_path / "missing")],
        [str(tmp_path)],  # a directory without summary.json
        # --images that cannot give any sample: a plain file, a folder without the run's keys
        [str(run_dir / "fit"), "--images", str(tmp_path / "afile.txt")],
        [str(run_dir / "fit"), "--images", str(tmp_path / "no_images")],
    ]
    for name, data in {"garbage": b"\xff\xfe\x00junk", "int_history": b'{"history": 5}',
                       "list_history": b'{"history": [1, 2]}'}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_bytes(data)
        cases.append([str(tmp_path / name)])
    for args in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "report", *args, "-o", str(tmp_path / "x.html")],
            cwd=REPO, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("deepdpm report: error:")
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.html").exists()


def test_summaries_are_strict_json_with_null_for_non_finite_numbers(tmp_path):
    from deepdpm_core.atomic_files import write_json_atomic

    path = tmp_path / "summary.json"
    write_json_atomic({"history": [{"loss": float("nan"), "k": np.int64(3)}], "x": [float("inf"), 1.5]}, path)
    strict = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert strict == {"history": [{"loss": None, "k": 3}], "x": [None, 1.5]}
    # an output path that is a folder is named as such, and nothing is left in it
    with pytest.raises(IsADirectoryError, match=f"output {tmp_path} is a folder"):
        write_json_atomic({}, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.parametrize("size", [(8, 8), (32, 24), (300, 150)])
def test_sample_thumbnails_fill_their_tiles(size):
    """Small images grow to the 96 px tile (aspect kept), large ones shrink to it."""
    from pipeline.report.sample_images import image_strip

    buf = io.BytesIO()
    Image.new("RGB", size, (10, 10, 10)).save(buf, format="PNG")
    strip = Image.open(io.BytesIO(image_strip([buf.getvalue()] * 2))).convert("RGB")
    assert strip.size == (2 * 96 + 4, 96)
    dark = np.argwhere(np.asarray(strip)[:, :96].sum(axis=2) < 100)  # the first tile's image
    height, width = dark.max(axis=0) - dark.min(axis=0) + 1
    assert max(width, height) == 96
    assert width / height == pytest.approx(size[0] / size[1], rel=0.05)


def test_report_says_why_the_fit_stopped(tmp_path):
    fit = tmp_path / "fit"
    fit.mkdir()
    # the last record says why the fit stopped, as the fit's schedule said it
    history = _history(20)
    history[-1]["stop_reason"] = "K settled after 20 epochs (3 move rounds in a row accepted nothing)"
    summary = {"n_clusters": 4, "epochs": 20, "fit_seconds": 1.0, "history": history}
    (fit / "summary.json").write_text(json.dumps(summary))
    output = tmp_path / "r.html"
    assert main(["report", str(fit), "-o", str(output)]) == 0
    parser, _ = _parse(output)
    text = " ".join(parser.text)
    assert "stopped" in text
    assert "K settled after 20 epochs (3 move rounds in a row accepted nothing)" in text
