"""Sufficient statistics of weighted Gaussian data, as a small type that adds.

For rows r = 1..R (clusters or subclusters) the statistics of points x_i with weights
w_ir are the uncentred sums

    n_r  = Σ_i w_ir                 shape (R,)
    s1_r = Σ_i w_ir x_i             shape (R, D)
    s2_r = Σ_i w_ir x_i x_iᵀ        shape (R, D, D)

kept in float64. Uncentred sums make aggregation exact: stats(A ∪ B) = stats(A) +
stats(B), an all-reduce is a sum of the flat tensor, and merging two clusters is the sum
of their rows. (Data are shifted by the global mean before accumulation, so the
uncentred sums do not lose precision to a large common offset.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def pair_sums(self) -> SuffStats:
        """Sum consecutive row pairs (2k, 2k+1) -> row k: subcluster stats -> cluster stats."""
        r = self.n_rows // 2
        return SuffStats(
            self.n.view(r, 2).sum(1),
            self.s1.view(r, 2, -1).sum(1),
            self.s2.view(r, 2, self.dim, self.dim).sum(1),
        )

    def flat(self) -> Tensor:
        """All statistics as one contiguous float64 vector (what an all-reduce sends)."""
        return torch.cat([self.n, self.s1.reshape(-1), self.s2.reshape(-1)])

    @staticmethod
    def numel(n_rows: int, dim: int) -> int:
        """Length of :meth:`flat` for ``n_rows`` groups: R (1 + D + D²)."""
        return n_rows * (1 + dim + dim * dim)

    @staticmethod
    def from_flat(flat: Tensor, n_rows: int, dim: int) -> SuffStats:
        """Inverse of :meth:`flat`."""
        a, b = n_rows, n_rows * (1 + dim)
        return SuffStats(
            flat[:a].clone(), flat[a:b].reshape(n_rows, dim).clone(),
            flat[b:].reshape(n_rows, dim, dim).clone(),
        )


def dense_stats(x: Tensor, weights: Tensor) -> SuffStats:
    """Statistics with a dense weight matrix.

    Parameters
    ----------
    x : Tensor of shape (B, D)
    weights : Tensor of shape (B, R)
        e.g. soft responsibilities r_ik.

    Returns
    -------
    SuffStats with R rows. Cost O(B·R·D²) as one matrix product.
    """
    x = x.to(torch.float64)
    w = weights.to(torch.float64)
    b, d = x.shape
    outer = (x[:, :, None] * x[:, None, :]).reshape(b, d * d)
    return SuffStats(w.sum(0), w.T @ x, (w.T @ outer).reshape(-1, d, d))


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
