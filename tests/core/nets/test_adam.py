"""The nets' Adam: torch.optim.Adam's steps and state dict, without importing TorchDynamo."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from deepdpm_core.nets import Adam


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _steps(opt, params, seed: int, n: int, skip_second: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        opt.zero_grad()
        for j, p in enumerate(params):
            if not (skip_second and j == 1 and i % 2):  # a parameter without a gradient is not stepped
                p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("fused", [True, None])
def test_the_steps_are_torch_adams_to_the_bit(fused):
    ours, theirs = _params(0), _params(0)
    a = Adam(ours, 0.01, fused=fused)
    b = torch.optim.Adam(theirs, lr=0.01, **({"fused": True} if fused else {}))
    _steps(a, ours, 1, 4, skip_second=True)
    _steps(b, theirs, 1, 4, skip_second=True)
    for group in (a.param_groups[0], b.param_groups[0]):
        group["lr"] = 0.003
    _steps(a, ours, 2, 3)
    _steps(b, theirs, 2, 3)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][key], b.state[q][key])


@pytest.mark.parametrize("fused", [True, None])
def test_each_loads_the_others_state_dict_and_goes_on_alike(fused):
    kw = {"fused": True} if fused else {}
    first, second = _params(0), _params(0)
    torch_opt = torch.optim.Adam(first, lr=0.01, **kw)
    _steps(torch_opt, first, 1, 3)
    ours = Adam(second, 0.5, fused=fused)
    with torch.no_grad():
        for p, q in zip(second, first, strict=True):
            p.copy_(q)
    ours.load_state_dict(torch_opt.state_dict())
    assert ours.param_groups[0]["lr"] == 0.01
    back = torch.optim.Adam(_params(9), lr=0.5, **kw)
    with torch.no_grad():
        for p, q in zip(back.param_groups[0]["params"], first, strict=True):
            p.copy_(q)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch's keeps the tensors it is given
    _steps(torch_opt, first, 2, 2)
    _steps(ours, second, 2, 2)
    _steps(back, back.param_groups[0]["params"], 2, 2)
    for p, q, r in zip(first, second, back.param_groups[0]["params"], strict=True):
        assert torch.equal(p, q) and torch.equal(p, r)


def test_a_state_dict_of_other_parameters_is_refused():
    with pytest.raises(ValueError, match="3 parameters"):
        Adam(_params(0), 0.01).load_state_dict(Adam(_params(0) + _params(1)[:1], 0.01).state_dict())


def test_a_fit_does_not_import_torchdynamo():
    """torch.optim.Optimizer imports torch._dynamo (seconds) at its first construction."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from deepdpm_core import DeepDPM
        x = np.random.default_rng(0).normal(size=(600, 2)).astype(np.float32)
        x[:300] += 8
        DeepDPM(random_state=0, max_epochs=6).fit(x)
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
