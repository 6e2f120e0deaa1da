"""The model script of deepdpm's MLflow models (MLflow "models from code").

MLflow copies this file into every logged model and runs it when the model is loaded:
the model is the installed package's :class:`pipeline.tracking.mlflow_model.DeepDPMModel`, so
loading one unpickles nothing.
"""

import mlflow.models

from pipeline.tracking.mlflow_model import DeepDPMModel

mlflow.models.set_model(DeepDPMModel())
