"""The data side of the method: input checks, the fit's coordinates, generated
mixtures and clustering metrics."""

from deepdpm_core.data.coordinates import FeatureCoordinates, fit_coordinates
from deepdpm_core.data.datasets import make_mixture
from deepdpm_core.data.metrics import (
    ContingencyCounts,
    acc,
    ari,
    clustering_scores,
    contingency,
    contingency_scores,
    nmi,
)
from deepdpm_core.data.validation import (
    check_features,
    check_init_labels,
    is_real_dtype,
    readonly_tensor,
)

__all__ = [
    "acc", "ari", "check_features", "check_init_labels", "clustering_scores", "contingency",
    "contingency_scores", "ContingencyCounts", "FeatureCoordinates", "fit_coordinates",
    "is_real_dtype", "make_mixture", "nmi", "readonly_tensor"
]
