"""The resume format of a fit: a trainer's state as tensors and plain containers, and
what restoring it into a rebuilt trainer checks and rebuilds."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from deepdpm_core.config import Config
from deepdpm_core.data import FeatureCoordinates
from deepdpm_core.errors import CheckpointError
from deepdpm_core.estep import MixtureState
from deepdpm_core.moves import Nets
from deepdpm_core.training.fit_context import FitContext
from deepdpm_core.training.search_model import build_nets


def model_state(state: MixtureState, nets: Nets, rng: np.random.Generator, torch_gen: torch.Generator
                ) -> dict[str, Any]:
    """The mixture, the nets with their Adam moments, and the generators, as a resume
    state's entries (tensors on the CPU and plain containers)."""
    return {
        **state.state_dict(),
        "cluster_net": {k: v.cpu() for k, v in nets.cluster.state_dict().items()},
        "sub_nets": {k: v.cpu() for k, v in nets.sub.state_dict().items()},
        "opt_cluster": nets.opt_cluster.state_dict(),
        "opt_sub": nets.opt_sub.state_dict(),
        "rng": rng.bit_generator.state,
        "torch_gen": torch_gen.get_state(),
    }


def check_same_data(ctx: FitContext, state: dict[str, Any]) -> None:
    """Raise CheckpointError unless this fit's rows are those ``state`` was trained on:
    the same N over all ranks and, to round-off, the same mean."""
    stored_center = FeatureCoordinates.from_state(state["coordinates"]).center
    if ctx.n_total != int(state["n_total"]) or not torch.allclose(
            ctx.coords.center, stored_center, rtol=0, atol=1e-5 * ctx.coords.unit):
        raise CheckpointError(
            f"the data differ from the checkpoint's: {ctx.n_total} rows here, "
            f"{int(state['n_total'])} when it was written (or another mean)")


def restore_model(ctx: FitContext, config: Config, state: dict[str, Any], rng: np.random.Generator,
                  torch_gen: torch.Generator) -> tuple[MixtureState, Nets]:
    """The mixture and the nets of :func:`model_state` output, with their Adam moments,
    on ``ctx``'s device (the learning rate follows this run's global batch); the
    generators ``rng`` and ``torch_gen`` take their stored states."""
    mixture = MixtureState.from_state(state, ctx.device)
    nets = build_nets(ctx, config, mixture.n_clusters, torch_gen)
    nets.cluster.load_state_dict(state["cluster_net"])
    nets.sub.load_state_dict(state["sub_nets"])
    optim = config.optim
    for opt, key, base in ((nets.opt_cluster, "opt_cluster", optim.lr_cluster),
                           (nets.opt_sub, "opt_sub", optim.lr_subcluster)):
        # a copy: Adam keeps the given moment/step tensors and updates them in place
        opt.load_state_dict(copy.deepcopy(state[key]))
        for group in opt.param_groups:
            group["lr"] = ctx.learning_rate(config, base)
    rng.bit_generator.state = state["rng"]
    torch_gen.set_state(state["torch_gen"])
    return mixture, nets
