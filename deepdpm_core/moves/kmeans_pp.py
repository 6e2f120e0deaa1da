"""k-means++ seeding (Arthur & Vassilvitskii 2007) for the initial clusters and for the
k-means partitions that polish and growth score: each next seed is a row drawn with
probability proportional to its squared distance to the nearest seed so far (D²).

The first :data:`PP_SEQUENTIAL_SEEDS` seeds are drawn one by one, each measured against
the rows it may come nearer to; the rest in blocks of :data:`PP_BLOCK`, by rejection from
the distances of the last block (:func:`kmeans_pp_seeds`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

Tensor = torch.Tensor

#: :func:`kmeans_pp_seeds` keeps a row among those a new seed may come nearer to unless the
#: triangle inequality rules it out by this many times a dot product's rounding
#: ((D + 2)·ε, relative to ‖x‖² + max ‖x‖²) beyond its squared distance
PP_ROUNDING = 4
#: ... and measures only those rows where they are fewer than 1/this of all: gathering a
#: row costs about what its distance costs (82,000 x 128, one CPU thread: 5.7 ms to gather
#: 20,000 rows, 11.5 ms for the distances of all 82,000)
PP_GATHER_COST = 2
#: seeds drawn one by one, as by the paper's loop, before the draw goes on in blocks: the
#: initial clusters (10 by default) and most k-means partitions that polish and growth try.
#: Blocks are faster from the first seed where groups are close in many features (82,000 x
#: 128 rows of 1,000 close Gaussians, one CPU thread: 256 seeds 2.29 s one by one, 0.21 s in
#: blocks), but they draw other seeds from the generator
PP_SEQUENTIAL_SEEDS = 256
#: seeds a block holds: every row is measured against them at once, one GEMM that reads the
#: rows once, where one seed at a time reads them once a seed (the rows above: 2,048 seeds
#: 20.0 s one by one, 3.6 s with the first 256 one by one)
PP_BLOCK = 64
#: draws rejected in a row before the block is measured early (then none is rejected): only
#: where nearly all of the D² mass lies next to the block's seeds
PP_MAX_REJECTIONS = 32


def kmeans_pp_seeds(x: np.ndarray, n_clusters: int, rng: np.random.Generator,
                    sequential: int = PP_SEQUENTIAL_SEEDS) -> np.ndarray:
    """k-means++ seeds: rows of ``x`` drawn by the D² law (module docstring).

    FAISS's uniformly drawn seeds leave small clusters of imbalanced data without a centre,
    each then to be recovered by a split (1.28M x 128, 1000 Gaussians: 656 covered from
    random seeds, 865 from k-means++). The first ``sequential`` seeds are drawn one by one:
    each new seed c measures only the rows it may come nearer to, by the triangle
    inequality ‖x − c‖ ≥ ‖c − s‖ − ‖x − s‖ ≥ ‖x − s‖ wherever ‖c − s‖ ≥ 2‖x − s‖, s the
    row's nearest seed (Elkan 2003), so once the seeds are many most rows of separated
    groups are ruled out by one look-up. Where groups are close in many features that rules
    out few rows and each seed reads every row, so the rest are drawn in blocks
    (:func:`_blocked_draws`): the same D² law, other draws of the generator.

    Parameters
    ----------
    x : ndarray of shape (N, D), float32
    rng : numpy Generator
    sequential : int
        Seeds drawn one by one (:data:`PP_SEQUENTIAL_SEEDS`).

    Returns
    -------
    ndarray of shape (n_clusters, D), float32 — rows of ``x``
    """
    X = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    sq = X.square().sum(1)
    chosen = [int(rng.integers(len(X)))]
    d2 = torch.full_like(sq, math.inf)
    owner = torch.zeros(len(X), dtype=torch.long)  # each row's nearest seed, by its place in ``chosen``
    seeds = torch.empty(min(n_clusters, max(sequential, 1)), X.shape[1])
    # what the formula below may be off by (its rounding), added where a row is ruled out
    slack = PP_ROUNDING * (X.shape[1] + 2) * torch.finfo(torch.float32).eps * (sq + sq.max())
    for t in range(len(seeds) - 1):
        c = chosen[-1]
        seeds[t] = X[c]
        rows = None  # every row
        if t:
            to_seeds = (seeds[:t] - X[c]).square_().sum(1)  # ‖c − s‖² for every earlier seed s
            maybe = torch.nonzero(to_seeds[owner] < 4.0 * (d2 + slack)).squeeze(1)
            if len(maybe) * PP_GATHER_COST < len(X):
                rows = maybe
        # ||x - c||² = ||x||² - 2 x·c + ||c||², clamped: cancellation can go below 0
        if rows is None:
            dist = torch.addmv(sq, X, X[c], alpha=-2.0).add_(sq[c]).clamp_min_(0.0)
            owner.masked_fill_(dist < d2, t)
            torch.minimum(d2, dist, out=d2)
        else:
            dist = torch.addmv(sq[rows], X.index_select(0, rows), X[c], alpha=-2.0).add_(sq[c]).clamp_min_(0.0)
            nearer = dist < d2[rows]
            moved = rows[nearer]
            d2[moved], owner[moved] = dist[nearer], t
        chosen.append(_d2_draw(d2, rng))
    if len(chosen) < n_clusters:
        _blocked_draws(X, sq, d2, chosen, n_clusters, rng)
    return x[chosen].astype(np.float32, copy=False)


def _d2_draw(d2: Tensor, rng: np.random.Generator, cum: Tensor | None = None) -> int:
    """A row drawn with probability ∝ ``d2`` (N,), or uniformly where every d2 is 0;
    ``cum``: d2's cumulative sums in float64, where already at hand."""
    cum = torch.cumsum(d2, 0, dtype=torch.float64) if cum is None else cum
    if cum[-1] <= 0:  # fewer distinct rows than seeds: the rest at random
        return int(rng.integers(len(d2)))
    pick = int(torch.searchsorted(cum, torch.tensor([float(cum[-1]) * rng.random()], dtype=torch.float64),
                                  right=True))
    return min(pick, len(d2) - 1)


def _blocked_draws(X: Tensor, sq: Tensor, d2: Tensor, chosen: list[int], n_clusters: int,
                   rng: np.random.Generator) -> None:
    """Append seeds to ``chosen`` up to ``n_clusters`` by the D² law, a block of
    :data:`PP_BLOCK` at a time. ``d2`` (N,) holds each row's squared distance to the
    nearest of the seeds before ``chosen``'s last; the seeds since then form the block.
    A row is proposed from ``d2`` as it stood at the block's start and accepted with
    probability d2_now/d2_then, where d2_now also counts the block's seeds (B·D work a
    draw): an accepted row follows d2_now exactly (rejection sampling). A full block is
    measured against every row in one GEMM, and ``d2`` updated (in place)."""
    block = [chosen[-1]]
    cum = None
    rejected = 0
    while len(chosen) < n_clusters:
        if len(block) == PP_BLOCK or rejected == PP_MAX_REJECTIONS or cum is None:
            seeds = X[block]
            dist = torch.addmm(sq[:, None], X, seeds.T, alpha=-2.0).add_(sq[block]).clamp_min_(0.0)
            torch.minimum(d2, dist.min(1).values, out=d2)
            block, cum, rejected = [], torch.cumsum(d2, 0, dtype=torch.float64), 0
        row = _d2_draw(d2, rng, cum)
        then = float(d2[row])  # 0 only where every row's is: drawn uniformly, kept
        if block and then > 0:
            now = float((sq[block] - 2.0 * (X[block] @ X[row]) + sq[row]).clamp_min(0.0).min())
            if rng.random() * then >= now:  # kept with probability min(then, now)/then
                rejected += 1
                continue
        chosen.append(row)
        block.append(row)
        rejected = 0
