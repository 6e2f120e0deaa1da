"""The fit's own coordinates: the optional ``data.transform``, then centring and one scale.

Every row x becomes x̃ = (r(x) − c) ⊙ a / σ̄: r the identity or the row's L2 normalisation,
c the mean of r(x), a the transform's per-feature factor and σ̄² the mean per-feature
variance of (r(x) − c) ⊙ a, so x̃ has mean 0 and mean variance 1 in any units (docs/design.md,
"Coordinates"). The moments are sums all-reduced over the ranks, so every rank builds the
same transform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepdpm_core.config import DataConfig
from deepdpm_core.errors import DataError
from deepdpm_core.runtime import Communicator

Tensor = torch.Tensor
#: rows per chunk of the moment passes (a float64 copy of all rows would double memory)
_CHUNK = 1 << 16


@dataclass(frozen=True)
class FeatureCoordinates:
    """x ↦ x̃ = (r(x) − center) ⊙ mult, with r the row normalisation for ``normalize``.

    Attributes
    ----------
    kind : str
        The ``data.transform`` it was built for.
    center : Tensor of shape (D,), float64
    mult : Tensor of shape (D,), float64
        a / σ̄ (module docstring).
    unit : float
        σ̄, the scale of one unit of x̃ in the transformed features' units: a prior given
        in those units (the paper's fixed Ψ) is divided by σ̄² to act on x̃.
    feature_std : Tensor of shape (D,), float64
        Per-feature standard deviation of the transformed features r(x) ⊙ a.
    """

    kind: str
    center: Tensor
    mult: Tensor
    unit: float
    feature_std: Tensor

    def apply(self, x: Tensor) -> Tensor:
        """x̃ of raw rows (any float dtype, any device), float64 on x's device; (B, D)."""
        x = _rows(x, self.kind == "normalize")
        return (x - self.center.to(x.device)) * self.mult.to(x.device)

    def means_to_features(self, means: Tensor) -> Tensor:
        """Cluster means in x̃ -> in the (transformed) features' space; (K, D)."""
        return means / self.mult.to(means) + self.center.to(means)

    def covariances_to_features(self, covs: Tensor) -> Tensor:
        """Covariances in x̃ -> in the (transformed) features' space; (K, D, D)."""
        inv = 1.0 / self.mult.to(covs)
        return covs * inv[:, None] * inv[None, :]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "center": self.center.cpu(), "mult": self.mult.cpu(),
                "unit": self.unit, "feature_std": self.feature_std.cpu()}

    @staticmethod
    def from_state(state: dict[str, Any]) -> FeatureCoordinates:
        return FeatureCoordinates(str(state["kind"]), state["center"].to(torch.float64),
                                  state["mult"].to(torch.float64), float(state["unit"]),
                                  state["feature_std"].to(torch.float64))


def _rows(x: Tensor, normalize: bool) -> Tensor:
    """r(x): the rows in float64, divided by their L2 norms when ``normalize``; (B, D)."""
    x = x.to(torch.float64)
    return x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny) if normalize else x


def _moments(x: Tensor, normalize_rows: bool, comm: Communicator, device: torch.device
             ) -> tuple[int, list[int], Tensor, Tensor, Tensor, Tensor]:
    """(N, rows per rank, mean, variance, min, max) of r(x) over all ranks, float64."""
    n_local, d = x.shape
    f64 = {"dtype": torch.float64}
    s1, s2 = torch.zeros(d, **f64), torch.zeros(d, **f64)
    hi = torch.full((d,), -torch.inf, **f64)
    neg_lo = torch.full((d,), -torch.inf, **f64)
    for s in range(0, n_local, _CHUNK):
        xc = _rows(x[s : s + _CHUNK], normalize_rows)
        s1 += xc.sum(0)
        s2 += xc.square().sum(0)
        hi = torch.maximum(hi, xc.max(0).values)
        neg_lo = torch.maximum(neg_lo, (-xc).max(0).values)
    rows = torch.zeros(comm.world_size, **f64)
    rows[comm.rank] = n_local
    tot = comm.all_reduce(torch.cat([torch.tensor([float(n_local)], **f64), s1, s2, rows]).to(device)).cpu()
    extremes = comm.all_reduce(torch.cat([hi, neg_lo]).to(device), op="max").cpu()
    n = tot[0]
    mean = tot[1 : 1 + d] / n
    var = (tot[1 + d : 1 + 2 * d] / n - mean.square()).clamp_min(0)
    return int(n.item()), [int(v) for v in tot[1 + 2 * d :].tolist()], mean, var, -extremes[d:], extremes[:d]


def resolve_transform(data: DataConfig, variance: Tensor) -> str:
    """The transform ``data.transform: auto`` stands for, from the per-feature variances (D,).

    ``standard`` when the features are in different units: the participation ratio
    (Σv)²/Σv² is below ``data.auto_max_participation`` (3) and the standard deviations
    span more than ``data.auto_min_std_ratio`` (30×); else ``none``, so the relative scales
    that carry the clusters are kept (docs/design.md, "Coordinates", for the data sets that
    set these bounds). Every other transform is returned as it is.
    """
    if data.transform != "auto":
        return data.transform
    live = variance[variance > 0]
    if live.numel() < 3:
        return "none"
    participation = float(live.sum() ** 2 / live.square().sum())
    std_ratio = float((live.max() / live.min()).sqrt())
    mixed = participation < data.auto_max_participation and std_ratio > data.auto_min_std_ratio
    return "standard" if mixed else "none"


def fit_coordinates(x: Tensor, data: DataConfig, comm: Communicator, device: torch.device
                    ) -> tuple[FeatureCoordinates, int, list[int]]:
    """Build the coordinates of all ranks' rows (one all-reduce of moments, one of extremes).

    Parameters
    ----------
    x : Tensor of shape (N_local, D)
        This rank's raw rows.
    data : DataConfig
        Its ``transform``; ``auto`` is resolved from the moments
        (:func:`resolve_transform`) and the coordinates record the transform it stood for.

    Returns
    -------
    coords : FeatureCoordinates
    n_total : int
        Rows over all ranks.
    rank_rows : list of int
        Rows held by each rank.

    Raises
    ------
    DataError
        ``normalize`` and every row is zero.
    """
    normalize = data.transform == "normalize"
    n, rank_rows, mean, var, lo, hi = _moments(x, normalize, comm, device)
    if normalize and n and bool(((hi == 0) & (lo == 0)).all()):
        raise DataError("data.transform=normalize: every row is zero")
    kind = resolve_transform(data, var)
    std = var.sqrt()
    if kind == "standard":
        a = torch.where(std > 0, 1.0 / std.clamp_min(1e-300), torch.ones_like(std))
    elif kind == "min_max":
        span = hi - lo
        a = torch.where(span > 0, 1.0 / span.clamp_min(1e-300), torch.ones_like(span))
    else:
        a = torch.ones_like(std)
    unit = float((var * a.square()).mean().sqrt()) if n else 0.0
    if not (unit > 0 and torch.isfinite(torch.tensor(unit))):  # constant data: one cluster
        unit = 1.0
    coords = FeatureCoordinates(kind, mean, a / unit, unit, std * a)
    return coords, n, rank_rows
