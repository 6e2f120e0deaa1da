"""The fitted model: what predicting needs, and nothing of the training.

:class:`ClusterAssigner` is the net and the input transform alone (:meth:`ClusterAssigner.load`
reads just those from a model file: at K = 1000, D = 128 the covariances are 131 MB of the
file's 132 MB); :class:`FittedModel` adds the mixture, the config and the epoch history.
Model files (``model.pt``) are read through :func:`deepdpm_core.model.files.safe_load`
(docs/design.md, "Fitted model and file formats").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from deepdpm_core.config import Config, from_stored
from deepdpm_core.data import FeatureCoordinates, check_features, readonly_tensor
from deepdpm_core.errors import CheckpointError, ConfigError
from deepdpm_core.model.files import safe_load, save_checkpoint
from deepdpm_core.nets import ClusterNet
from deepdpm_core.runtime import net_precision, resolve_precision

if TYPE_CHECKING:
    from deepdpm_core.training import Search

Tensor = torch.Tensor
FORMAT = "deepdpm-model/1"


#: the keys of a model file that assigning rows reads
_ASSIGNER_KEYS = ("format", "config", "coordinates", "cluster_net")


#: what reading a model's dict raises when its values are not what a model holds (a list
#: for the config, a 1-D weight, tensors of the wrong shapes)
_MALFORMED = (TypeError, ValueError, AttributeError, IndexError, RuntimeError)


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (with the next where it ends in a colon, as
    ``load_state_dict``'s does), at most 200 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return text[:200]


@dataclass(eq=False)
class ClusterAssigner:
    """What assigning rows to clusters needs of a fitted model: the input transform and the
    clustering net, not the mixture parameters.

    Attributes
    ----------
    config : Config
        The config of the fit (``model.precision`` sets the net's matmul precision).
    coords : FeatureCoordinates
        Raw rows -> the fit's coordinates x̃.
    cluster_net : ClusterNet
        f_cl: x̃ (B, D) -> logits (B, K).
    """

    config: Config
    coords: FeatureCoordinates
    cluster_net: ClusterNet

    @property
    def dim(self) -> int:
        """D, the number of features."""
        return self.coords.n_features

    @property
    def n_clusters(self) -> int:
        """K."""
        return int(self.cluster_net.n_clusters)

    @property
    def device(self) -> torch.device:
        """Where the net runs."""
        return self.cluster_net.out.weight.device

    @classmethod
    def from_state(cls, state: dict[str, Any], device: str = "cpu") -> ClusterAssigner:
        """The assigner held by a model file's dict (or the subset :meth:`state_dict` writes);
        ``device`` replaces the config's device.

        Raises
        ------
        CheckpointError
            Not a ``deepdpm-model/1`` dict, or keys missing.
        """
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"not a DeepDPM model checkpoint ({FORMAT})")
        try:
            config = from_stored({**state["config"], "device": device})
            weights = state["cluster_net"]
            (hidden, dim), k = weights["hidden.weight"].shape, weights["out.weight"].shape[0]
            net = ClusterNet(int(dim), int(hidden), int(k), torch.Generator())
            net.load_state_dict(weights)
            coords = FeatureCoordinates.from_state(state["coordinates"])
        except KeyError as exc:
            raise CheckpointError(f"a DeepDPM model checkpoint without the key {exc}") from exc
        except _MALFORMED as exc:  # a readable archive whose content is not a model's
            raise CheckpointError(f"a DeepDPM model checkpoint with a malformed state ({_first_line(exc)})") from None
        return cls(config, coords, net.to(device).eval().requires_grad_(False))

    def state_dict(self) -> dict[str, Any]:
        """The assigner as tensors and plain containers: a model file's dict less the
        mixture parameters and the history (:meth:`from_state` reads it back)."""
        return {
            "format": FORMAT,
            "config": self.config.to_dict(),
            "coordinates": self.coords.state_dict(),
            "cluster_net": {k: v.cpu() for k, v in self.cluster_net.state_dict().items()},
        }

    @classmethod
    def load(cls, path: str | Path) -> ClusterAssigner:
        """Read the assigner of a model file (or of a file of its :meth:`state_dict`), on the
        CPU: the file is memory-mapped and only the tensors of :data:`_ASSIGNER_KEYS` are
        copied out of it (the mixture is never read from disk).

        Raises
        ------
        CheckpointError
            Not a PyTorch checkpoint, not safe to read, or not a DeepDPM model.
        """
        mapped = safe_load(path, "model checkpoint", mmap=True)
        if not isinstance(mapped, dict):
            raise CheckpointError(f"{path} is not a DeepDPM model checkpoint ({FORMAT})")
        state = {key: _copied(mapped[key]) for key in _ASSIGNER_KEYS if key in mapped}
        del mapped
        try:
            return cls.from_state(state)
        except CheckpointError as exc:
            raise CheckpointError(f"{path} is {exc}") from exc

    @torch.no_grad()
    def log_proba_batches(self, x: Tensor, batch_size: int = 65536, *,
                          transformed: bool = False) -> Iterator[Tensor]:
        """ln r = log_softmax(f_cl(x̃)) for raw rows x (N, D), or for rows already in x̃
        when ``transformed``, one (B, K) CPU batch at a time."""
        precision = resolve_precision(self.config.model.precision, self.device)
        self.cluster_net.eval()  # no train-only layers; a search sets its own mode per epoch
        for s in range(0, x.shape[0], batch_size):
            xb = x[s : s + batch_size].to(self.device)
            xb = (xb if transformed else self.coords.apply(xb)).float()
            with net_precision(precision, self.device):
                logits = self.cluster_net(xb)
            yield F.log_softmax(logits.float(), dim=1).cpu()

    def predict_log_proba(self, x: Tensor, batch_size: int = 65536) -> Tensor:
        """ln r for raw rows; shape (N, K)."""
        out = list(self.log_proba_batches(x, batch_size))
        return torch.cat(out) if out else torch.zeros(0, self.n_clusters)

    def predict_assignments(self, x: Tensor, batch_size: int = 65536, *,
                            transformed: bool = False) -> tuple[Tensor, Tensor]:
        """Hard cluster and its responsibility max_k r_ik of raw rows (in x̃ when
        ``transformed``), batch by batch (never the (N, K) array: 5 GB at 1.28M rows and
        K = 1000).

        Returns
        -------
        labels : Tensor of shape (N,), int64
        confidence : Tensor of shape (N,), float32
        """
        labels, confidence = [], []
        for lp in self.log_proba_batches(x, batch_size, transformed=transformed):
            best, arg = lp.max(1)
            labels.append(arg)
            confidence.append(best.exp())
        if not labels:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0)
        return torch.cat(labels), torch.cat(confidence)

    def predict_confidence(self, X: Any, batch_size: int = 65536) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`DeepDPM.predict_confidence <deepdpm_core.model.estimator.DeepDPM.predict_confidence>`
        (its parameters and results): labels (N,) int64 and confidence (N,) float32 of
        rows X (N, D), checked first.

        Raises
        ------
        DataError
            Not a finite (N, D) array of numbers, N = 0, or D not that of the model.
        ConfigError
            ``batch_size`` < 1.
        """
        rows = readonly_tensor(check_features(X, n_features=self.dim))
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        labels, confidence = self.predict_assignments(rows, batch_size)
        return labels.numpy(), confidence.numpy()


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) copied into memory of
    its own, out of a memory-mapped file."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return type(value)((k, _copied(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


@dataclass(eq=False)
class FittedModel(ClusterAssigner):
    """A fitted DeepDPM: the assigner (its config, input transform and clustering net, in
    whose coordinates x̃ the mixture lives) and the mixture parameters.

    Attributes
    ----------
    means : Tensor of shape (K, D), float64
        Cluster means in x̃.
    covariances : Tensor of shape (K, D, D), float64
        Cluster covariances in x̃.
    log_weights : Tensor of shape (K,), float64
        Log mixture weights.
    history : list of dict
        One record per epoch (see :class:`~deepdpm_core.model.estimator.DeepDPM`).
    n_total : int
        Rows it was fitted on.
    feature_names : list of str, optional
        The names of the D features (the columns of the table fitted), in order; None
        when the features had none (an array).
    """

    means: Tensor
    covariances: Tensor
    log_weights: Tensor
    history: list[dict[str, Any]]
    n_total: int
    feature_names: list[str] | None = None

    # ------------------------------------------------------------- building
    @classmethod
    def from_search(cls, search: Search) -> FittedModel:
        """The search's model at the end of its last epoch: its own net and tensors (no
        copy, so a view between epochs costs nothing; :meth:`freeze` it once the search is
        done), not its data, subclustering nets or optimisers."""
        state = search.state
        return cls(search.config, search.coords, search.nets.cluster, state.means, state.covariances,
                   state.log_weights, list(search.history), int(search.n_total))

    def freeze(self) -> FittedModel:
        """Drop the net's gradients and stop tracking new ones (its training is over)."""
        self.cluster_net.zero_grad(set_to_none=True)
        self.cluster_net.requires_grad_(False)
        return self

    @classmethod
    def from_state(cls, state: dict[str, Any], device: str = "cpu") -> FittedModel:
        """The model held by a model file's dict (this class's :meth:`state_dict` or a
        full search state); ``device`` replaces the config's device.

        Raises
        ------
        CheckpointError
            Not a ``deepdpm-model/1`` dict, or keys missing.
        """
        assigner = ClusterAssigner.from_state(state, device)
        k = assigner.cluster_net.out.weight.shape[0]
        try:
            means, covariances, log_weights = (state[name].to(device) for name in
                                               ("means", "covariances", "log_weights"))
            if means.ndim != 2 or covariances.ndim < 2 or tuple(log_weights.shape) != (k,) \
                    or means.shape[0] != k or covariances.shape[0] != k:
                raise ValueError(f"{k} clusters in the net, mixture shapes {tuple(means.shape)}, "
                                 f"{tuple(covariances.shape)}, {tuple(log_weights.shape)}")
            return cls(assigner.config, assigner.coords, assigner.cluster_net, means, covariances,
                       log_weights, list(state["history"]), int(state["n_total"]),
                       state.get("feature_names")).freeze()
        except KeyError as exc:
            raise CheckpointError(f"a DeepDPM model checkpoint without the key {exc}") from exc
        except _MALFORMED as exc:  # a readable archive whose content is not a model's
            raise CheckpointError(f"a DeepDPM model checkpoint with a malformed state ({_first_line(exc)})") from None

    def state_dict(self) -> dict[str, Any]:
        """The model as tensors and plain containers (what :meth:`save` writes)."""
        return {
            "format": FORMAT,
            "config": self.config.to_dict(),
            "dim": self.dim,
            "n_total": self.n_total,
            "coordinates": self.coords.state_dict(),
            "history": list(self.history),
            "means": self.means.cpu(),
            "covariances": self.covariances.cpu(),
            "log_weights": self.log_weights.cpu(),
            "cluster_net": {k: v.cpu() for k, v in self.cluster_net.state_dict().items()},
            # a file without the key (written before names were kept) reads as None
            **({"feature_names": list(self.feature_names)} if self.feature_names is not None
               else {}),
        }

    def save(self, path: str | Path) -> None:
        """Write :meth:`state_dict` to ``path`` atomically (a temporary file, then a rename)."""
        save_checkpoint(self.state_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> FittedModel:
        """Read a model file (``torch.load(weights_only=True)``), on the CPU.

        Raises
        ------
        CheckpointError
            Not a PyTorch checkpoint, not safe to read, or not a DeepDPM model.
        """
        state = safe_load(path, "model checkpoint")
        try:
            return cls.from_state(state)
        except CheckpointError as exc:
            raise CheckpointError(f"{path} is {exc}") from exc
