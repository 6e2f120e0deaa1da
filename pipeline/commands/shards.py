"""``deepdpm shards``: an image folder (ImageFolder / ImageNet layout) -> webdataset shards."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.io.results import add_json_argument

HELP = "write an image folder (one sub-folder per class) as webdataset .tar shards"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="image folder: one sub-folder per class")
    parser.add_argument("--output", required=True, help="folder for shard-NNNNNN.tar files")
    parser.add_argument(
        "--shard-size", type=int, default=1000, help="images per shard (default: 1000)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace shards already in --output"
    )
    parser.add_argument(
        "--read-threads", type=int, default=8, help="threads reading files (default: 8)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from pipeline.extras import require

    # checked before PIL and webdataset load, so that a wrong path is answered at once
    require("writing webdataset shards", "extract", modules=("webdataset", "PIL"))
    if not Path(args.input).is_dir():
        raise FileNotFoundError(f"input folder not found: {args.input}")

    from pipeline.extract.shards import CLASS_INDEX_NAME, MANIFEST_NAME, write_shards
    from pipeline.io.existing_outputs import refuse_foreign_folder
    from pipeline.io.results import print_result, shown_path

    refuse_foreign_folder(args.output, args.overwrite,
                          ("shard-*.tar", CLASS_INDEX_NAME, MANIFEST_NAME), "shards")

    report = write_shards(
        args.input,
        args.output,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
        read_threads=args.read_threads,
        progress=not args.no_progress,
    )
    labeled = f"{len(report.classes)} classes" if report.classes else "unlabeled"
    out = shown_path(report.output_dir)
    print_result(args, [
        f"wrote {report.images_written} images ({labeled}) into {len(report.shards)} shards "
        f"in {out} ({report.seconds:.1f} s)",
        f"class index: {out}/{CLASS_INDEX_NAME}",
        f"manifest:    {out}/{MANIFEST_NAME}",
    ], {**report.to_dict(), "output": out, "output_dir": out})
    if report.skipped:
        print(
            f"warning: skipped {len(report.skipped)} unreadable files (listed in the manifest), "
            f"e.g. {report.skipped[0]['path']}: {report.skipped[0]['reason']}",
            file=sys.stderr,
        )
    return 0
