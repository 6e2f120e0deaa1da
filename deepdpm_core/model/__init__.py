"""The fitted model and the scikit-learn estimator, model files, and the diagnostics of a
fit's K."""

from deepdpm_core.model.diagnostics import (
    DiagnosticsMonitor,
    diagnose,
    stop_reason,
    tiny_cluster_rows,
    tiny_clusters,
    variance_summary,
)
from deepdpm_core.model.estimator import DeepDPM
from deepdpm_core.model.files import safe_load, save_checkpoint
from deepdpm_core.model.fitted_model import FORMAT, ClusterAssigner, FittedModel

__all__ = [
    "ClusterAssigner", "DeepDPM", "diagnose", "DiagnosticsMonitor", "FittedModel", "FORMAT",
    "safe_load", "save_checkpoint", "stop_reason", "tiny_cluster_rows", "tiny_clusters",
    "variance_summary"
]
