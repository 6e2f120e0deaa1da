"""The MLflow metrics of an epoch record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepdpm_core.runtime import EPOCH_PHASES

#: epoch-record key -> MLflow metric name (see ``DeepDPM.history_``)
EPOCH_METRICS: dict[str, str] = {
    "n_clusters": "n_clusters",
    "loss_cluster": "loss_cluster",
    "loss_subcluster": "loss_subcluster",
    "splits_accepted": "splits_accepted",
    "merges_accepted": "merges_accepted",
    "prior_scale": "prior_scale",
    "prior_nu": "prior_nu",
    "diagonal_covariances": "diagonal_covariances",
    "seconds": "epoch_seconds",
    **{f"seconds_{phase}": f"epoch_seconds_{phase}" for phase, _ in EPOCH_PHASES},
    "nmi": "nmi",
    "ari": "ari",
    "acc": "acc",
}


def epoch_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """MLflow metrics of one epoch record (``seconds[_phase]`` becomes ``epoch_seconds[_phase]``)."""
    return {name: float(record[key]) for key, name in EPOCH_METRICS.items() if record.get(key) is not None}
