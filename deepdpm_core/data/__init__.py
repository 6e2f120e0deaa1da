"""The data side of the method: input checks, the fit's coordinates, generated
mixtures and clustering metrics.

The metrics are plain NumPy and load with the package; the rest (which needs torch) loads
on first use, so that scoring a prediction (``deepdpm predict`` on the CPU) does not pay
for torch.
"""

from deepdpm_core.data.metrics import (
    ContingencyCounts,
    acc,
    ari,
    clustering_scores,
    contingency,
    contingency_scores,
    nmi,
)

#: the names that load their module (and torch) on first use
_ON_USE = {
    "FeatureCoordinates": "coordinates", "fit_coordinates": "coordinates",
    "make_mixture": "datasets",
    "check_features": "validation", "check_init_labels": "validation",
    "is_real_dtype": "validation", "readonly_tensor": "validation",
}


def __getattr__(name: str):
    if name in _ON_USE:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_ON_USE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "acc", "ari", "check_features", "check_init_labels", "clustering_scores", "contingency",
    "contingency_scores", "ContingencyCounts", "FeatureCoordinates", "fit_coordinates",
    "is_real_dtype", "make_mixture", "nmi", "readonly_tensor"
]
