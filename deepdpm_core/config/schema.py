"""Typed, frozen run configuration, built strictly from a mapping.

Every hyperparameter of the method lives here, as a field of a frozen dataclass.
``cluster_configs/default.yaml`` documents each key; a test keeps the YAML and these
defaults identical. Unknown or mistyped keys raise :class:`ConfigError` naming the
dotted key, so a typo never silently falls back to a default. YAML files and ``--set`` overrides
are read by :mod:`deepdpm_core.config.loading`.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal

from deepdpm_core.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    """Input transform applied to every row before the fit and at prediction time.

    ``none``: the features as given (the fit is invariant to their common unit: see
    ``docs/design.md``, section Invariances); ``normalize``: each row divided by its L2
    norm (the reference code's default, scikit-learn ``Normalizer``); ``standard``: each
    feature centred and divided by its standard deviation; ``min_max``: each feature
    mapped to [0, 1]. The last two are fitted on the training data and stored with the
    model. ``auto`` (default) is ``standard`` for features in different units, else
    ``none`` (:func:`deepdpm_core.data.coordinates.resolve_transform`); the choice is stored
    with the model: ``standard`` where the participation ratio (Σv)²/Σv² of the
    per-feature variances v is below ``auto_max_participation`` (two or three features carry
    the variance) and the features' standard deviations span more than
    ``auto_min_std_ratio``.
    """

    transform: Literal["auto", "none", "normalize", "standard", "min_max"] = "auto"
    auto_max_participation: float = 3.0
    auto_min_std_ratio: float = 30.0


@dataclass(frozen=True)
class PriorConfig:
    """Dirichlet-process and Normal-Inverse-Wishart prior (paper Supmat §NIW).

    ``sigma_scale: auto`` (default) fits s of Ψ0 = s·P to the current clusters at every
    M-step: the type-II maximum likelihood (:func:`deepdpm_core.bayes.niw.empirical_bayes_scale`)
    of the per-feature variances, i.e. of the diagonal model of the same clusters.
    ``evidence`` maximises the evidence of the prior's own model instead (for full
    covariances it is ruled by the clusters' smallest principal variances, and on UMAP
    layouts, whose clusters have near-degenerate directions, it lets them split). A
    number is the paper's fixed Ψ0 = s·I (``psi: identity``) or s·diag(std)
    (``psi: data_std``) in the units of the features. A fitted s makes the fit
    independent of the features' units. ``kappa: auto`` is κ0 = s / v̄ with
    v̄ the data's mean per-feature variance: the prior spread of cluster means, Σ/κ0, is
    then the data's own. ``nu: auto`` fits ν0 the same way, given s
    (:func:`deepdpm_core.bayes.niw.empirical_bayes_nu`), never below the paper's D + 2: clusters
    of one common shape raise it, so that a full covariance costs little evidence even
    with few points per dimension (10 clusters of 600 points in 128-D are found; at
    ν0 = D + 2 the fit stays at K = 2–3); clusters of varied shapes keep it at D + 2.
    ``nu: null`` is the paper's D + 2 (3 when diagonal).
    ``covariance_floor`` ε treats every value as known to a variance of ε times its
    feature's variance over the data (the mean per-feature variance for a constant
    feature): each cluster's scatter gains n·ε·diag(v), so constant, duplicated, binary or
    collinear features and clusters of a few rows keep a positive-definite posterior.
    ``coarsening`` c judges each split or merge by the coarsened posterior (Miller &
    Dunson 2019) with the likelihood raised to ζ = c / (c + n), n the points the move
    touches (:func:`deepdpm_core.moves.coarsened`): clusters that are not quite Gaussian
    (curved, heavy-tailed, as real embeddings are) are not split further as N grows.
    ``null`` is the exact DP posterior of the paper, under which K grows with N on such
    clusters. ``coarsening_per_parameter`` c_p raises c to c_p·P for clusters with P > c/c_p
    free parameters (D + D(D + 1)/2, or 2D diagonal; above 10 features at the defaults),
    so that a split needs about the same gain per point in every dimension
    (:func:`deepdpm_core.moves.coarsening_constant`); ``null`` keeps c in every dimension.
    ``covariance_type: diag`` uses diagonal covariances (one
    Normal-Inverse-Gamma model per feature, as the reference code's NIG prior); ``auto``
    takes, at every M-step, the one of full and diag whose evidence Σ_k ln f(X_k) given
    the current clusters is larger. It is not the default: at K = 1 the evidence judges
    one cluster, and on PCA scores (a diagonal global covariance) it picks diag and the
    fit stays at K = 1 (digits PCA-10).
    """

    alpha: float = 10.0
    kappa: float | Literal["auto"] = "auto"
    nu: float | Literal["auto"] | None = "auto"
    sigma_scale: float | Literal["auto", "evidence"] = "auto"
    psi: Literal["identity", "data_std"] = "identity"
    covariance_type: Literal["full", "diag", "auto"] = "full"
    weight_pseudocount: float = 1.0
    covariance_floor: float = 1.0e-4
    coarsening: float | None = 500.0
    coarsening_per_parameter: float | None = 7.5


@dataclass(frozen=True)
class InitConfig:
    """k-means initialisation of clusters and subclusters."""

    n_clusters: int | Literal["auto"] = "auto"
    max_points: int = 200_000
    kmeans_iters: int = 25
    seeding: Literal["kmeans++", "random"] = "kmeans++"


@dataclass(frozen=True)
class ModelConfig:
    """Clustering net and batched subclustering nets (one hidden layer each)."""

    hidden: int = 50
    sub_hidden: int = 50
    precision: Literal["auto", "float32", "tf32", "bf16"] = "auto"


@dataclass(frozen=True)
class OptimConfig:
    """Adam optimisers of the two nets and the minibatch schedule."""

    lr_cluster: float = 5.0e-4
    lr_subcluster: float = 5.0e-3
    batch_size: int | Literal["auto"] = "auto"
    base_batch_size: int = 128
    max_batch_size: int = 4096
    steps_per_epoch: int = 64
    min_steps_per_epoch: int = 64
    lr_scaling: Literal["none", "sqrt", "linear"] = "sqrt"


@dataclass(frozen=True)
class ScheduleConfig:
    """When the M-step runs, when moves are proposed and when training stops."""

    max_epochs: int = 200
    warmup_epochs: int = 5
    move_every: int = 4
    freeze_epochs: int = 2
    patience: int = 3
    settled_spread: float = 0.01
    min_epochs: int = 0


@dataclass(frozen=True)
class SmallDataConfig:
    """Fits of at most ``max_rows`` rows (over all ranks) search by exact EM.

    Each epoch's M-step takes the E-step responsibilities r^E themselves (paper Eq. 5;
    what the clustering net learns to output) and the subclusters are 2-means steps
    within each cluster (the minimiser of the subclustering nets' loss, Eq. 7, for the
    current means); the moves, the prior and the stop rule are the same. Without nets to wait
    for, moves come every ``move_every`` epochs after ``warmup_epochs``, with no freeze.
    Once K has settled, the clustering net is fitted to the final responsibilities
    (full batch, Adam at ``distil_lr``) until its argmax agrees with theirs on
    ``distil_agreement`` of the rows, or stops improving, or ``distil_max_steps``.
    """

    max_rows: int = 100_000
    warmup_epochs: int = 1
    move_every: int = 2
    distil_lr: float = 0.02
    distil_agreement: float = 0.99
    distil_max_steps: int = 1000


@dataclass(frozen=True)
class MovesConfig:
    """Split/merge proposals (paper §3.2, Supmat 'Merge Proposals') and the density-valley
    rules (:mod:`deepdpm_core.moves.density_valleys`).

    ``valley_min_points``: the valley rules judge a split or merge only when each side
    holds this many points. At 25 a side one Gaussian shows no valley below 0.9 in 99
    draws of 100, and two Gaussians 5 standard deviations apart show one below 0.75 in 99
    (4 apart: 80, 3.5 apart: 39, pairs whose split the Hastings ratio itself barely takes
    at that size); below it the kernel fills valleys, and the moves are left to the
    Hastings ratio. ``birth_parts``: in a small-data fit (exact EM) a cluster whose split
    is not taken is also offered the cut into this many parts by k-means
    (:mod:`deepdpm_core.moves.births`; ``birth_kmeans_iters`` Lloyd iterations); None: no births.
    ``exact_valley``: a split or merge across a valley at most this deep is judged by the
    exact posterior, not the coarsened one (:func:`~deepdpm_core.moves.exact_across_deep_valleys`);
    None: every move coarsened. ``valley_bandwidth``: the smoothing kernel's width is this times
    n^(−1/5) standard deviations for n points, Silverman's rule for one Gaussian mode
    (0.9); narrower kernels show valleys in one mode's sampling noise at a few thousand
    points.
    """

    split: bool = True
    merge: bool = True
    merge_neighbours: int = 3
    min_subcluster_size: int = 5
    prune_empty: bool = True
    split_valley: float | None = 0.75
    merge_valley: float | None = 0.9
    valley_min_points: int = 25
    valley_bandwidth: float = 0.9
    birth_parts: int | None = 4
    birth_kmeans_iters: int = 10
    exact_valley: float | None = 0.2


@dataclass(frozen=True)
class EStepConfig:
    """E-step targets and soft statistics.

    The E-step (:meth:`~deepdpm_core.estep.gmm.GaussianMixture.sparse_log_responsibilities`)
    rules out, by a lower bound on each cluster's Mahalanobis distance, the clusters whose
    responsibility is provably below float32 resolution, and computes exact log-densities
    for the rest. While K <= ``dense_max_k`` a point may keep every cluster (the targets are
    the dense E-step's to float32 resolution; memory O(N·K)); above it each point keeps at
    most ``top_m``, its most likely ones (memory O(N·top_m)). The soft statistics take the
    net's responsibilities on each point's support, so an epoch costs O(N·K·D + N·s·D²) for
    s supported clusters per point (about 1.1–1.4) instead of O(N·K·D²).
    """

    top_m: int = 8
    dense_max_k: int = 32


@dataclass(frozen=True)
class AEConfig:
    """MLP autoencoder and the AE <-> DeepDPM alternation (paper Supmat 'Jointly Learning
    Features and Clustering'; architecture D-500-500-2000-d, Adam lr 0.002).

    Per-sample loss: ``recon_weight * ||g(f(x)) - x||^2 + (beta / 2) * ||f(x) - mu_z||^2``,
    averaged over the batch (the reference code's ``lambda_`` is ``recon_weight``). The
    defaults are the paper's raw-pixel (MNIST) recipe, lambda 0.005 and beta 1; only their
    ratio matters to Adam. ImageNet-50 on MoCo features used 0.05 and 0.01.
    """

    latent_dim: int = 10
    hidden: tuple[int, ...] = (500, 500, 2000)
    lr: float = 0.002
    weight_decay: float = 0.0
    batch_size: int = 256
    pretrain_epochs: int = 200
    epochs: int = 50
    recon_weight: float = 0.005
    beta: float = 1.0
    alternations: int = 3
    stop_when_k_stable: bool = True
    input_scaling: Literal["none", "global"] = "global"


@dataclass(frozen=True)
class EmbedConfig:
    """``deepdpm embed`` output size and UMAP settings (n2d, McConville et al. 2021:
    ``n_neighbors=20, min_dist=0, metric=euclidean``)."""

    dim: int = 10
    n_neighbors: int = 20
    min_dist: float = 0.0
    metric: str = "euclidean"


@dataclass(frozen=True)
class Config:
    """The whole run configuration.

    Sections: ``data`` (input transform), ``prior``, ``init``, ``model``, ``optim``, ``schedule``, ``moves``, ``estep``, ``small_data``, ``ae``
    (autoencoder, alternation), ``embed`` (UMAP);
    plus ``seed`` (all randomness of a fit derives from it) and ``device``.
    """

    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    data: DataConfig = field(default_factory=DataConfig)
    prior: PriorConfig = field(default_factory=PriorConfig)
    init: InitConfig = field(default_factory=InitConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    moves: MovesConfig = field(default_factory=MovesConfig)
    estep: EStepConfig = field(default_factory=EStepConfig)
    small_data: SmallDataConfig = field(default_factory=SmallDataConfig)
    ae: AEConfig = field(default_factory=AEConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)

    def __post_init__(self) -> None:
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain-dict form (what YAML and checkpoints store)."""
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Flattened ``{"prior.alpha": 10.0, ...}`` form (MLflow params)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}{k}.", v)
            else:
                out[prefix[:-1]] = value

        walk("", self.to_dict())
        return out

    def with_overrides(self, overrides: dict[str, Any]) -> Config:
        """Return a copy with dotted-key overrides (``{"prior.alpha": 1.0}``) applied."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            node = data
            parts = dotted.split(".")
            for part in parts[:-1]:
                if not isinstance(node.get(part), dict):
                    raise _unknown_key(dotted)
                node = node[part]
            if parts[-1] not in node or isinstance(node[parts[-1]], dict):
                raise _unknown_key(dotted)
            node[parts[-1]] = value
        return from_dict(data)


def _positive(cfg: Config) -> dict[str, float]:
    return {
        "data.auto_max_participation": cfg.data.auto_max_participation,
        "data.auto_min_std_ratio": cfg.data.auto_min_std_ratio,
        "prior.alpha": cfg.prior.alpha,
        "prior.kappa": 1.0 if cfg.prior.kappa == "auto" else cfg.prior.kappa,
        "prior.sigma_scale": cfg.prior.sigma_scale if isinstance(cfg.prior.sigma_scale, float) else 1.0,
        "prior.coarsening": 1.0 if cfg.prior.coarsening is None else cfg.prior.coarsening,
        "prior.coarsening_per_parameter": 1.0 if cfg.prior.coarsening_per_parameter is None
        else cfg.prior.coarsening_per_parameter,
        "optim.lr_cluster": cfg.optim.lr_cluster,
        "optim.lr_subcluster": cfg.optim.lr_subcluster,
        "optim.batch_size": 1 if cfg.optim.batch_size == "auto" else cfg.optim.batch_size,
        "optim.steps_per_epoch": cfg.optim.steps_per_epoch,
        "optim.min_steps_per_epoch": cfg.optim.min_steps_per_epoch,
        "optim.base_batch_size": cfg.optim.base_batch_size,
        "optim.max_batch_size": cfg.optim.max_batch_size,
        "init.n_clusters": 1 if cfg.init.n_clusters == "auto" else cfg.init.n_clusters,
        "init.max_points": cfg.init.max_points,
        "init.kmeans_iters": cfg.init.kmeans_iters,
        "model.hidden": cfg.model.hidden,
        "model.sub_hidden": cfg.model.sub_hidden,
        "schedule.max_epochs": cfg.schedule.max_epochs,
        "small_data.move_every": cfg.small_data.move_every,
        "small_data.distil_lr": cfg.small_data.distil_lr,
        "small_data.distil_agreement": cfg.small_data.distil_agreement,
        "schedule.move_every": cfg.schedule.move_every,
        "schedule.patience": cfg.schedule.patience,
        "moves.merge_neighbours": cfg.moves.merge_neighbours,
        "moves.valley_bandwidth": cfg.moves.valley_bandwidth,
        "estep.top_m": cfg.estep.top_m,
        "ae.latent_dim": cfg.ae.latent_dim,
        "ae.lr": cfg.ae.lr,
        "ae.batch_size": cfg.ae.batch_size,
        "ae.recon_weight": cfg.ae.recon_weight,
        "ae.beta": cfg.ae.beta,
        "embed.dim": cfg.embed.dim,
        "embed.n_neighbors": cfg.embed.n_neighbors,
    }


def _validate(cfg: Config) -> None:
    for key, value in _positive(cfg).items():
        if not value > 0:
            raise ConfigError(f"config key '{key}' must be > 0, got {_shown(value)}")
    for key, value in {
        "schedule.warmup_epochs": cfg.schedule.warmup_epochs,
        "schedule.freeze_epochs": cfg.schedule.freeze_epochs,
        "schedule.min_epochs": cfg.schedule.min_epochs,
        "schedule.settled_spread": cfg.schedule.settled_spread,
        "small_data.max_rows": cfg.small_data.max_rows,
        "small_data.warmup_epochs": cfg.small_data.warmup_epochs,
        "small_data.distil_max_steps": cfg.small_data.distil_max_steps,
        "prior.weight_pseudocount": cfg.prior.weight_pseudocount,
        "prior.covariance_floor": cfg.prior.covariance_floor,
        "moves.min_subcluster_size": cfg.moves.min_subcluster_size,
        "moves.valley_min_points": cfg.moves.valley_min_points,
        "moves.birth_kmeans_iters": cfg.moves.birth_kmeans_iters,
        "ae.weight_decay": cfg.ae.weight_decay,
        "ae.pretrain_epochs": cfg.ae.pretrain_epochs,
        "ae.epochs": cfg.ae.epochs,
        "ae.alternations": cfg.ae.alternations,
        "embed.min_dist": cfg.embed.min_dist,
        "estep.dense_max_k": cfg.estep.dense_max_k,
    }.items():
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {_shown(value)}")
    if cfg.small_data.distil_agreement > 1.0:
        raise ConfigError("config key 'small_data.distil_agreement' must be <= 1, "
                          f"got {_shown(cfg.small_data.distil_agreement)}")
    if cfg.moves.birth_parts is not None and cfg.moves.birth_parts < 2:
        raise ConfigError(f"config key 'moves.birth_parts' must be >= 2 or null, got {_shown(cfg.moves.birth_parts)}")
    for key in ("split_valley", "merge_valley", "exact_valley"):
        value = getattr(cfg.moves, key)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(f"config key 'moves.{key}' must be in [0, 1] or null, got {_shown(value)}")
    if cfg.embed.min_dist > 1.0:  # UMAP needs min_dist <= spread, which it leaves at 1
        raise ConfigError(f"config key 'embed.min_dist' must be <= 1, got {_shown(cfg.embed.min_dist)}")
    if cfg.embed.n_neighbors < 2:
        raise ConfigError(f"config key 'embed.n_neighbors' must be >= 2, got {_shown(cfg.embed.n_neighbors)}")
    if not 0 <= cfg.seed < 2**31:  # FAISS and the derived per-epoch torch seeds stay in range
        raise ConfigError(f"config key 'seed' must be in [0, 2**31), got {_shown(cfg.seed)}")
    if cfg.optim.max_batch_size < cfg.optim.base_batch_size:
        raise ConfigError(f"config key 'optim.max_batch_size' ({cfg.optim.max_batch_size}) must be >= "
                          f"optim.base_batch_size ({cfg.optim.base_batch_size})")
    if isinstance(cfg.prior.nu, float) and cfg.prior.nu <= 0:
        raise ConfigError(f"config key 'prior.nu' must be > 0, auto or null, got {_shown(cfg.prior.nu)}")
    if not cfg.ae.hidden or min(cfg.ae.hidden) <= 0:
        raise ConfigError(
            f"config key 'ae.hidden' must be a non-empty list of positive sizes, got {_shown(list(cfg.ae.hidden))}"
        )


#: characters of a value an error message shows at most
_SHOWN_CHARS = 120


def _shown(value: Any) -> str:
    """``repr(value)`` for an error message, bounded: nested and long values are elided
    (``[[1, 2, ...], ...]``) without walking them, so a huge value costs nothing to show."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict = 3, 6, 6, 6
    short.maxstring = short.maxother = short.maxlong = _SHOWN_CHARS
    text = short.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _coerce(key: str, annotation: Any, value: Any) -> Any:
    """Check ``value`` against a field annotation; ints are accepted for floats."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        if value not in typing.get_args(annotation):
            allowed = ", ".join(repr(a) for a in typing.get_args(annotation))
            raise ConfigError(f"config key '{key}' must be one of {allowed}, got {_shown(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, arg, value)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"config key '{key}' has a bad value {_shown(value)}")
    if origin is tuple:
        # Only homogeneous ``tuple[T, ...]`` fields (e.g. layer sizes); YAML gives a list.
        item_type, ellipsis = typing.get_args(annotation)
        if ellipsis is not Ellipsis or not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {_shown(value)}")
        return tuple(_coerce(f"{key}[{i}]", item_type, v) for i, v in enumerate(value))
    if is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {_shown(value)}")
        return _build(annotation, value, prefix=f"{key}.")
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false, got {_shown(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer, got {_shown(value)}")
        return value
    if annotation is float:
        if isinstance(value, str):
            # YAML 1.1 reads "5e-4" (no dot) as a string; accept it as the number it is.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number, got {_shown(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}' must be a finite number, got {_shown(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' must be a string, got {_shown(value)}")
        return value
    raise ConfigError(f"config key '{key}' has an unsupported type {annotation!r}")


def _unknown_key(dotted: str) -> ConfigError:
    """The error for an unknown key, naming the closest known dotted key if any:
    ``unknown config key 'prior.sigma_scal' (did you mean prior.sigma_scale?)``."""
    import difflib

    sections = [name for name, value in Config().to_dict().items() if isinstance(value, dict)]
    known = [*Config().flat(), *sections]
    close = difflib.get_close_matches(str(dotted), known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"unknown config key '{dotted}'{hint}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            raise _unknown_key(f"{prefix}{key}")
    kwargs = {name: _coerce(prefix + name, hints[name], data[name]) for name in data}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - defensive, names are checked above
        raise ConfigError(str(exc)) from exc


def _nested(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with dotted keys (``{"prior.alpha": 1.0}``, as ``--set`` names them) as
    nested mappings (``{"prior": {"alpha": 1.0}}``); a key given twice is an error."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        *sections, leaf = str(key).split(".")
        node = out
        for i, name in enumerate(sections):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{'.'.join(sections[:i + 1])}' is given as a "
                                  f"value and as a section")
        if isinstance(value, dict):
            value = _nested(value)
            if isinstance(node.get(leaf), dict):
                clash = set(node[leaf]) & set(value)
                if clash:
                    raise ConfigError(f"config key '{key}.{sorted(clash)[0]}' is given twice")
                value = {**node[leaf], **value}
        elif leaf in node:
            raise ConfigError(f"config key '{key}' is given twice")
        node[leaf] = value
    return out


def from_dict(data: dict[str, Any] | None) -> Config:
    """Build a :class:`Config` from a mapping, nested or with dotted keys
    (``{"prior.alpha": 1.0}``), rejecting unknown keys."""
    if data is None:
        return Config()
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping, got {type(data).__name__}")
    return _build(Config, _nested(data))


__all__ = [
    "AEConfig",
    "Config",
    "DataConfig",
    "EStepConfig",
    "EmbedConfig",
    "InitConfig",
    "ModelConfig",
    "MovesConfig",
    "OptimConfig",
    "PriorConfig",
    "ScheduleConfig",
    "SmallDataConfig",
    "from_dict",
    "replace",
]
