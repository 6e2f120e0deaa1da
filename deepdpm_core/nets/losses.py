"""The clustering net's loss: KL(r^E ‖ r) with r = softmax(logits) (paper Eqs. 5–6).

The target r^E is non-zero on a point's *slots* only (its E-step support), so

    KL(r^E ‖ r) = Σ_c p_c (ln p_c − logit_c + lse),   lse = ln Σ_k exp(logit_k),

over the slots c, with gradient softmax(logits)·Σ_c p_c − p scattered onto the slots. One
autograd function computes both in two passes over the (B, K) logits forward (the max also
gives z = argmax r) and one backward; log_softmax, argmax, gather and their backward passes
took 2.4 ms a step against 1.1 (B = 3125, K = 200, one CPU core). The sums are taken in
float32 whatever the logits' dtype (bf16 under autocast).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

#: logits more than this far below a row's largest are taken as this far: their exp (below
#: 1.7e-38) adds nothing to a float32 sum of at least 1, and exp of a float32 below about
#: −87.3 leaves the vectorised kernel (18 × slower a step where a trained net's far logits
#: fill the (B, K) array)
EXP_FLOOR = -87.0
#: softmax terms (before the row's normalisation by a sum of at least 1) at most this small
#: are taken as 0, and so are their gradients: scaled by the loss's 1/N and multiplied by
#: the output weights in the backward's GEMM, they fall below float32's normal range
#: (1.2e-38), where every product takes the CPU's microcoded slow path. The epoch's
#: flush-to-zero mode (:func:`~deepdpm_core.runtime.flush_denormals`) is the calling
#: thread's own; a BLAS thread started before it keeps its mode (2 threads, 1,000 clusters,
#: 256 hidden units, 50,000 rows: 10 full-batch steps 34.3 s without this, 5.6 s with it).
#: Such a term is 10¹⁸ times below float32's resolution of the sum it joins
SOFTMAX_ZERO = 1e-26


def kl_forward(logits: Tensor, slots: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KL(r^E ‖ softmax(logits)) and what its gradient needs (:func:`slot_kl`'s arguments).

    Returns
    -------
    kl, z, log_r : as :func:`slot_kl`
    exp : Tensor of shape (B, K), float32
        exp(logits − the row's largest), floored at :data:`EXP_FLOOR`, 0 where at most :data:`SOFTMAX_ZERO`.
    total : Tensor of shape (B,), float32
        The rows' sums of ``exp``.
    """
    if logits.dtype != torch.float32:  # bf16 logits (autocast) summed in float32
        logits = logits.float()
    top, z = logits.max(1)
    exp = torch.sub(logits, top.unsqueeze(1)).clamp_min_(EXP_FLOOR).exp_()  # softmax up to the row sums
    torch.nn.functional.threshold_(exp, SOFTMAX_ZERO, 0.0)  # exactly 0 at most SOFTMAX_ZERO
    total = exp.sum(1)
    log_r = logits.gather(1, slots).sub_((top + total.log()).unsqueeze(1))
    kl = (torch.special.xlogy(target, target) - target * log_r).sum()
    return kl, z, log_r, exp, total


def kl_grad(exp: Tensor, total: Tensor, slots: Tensor, target: Tensor, grad_kl: Tensor) -> Tensor:
    """The gradient of :func:`kl_forward`'s ``kl`` times ``grad_kl`` with respect to the
    logits, (B, K): softmax(logits)·Σ_c p_c − p scattered onto the slots."""
    # out of place: a graph kept for a second backward (retain_graph) still needs exp
    grad = exp * (target.sum(1) / total).unsqueeze(1)
    grad.scatter_add_(1, slots, -target)
    return grad.mul_(grad_kl)


class _SlotKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, slots: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        kl, z, log_r, exp, total = kl_forward(logits, slots, target)
        ctx.save_for_backward(exp, total, slots, target)
        ctx.mark_non_differentiable(z, log_r)
        ctx.set_materialize_grads(False)  # no zeros made for z's and ln r's (absent) gradients
        return kl, z, log_r

    @staticmethod
    def backward(ctx, grad_kl: Tensor | None, _grad_z: None, _grad_log_r: None) -> tuple[Tensor | None, None, None]:
        if grad_kl is None:  # nothing flows back from the loss
            return None, None, None
        return kl_grad(*ctx.saved_tensors, grad_kl), None, None


def slot_kl(logits: Tensor, slots: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """KL(r^E ‖ softmax(logits)) summed over the batch, with r^E given on slots.

    Parameters
    ----------
    logits : Tensor of shape (B, K)
        The clustering net's output (differentiable).
    slots : Tensor of shape (B, m), int64
        Clusters where each row's target may be non-zero (repeats allowed when the
        target there is 0).
    target : Tensor of shape (B, m)
        r^E on the slots, float32; rows sum to 1 over distinct clusters.

    Returns
    -------
    kl : Tensor, scalar
    z : Tensor of shape (B,), int64
        argmax_k logits (the hard clusters, paper §3.1); not differentiable.
    log_r : Tensor of shape (B, m), float32
        ln softmax(logits) on the slots; not differentiable.
    """
    return _SlotKL.apply(logits, slots, target)


def first_slots(slots: Tensor) -> Tensor:
    """Whether each slot is the first of its row to hold its cluster, (B, m) float32 of 0
    and 1, from ``slots`` (B, m) int64 (:func:`slot_kl`'s; a repeated slot has target 0)."""
    m = slots.shape[1]
    earlier = torch.ones(m, m, dtype=torch.bool, device=slots.device).tril(-1)  # [j, i]: slot i comes before j
    return (~((slots[:, :, None] == slots[:, None, :]) & earlier).any(2)).float()


def slot_misfit(log_r: Tensor, target: Tensor, first: Tensor) -> Tensor:
    """‖softmax(logits) − r^E‖₁ of each row, from :func:`slot_kl`'s ``log_r``: the slots'
    terms, each cluster counted once, plus the probability the net puts off the slots. It
    bounds the row's gradient of the loss with respect to its logits (softmax − r^E) in
    every entry.

    Parameters
    ----------
    log_r : Tensor of shape (B, m)
        ln softmax(logits) on the slots.
    target : Tensor of shape (B, m)
        As :func:`slot_kl`'s.
    first : Tensor of shape (B, m)
        :func:`first_slots` of the slots.

    Returns
    -------
    Tensor of shape (B,), float32
    """
    prob = log_r.float().exp() * first
    return (prob - target).abs().sum(1) + (1.0 - prob.sum(1)).clamp_min(0)
