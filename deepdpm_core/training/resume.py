"""The resume format of a fit: a trainer's state as tensors and plain containers, and
what restoring it into a rebuilt trainer checks and sets."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from deepdpm_core.data import FeatureCoordinates
from deepdpm_core.errors import CheckpointError
from deepdpm_core.estep import MixtureState

if TYPE_CHECKING:
    from deepdpm_core.training.trainer import Trainer


def trainer_state(trainer: Trainer) -> dict[str, Any]:
    """Everything a fit needs to resume (tensors and plain containers only); also a model
    file's dict, which :class:`~deepdpm_core.model.fitted_model.FittedModel` reads."""
    nets = trainer.nets
    return {
        "config": trainer.config.to_dict(),
        "dim": trainer.coords.n_features,
        "n_total": trainer.n_total,
        "coordinates": trainer.coords.state_dict(),
        **trainer.prior_fit.state_dict(),
        "epoch": trainer.epoch,
        **trainer.schedule.counters(),
        "history": list(trainer.history),
        **trainer.state.state_dict(),
        "cluster_net": {k: v.cpu() for k, v in nets.cluster.state_dict().items()},
        "sub_nets": {k: v.cpu() for k, v in nets.sub.state_dict().items()},
        "opt_cluster": nets.opt_cluster.state_dict(),
        "opt_sub": nets.opt_sub.state_dict(),
        "rng": trainer.rng.bit_generator.state,
        "torch_gen": trainer.torch_gen.get_state(),
    }


def check_same_data(trainer: Trainer, state: dict[str, Any]) -> None:
    """Raise CheckpointError unless the trainer's rows are those ``state`` was trained on:
    the same N over all ranks and, to round-off, the same mean."""
    stored_center = FeatureCoordinates.from_state(state["coordinates"]).center
    if trainer.n_total != int(state["n_total"]) or not torch.allclose(
            trainer.coords.center, stored_center, rtol=0, atol=1e-5 * trainer.coords.unit):
        raise CheckpointError(
            f"the data differ from the checkpoint's: {trainer.n_total} rows here, "
            f"{int(state['n_total'])} when it was written (or another mean)")


def restore_optimisers(trainer: Trainer, state: dict[str, Any]) -> None:
    """The Adam moments and the generators of :func:`trainer_state` output, into a trainer
    whose nets are rebuilt; the learning rate follows this run's (global) batch."""
    nets, optim = trainer.nets, trainer.config.optim
    if "opt_cluster" in state:
        for opt, key, base in ((nets.opt_cluster, "opt_cluster", optim.lr_cluster),
                               (nets.opt_sub, "opt_sub", optim.lr_subcluster)):
            # a copy: Adam keeps the given moment/step tensors and updates them in place
            opt.load_state_dict(copy.deepcopy(state[key]))
            for group in opt.param_groups:
                group["lr"] = trainer.learning_rate(base)
    if "rng" in state:
        trainer.rng.bit_generator.state = state["rng"]
        trainer.torch_gen.set_state(state["torch_gen"])


def restore_trainer(trainer: Trainer, state: dict[str, Any]) -> None:
    """Restore :func:`trainer_state` output into a trainer built on the same rows and
    config: the epoch, schedule and history, the mixture, the prior, the nets with their
    Adam moments, and the generators."""
    trainer.epoch = int(state["epoch"])
    trainer.schedule.restore(state)
    trainer.history = list(state["history"])
    trainer.state = MixtureState.from_state(state, trainer.device)
    trainer.prior_fit.restore(state)
    trainer.build_nets(trainer.n_clusters)
    trainer.nets.cluster.load_state_dict(state["cluster_net"])
    trainer.nets.sub.load_state_dict(state["sub_nets"])
    restore_optimisers(trainer, state)
    trainer.reshaped()
