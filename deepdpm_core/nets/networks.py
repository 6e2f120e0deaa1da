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

from deepdpm_core.nets.adam import Adam
from deepdpm_core.nets.losses import kl_forward, kl_grad, slot_kl

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

    def forward(self, x: Tensor, slots: Tensor | None = None, target: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor, Tensor, Tensor]:
        """The logits (B, K); given a batch's E-step ``slots`` and ``target`` (B, m), the
        clustering loss instead: ``(kl, z, log_r, logits)`` as :func:`~deepdpm_core.nets.slot_kl`
        gives them, ``logits`` not differentiable.

        The loss runs the net and the loss as one autograd node whose backward is the
        operators autograd would run, without their per-operator bookkeeping (a step of
        small nets costs its operator count); under autocast (bf16) it is the net's
        layers and :func:`~deepdpm_core.nets.slot_kl` as autograd records them.
        """
        if slots is None:
            return self.out(torch.relu(self.hidden(x)))
        if torch.is_autocast_enabled(x.device.type):
            logits = self.out(torch.relu(self.hidden(x)))
            return (*slot_kl(logits, slots, target), logits.detach())
        return _ClusterKL.apply(x, slots, target, self.hidden.weight, self.hidden.bias,
                                self.out.weight, self.out.bias)


class _ClusterKL(torch.autograd.Function):
    """linear → relu → linear → KL(r^E ‖ r), both passes; the backward computes each
    gradient with the products, in the orientation, autograd's linear and relu backward use
    (the same bits)."""

    @staticmethod
    def forward(ctx, x: Tensor, slots: Tensor, target: Tensor, w1: Tensor, b1: Tensor,
                w2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h = torch.addmm(b1, x, w1.t()).relu_()
        logits = torch.addmm(b2, h, w2.t())
        kl, z, log_r, exp, total = kl_forward(logits, slots, target)
        ctx.save_for_backward(x, h, w2, exp, total, slots, target)
        ctx.mark_non_differentiable(z, log_r, logits)
        ctx.set_materialize_grads(False)  # no zeros made for the outputs without a gradient
        return kl, z, log_r, logits

    @staticmethod
    def backward(ctx, grad_kl: Tensor | None, *_: None) -> tuple[Tensor | None, ...]:
        if grad_kl is None:  # nothing flows back from the loss
            return (None,) * 7
        x, h, w2, exp, total, slots, target = ctx.saved_tensors
        g = kl_grad(exp, total, slots, target, grad_kl)
        dh = torch.ops.aten.threshold_backward(g.mm(w2), h, 0)
        return None, None, None, dh.t().mm(x), dh.sum(0), g.t().mm(h), g.sum(0)


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

    def forward(self, x: Tensor, z: Tensor, dist2: Tensor) -> tuple[Tensor, Tensor]:
        """The subclustering loss (paper Eq. 7) of each point under the net of its cluster.

        Parameters
        ----------
        x : Tensor of shape (B, D)
        z : Tensor of shape (B,), int64 — hard cluster of each point.
        dist2 : Tensor of shape (B, 2), float32
            Squared distance of each point to its cluster's two subcluster means.

        Returns
        -------
        loss : Tensor, scalar
            Σ_i Σ_j softmax(logits_i)_j · dist2_ij, float32.
        logits : Tensor of shape (B, 2)
            Not differentiable.
        """
        # on a GPU a layout sized by the data makes the host wait for the device every step;
        # on the CPU that wait costs nothing, and the fixed size's unused blocks cost
        # 15-35 % more in both passes (one CPU core, K = 200 and 1000)
        fixed = z.device.type != "cpu"
        cells, block_cluster, cap = cluster_blocks(z, self.n_clusters, fixed_shape=fixed)
        return _BlockLoss.apply(x, cells, block_cluster, cap, dist2, self.w1, self.b1, self.w2, self.b2)


class _BlockLoss(torch.autograd.Function):
    """The K one-hidden-layer nets over the :func:`cluster_blocks` layout and their loss,
    both passes, each product one batched GEMM over all blocks.

    Each block reads its cluster's weights gathered into one (n_blocks, ...) tensor per
    parameter; the backward writes the primary blocks' gradients in place of the (K, ...)
    gradients and adds the overflow blocks'. Splitting the products into primary blocks
    (the weights as they are) and overflow blocks (gathered ones) saves the gather of the
    K primary blocks' weights but doubles the operators of both passes, which is what a
    step of these small nets costs on a GPU (a whole step, both nets: 5.2 ms with the
    products split and a node per layer, 3.7 ms with this node and the clustering net's,
    one H200, K = 1,000, D = 128, B = 4,096). On the CPU (float32) memory traffic is the
    cost instead: the first layer's weights, (K, D, H), are most of what a pass reads, and
    a gathered copy of them (up to 2K blocks) is fresh memory the kernel faults in page by
    page, in both passes. There the first layer's products are split: the two passes
    62 → 22 ms at that size on one core.
    """

    @staticmethod
    def forward(ctx, x: Tensor, cells: Tensor, block_cluster: Tensor, cap: int, dist2: Tensor,
                w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor]:
        n_blocks, k = block_cluster.shape[0], w1.shape[0]
        padded = x.new_zeros(n_blocks * cap, x.shape[1]).index_put_((cells,), x).view(n_blocks, cap, -1)
        bw2 = w2.index_select(0, block_cluster)
        bb1 = b1.index_select(0, block_cluster).unsqueeze(1)
        ctx.in_place = _first_layer_in_place(x)
        if ctx.in_place:
            h = padded.new_empty(n_blocks, cap, w1.shape[2])
            torch.baddbmm(bb1[:k], padded[:k], w1, out=h[:k])
            torch.baddbmm(bb1[k:], padded[k:], w1.index_select(0, block_cluster[k:]), out=h[k:])
            h.relu_()
        else:
            h = torch.baddbmm(bb1, padded, w1.index_select(0, block_cluster)).relu_()
        logits = torch.baddbmm(b2.index_select(0, block_cluster).unsqueeze(1), h, bw2).view(-1, 2).index_select(0, cells)
        sub_r = torch.softmax(logits, dim=1)
        loss = (sub_r * dist2).sum()
        ctx.cap, ctx.k = cap, k
        ctx.save_for_backward(padded, h, cells, block_cluster, bw2, sub_r, dist2)
        ctx.mark_non_differentiable(logits)
        ctx.set_materialize_grads(False)  # no zeros made for the logits' (absent) gradient
        return loss, logits

    @staticmethod
    def backward(ctx, grad_loss: Tensor | None, _grad_logits: None) -> tuple[Tensor | None, ...]:
        if grad_loss is None:  # nothing flows back from the loss
            return (None,) * 9
        padded, h, cells, block_cluster, bw2, sub_r, dist2 = ctx.saved_tensors
        k, dtype = ctx.k, h.dtype  # the forward's compute dtype (bf16 under autocast)
        grad_r = dist2 * grad_loss
        if grad_r.dtype != sub_r.dtype:  # autocast's softmax in bf16 (CPU): its gradient too
            grad_r = grad_r.to(sub_r.dtype)
        grad_logits = torch._softmax_backward_data(grad_r, sub_r, 1, sub_r.dtype)
        w2_block = bw2
        if dtype != bw2.dtype:
            padded, w2_block, grad_logits = padded.to(dtype), bw2.to(dtype), grad_logits.to(dtype)
        g = grad_logits.new_zeros(h.shape[0] * ctx.cap, 2).index_put_((cells,), grad_logits).view(*h.shape[:2], 2)
        dh = torch.ops.aten.threshold_backward(torch.bmm(g, w2_block.mT), h, 0)
        overflow = block_cluster[k:]

        def per_cluster(blocks: Tensor) -> Tensor:  # (K, ...) primary blocks + the overflow blocks
            if blocks.dtype != bw2.dtype:
                blocks = blocks.to(bw2.dtype)
            return blocks[:k].index_add_(0, overflow, blocks[k:])

        if ctx.in_place:
            grad_w1 = torch.bmm(padded[:k].mT, dh[:k]).index_add_(0, overflow, torch.bmm(padded[k:].mT, dh[k:]))
        else:
            grad_w1 = per_cluster(torch.bmm(padded.mT, dh))
        return (None, None, None, None, None, grad_w1,
                per_cluster(dh.sum(1, dtype=bw2.dtype)), per_cluster(torch.bmm(h.mT, g)),
                per_cluster(g.sum(1, dtype=bw2.dtype)))


def _first_layer_in_place(x: Tensor) -> bool:
    """Whether the K primary blocks read the first layer's weights where they are
    (:class:`_BlockLoss`): on the CPU in float32, where memory traffic, not operators, is
    what a step costs."""
    return x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")


def cluster_blocks(z: Tensor, n_clusters: int, fixed_shape: bool = False) -> tuple[Tensor, Tensor, int]:
    """Lay rows out in blocks of same-cluster rows, for batched per-cluster GEMMs.

    Blocks hold c = ceil(B / K) zero-padded rows. Block k < K is cluster k's first c rows
    (the *primary* blocks); a cluster with more rows continues in *overflow* blocks after
    them, in cluster order: K·c ≤ B + K primary and at most B overflow padded rows, so at
    most 2B + K however imbalanced the clusters.

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
    cells : Tensor of shape (B,), int64
        Padded row of each row: its block times c plus its place in the block.
    block_cluster : Tensor of shape (n_blocks,), int64
        Cluster of each block: 0 … K − 1, then the overflow blocks'.
    cap : int
        c, rows per block.
    """
    b, dev, k = z.shape[0], z.device, n_clusters
    # an empty batch still has the K primary blocks, so its graph reaches every weight
    # (a DDP rank whose rows ran out takes part in the gradient all-reduce)
    cap = max(1, -(-b // k))
    order = torch.argsort(z)
    z_sorted = z.take(order)
    clusters = torch.arange(k, device=dev)
    first = torch.searchsorted(z_sorted, clusters)  # not bincount: its size is read off the data
    extra = torch.searchsorted(z_sorted, clusters, right=True).sub_(first).sub_(1).div_(cap, rounding_mode="floor").clamp_min_(0)
    ends = extra.cumsum(0)  # overflow blocks up to each cluster's last
    # the sorted row at place p of cluster k's rows goes to cell k·c + p while p < c (its
    # primary block), else to (K − 1 + k's overflow blocks before)·c + p: the first cell
    # of the two looked up by (p ≥ c, k)
    place = torch.arange(b, device=dev).sub_(first.take(z_sorted))
    base = torch.cat([clusters, (ends - extra).add_(k - 1)]).mul_(cap)
    cells = torch.empty_like(order).index_put_((order,), base.take(torch.add(z_sorted, place >= cap, alpha=k)).add_(place))
    if fixed_shape:  # block j's cluster: the clusters whose overflow ends at or before it
        blocks = torch.arange(max(0, -(-b // cap) - 1), device=dev)
        overflow = torch.searchsorted(ends, blocks, right=True).clamp_max_(k - 1)
    else:
        overflow = torch.searchsorted(ends, torch.arange(int(ends[-1]), device=dev), right=True)
    return cells, torch.cat([clusters, overflow]), cap


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
    optimizer: Adam,
    axis: int = 0,
) -> None:
    """Replace parameter ``module.<name>`` by ``old[src]`` along ``axis`` (its rows by default).

    Parameters
    ----------
    module : nn.Module
    name : str
        Attribute holding the parameter.
    src : Tensor of shape (K_new,), int64
        Source row of each new row; −1 marks a fresh row.
    fresh : Tensor of shape (n_fresh, ...) or None
        Values of the fresh rows, in order (``axis`` first).
    optimizer : Adam
        Its state for the parameter (Adam moments) is moved along the same map; fresh
        rows start with zero moments.
    axis : int
        The axis the rows lie along.
    """
    old: nn.Parameter = getattr(module, name)
    keep = src.clamp_min(0)
    is_fresh = src < 0
    data = old.detach().index_select(axis, keep)
    if bool(is_fresh.any()):
        data.movedim(axis, 0)[is_fresh] = fresh.to(data)
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    setattr(module, name, new)
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    state = optimizer.state.pop(old, None)
    if state:
        moved = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == old.shape:
                value = value.index_select(axis, keep)
                value.movedim(axis, 0)[is_fresh] = 0
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
