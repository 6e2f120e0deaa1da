"""Which columns of a table are the features, the label and the row key.

A wide table (CSV, Parquet, Arrow: one column per feature) is read as every numeric
column a feature, except the label and the key: the columns named by
:class:`TableColumns` (``--label``, ``--key``, ``--features``), else the columns called
``label`` and ``key``, and a pandas index (``__index_level_0__``, or the unnamed first
column ``DataFrame.to_csv`` writes) as the key. A column may be named by its name or by
its position (``0``, ``-1`` for the last; a CSV without a header has only positions).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepdpm_core.errors import DataError

if TYPE_CHECKING:  # imported where used: the commands' flags are read without pyarrow
    import pyarrow as pa

#: columns a pandas DataFrame's index becomes: in Parquet, and in a CSV (nameless)
_PANDAS_INDEX = re.compile(r"^(__index_level_\d+__|Unnamed: 0|)$")


@dataclass(frozen=True)
class TableColumns:
    """How to read a wide table (the ``--features``, ``--label``, ``--key`` flags).

    Parameters
    ----------
    features : sequence of str, optional
        The feature columns, by name or position; None: every numeric column but the
        label and the key.
    label : str, optional
        The column of known classes (integers, whole numbers or strings; empty: none),
        used only to score the clusters; None: the column ``label`` if there is one.
    key : str, optional
        The column of row ids, copied into the assignments; None: the column ``key``,
        else the pandas index, else the row number.
    header : bool, optional
        A CSV's first line names the columns; None: it does unless every field of it is
        a number.
    """

    features: tuple[str, ...] | None = None
    label: str | None = None
    key: str | None = None
    header: bool | None = None

    def __post_init__(self) -> None:
        if self.features is not None:
            if isinstance(self.features, str):
                object.__setattr__(self, "features", split_names(self.features))
            object.__setattr__(self, "features", tuple(str(f) for f in self.features))
            if not self.features:
                raise DataError("features: name at least one column")

    @classmethod
    def of(cls, value: TableColumns | Mapping[str, Any] | None) -> TableColumns:
        """``value`` as a :class:`TableColumns` (a mapping of its fields, or None: defaults)."""
        if isinstance(value, TableColumns):
            return value
        return cls(**dict(value or {}))

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults (what a fit request stores)."""
        return {name: list(v) if isinstance(v, tuple) else v
                for name in ("features", "label", "key", "header")
                if (v := getattr(self, name)) is not None}


def summary_columns(summary: Mapping[str, Any]) -> TableColumns | None:
    """The columns a fit read its input by, from its ``summary.json`` (one written before
    fits recorded them: its feature names); None: the defaults."""
    if "columns" in summary:
        return TableColumns.of(summary["columns"])
    return TableColumns(features=summary["feature_names"]) if summary.get("feature_names") else None


def add_column_arguments(parser: Any) -> None:
    """``--features``, ``--label``, ``--key``, ``--header``/``--no-header``: how a command
    reads a wide table (:class:`TableColumns`)."""
    group = parser.add_argument_group(
        "table columns",
        "A CSV, Parquet or Arrow table with one column per feature: every numeric column "
        "is a feature except the label and the key (by default the columns named 'label' "
        "and 'key', and a pandas index). Name a column or its position (0, -1 for the last).")
    group.add_argument("--features", metavar="COLS",
                       help="the feature columns, comma-separated (default: every numeric one)")
    group.add_argument("--label", metavar="COL",
                       help="column of known classes: scores the clusters (NMI/ARI/ACC); not a "
                            "feature")
    group.add_argument("--key", metavar="COL",
                       help="column of row ids, copied into the assignments; not a feature")
    group.add_argument("--header", action=argparse.BooleanOptionalAction, default=None,
                       help="whether a CSV's first line names the columns (default: it does "
                            "unless all its fields are numbers)")


def columns_from_args(args: Any) -> TableColumns:
    """The :class:`TableColumns` of :func:`add_column_arguments` flags."""
    return TableColumns(features=args.features or None, label=args.label, key=args.key,
                        header=args.header)


def split_names(text: str) -> tuple[str, ...]:
    """``"a,b, c"`` -> ``("a", "b", "c")`` (the ``--features`` flag)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


@dataclass(frozen=True)
class ChosenColumns:
    """The columns of one table that :func:`choose_columns` picked."""

    features: list[str]
    label: str | None
    key: str | None


def _resolve(ref: str, names: Sequence[str], path: str | Path, what: str) -> str:
    """The column ``ref`` names: a name, else a position (negative from the end)."""
    if ref in names:
        return ref
    if re.fullmatch(r"-?\d+", ref.strip()):
        at = int(ref)
        if -len(names) <= at < len(names):
            return names[at]
    shown = ", ".join(repr(n) for n in names[:12]) + (", ..." if len(names) > 12 else "")
    raise DataError(f"{path}: no column {ref!r} for {what} (columns: {shown})")


def is_number_type(typ: pa.DataType) -> bool:
    """Integers, floats, decimals or booleans: what a feature column may hold (an all-empty
    column, type null, is NaN)."""
    import pyarrow as pa
    return (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ)
            or pa.types.is_boolean(typ) or pa.types.is_null(typ))


def choose_columns(schema: pa.Schema, columns: TableColumns, path: str | Path) -> ChosenColumns:
    """The feature, label and key columns of a wide table with ``schema``.

    Raises
    ------
    DataError
        A named column that is not there, a feature column that does not hold numbers
        (every such column is named, with the flags that take it out), no feature column,
        a column name the table has twice, a column chosen for two roles.
    """
    names = list(schema.names)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataError(f"{path}: column name(s) {', '.join(map(repr, twice))} appear more than "
                        "once: give each column its own name")
    key = _resolve(columns.key, names, path, "--key") if columns.key is not None else None
    label = _resolve(columns.label, names, path, "--label") if columns.label is not None else None
    if key is None and "key" in names and label != "key":
        key = "key"
    index = [n for n in names if _PANDAS_INDEX.match(n)]
    if key is None and index and index[0] != label:
        key = index[0]
    if label is None and columns.features is None and "label" in names and key != "label":
        label = "label"
    if columns.features is not None:
        features = [_resolve(ref, names, path, "--features") for ref in columns.features]
    else:
        features = [n for n in names if n not in (key, label) and not _PANDAS_INDEX.match(n)]
    roles = [*features, *(c for c in (label, key) if c is not None)]
    again = sorted({n for n in roles if roles.count(n) > 1})
    if again:
        raise DataError(f"{path}: column(s) {', '.join(map(repr, again))} chosen twice (by "
                        "--features, --label or --key): give each column one role")
    if not features:
        raise DataError(f"{path} has no feature column (columns: {', '.join(map(repr, names))})")
    not_numbers = [n for n in features if not is_number_type(schema.field(n).type)]
    if not_numbers:
        shown = ", ".join(f"{n!r} ({schema.field(n).type})" for n in not_numbers[:8])
        more = f" and {len(not_numbers) - 8} more" if len(not_numbers) > 8 else ""
        raise DataError(f"{path}: column(s) {shown}{more} do not hold numbers: name the label "
                        "column with --label, the row ids with --key, or the feature columns "
                        "with --features")
    return ChosenColumns(features, label, key)


__all__ = ["ChosenColumns", "TableColumns", "add_column_arguments", "choose_columns",
           "columns_from_args", "is_number_type", "split_names", "summary_columns"]
