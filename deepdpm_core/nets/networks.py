"""The clustering net, the batched subclustering nets, and the row maps of surgery.

Both are one-hidden-layer MLPs (paper §3.1). The K subclustering nets are one parameter
tensor per layer with a leading K axis, run by batched GEMMs over blocks of same-cluster
points: O(B·D·H) per batch whatever K is (the reference code's block-masked layer grows
with K²). Surgery builds new parameters from a row map and moves the Adam state along the
same map (docs/design.md, "Surgery").
"""

from __future__ import annotations

import math

import torch
from torch import nn

Tensor = torch.Tensor

class ClusterNet(nn.Module):
    """f_cl: x (B, D) -> logits (B, K); r = softmax(logits).

    Weights are drawn from ``generator`` (PyTorch's Linear default ranges), never from
    the global RNG, so a seed fixes the net on every rank.
    """

    def __init__(self, dim: int, hidden: int, n_clusters: int, generator: torch.Generator) -> None:
        super().__init__()
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, n_clusters)
        with torch.no_grad():
            for layer in (self.hidden, self.out):
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.copy_((torch.rand(layer.weight.shape, generator=generator) * 2 - 1) * bound)
                layer.bias.copy_((torch.rand(layer.bias.shape, generator=generator) * 2 - 1) * bound)

    @property
    def n_clusters(self) -> int:
        return self.out.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.hidden(x)))


class SubclusterNets(nn.Module):
    """K subclustering nets f_sub^k: (x, k) -> 2 logits, run batched over same-cluster blocks.

    Parameters are ``w1`` (K, D, H), ``b1`` (K, H), ``w2`` (K, H, 2), ``b2`` (K, 2).
    """

    def __init__(self, dim: int, hidden: int, n_clusters: int, generator: torch.Generator) -> None:
        super().__init__()
        self.dim, self.hidden_size = dim, hidden
        w1, b1, w2, b2 = self.fresh(n_clusters, generator)
        self.w1, self.b1 = nn.Parameter(w1), nn.Parameter(b1)
        self.w2, self.b2 = nn.Parameter(w2), nn.Parameter(b2)

    @property
    def n_clusters(self) -> int:
        return self.w1.shape[0]

    def fresh(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Default (PyTorch Linear-style uniform) initial values for ``n`` nets."""
        d, h = self.dim, self.hidden_size
        a1, a2 = 1.0 / math.sqrt(d), 1.0 / math.sqrt(h)

        def u(shape: tuple[int, ...], bound: float) -> Tensor:
            return (torch.rand(shape, generator=generator) * 2 - 1) * bound

        return u((n, d, h), a1), u((n, h), a1), u((n, h, 2), a2), u((n, 2), a2)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        """Subcluster logits of each point under the net of its cluster.

        Parameters
        ----------
        x : Tensor of shape (B, D)
        z : Tensor of shape (B,), int64 — hard cluster of each point.

        Returns
        -------
        Tensor of shape (B, 2)
        """
        # on a GPU a layout sized by the data makes the host wait for the device every step;
        # on the CPU that wait costs nothing, and the fixed size's unused blocks cost
        # 15-35 % more in both passes (one CPU core, K = 200 and 1000)
        fixed = z.device.type != "cpu"
        block, slot, overflow, cap = cluster_blocks(z, self.n_clusters, fixed_shape=fixed)
        return _BlockMLP.apply(x, block, slot, overflow, cap, self.w1, self.b1, self.w2, self.b2)


class _BlockMLP(torch.autograd.Function):
    """The K one-hidden-layer nets over the :func:`cluster_blocks` layout, both passes.

    Only the overflow blocks read gathered copies of the weights; the backward writes the
    primary blocks' gradients straight into (K, ...) tensors and adds the overflow blocks'.
    A copy per block (autograd through ``index_select``) costs up to 2x the weights per
    step, over glibc's 32 MB mmap limit at K = 1000, D = 128, B = 4096 (fresh pages every
    step): in the epochs of a fit at 320k x 128 x 1000 (one CPU core) the subnets' forward
    took 0.95 s that way and 0.51 s this way, the backward of both nets 1.9-2.3 s and 1.4 s.
    """

    @staticmethod
    def forward(ctx, x: Tensor, block: Tensor, slot: Tensor, overflow: Tensor, cap: int,
                w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
        k = w1.shape[0]
        padded = x.new_zeros(k + overflow.shape[0], cap, x.shape[1]).index_put_((block, slot), x)
        ow1, ow2 = w1.index_select(0, overflow), w2.index_select(0, overflow)
        h = torch.cat([torch.baddbmm(b1[:, None, :], padded[:k], w1),
                       torch.baddbmm(b1.index_select(0, overflow)[:, None, :], padded[k:], ow1)]).relu_()
        out = torch.cat([torch.baddbmm(b2[:, None, :], h[:k], w2),
                         torch.baddbmm(b2.index_select(0, overflow)[:, None, :], h[k:], ow2)])
        ctx.save_for_backward(padded, h, block, slot, overflow, w2, ow2)
        return out[block, slot]

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        padded, h, block, slot, overflow, w2, ow2 = ctx.saved_tensors
        k, dtype = w2.shape[0], h.dtype  # the forward's compute dtype (bf16 under autocast)
        padded = padded.to(dtype)
        g = grad_out.new_zeros(*h.shape[:2], 2, dtype=dtype).index_put_((block, slot), grad_out.to(dtype))
        dh = torch.cat([torch.bmm(g[:k], w2.to(dtype).transpose(1, 2)),
                        torch.bmm(g[k:], ow2.to(dtype).transpose(1, 2))]).mul_(h > 0)

        def per_cluster(primary: Tensor, over: Tensor) -> Tensor:  # (K, ...) + overflow blocks
            return primary.to(w2.dtype).index_add_(0, overflow, over.to(w2.dtype))

        dw1 = per_cluster(torch.bmm(padded[:k].transpose(1, 2), dh[:k]), torch.bmm(padded[k:].transpose(1, 2), dh[k:]))
        dw2 = per_cluster(torch.bmm(h[:k].transpose(1, 2), g[:k]), torch.bmm(h[k:].transpose(1, 2), g[k:]))
        db1, db2 = dh.sum(1, dtype=w2.dtype), g.sum(1, dtype=w2.dtype)
        return (None, None, None, None, None, dw1, per_cluster(db1[:k], db1[k:]),
                dw2, per_cluster(db2[:k], db2[k:]))


def cluster_blocks(z: Tensor, n_clusters: int, fixed_shape: bool = False) -> tuple[Tensor, Tensor, Tensor, int]:
    """Lay rows out in blocks of same-cluster rows, for batched per-cluster GEMMs.

    Blocks hold c = ceil(B / K) zero-padded rows. Block k < K is cluster k's first c rows
    (the *primary* blocks, multiplied by the (K, ...) weights without a gather); a cluster
    with more rows continues in *overflow* blocks after them: K·c ≤ B + K primary and at
    most B overflow padded rows, so at most 2B + K however imbalanced the clusters.

    Parameters
    ----------
    z : Tensor of shape (B,), int64, values in [0, n_clusters)
    n_clusters : int
    fixed_shape : bool
        Size the overflow by its bound, ceil(B / c) − 1 blocks, not by the data, so that no
        operator's output size depends on ``z`` (none makes a GPU's host wait). The blocks
        past the data's overflow stay empty and are given to cluster K − 1: its gradients
        gain zeros, added after its own blocks, so every output and gradient is the same.

    Returns
    -------
    block : Tensor of shape (B,), int64 — block of each row.
    slot : Tensor of shape (B,), int64 — position of each row in its block.
    overflow : Tensor of shape (n_blocks − K,), int64 — cluster of each overflow block.
    cap : int — rows per block.
    """
    b, dev = z.shape[0], z.device
    # not bincount: its output size is read off the data (a host sync on a GPU)
    counts = torch.zeros(n_clusters, dtype=torch.long, device=dev).index_add_(0, z, torch.ones_like(z))
    # an empty batch still has the K primary blocks, so its graph reaches every weight
    # (a DDP rank whose rows ran out takes part in the gradient all-reduce)
    cap = max(1, -(-b // n_clusters))
    extra = (-(-counts // cap) - 1).clamp_min(0)  # overflow blocks per cluster
    order = torch.argsort(z)
    z_sorted = z[order]
    pos = torch.arange(b, device=dev) - (torch.cumsum(counts, 0) - counts)[z_sorted]
    q = torch.div(pos, cap, rounding_mode="floor")  # 0: primary block, q ≥ 1: overflow block q
    overflow_block = n_clusters - 1 + (torch.cumsum(extra, 0) - extra)[z_sorted] + q
    block, slot = torch.empty_like(order), torch.empty_like(order)
    block[order] = torch.where(q == 0, z_sorted, overflow_block)
    slot[order] = pos - q * cap
    if fixed_shape:  # block j's cluster: the clusters whose overflow ends at or before it
        ends = torch.cumsum(extra, 0)
        blocks = torch.arange(max(0, -(-b // cap) - 1), device=dev)
        overflow = torch.searchsorted(ends, blocks, right=True).clamp_max_(n_clusters - 1)
    else:
        overflow = torch.repeat_interleave(torch.arange(n_clusters, device=dev), extra)
    return block, slot, overflow, cap


def axis_aligned_subnets(
    dim: int, hidden: int, centers: Tensor, directions: Tensor, spreads: Tensor, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Data-free initial weights of n subclustering nets, net i splitting along ``directions[i]``.

    Two hidden units compute relu(±(x − c)·v / spread), each driving one subcluster's
    logit, so the net starts out halving its cluster along its direction; the other units
    start small and random. A function of the parameters only: the same on every rank.
    The random values of all nets are one draw, each net's w1 then w2 in net order: the
    values of drawing them net by net, without a draw and a dozen small operators per
    net (in `bench/scale.py`'s epoch at K = 1,000, 350 subclusters restart).

    Parameters
    ----------
    dim, hidden : int
    centers, directions : Tensor of shape (n, D)
    spreads : Tensor of shape (n,)
    generator : torch.Generator
        A CPU generator.

    Returns
    -------
    w1 (n, D, H), b1 (n, H), w2 (n, H, 2), b2 (n, 2), float32, on the CPU
    """
    n = centers.shape[0]
    v = directions.cpu().to(torch.float32) / spreads.cpu().to(torch.float32)[:, None]
    c = centers.cpu().to(torch.float32)
    draws = torch.rand(n, dim * hidden + hidden * 2, generator=generator) * 2 - 1
    w1 = draws[:, : dim * hidden].reshape(n, dim, hidden) * (0.1 / math.sqrt(dim))
    w2 = draws[:, dim * hidden :].reshape(n, hidden, 2) * (0.1 / math.sqrt(hidden))
    b1, b2 = torch.zeros(n, hidden), torch.zeros(n, 2)
    if hidden >= 2 and n:
        # one dot product per net: a batched product would sum in another order
        offset = torch.stack([v[i] @ c[i] for i in range(n)])
        w1[:, :, 0], b1[:, 0] = v, -offset
        w1[:, :, 1], b1[:, 1] = -v, offset
        w2[:, 0, 0], w2[:, 1, 1] = 2.0, 2.0
        w2[:, 0, 1], w2[:, 1, 0] = 0.0, 0.0
    return w1, b1, w2, b2


def reindex_rows(
    module: nn.Module,
    name: str,
    src: Tensor,
    fresh: Tensor | None,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Replace parameter ``module.<name>`` by ``old[src]`` along its first axis.

    Parameters
    ----------
    module : nn.Module
    name : str
        Attribute holding the parameter.
    src : Tensor of shape (K_new,), int64
        Source row of each new row; −1 marks a fresh row.
    fresh : Tensor of shape (n_fresh, ...) or None
        Values of the fresh rows, in order.
    optimizer : Optimizer
        Its state for the parameter (Adam moments) is moved along the same map; fresh
        rows start with zero moments.
    """
    old: nn.Parameter = getattr(module, name)
    keep = src.clamp_min(0)
    is_fresh = src < 0
    data = old.detach()[keep].clone()
    if bool(is_fresh.any()):
        data[is_fresh] = fresh.to(data)
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    setattr(module, name, new)
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    state = optimizer.state.pop(old, None)
    if state:
        moved = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == old.shape:
                value = value[keep].clone()
                value[is_fresh] = 0
            moved[key] = value
        optimizer.state[new] = moved


def new_row_of(kept: Tensor, n_old: int) -> Tensor:
    """Inverse of a row map: the new row of each old row, −1 where it was not kept.

    Parameters
    ----------
    kept : Tensor of shape (K_new,), int64
        Old row of each new row (distinct).
    n_old : int

    Returns
    -------
    Tensor of shape (n_old,), int64
    """
    out = torch.full((n_old,), -1, dtype=torch.long, device=kept.device)
    out[kept] = torch.arange(len(kept), device=kept.device)
    return out


def cluster_row_map(n_clusters: int, splits: list[int], removed: list[int]) -> Tensor:
    """Row map of a move: kept clusters in order (a split one as its first half), then the
    second half of each split; removed clusters (merged away or empty) disappear.

    Returns
    -------
    Tensor of shape (K_new,), int64 — source cluster of every new cluster.
    """
    gone = set(removed)
    kept = [k for k in range(n_clusters) if k not in gone]
    return torch.tensor(kept + list(splits), dtype=torch.long)
