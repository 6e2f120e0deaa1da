"""The clustering loss KL(r^E ‖ softmax(logits)) on E-step slots: its hand-written backward
against finite differences and against autograd of the same formula."""

import time

import torch

from deepdpm_core.nets import ClusterNet, first_slots, slot_kl, slot_misfit


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """6 rows, K = 5, m = 3 slots per row; row 2 repeats a slot whose target is 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 5, generator=g, dtype=torch.float64) * 2.0
    slots = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(6)])
    slots[2, 2] = slots[2, 1]
    target = torch.rand(6, 3, generator=g, dtype=torch.float64)
    target[2, 2] = 0.0
    target = (target / target.sum(1, keepdim=True)).float()
    return logits, slots, target


def test_the_backward_matches_finite_differences():
    logits, slots, target = _case()
    logits.requires_grad_(True)
    # the forward sums in float32 (bf16 logits under autocast): differences at float32 precision
    assert torch.autograd.gradcheck(lambda lg: slot_kl(lg, slots, target)[0].double(), (logits,),
                                    eps=1e-3, atol=2e-3, rtol=1e-3)


def test_the_backward_is_autograd_of_the_formula():
    logits, slots, target = _case(1)
    a = logits.float().requires_grad_(True)
    kl, z, log_r = slot_kl(a, slots, target)
    kl.backward()
    b = logits.float().requires_grad_(True)
    ref_log_r = torch.log_softmax(b, 1).gather(1, slots)
    ref = (torch.special.xlogy(target, target) - target * ref_log_r).sum()
    ref.backward()
    torch.testing.assert_close(kl, ref)
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(log_r, ref_log_r.detach())
    assert torch.equal(z, logits.argmax(1))


def test_the_misfit_is_the_l1_distance_to_the_targets_and_bounds_each_rows_gradient():
    for seed in range(3):
        logits, slots, target = _case(seed)
        a = logits.float().requires_grad_(True)
        kl, _, log_r = slot_kl(a, slots, target)
        kl.backward()
        dense = torch.zeros(6, 5).scatter_add_(1, slots, target)  # r^E over all K clusters
        brute = (torch.softmax(logits.float(), 1) - dense).abs().sum(1)
        misfit = slot_misfit(log_r, target, first_slots(slots))
        torch.testing.assert_close(misfit, brute)
        assert (a.grad.abs().amax(1) <= misfit + 1e-6).all()
    assert torch.equal(first_slots(torch.tensor([[3, 1, 3, 3], [0, 1, 2, 0]])),
                       torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]))
    # the net's own softmax as the target: no misfit; the net sure of another cluster: nearly 2
    logits = torch.tensor([[4.0, 0.0, -2.0]])
    slots, own, other = torch.tensor([[0, 1, 2]]), torch.softmax(logits, 1), torch.tensor([[0.0, 1.0, 0.0]])
    assert float(slot_misfit(slot_kl(logits, slots, own)[2], own, first_slots(slots))) < 1e-6
    assert float(slot_misfit(slot_kl(logits, slots, other)[2], other, first_slots(slots))) > 1.9


def test_logits_far_below_the_row_maximum_cost_no_more_and_change_nothing():
    """A trained net puts most logits hundreds below each row's best: the loss, its
    gradient and ln r on the slots are autograd's of the formula, and a step over such
    logits takes no longer than over logits near 0 (exp of a float32 below about −87 leaves
    the vectorised kernel)."""
    g = torch.Generator().manual_seed(2)
    rows, k = 4096, 128
    far = torch.randn(rows, k, generator=g) * 60.0 - 200.0
    far[:, 0] = 0.0  # each row's best cluster
    near = torch.randn(rows, k, generator=g)
    slots = torch.stack([torch.zeros(rows, dtype=torch.long), torch.randint(1, k, (rows,), generator=g)], 1)
    target = torch.tensor([[0.999, 0.001]]).expand(rows, 2).contiguous()

    a = far.clone().requires_grad_(True)
    kl, _, log_r = slot_kl(a, slots, target)
    kl.backward()
    b = far.double().requires_grad_(True)
    ref_log_r = torch.log_softmax(b, 1).gather(1, slots)
    (torch.special.xlogy(target.double(), target.double()) - target.double() * ref_log_r).sum().backward()
    torch.testing.assert_close(log_r, ref_log_r.detach().float())
    torch.testing.assert_close(a.grad, b.grad.float(), atol=1e-6, rtol=1e-5)

    def seconds(logits: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(5):
            x = logits.clone().requires_grad_(True)
            t = time.perf_counter()
            slot_kl(x, slots, target)[0].backward()
            best = min(best, time.perf_counter() - t)
        return best

    assert seconds(far) < 3 * seconds(near)


def test_the_backward_through_the_output_weights_makes_no_subnormal_number():
    """Logits up to 87 below a row's best (their exp float32's normal numbers), the loss
    scaled by 1/N as a distillation scales it: every product of a logit's gradient and an
    output weight, as the backward's GEMM forms them, is 0 or a normal number (a subnormal
    one takes the CPU's slow path: a step at 1,000 clusters 7 s against 1 s)."""
    g = torch.Generator().manual_seed(3)
    rows, k, hidden = 512, 256, 64
    logits = -torch.rand(rows, k, generator=g) * 87.0
    logits[:, 0] = 0.0
    slots = torch.stack([torch.zeros(rows, dtype=torch.long), torch.randint(1, k, (rows,), generator=g)], 1)
    target = torch.tensor([[0.999, 0.001]]).expand(rows, 2).contiguous()
    a = logits.requires_grad_(True)
    (slot_kl(a, slots, target)[0] / 50_000).backward()
    weights = torch.rand(k, hidden, generator=g) * 0.01 + 1e-3
    products = a.grad[:, :, None] * weights[None]
    tiny = torch.finfo(torch.float32).tiny
    assert not ((products != 0) & (products.abs() < tiny)).any()
    assert (a.grad != 0).sum(1).min() >= 2  # the slots and the rows' near logits keep theirs


def test_the_net_and_its_loss_in_one_node_give_the_bits_of_autograd():
    """The clustering net given a batch's slots: loss, z, ln r, logits and every gradient
    exactly as autograd of the net's layers followed by :func:`slot_kl` gives them."""
    g = torch.Generator().manual_seed(3)
    net = ClusterNet(7, 11, 5, g)
    x = torch.randn(6, 7, generator=g) * 3  # some hidden units dead on some rows
    _, slots, target = _case(3)
    kl, z, log_r, logits = net(x, slots, target)
    grads = torch.autograd.grad(kl * 0.37, list(net.parameters()))
    ref_logits = net(x)
    ref_kl, ref_z, ref_log_r = slot_kl(ref_logits, slots, target)
    ref_grads = torch.autograd.grad(ref_kl * 0.37, list(net.parameters()))
    assert not logits.requires_grad
    for a, b in zip((kl, z, log_r, logits, *grads), (ref_kl, ref_z, ref_log_r, ref_logits.detach(), *ref_grads),
                    strict=True):
        assert torch.equal(a, b)
