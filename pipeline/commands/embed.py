"""``deepdpm embed``: learn a feature space to cluster in (AE, UMAP, AE + UMAP, PCA).

Reads raw pixel arrays (``.npz`` with ``X`` [N, ...] and optional ``y``, or ``.npy``), a
table (CSV, Parquet or Arrow; one column per feature or an ``embedding`` column) or a
folder of tables, and writes a feature table (key, embedding, label) for ``deepdpm
fit``; ``--save-model`` keeps the trained autoencoder (safe to load) to encode new data.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pipeline.io.columns import add_column_arguments
from pipeline.io.existing_outputs import add_overwrite_argument
from pipeline.io.results import add_json_argument

HELP = "learn features from raw pixels or features (autoencoder, UMAP, AE+UMAP = n2d, PCA) into Parquet"

#: = ``deepdpm_core.features.embedding.METHODS`` (spelled out so ``deepdpm --help`` needs no torch)
METHODS = ("ae", "umap", "ae-umap", "pca")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        required=True,
        type=Path,
        help="raw .npz (X, y) / .npy, a table (.csv, .tsv, .parquet, .arrow) or a folder of tables",
    )
    parser.add_argument("--output", required=True, type=Path, help="Parquet feature table to write")
    parser.add_argument("--method", required=True, choices=METHODS, help="embedding method")
    parser.add_argument(
        "--dim",
        type=int,
        default=None,
        help="output dimension (default: ae.latent_dim for ae, embed.dim otherwise)",
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML run config")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted config override, e.g. --set ae.pretrain_epochs=100 (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
    parser.add_argument(
        "--save-model", type=Path, default=None, help="also save the trained autoencoder (.pt)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_overwrite_argument(parser, "an existing --output (and --save-model) file")
    add_column_arguments(parser)
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from deepdpm_core.errors import DataError
    from pipeline.extras import require

    # the arguments and the input first: a mistake is answered before torch loads (the
    # paths before the config, which loads pydantic)
    if "umap" in args.method:
        require(f"--method {args.method}", "umap")
    if not args.input.exists():
        raise FileNotFoundError(f"input not found: {args.input}")
    if args.output.suffix.lower() != ".parquet":
        raise DataError(f"--output must be a .parquet file, got '{args.output}'")
    if args.output.resolve() == args.input.resolve():
        raise DataError("--output must differ from --input")
    from pipeline.io.existing_outputs import refuse_existing_file

    refuse_existing_file(args.output, args.overwrite)
    if args.save_model is not None:
        refuse_existing_file(args.save_model, args.overwrite, "--save-model")
    if args.save_model is not None and args.save_model.resolve() == args.output.resolve():
        raise DataError("--save-model must differ from --output")
    if args.save_model is not None and args.method not in ("ae", "ae-umap"):
        raise DataError(
            f"--save-model needs an autoencoder method (ae, ae-umap), not '{args.method}'"
        )
    from pipeline.fit.request import config_from_args

    config = config_from_args(args.config, args.overrides, args.seed)
    from pipeline.io.columns import columns_from_args
    from pipeline.io.row_checks import check_fit_rows
    from pipeline.io.table_writing import features_table, write_parquet_atomic
    from pipeline.io.tables import read_features

    table = read_features(args.input, columns_from_args(args))
    if table.X.ndim <= 2:  # rows of features; [N, ...] images are checked when flattened
        check_fit_rows(table, args.input)

    from deepdpm_core.features import as_feature_matrix, embed, save_autoencoder
    from deepdpm_core.progress_bars import progress_bar
    from pipeline.io.results import print_result, shown_path

    X = as_feature_matrix(table.X, name=str(args.input))

    def on_epoch(record: dict[str, float]) -> None:
        if bar is not None:
            bar.set_postfix(loss=f"{record['loss']:.4g}", refresh=False)
            bar.update(1)

    start = time.perf_counter()
    with progress_bar(args.method in ("ae", "ae-umap") and not args.quiet,
                      total=config.ae.pretrain_epochs, desc="autoencoder", unit="epoch") as bar:
        result = embed(X, args.method, config, dim=args.dim, on_epoch=on_epoch)
    seconds = time.perf_counter() - start

    # the model first: if it cannot be written, no feature table claims to come from it
    if args.save_model is not None and result.autoencoder is not None:
        save_autoencoder(result.autoencoder, config, args.save_model)
    write_parquet_atomic(features_table(result.embedding, table.keys, table.labels), args.output)
    summary = (
        f"embedded {X.shape[0]} rows: {X.shape[1]} -> {result.embedding.shape[1]} dims "
        f"with {args.method} in {seconds:.1f}s"
    )
    losses = [r["loss"] for r in result.ae_history]
    if losses:
        summary += f" (AE loss {losses[0]:.4g} -> {losses[-1]:.4g})"
    saved = args.save_model is not None and result.autoencoder is not None
    print_result(args, f"{summary} -> {shown_path(args.output)}", {
        "output": shown_path(args.output), "method": args.method, "n_rows": int(X.shape[0]),
        "input_dim": int(X.shape[1]), "dim": int(result.embedding.shape[1]),
        "seconds": round(seconds, 3), "ae_loss_first": losses[0] if losses else None,
        "ae_loss_last": losses[-1] if losses else None,
        "autoencoder": shown_path(args.save_model) if saved else None,
    })  # fmt: skip
    return 0
