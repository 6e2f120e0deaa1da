"""Sufficient statistics of weighted Gaussian data, as a small type that adds.

For rows r = 1..R (clusters or subclusters) and points x_i with weights w_ir, the float64
uncentred sums n_r = Σ_i w_ir (R,), s1_r = Σ_i w_ir x_i (R, D), s2_r = Σ_i w_ir x_i x_iᵀ
(R, D, D). So stats(A ∪ B) = stats(A) + stats(B): an all-reduce or a merge is a sum
(docs/design.md, "Sufficient statistics"). The data are centred first, so the uncentred
sums keep their precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepdpm_core.bayes import blocks

Tensor = torch.Tensor

#: rows of x x^T accumulated per chunk in the sparse path (bounds the B x D x D buffer)
_OUTER_CHUNK_ELEMS = 1 << 24


@dataclass(frozen=True)
class SuffStats:
    """Sufficient statistics of R weighted Gaussian groups.

    Attributes
    ----------
    n : Tensor of shape (R,), float64
        Summed weights (soft or hard counts).
    s1 : Tensor of shape (R, D), float64
        Weighted sums of points.
    s2 : Tensor of shape (R, D, D), float64
        Weighted sums of outer products x xᵀ.
    """

    n: Tensor
    s1: Tensor
    s2: Tensor

    @staticmethod
    def zeros(n_rows: int, dim: int, device: torch.device | str = "cpu") -> SuffStats:
        """Empty statistics for ``n_rows`` groups in ``dim`` dimensions."""
        kw = {"dtype": torch.float64, "device": device}
        return SuffStats(
            torch.zeros(n_rows, **kw), torch.zeros(n_rows, dim, **kw), torch.zeros(n_rows, dim, dim, **kw)
        )

    @property
    def n_rows(self) -> int:
        return self.n.shape[0]

    @property
    def dim(self) -> int:
        return self.s1.shape[1]

    def __add__(self, other: SuffStats) -> SuffStats:
        return SuffStats(self.n + other.n, self.s1 + other.s1, self.s2 + other.s2)

    def rows(self, index: Tensor | list[int]) -> SuffStats:
        """Select (and reorder or repeat) rows."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.n.device)
        return SuffStats(self.n[index], self.s1[index], self.s2[index])

    def scaled(self, factor: Tensor) -> SuffStats:
        """Every row's statistics times its ``factor`` (R,): the statistics of its points
        each weighted by that factor."""
        f = factor.to(self.n)
        return SuffStats(self.n * f, self.s1 * f[:, None], self.s2 * f[:, None, None])

    def pair_sums(self) -> SuffStats:
        """Sum consecutive row pairs (2k, 2k+1) -> row k: subcluster stats -> cluster stats."""
        r = self.n_rows // 2
        return SuffStats(
            self.n.view(r, 2).sum(1),
            self.s1.view(r, 2, -1).sum(1),
            self.s2.view(r, 2, self.dim, self.dim).sum(1),
        )

    def regrouped(self, group: Tensor, n_groups: int) -> SuffStats:
        """Rows summed into ``n_groups`` groups, row r into ``group[r]`` (R,): the statistics
        of the groups' unions."""
        g = group.to(self.n.device)

        def summed(t: Tensor) -> Tensor:
            return torch.zeros((n_groups, *t.shape[1:]), dtype=t.dtype, device=t.device).index_add_(0, g, t)

        return SuffStats(summed(self.n), summed(self.s1), summed(self.s2))

    def flat(self) -> Tensor:
        """All statistics as one contiguous float64 vector (what an all-reduce sends)."""
        return torch.cat([self.n, self.s1.reshape(-1), self.s2.reshape(-1)])

    @staticmethod
    def numel(n_rows: int, dim: int) -> int:
        """Length of :meth:`flat` for ``n_rows`` groups: R (1 + D + D²)."""
        return n_rows * (1 + dim + dim * dim)

    @staticmethod
    def from_flat(flat: Tensor, n_rows: int, dim: int) -> SuffStats:
        """Inverse of :meth:`flat`: views into ``flat`` (no copy; at K = 1000, D = 128 the
        statistics of an epoch are 0.4 GB, so statistics are accumulated into views of
        the one buffer that is all-reduced)."""
        a, b = n_rows, n_rows * (1 + dim)
        return SuffStats(flat[:a], flat[a:b].view(n_rows, dim), flat[b:].view(n_rows, dim, dim))


def sparse_stats(x: Tensor, index: Tensor, weights: Tensor, n_rows: int) -> SuffStats:
    """Statistics where each point contributes to a few rows only.

    Parameters
    ----------
    x : Tensor of shape (B, D)
    index : Tensor of shape (B,) or (B, M), int64
        Row(s) each point contributes to (hard assignment: shape (B,)).
    weights : Tensor of shape (B,) or (B, M)
        Its weight(s) in those rows (1 for hard counts).
    n_rows : int
        R, the number of rows of the result.

    Returns
    -------
    SuffStats with R rows. Cost O(B·M·D²), memory O(R·D² + chunk·D²).
    """
    x = x.to(torch.float64)
    b, d = x.shape
    index = index.reshape(b, -1) if index.dim() > 1 else index[:, None]  # B may be 0
    weights = weights.to(torch.float64)
    weights = weights.reshape(b, -1) if weights.dim() > 1 else weights[:, None]
    out = SuffStats.zeros(n_rows, d, device=x.device)
    flat_idx = index.reshape(-1)
    out.n.index_add_(0, flat_idx, weights.reshape(-1))
    out.s1.index_add_(0, flat_idx, (weights[:, :, None] * x[:, None, :]).reshape(-1, d))
    chunk = max(1, _OUTER_CHUNK_ELEMS // max(1, d * d * index.shape[1]))
    for start in range(0, b, chunk):
        xs = x[start : start + chunk]
        ws = weights[start : start + chunk]
        outer = xs[:, None, :, None] * xs[:, None, None, :] * ws[:, :, None, None]
        out.s2.index_add_(0, index[start : start + chunk].reshape(-1), outer.reshape(-1, d, d))
    return out


def gather_chunk_rows(dim: int, device: torch.device | str) -> int:
    """Rows per gathered (rows, D) block of the grouped GEMMs.

    On CPU a 1 MiB float32 block (2^18 / D rows): blocks that stay in cache made the
    E-step whitening and the soft statistics about twice as fast as 2^16-row ones (1.6M
    pairs at D = 64, one core: 0.59 -> 0.26 s and 0.69 -> 0.33 s). On a GPU 2^16 rows,
    for fewer kernel launches.
    """
    return max(1, (1 << 18) // max(1, dim)) if torch.device(device).type == "cpu" else 1 << 16


def grouped_stats(
    x: Tensor, points: Tensor, rows: Tensor, weights: Tensor, n_rows: int, chunk_rows: int | None = None,
    dtype: torch.dtype | None = None, out: SuffStats | None = None, batched: bool | None = None,
    layout: blocks.BlockLayout = blocks.DEFAULT_LAYOUT,
) -> SuffStats:
    """Statistics from (point, row, weight) triples, one GEMM per row.

    The triples are sorted by (row, point); row r gets s2_r = (w ⊙ X_r)ᵀ X_r over its
    points X_r. Same result as :func:`sparse_stats` but with no (B, D, D) outer-product
    buffer. The GEMMs run in ``dtype`` (default ``x``'s; float32 is ~8x faster than float64 on CPU) on
    points centred at a point c near them, and the float64 uncentred sums are rebuilt
    exactly from them: s1 = s1_c + n c, s2 = s2_c + c s1_cᵀ + s1_c cᵀ + n c cᵀ. Centring
    leaves only rounding relative to the cluster's own spread (~1e-7), not to its offset.
    Cost O(T·D²) for T triples, memory O(T + R·D² + chunk·D).

    On the CPU a Python loop runs one GEMM per row and chunk (c: the chunk's mean); on a
    GPU :func:`_blocked_scatter` runs them as a few batched GEMMs
    (:mod:`deepdpm_core.bayes.blocks`).

    Parameters
    ----------
    x : Tensor of shape (N, D)
        All points the triples refer to.
    points : Tensor of shape (T,), int64
        Row of ``x`` of each triple.
    rows : Tensor of shape (T,), int64
        Statistics row (cluster or subcluster) of each triple.
    weights : Tensor of shape (T,)
        Weight of each triple.
    n_rows : int
    chunk_rows : int, optional
        Most points in one GEMM of the loop (default :func:`gather_chunk_rows`).
    dtype : torch.dtype, optional
        dtype of the GEMMs.
    out : SuffStats, optional
        ``n_rows`` rows to add the statistics to (e.g. views of a flat buffer); new zeros
        by default.
    batched : bool, optional
        Use :func:`_blocked_scatter` (default: on a GPU).
    layout : BlockLayout
        The blocked path's sizes.

    Returns
    -------
    SuffStats with ``n_rows`` rows (``out`` when given).
    """
    d = x.shape[1]
    dtype = dtype or x.dtype
    out = SuffStats.zeros(n_rows, d, device=x.device) if out is None else out
    out.n.index_add_(0, rows, weights.to(torch.float64))
    # (row, point) order: one segment per row, and points read in memory order
    order = torch.argsort(rows * x.shape[0] + points)
    points, weights = points.index_select(0, order), weights.index_select(0, order).to(torch.float64)
    counts = torch.bincount(rows, minlength=n_rows)
    if blocks.use_blocks(x, batched):
        return _blocked_scatter(x, points, counts, weights, dtype, out, layout)
    chunk_rows = chunk_rows or gather_chunk_rows(d, x.device)
    weights_work = weights.to(dtype)
    start = 0
    for r, count in enumerate(counts.tolist()):
        for s in range(start, start + count, chunk_rows):
            e = min(s + chunk_rows, start + count)
            xs = x.index_select(0, points[s:e]).to(dtype)
            c = xs.mean(0)
            xc = xs - c
            wx = xc * weights_work[s:e, None]
            n = weights[s:e].sum()  # float64: n c cᵀ must not carry float32 rounding of n
            _add_uncentred(out.s1[r], out.s2[r], n, c, wx.sum(0), wx.T @ xc)
        start += count
    return out


def _blocked_scatter(x: Tensor, points: Tensor, counts: Tensor, weights: Tensor, dtype: torch.dtype,
                     out: SuffStats, layout: blocks.BlockLayout) -> SuffStats:
    """The per-row sums of :func:`grouped_stats` as batched GEMMs over
    :meth:`~deepdpm_core.bayes.blocks.BlockLayout.segment`.

    Each row's points are centred at c_r, the mean of its first block; each block's
    (D, b) x (b, D) GEMM runs in ``dtype``, one ``bmm`` per chunk of blocks, and the
    blocks' sums are added per row in float64 before the exact float64 rebuild.

    Parameters
    ----------
    x : Tensor of shape (N, D)
    points : Tensor of shape (T,), int64 — sorted by row.
    counts : Tensor of shape (R,), int64 — triples per row.
    weights : Tensor of shape (T,), float64 — in the same order.
    dtype : torch.dtype
    out : SuffStats with R rows, ``n`` already added
    layout : BlockLayout
    """
    n_rows, d, dev = len(counts), x.shape[1], x.device
    block, slot, segment, first = layout.segment(counts)
    centre = torch.zeros(n_rows, d, dtype=dtype, device=dev)
    n = torch.zeros(n_rows, dtype=torch.float64, device=dev).index_add_(
        0, torch.repeat_interleave(torch.arange(n_rows, device=dev), counts), weights)
    s1c = torch.zeros(n_rows, d, dtype=torch.float64, device=dev)
    s2c = torch.zeros(n_rows, d, d, dtype=torch.float64, device=dev)
    for b0, b1, t0, t1 in layout.chunks(block, len(segment), layout.rows * d + 3 * d * d):
        at = (block[t0:t1] - b0, slot[t0:t1])
        xs = layout.pack(x.index_select(0, points[t0:t1]).to(dtype), at, b1 - b0)
        ws = layout.pack(weights[t0:t1].to(dtype), at, b1 - b0)
        seg = segment[b0:b1]
        # a row's first block sets its centre; later blocks (later chunks too) reuse it
        lead = torch.nonzero(first[seg] == torch.arange(b0, b1, device=dev)).squeeze(1)
        filled = torch.bincount(at[0], minlength=b1 - b0).clamp_min(1)
        centre[seg[lead]] = xs[lead].sum(1) / filled[lead, None].to(dtype)
        xc = xs - centre[seg][:, None, :]  # padded rows have weight 0, so they add nothing
        wx = xc * ws[:, :, None]
        s1c.index_add_(0, seg, wx.sum(1).to(torch.float64))
        s2c.index_add_(0, seg, torch.bmm(wx.transpose(1, 2), xc).to(torch.float64))
    _add_uncentred(out.s1, out.s2, n, centre, s1c, s2c)
    return out


def _add_uncentred(s1: Tensor, s2: Tensor, n: Tensor, c: Tensor, s1c: Tensor, s2c: Tensor) -> None:
    """Add sums taken about a centre c back as uncentred float64 sums, in place:
    s1 += s1_c + n c, s2 += sym(s2_c) + c s1_cᵀ + s1_c cᵀ + n c cᵀ.

    Parameters
    ----------
    s1, s2 : Tensor of shape (..., D) and (..., D, D), float64 — updated in place.
    n : Tensor of shape (...), float64 — summed weights.
    c : Tensor of shape (..., D) — the centre.
    s1c, s2c : Tensor of shape (..., D) and (..., D, D) — weighted sums of x − c and of
        their outer products (any float dtype; the GEMM's rounding is not symmetric, so
        s2_c is symmetrised).
    """
    c, s1c, s2c = c.to(torch.float64), s1c.to(torch.float64), s2c.to(torch.float64)
    n = n[..., None]
    s1.add_(s1c + n * c)
    s2.add_(0.5 * (s2c + s2c.transpose(-1, -2)) + c[..., :, None] * s1c[..., None, :]
            + s1c[..., :, None] * c[..., None, :] + n[..., None] * (c[..., :, None] * c[..., None, :]))


class TripleBuffer:
    """(point, row, weight) triples collected over an epoch, reduced by :func:`grouped_stats`.

    Accumulating per minibatch costs a Python loop over the rows every batch; collecting
    the triples (O(N·m) memory for m rows per point) and reducing once per epoch makes
    every row's GEMM large. The storage is allocated once, up front: appending a small
    tensor per batch interleaves long-lived blocks with each step's transient ones, and
    the fragmented heap then held several times the buffers' size (1.7 GB of RSS over
    a 640k-row epoch at K = 1000).

    Parameters
    ----------
    capacity : int
        Most triples that will be added.
    device : torch.device or str
    dtype : torch.dtype
        dtype of the stored weights.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self._points = torch.empty(capacity, dtype=torch.long, device=device)
        self._rows = torch.empty(capacity, dtype=torch.long, device=device)
        self._weights = torch.empty(capacity, dtype=dtype, device=device)
        self._size = 0

    def add(self, points: Tensor, rows: Tensor, weights: Tensor) -> None:
        """Record that point ``points[t]`` has weight ``weights[t]`` in row ``rows[t]``.

        Parameters
        ----------
        points, rows : Tensor of shape (T,), int64
        weights : Tensor of shape (T,)
        """
        end = self._size + points.shape[0]
        if end > self._points.shape[0]:
            raise ValueError(f"TripleBuffer holds {self._points.shape[0]} triples; {end} were added")
        self._points[self._size : end] = points
        self._rows[self._size : end] = rows
        self._weights[self._size : end] = weights
        self._size = end

    def positive(self) -> TripleBuffer:
        """The recorded triples of positive weight, in order (one host synchronisation)."""
        n = self._size
        keep = torch.nonzero(self._weights[:n] > 0).squeeze(1)
        kept = TripleBuffer(0, self._points.device, self._weights.dtype)
        kept._points, kept._rows, kept._weights = (t[:n].index_select(0, keep)
                                                   for t in (self._points, self._rows, self._weights))
        kept._size = keep.shape[0]
        return kept

    def stats(self, x: Tensor, n_rows: int, out: SuffStats | None = None) -> SuffStats:
        """Statistics of all recorded triples over the points ``x`` (N, D), added to
        ``out`` when given (see :func:`grouped_stats`)."""
        n = self._size
        return grouped_stats(x, self._points[:n], self._rows[:n], self._weights[:n], n_rows, out=out)
