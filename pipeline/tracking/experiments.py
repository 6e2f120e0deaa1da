"""The MLflow experiment a run goes in: found by name, or created, shown as model training."""

from __future__ import annotations

from typing import Any

#: experiment tag by which MLflow 3's UI shows an experiment as model training (its Runs)
#: rather than GenAI (overview, "Evaluation runs"); UIs with the GenAI / Model training
#: switch follow the switch or the URL's ``workflowType`` instead (:attr:`~pipeline.tracking.run_tracker.RunTracker.run_url`)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def find_or_create_experiment(client: Any, name: str, artifact_location: str | None) -> str:
    """The id of the experiment ``name``, created (with ``artifact_location`` as its
    artifact root) when missing; tagged :data:`EXPERIMENT_KIND` unless someone has set
    its kind.

    Parameters
    ----------
    client : mlflow.MlflowClient
    name : str
    artifact_location : str or None
        The server's choice when None.
    """
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        try:
            experiment_id = client.create_experiment(name, artifact_location=artifact_location)
        except Exception:
            # another process may have created it between our get and create
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            experiment_id = experiment.experiment_id
    if experiment is None or EXPERIMENT_KIND_TAG not in experiment.tags:
        # an experiment someone has set a kind for keeps it
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment_id
