"""Blocks of same-group rows: per-group GEMMs as a few batched ones (the GPU path).

The sparse E-step and the grouped statistics multiply each group's rows by that group's
own matrix. On the CPU a Python loop over the groups is fastest (padding costs arithmetic);
on a GPU it launches tiny kernels and syncs the host per group, which at K = 1000 on an
H100 left the device idle for most of an epoch. Here items sorted by group are laid out in
blocks of ``b`` rows of one group (:meth:`BlockLayout.segment`), and each chunk of blocks
(:meth:`BlockLayout.chunks`) is one ``bmm``. Callers choose by device; tests compare both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class BlockLayout:
    """The sizes of the blocked path.

    Attributes
    ----------
    rows : int
        b, the rows of a block: padding adds at most R·(b − 1) rows to T items in R groups.
    chunk_elems : int
        Bound on the elements one chunk of blocks holds at once (its padded input, gathered
        matrices and output); the default is 128 MiB of float32.
    """

    rows: int = 256
    chunk_elems: int = 1 << 25

    def segment(self, counts: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Blocks of :attr:`rows` items over consecutive segments.

        Items are sorted by segment, segment r holding ``counts[r]`` of them; segment r gets
        ⌈counts[r] / b⌉ blocks, its items in order, the last one zero-padded.

        Parameters
        ----------
        counts : Tensor of shape (R,), int64

        Returns
        -------
        block : Tensor of shape (T,), int64 — block of each item (non-decreasing).
        slot : Tensor of shape (T,), int64 — its position in the block.
        segment : Tensor of shape (n_blocks,), int64 — segment of each block.
        first : Tensor of shape (R,), int64 — first block of each segment.
        """
        dev, b = counts.device, self.rows
        n_blocks = -(-counts // b)
        first = torch.cumsum(n_blocks, 0) - n_blocks
        segment_of_item = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts)
        pos = torch.arange(len(segment_of_item), device=dev) - (torch.cumsum(counts, 0) - counts)[segment_of_item]
        block = first[segment_of_item] + torch.div(pos, b, rounding_mode="floor")
        return block, pos % b, torch.repeat_interleave(torch.arange(len(counts), device=dev), n_blocks), first

    def chunks(self, block: Tensor, n_blocks: int, elems_per_block: int) -> list[tuple[int, int, int, int]]:
        """Consecutive blocks in chunks of at most :attr:`chunk_elems` elements.

        Parameters
        ----------
        block : Tensor of shape (T,), int64 — block of each item, non-decreasing.
        n_blocks : int
        elems_per_block : int
            Elements a block needs at once (input, gathered matrix, output).

        Returns
        -------
        list of (first block, end block, first item, end item), one per chunk (one host sync)
        """
        per_chunk = max(1, self.chunk_elems // max(1, elems_per_block))
        starts = torch.arange(0, n_blocks + per_chunk, per_chunk, device=block.device).clamp_max(n_blocks)
        items = torch.searchsorted(block, starts).tolist()
        starts = starts.tolist()
        return [(starts[i], starts[i + 1], items[i], items[i + 1])
                for i in range(len(starts) - 1) if starts[i] < starts[i + 1]]

    def pack(self, values: Tensor, at: tuple[Tensor, Tensor], n_blocks: int, fill: float = 0.0) -> Tensor:
        """Items (n, ...) into their (block, slot) places of an (n_blocks, b, ...) tensor, the
        rest ``fill``."""
        out = values.new_full((n_blocks, self.rows, *values.shape[1:]), fill)
        return out.index_put_(at, values)


#: the sizes a caller gets unless it passes its own
DEFAULT_LAYOUT = BlockLayout()


def use_blocks(x: Tensor, batched: bool | None) -> bool:
    """Whether to run the blocked path: as asked, by default on a GPU."""
    return x.device.type != "cpu" if batched is None else batched
