"""The fitted model and the scikit-learn estimator, model files, and the diagnostics of a
fit's K."""

import importlib

from deepdpm_core.model.files import safe_load, save_checkpoint
from deepdpm_core.model.fitted_model import FORMAT, ClusterAssigner, FittedModel

#: names imported on first use: the estimator pulls in scikit-learn, the diagnostics the
#: moves (faiss), neither of which predicting with a model file needs
_LAZY = {"DeepDPM": "estimator", "DiagnosticsMonitor": "diagnostics", "diagnose": "diagnostics",
         "stop_reason": "diagnostics", "tiny_cluster_rows": "diagnostics",
         "tiny_clusters": "diagnostics", "variance_summary": "diagnostics"}

__all__ = [
    "ClusterAssigner", "DeepDPM", "diagnose", "DiagnosticsMonitor", "FittedModel", "FORMAT",
    "safe_load", "save_checkpoint", "stop_reason", "tiny_cluster_rows", "tiny_clusters",
    "variance_summary"
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"deepdpm_core.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'deepdpm_core.model' has no attribute {name!r}")
