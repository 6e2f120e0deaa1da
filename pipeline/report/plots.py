"""PNG plots of a fit: K over epochs, accepted moves, losses, cluster sizes, epoch time, scores.

Every function takes plain data (the epoch records of ``DeepDPM.history_`` or cluster
counts) and writes one PNG atomically with matplotlib's Agg backend, so plots work on
headless machines and inside Ray workers. Legends sit outside the axes, where they hide
no data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

from deepdpm_core.atomic_files import atomic_path  # noqa: E402
from deepdpm_core.runtime import EPOCH_PHASES  # noqa: E402

_SPLIT_COLOUR = "tab:green"
_MERGE_COLOUR = "tab:red"
_PRUNE_COLOUR = "dimgrey"
_DPI = 110

#: what changes K in an epoch record: (key, colour, marker, legend label); ``polished`` and
#: ``grown`` are the end of the search, which may set K anew (docs/design.md, "Polish")
K_CHANGES = (
    ("splits_accepted", _SPLIT_COLOUR, "^", "split accepted"),
    ("merges_accepted", _MERGE_COLOUR, "v", "merge accepted"),
    ("prunes", _PRUNE_COLOUR, "X", "cluster pruned (too small or empty)"),
    ("polished", "tab:purple", "D", "k-means partition taken at the end"),
    ("grown", "tab:orange", "*", "search restarted from more clusters"),
)
#: epochs between the markers of two changes in one epoch, side by side
_MARKER_GAP = 0.3


def save_figure(fig: plt.Figure, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` as a PNG, atomically, and close it."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _integer_axes(ax: plt.Axes, x: bool = True, y: bool = False) -> None:
    if x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _count_range(ax: plt.Axes, values: np.ndarray, floor: float = 0.0) -> None:
    """Integer y ticks for counts (K, moves) over a range that holds at least three
    integers: MaxNLocator(integer=True) falls back to fractional ticks (0.945 ... 1.05)
    when fewer than two integers are in view, e.g. for a K that stays at 1."""
    values = np.asarray(values, dtype=float)
    lo = float(values.min()) if values.size else floor
    hi = float(values.max()) if values.size else floor
    pad = max(1.0, 0.05 * (hi - lo))
    ax.set_ylim(max(floor, lo - pad), hi + pad)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _column(history: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r.get(key) or 0) for r in history])


def _legend_below(ax: plt.Axes, ncol: int = 3, gap: float = 0.18, **kw: Any) -> None:
    """The legend under the axes and their x label, ``gap`` axes heights down: inside it
    would hide points, and on the right it would take the width of the plot (and a second
    y-axis has its label there)."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -gap), ncol=ncol, fontsize="small",
              frameon=False, **kw)


def plot_k_over_epochs(history: Sequence[Mapping[str, Any]], path: str | Path,
                       resumed_after: int | None = None) -> Path:
    """K after each epoch, each change marked by what the epoch's record says made it
    (:data:`K_CHANGES`: splits, merges, prunes, the end's k-means partition, a growth).

    Parameters
    ----------
    history : sequence of epoch records (``epoch``, ``n_clusters`` and the keys of
        :data:`K_CHANGES`; a missing key counts 0)
    path : destination PNG
    resumed_after : int, optional
        The epoch after which a resumed fit continued: a dashed line there.
    """
    epochs = _column(history, "epoch")
    k = _column(history, "n_clusters")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.step(epochs, k, where="post", color="tab:blue", lw=2, label="K")
    made = np.array([_column(history, key) > 0 for key, *_ in K_CHANGES]).reshape(len(K_CHANGES), -1)
    # the i-th of n changes in an epoch is drawn (i - (n - 1) / 2) gaps from it: none hides another
    offset = (np.cumsum(made, 0) - 1 - (made.sum(0) - 1) / 2) * _MARKER_GAP
    for (_, colour, marker, name), moved, shift in zip(K_CHANGES, made, offset, strict=True):
        if moved.any():
            ax.scatter(epochs[moved] + shift[moved], k[moved], color=colour, marker=marker,
                       zorder=3, s=40, label=name)
    if resumed_after:
        ax.axvline(resumed_after, color="grey", ls="--", lw=1,
                   label=f"resumed after epoch {resumed_after}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("number of clusters K")
    ax.set_title("K after each epoch, and what changed it")
    _integer_axes(ax)
    _count_range(ax, k)
    ax.grid(alpha=0.3)
    _legend_below(ax, ncol=2)
    return save_figure(fig, path)


def plot_moves(history: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Accepted splits (up), merges and pruned clusters (down, stacked) per epoch, and
    their running totals."""
    epochs = _column(history, "epoch")
    splits = _column(history, "splits_accepted")
    merges = _column(history, "merges_accepted")
    prunes = _column(history, "prunes")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 4.8), sharex=True)
    top.bar(epochs, splits, color=_SPLIT_COLOUR, label="splits")
    top.bar(epochs, -merges, color=_MERGE_COLOUR, label="merges")
    top.bar(epochs, -prunes, bottom=-merges, color=_PRUNE_COLOUR, label="prunes")
    top.axhline(0, color="black", lw=0.8)
    top.set_ylabel("this epoch")
    top.set_title("Moves per epoch: splits raise K, merges and prunes lower it")
    for counts, colour, name in ((splits, _SPLIT_COLOUR, "splits"),
                                 (merges, _MERGE_COLOUR, "merges"),
                                 (prunes, _PRUNE_COLOUR, "prunes")):
        bottom.step(epochs, np.cumsum(counts), where="post", color=colour, label=name)
    bottom.set_xlabel("epoch")
    bottom.set_ylabel("so far")
    # one legend for both panels: each kind has one colour in both
    _legend_below(bottom, gap=0.32, handles=top.get_legend_handles_labels()[0])  # a lower axes
    # counts: integer ticks, never -0.045 moves; merges and prunes are drawn down but
    # counted up
    top_most = max(float(splits.max(initial=0)), float((merges + prunes).max(initial=0)), 1.0)
    top.set_ylim(-top_most * 1.15, top_most * 1.15)
    top.yaxis.set_major_locator(MaxNLocator(integer=True, symmetric=True))
    top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{abs(v):g}"))
    _count_range(bottom, np.concatenate([np.cumsum(splits), np.cumsum(merges), np.cumsum(prunes)]))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        _integer_axes(ax)
    return save_figure(fig, path)


def plot_losses(history: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Cluster and subcluster losses per epoch (two y-axes: their scales differ); the
    subcluster loss alone where the records have no cluster loss (exact EM trains no net
    during the search)."""
    epochs = _column(history, "epoch")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    sub_ax = ax
    if any(r.get("loss_cluster") is not None for r in history):
        ax.plot(epochs, _column(history, "loss_cluster"), color="tab:blue", label="cluster")
        ax.set_ylabel("cluster loss", color="tab:blue")
        sub_ax = ax.twinx()
    sub_ax.plot(epochs, _column(history, "loss_subcluster"), color="tab:orange")
    sub_ax.set_ylabel("subcluster loss", color="tab:orange")
    ax.set_xlabel("epoch")
    ax.set_title("Mean loss per row of the nets" if sub_ax is not ax else "Mean subcluster loss per row")
    _integer_axes(ax)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def has_phases(history: Sequence[Mapping[str, Any]]) -> bool:
    """True when the epoch records say where their seconds went (records of this version)."""
    return any(r.get("seconds_train") is not None for r in history)


def plot_epoch_time(history: Sequence[Mapping[str, Any]], path: str | Path,
                    fit_seconds: float | None = None) -> Path:
    """Seconds of each epoch, stacked by phase (:data:`EPOCH_PHASES`), with K.

    Parameters
    ----------
    history : sequence of epoch records (``epoch``, ``seconds_<phase>``, ``n_clusters``)
    path : destination PNG
    fit_seconds : float, optional
        The fit's time (``summary.json``), named beside the epochs' total: it also counts
        the initialisation before the first epoch.
    """
    epochs = _column(history, "epoch")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    bottom = np.zeros(len(epochs))
    for phase, label in EPOCH_PHASES:
        part = _column(history, f"seconds_{phase}")
        ax.bar(epochs, part, bottom=bottom.copy(), width=1.0, label=label)
        bottom += part
    ax.set_xlabel("epoch")
    ax.set_ylabel("seconds")
    # the tallest bar with room above it (stacked bars' sticky edges stop the autoscale margin)
    ax.set_ylim(0, max(float(bottom.max(initial=0)), 1e-3) * 1.08)
    twin = ax.twinx()
    twin.step(epochs, _column(history, "n_clusters"), where="mid", color="black", lw=1, ls="--")
    twin.set_ylabel("K (dashed)")
    _count_range(twin, _column(history, "n_clusters"))
    total = f"{bottom.sum():.1f} s in all" if fit_seconds is None else (
        f"{bottom.sum():.1f} s of the fit's {fit_seconds:.1f} s; the rest: initialisation")
    ax.set_title(f"Where the epochs went\n({total})")
    _integer_axes(ax)
    ax.grid(alpha=0.3, axis="y")
    _legend_below(ax)
    return save_figure(fig, path)


#: label scores of an epoch record (present when the fitted data have labels)
SCORE_KEYS = ("nmi", "ari", "acc")


def has_scores(history: Sequence[Mapping[str, Any]]) -> bool:
    """True when the epoch records carry NMI/ARI/ACC (labelled data)."""
    return any(r.get("nmi") is not None for r in history)


def plot_scores(history: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """NMI, ARI and ACC per epoch of the fit's partition as it stood after the epoch (each
    row's most likely cluster under the mixture; on the labelled rows the fit scored), with K."""
    epochs = _column(history, "epoch")
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for key, colour in zip(SCORE_KEYS, ("tab:purple", "tab:olive", "tab:cyan"), strict=True):
        ax.plot(epochs, _column(history, key), color=colour, lw=2, label=key.upper())
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("epoch")
    ax.set_ylabel("score")
    twin = ax.twinx()
    twin.step(epochs, _column(history, "n_clusters"), where="post", color="grey", lw=1, ls="--")
    twin.set_ylabel("K (dashed)", color="grey")
    _count_range(twin, _column(history, "n_clusters"))
    ax.set_title("Agreement with the labels after each epoch")
    _integer_axes(ax)
    ax.grid(alpha=0.3)
    _legend_below(ax)
    return save_figure(fig, path)


def plot_cluster_sizes(
    counts: Sequence[int] | np.ndarray, path: str | Path, ids: Sequence[int] | None = None
) -> Path:
    """Cluster sizes from largest to smallest, each bar labelled with its cluster id (the
    numbering of ``assignments.parquet`` and the report's table; ties by id, as there).

    Parameters
    ----------
    counts : array of shape (K,)
        Points per cluster, in any order.
    path : destination PNG
    ids : array of shape (K,), optional
        Cluster id of each count (default: its index, as in ``summary.json``'s
        ``cluster_sizes``).
    """
    sizes = np.asarray(counts, dtype=np.int64)
    ids = np.arange(len(sizes)) if ids is None else np.asarray(ids, dtype=np.int64)
    order = np.lexsort((ids, -sizes))  # largest first, then by id
    sizes, ids = sizes[order], ids[order]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    positions = np.arange(len(sizes))
    ax.bar(positions, sizes, width=1.0 if len(sizes) > 60 else 0.8, color="tab:blue")
    if len(sizes) <= 40:  # every id
        ax.set_xticks(positions, [str(i) for i in ids], fontsize="small",
                      rotation=90 if len(sizes) > 20 else 0)
    else:  # some bars, still named by id
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_formatter(FuncFormatter(
            lambda v, _: str(ids[int(v)]) if v == int(v) and 0 <= int(v) < len(ids) else ""))
    ax.set_xlim(-0.6, max(len(sizes), 1) - 0.4)
    ax.set_xlabel("cluster id (largest first)")
    ax.set_ylabel("points")
    ax.set_title(f"Cluster sizes (K = {len(sizes)}, N = {int(sizes.sum())})")
    if len(sizes) and sizes[0] > 50 * max(int(sizes[-1]), 1):
        ax.set_yscale("log")  # imbalanced: keep the small clusters visible
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def write_fit_plots(
    history: Sequence[Mapping[str, Any]], counts: Sequence[int] | np.ndarray, out_dir: str | Path,
    fit_seconds: float | None = None,
) -> list[Path]:
    """The plots a fit leaves beside ``summary.json`` (``epoch_time.png`` when the records have
    their phase seconds, ``scores.png`` when they carry label scores); returns their paths."""
    out = Path(out_dir)
    paths = [
        plot_k_over_epochs(history, out / "k_over_epochs.png"),
        plot_cluster_sizes(counts, out / "cluster_sizes.png"),
        plot_moves(history, out / "moves.png"),
        plot_losses(history, out / "losses.png"),
    ]
    if has_phases(history):
        paths.append(plot_epoch_time(history, out / "epoch_time.png", fit_seconds))
    if has_scores(history):
        paths.append(plot_scores(history, out / "scores.png"))
    return paths


__all__ = ["K_CHANGES", "SCORE_KEYS", "has_phases", "has_scores", "plot_cluster_sizes", "plot_epoch_time",
           "plot_k_over_epochs", "plot_losses", "plot_moves", "plot_scores", "save_figure",
           "write_fit_plots"]
