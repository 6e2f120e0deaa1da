"""Shared test set-up: quiet, single-threaded BLAS, no MLflow telemetry."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import torch  # noqa: E402

torch.set_num_threads(1)
