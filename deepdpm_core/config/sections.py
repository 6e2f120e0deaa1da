"""The sections of the run configuration (``data``, ``prior``, ``init``, ``model``, ``optim``,
``schedule``, ``small_data``, ``moves``, ``estep``, ``ae``, ``embed``): frozen pydantic models
whose fields carry their bounds."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from deepdpm_core.errors import DataError


def _yaml_number(value: Any) -> Any:
    # YAML 1.1 reads "5e-4" (no dot) as a string; accept it as the number it is
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def seed_in_range(value: int) -> int:
    if not 0 <= value < 2**31:  # FAISS and the derived per-epoch torch seeds stay in range
        raise ValueError("must be in [0, 2**31)")
    return value


#: a finite float (an int is accepted); ``Positive``: > 0
Number = Annotated[float, BeforeValidator(_yaml_number)]
Positive = Annotated[Number, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


class Section(BaseModel):
    """Strict: no unknown keys, no type coercion but int -> float, finite numbers only."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class DataConfig(Section):
    """Input transform applied to every row before the fit and at prediction time, fitted
    on the training data and stored with the model (docs/design.md, "Coordinates")."""

    transform: Literal["auto", "none", "normalize", "standard", "min_max"] = Field(
        "auto", description="`standard` when the features are in different units, else as given")


class PriorConfig(Section):
    """Dirichlet-process and Normal-Inverse-Wishart prior (paper Supmat §NIW), fitted to the
    current clusters by empirical Bayes at every M-step by default, and the coarsened
    posterior that judges the moves (docs/design.md, "The prior", "Self-calibration" and
    "Split and merge moves"). ``covariance_type: auto`` is not the default: at K = 1 the
    evidence judges one cluster, and on PCA scores (a diagonal global covariance) it picks
    diag and the fit stays at K = 1 (digits PCA-10)."""

    alpha: Positive = Field(
        10.0, description="DP concentration: ln α per split; higher favours more clusters (weakly when α << N)")
    kappa: Positive | Literal["auto"] = Field(
        "auto", description="κ0 = s / (mean per-feature variance): the prior spread of the means is the data's")
    nu: Positive | Literal["auto"] | None = Field(
        "auto", description="ν0 fitted given s, at least the paper's D + 2 (logged as `prior_nu`)")
    sigma_scale: Positive | Literal["auto", "evidence"] = Field(
        "auto", description="s, refitted at every M-step by empirical Bayes to the clusters' variances (logged as `prior_scale`)")
    psi: Literal["fitted", "identity", "data_std"] = Field(
        "fitted", description="Ψ0 = s·diag(p), each feature's scale p_d fitted to its own spread within the clusters")
    covariance_type: Literal["full", "diag", "auto"] = Field(
        "full", description="one full covariance per cluster")
    coarsening: Positive | None = Field(
        500.0, description="moves judged with the likelihood raised to c/(c + n) (coarsened posterior), so K does not grow with N on clusters that are not Gaussian")


class InitConfig(Section):
    """k-means initialisation of clusters and subclusters."""

    n_clusters: PositiveInt | Literal["auto"] = Field(
        "auto", description="start from 10 k-means clusters (fewer below 100 rows; max(10, N / 1,000) in the net search above `small_data.max_rows`): splits and growth add missing ones, merges remove extras")
    max_points: PositiveInt = Field(
        200_000, description="k-means sees at most this many sampled rows, 4·10⁷ / K of them (all 200,000 up to K = 200), or `init.points_per_cluster` a cluster where that is more")
    points_per_cluster: PositiveInt = Field(
        40, description="the initial k-means sees 4·10⁷ / K sampled rows (all of `init.max_points` = 200,000 up to K = 200), or this many a cluster where that is more; every row then goes to its nearest centre: the start's cost is bounded by K, not N")
    kmeans_iters: PositiveInt = Field(
        25, description="k-means iterations")

    @property
    def rows_needed(self) -> int:
        """The fewest rows a fit accepts: 2, or ``n_clusters`` when it is a number."""
        return 2 if self.n_clusters == "auto" else max(2, int(self.n_clusters))


def check_row_count(n: int, need: int, what: str = "X") -> None:
    """Refuse a fit of ``n`` rows that needs ``need`` (:attr:`InitConfig.rows_needed`).

    Raises
    ------
    DataError
        ``n < need``, naming ``what`` (X, or the input file).
    """
    if n < need:
        raise DataError(f"{what} has {n} rows, fewer than the {need} needed (initial clusters)")


class ModelConfig(Section):
    """Clustering net (one hidden layer of ``hidden`` units) and the nets' precision; the
    batched subclustering nets have one hidden layer of 50
    (:data:`deepdpm_core.training.fit_context.SUB_HIDDEN`)."""

    hidden: PositiveInt = Field(
        50, description="hidden units of the clustering net (paper: 50); exact EM widens it to 2·min(D, K − 1) for its final fit where that is more")
    precision: Literal["auto", "float32", "tf32", "bf16"] = Field(
        "auto", description="the nets' matmuls: float32 | tf32 (CUDA) | bf16 | auto (tf32 on CUDA, else float32)")


class OptimConfig(Section):
    """Adam optimisers of the two nets and the minibatch schedule."""

    lr_cluster: Positive = Field(
        5.0e-4, description="clustering-net learning rate at batch 128 (paper: 5e-4 at 128)")
    lr_subcluster: Positive = Field(
        5.0e-3, description="subclustering-net learning rate at batch 128 (paper: 5e-3)")
    batch_size: PositiveInt | Literal["auto"] = Field(
        "auto", description="minibatch size per rank, or auto: ceil(N / 64) within [128, 4096]")
    min_steps_per_epoch: PositiveInt = Field(
        64, description="small data get extra re-drawn training batches up to this many steps")
    lr_scaling: Literal["none", "sqrt", "linear"] = Field(
        "sqrt", description="none | sqrt | linear: lr *= (global batch / 128)^(0, 1/2, 1)")


class ScheduleConfig(Section):
    """When the M-step runs, when moves are proposed and when training stops; the freeze
    after an accepted move and the rules that tell K has settled are constants of
    :mod:`deepdpm_core.moves.schedule`."""

    max_epochs: PositiveInt = Field(
        200, description="hard stop; most fits stop earlier, once K has settled (deepdpm_core/moves/schedule.py)")
    warmup_epochs: NonNegativeInt = Field(
        5, description="epochs with k-means parameters frozen while the nets learn them")
    move_every: PositiveInt = Field(
        4, description="epochs between split/merge rounds (splits and merges alternate)")


class SmallDataConfig(Section):
    """Fits of at most ``max_rows`` rows (over all ranks; every fit when null) search by
    exact EM (:mod:`deepdpm_core.training.exact_em`; docs/design.md, "Exact EM")."""

    max_rows: NonNegativeInt | None = Field(
        None, description="up to this many rows the search is exact EM and the net is fitted to its result; null: at every N")
    growth_gain: Positive | None = Field(
        1.0, description="a settled exact-EM search restarts from k-means of 2K, 4K, ... clusters when that scores this many coarsened nats a row higher (one that collapsed to one cluster, or hides groups that density valleys part: 0.05 exact nats a row)")


def searches_by_exact_em(n_rows: int, max_rows: int | None) -> bool:
    """Whether a fit of ``n_rows`` rows (over all ranks) searches by exact EM under
    ``small_data.max_rows`` = ``max_rows`` (None: at every N); else the nets' search."""
    return max_rows is None or n_rows <= max_rows


class MovesConfig(Section):
    """Which split/merge rounds run (paper §3.2, Supmat 'Merge Proposals'); the rules of a
    round are constants of :mod:`deepdpm_core.moves` (docs/design.md, "Split and merge moves")."""

    split: bool = Field(
        True, description="propose splits")
    merge: bool = Field(
        True, description="propose merges")


class EStepConfig(Section):
    """E-step targets and soft statistics (:class:`~deepdpm_core.estep.EStep`;
    docs/design.md, "E-step")."""

    top_m: PositiveInt = Field(
        8, description="most clusters in a point's E-step support when K > `estep.dense_max_k` (memory N × top_m)")
    dense_max_k: NonNegativeInt = Field(
        32, description="while K <= this a point's support may hold every cluster (exact to float32; memory N × K)")


class AEConfig(Section):
    """MLP autoencoder and the AE <-> DeepDPM alternation (paper Supmat 'Jointly Learning
    Features and Clustering'; architecture D-500-500-2000-d, Adam lr 0.002).

    Per-sample loss: ``recon_weight * ||g(f(x)) - x||^2 + (beta / 2) * ||f(x) - mu_z||^2``,
    averaged over the batch (the reference code's ``lambda_`` is ``recon_weight``). The
    defaults are the paper's raw-pixel (MNIST) recipe, lambda 0.005 and beta 1; only their
    ratio matters to Adam. ImageNet-50 on MoCo features used 0.05 and 0.01.
    """

    latent_dim: PositiveInt = Field(
        10, description="d of the D-500-500-2000-d autoencoder (embedding the clusters live in)")
    hidden: Annotated[tuple[PositiveInt, ...], Field(min_length=1, strict=False)] = Field(
        (500, 500, 2000), description="encoder hidden sizes; the decoder mirrors them")
    lr: Positive = Field(
        0.002, description="Adam learning rate (paper Table: 0.002)")
    batch_size: PositiveInt = Field(
        256, description="AE minibatch (n2d)")
    pretrain_epochs: NonNegativeInt = Field(
        200, description="reconstruction-only pretraining epochs (n2d used 1000; recipes set it)")
    epochs: NonNegativeInt = Field(
        50, description="AE epochs per alternation, clusters held fixed")
    recon_weight: Positive = Field(
        0.005, description="λ: per-sample loss = λ·||g(f(x)) - x||² + β/2·||f(x) - μ_z||²")
    beta: Positive = Field(
        1.0, description="β, the clustering term's weight (MNIST recipe; ImageNet-50 used λ 0.05, β 0.01)")
    alternations: NonNegativeInt = Field(
        3, description="max AE<->DeepDPM alternations (`deepdpm fit --alternate N` overrides)")
    stop_when_k_stable: bool = Field(
        True, description="stop early once K is unchanged between two clusterings (Supmat)")


class EmbedConfig(Section):
    """``deepdpm embed`` output size and UMAP settings (n2d, McConville et al. 2021:
    ``n_neighbors=20, min_dist=0``; the metric is Euclidean,
    :data:`deepdpm_core.features.embedding.UMAP_METRIC`)."""

    dim: PositiveInt = Field(
        10, description="output dimension for umap / ae-umap / pca (ae uses `ae.latent_dim`)")
    n_neighbors: Annotated[int, Field(ge=2)] = Field(
        20, description="UMAP n_neighbors (n2d: 20)")
    # UMAP needs min_dist <= spread (1)
    min_dist: Annotated[Number, Field(ge=0, le=1)] = Field(
        0.0, description="UMAP min_dist (n2d: 0)")
