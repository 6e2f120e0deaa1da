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
#: a feature adds no direction when 1 − R² on the features kept before it is below this: an
#: exact linear dependence (redundant, one-hot or total columns) leaves float32 round-off
NULL_CORRELATION = 1e-6
#: rows of each rank (at least 16 D) sampled for the covariance that finds those features
COVARIANCE_ROWS = 4096


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
    kept : Tensor of shape (r,), int64, or None
        The features x̃ keeps (:func:`independent_features`); None: all D.
    lift : Tensor of shape (D, r), float64, or None
        Every feature of x̃ as a linear combination of the kept ones.
    """

    kind: str
    center: Tensor
    mult: Tensor
    unit: float
    feature_std: Tensor
    kept: Tensor | None = None
    lift: Tensor | None = None

    @property
    def n_features(self) -> int:
        """D, the features of a raw row."""
        return int(self.center.shape[0])

    @property
    def dim(self) -> int:
        """The coordinates of x̃: r when features are left out, else D."""
        return self.n_features if self.kept is None else int(self.kept.shape[0])

    @property
    def axis_std(self) -> Tensor:
        """``feature_std`` of the features x̃ keeps, (dim,)."""
        return self.feature_std if self.kept is None else self.feature_std[self.kept]

    def apply(self, x: Tensor) -> Tensor:
        """x̃ of raw rows (any float dtype, any device), float64 on x's device; (B, dim)."""
        x = _rows(x, self.kind == "normalize")
        x = (x - self.center.to(x.device)) * self.mult.to(x.device)
        return x if self.kept is None else x.index_select(1, self.kept.to(x.device))

    def means_to_features(self, means: Tensor) -> Tensor:
        """Cluster means in x̃ -> in the (transformed) features' space; (K, D)."""
        if self.lift is not None:
            means = means @ self.lift.to(means).T
        return means / self.mult.to(means) + self.center.to(means)

    def covariances_to_features(self, covs: Tensor) -> Tensor:
        """Covariances in x̃ -> in the (transformed) features' space; (K, D, D)."""
        if self.lift is not None:
            lift = self.lift.to(covs)
            covs = lift @ covs @ lift.T
        inv = 1.0 / self.mult.to(covs)
        return covs * inv[:, None] * inv[None, :]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "center": self.center.cpu(), "mult": self.mult.cpu(),
                "unit": self.unit, "feature_std": self.feature_std.cpu(),
                **({} if self.kept is None else {"kept": self.kept.cpu(), "lift": self.lift.cpu()})}

    @staticmethod
    def from_state(state: dict[str, Any]) -> FeatureCoordinates:
        kept = {"kept": state["kept"].to(torch.long), "lift": state["lift"].to(torch.float64)} if "kept" in state else {}
        return FeatureCoordinates(str(state["kind"]), state["center"].to(torch.float64),
                                  state["mult"].to(torch.float64), float(state["unit"]),
                                  state["feature_std"].to(torch.float64), **kept)


def _rows(x: Tensor, normalize: bool) -> Tensor:
    """r(x): the rows in float64, divided by their L2 norms when ``normalize``; (B, D)."""
    x = x.to(torch.float64)
    return x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny) if normalize else x


def _moments(x: Tensor, normalize_rows: bool, comm: Communicator, device: torch.device
             ) -> tuple[int, list[int], Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """(N, rows per rank, mean, variance, min, max, covariance) of r(x) over all ranks,
    float64; the covariance (D, D) of a fixed-seed uniform sample of each rank's rows (rows
    sorted by class still give each class its share), None below 4 D rows in all."""
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
    # the sample is centred on the mean of all rows, so its float64 sums lose nothing to an offset
    sample = torch.randperm(n_local, generator=torch.Generator().manual_seed(0))[: max(COVARIANCE_ROWS, 16 * d)]
    rows_c = _rows(x.index_select(0, sample.sort().values.to(x.device)), normalize_rows) - mean.to(x.device)
    sums = comm.all_reduce(torch.cat([torch.tensor([float(len(rows_c))], **f64).to(x.device), rows_c.sum(0),
                                      (rows_c.T @ rows_c).reshape(-1)]).to(device)).cpu()
    m, offset = float(sums[0]), sums[1 : 1 + d] / max(float(sums[0]), 1.0)
    covariance = sums[1 + d :].view(d, d) / m - torch.outer(offset, offset) if m >= 4 * d else None
    return (int(n.item()), [int(v) for v in tot[1 + 2 * d :].tolist()], mean, var, -extremes[d:], extremes[:d],
            covariance)


def independent_features(covariance: Tensor, variance: Tensor) -> tuple[Tensor, Tensor] | None:
    """The features that add a direction, given a sample's covariance (D, D) and all rows'
    variances (D,); None when every feature does (docs/design.md, "Coordinates").

    In order, a feature is left out when it is constant over all rows or its 1 − R² on the
    features kept before it is below :data:`NULL_CORRELATION` in the sample.

    Returns
    -------
    kept : Tensor of shape (r,), int64
    lift : Tensor of shape (D, r), float64
        Every feature (centred) as a linear combination of the kept ones.
    """
    d = covariance.shape[0]
    std = covariance.diagonal().clamp_min(0).sqrt()
    live = torch.nonzero(variance > variance.max() * 1e-24).squeeze(1).tolist()
    corr = covariance / torch.outer(std, std).clamp_min(torch.finfo(torch.float64).tiny)
    factor, info = torch.linalg.cholesky_ex(corr[live][:, live])  # its diagonal²: each 1 − R²
    if len(live) == d and int(info) == 0 and bool((factor.diagonal().square() >= NULL_CORRELATION).all()):
        return None
    chol = torch.zeros(d, d, dtype=torch.float64)  # Cholesky factor of `base`'s correlations
    kept: list[int] = []
    base: list[int] = []  # the kept features that vary in the sample
    for j in live:  # Gram–Schmidt in the correlation metric: 1 − R² given the kept ones
        if not std[j] > 0:  # varies, but not in the sample: kept, and no base for the others
            kept.append(j)
            continue
        b = len(base)
        w = (torch.linalg.solve_triangular(chol[:b, :b], corr[base, j][:, None], upper=False)[:, 0]
             if b else torch.zeros(0, dtype=torch.float64))
        residual = float(1.0 - w @ w)
        if residual < NULL_CORRELATION:
            continue
        chol[b, :b], chol[b, b] = w, residual**0.5
        base.append(j)
        kept.append(j)
    kept.sort()
    if len(kept) in (0, d):  # constant rows, or every feature its own direction
        return None
    index, on = torch.tensor(kept, dtype=torch.long), torch.tensor(base, dtype=torch.long)
    lift = torch.zeros(d, len(kept), dtype=torch.float64)  # a left-out feature: its regression on `base`
    lift[:, torch.searchsorted(index, on)] = torch.linalg.solve(covariance[on][:, on], covariance[on]).T
    lift[index] = torch.eye(len(kept), dtype=torch.float64)
    return index, lift


#: ``data.transform: auto`` standardises when fewer features than this carry the variance
#: (participation ratio (Σv)²/Σv²) ...: tables in mixed units have 1.0 to 2.0 (raw wine,
#: breast cancer, the K suite's mixed-units table; at 2 one of its seeds stayed raw and
#: ended at one cluster), data in one unit (iris, pixels, embeddings) 2.0 and far more
AUTO_MAX_PARTICIPATION = 3.0
#: ... and the features' standard deviations span more than this factor: 2500× to 2·10⁵
#: in those tables, 4× (iris) to 277× (digit pixels) in one unit; docs/design.md, "Coordinates"
AUTO_MIN_STD_RATIO = 30.0


def resolve_transform(data: DataConfig, variance: Tensor) -> str:
    """The transform ``data.transform: auto`` stands for, from the per-feature variances (D,).

    ``standard`` when the features are in different units: the participation ratio
    (Σv)²/Σv² is below :data:`AUTO_MAX_PARTICIPATION` (3) and the standard deviations
    span more than :data:`AUTO_MIN_STD_RATIO` (30×); else ``none``, so the relative scales
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
    mixed = participation < AUTO_MAX_PARTICIPATION and std_ratio > AUTO_MIN_STD_RATIO
    return "standard" if mixed else "none"


def fit_coordinates(x: Tensor, data: DataConfig, comm: Communicator, device: torch.device
                    ) -> tuple[FeatureCoordinates, int, list[int]]:
    """Build the coordinates of all ranks' rows (all-reduces of a sample's covariance, the moments, the extremes).

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
    n, rank_rows, mean, var, lo, hi, covariance = _moments(x, normalize, comm, device)
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
    found = None if covariance is None else independent_features(covariance * torch.outer(a, a), var * a.square())
    coords = FeatureCoordinates(kind, mean, a / unit, unit, std * a, *(found or (None, None)))
    return coords, n, rank_rows
