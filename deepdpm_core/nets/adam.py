"""Adam for the nets, without ``torch.optim.Optimizer``.

``torch.optim.Optimizer`` imports TorchDynamo (``torch._dynamo``, with sympy) when the first
optimizer of a process is built, for its ``torch._disable_dynamo`` decorators: 2–4.5 s on one
CPU core, more than a whole fit of 20,000 rows in 2-D. :class:`Adam` keeps the same moments
and calls the same update (``torch.optim.adam.adam``, the function ``torch.optim.Adam.step``
calls), so its steps are ``torch.optim.Adam``'s to the bit, and its state dict is
``torch.optim.Adam``'s: either loads the other's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam as adam_update

Tensor = torch.Tensor

#: torch.optim.Adam's defaults, which a fit never changes (betas, eps, no weight decay)
DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                            "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                            "decoupled_weight_decay": False}


class Adam:
    """Adam (Kingma & Ba 2015) over one group of parameters, ``torch.optim.Adam``'s update.

    Parameters
    ----------
    params : iterable of Tensor
        The parameters, stepped in this order.
    lr : float
        The learning rate (``param_groups[0]["lr"]`` may change it).
    fused : bool, optional
        One fused kernel for all parameters (as ``torch.optim.Adam(fused=True)``); None
        takes ``torch.optim.Adam``'s default (one tensor at a time on the CPU).

    Attributes
    ----------
    param_groups : list of dict
        One group: ``params``, ``lr`` and ``torch.optim.Adam``'s other entries.
    state : dict of Tensor -> dict
        Each stepped parameter's ``step``, ``exp_avg`` and ``exp_avg_sq``.
    """

    def __init__(self, params: Iterable[Tensor], lr: float, fused: bool | None = None) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": list(params), "lr": lr, **DEFAULTS, "fused": fused}]
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``torch.optim.Adam.zero_grad()``'s default)."""
        for p in self.param_groups[0]["params"]:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step of the parameters that have a gradient."""
        group = self.param_groups[0]
        fused = group["fused"]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            if p not in self.state:  # as torch.optim.Adam starts a parameter's moments
                step = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                        else torch.tensor(0.0, dtype=_scalar_dtype()))
                self.state[p] = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam_update(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=group["foreach"],
                    fused=fused, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Adam``'s layout: moments by the parameter's place in the group."""
        group = self.param_groups[0]
        index = {id(p): i for i, p in enumerate(group["params"])}
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()},
                "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                                  "params": list(range(len(group["params"])))}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take copies of the moments and the learning rate of a :meth:`state_dict` (or of a
        ``torch.optim.Adam``'s) of as many parameters, each on its parameter's device (the
        step count a CPU scalar unless fused)."""
        group = self.param_groups[0]
        (saved,) = state_dict["param_groups"]
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"a state of {len(saved['params'])} parameters for an optimizer of "
                             f"{len(group['params'])}")
        group["lr"] = saved["lr"]
        self.state = {}
        for place, i in enumerate(saved["params"]):
            if i not in state_dict["state"]:
                continue
            p, s = group["params"][place], state_dict["state"][i]
            step = s["step"].to(torch.float32 if group["fused"] else _scalar_dtype(), copy=True)
            self.state[p] = {"step": step.to(p.device) if group["fused"] else step.cpu(),
                             "exp_avg": s["exp_avg"].to(p, copy=True), "exp_avg_sq": s["exp_avg_sq"].to(p, copy=True)}


def _scalar_dtype() -> torch.dtype:
    """The step count's dtype outside the fused kernel, as ``torch.optim.Adam`` makes it."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
