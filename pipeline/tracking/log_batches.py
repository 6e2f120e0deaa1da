"""Params, tags and metrics cut into ``log_batch`` calls that MLflow accepts."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

#: MLflow accepts at most 100 params or tags and 1000 metrics per ``log_batch`` call
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_LENGTH = 6000


def text_batches(values: Mapping[str, Any]) -> Iterable[list[tuple[str, str]]]:
    """``{name: value}`` params or tags as ``(name, text)`` batches (``None`` becomes
    ``"null"``; texts cut to MLflow's longest)."""
    items = [(str(k), _param_value(v)) for k, v in values.items()]
    return _chunks(items, _MAX_PARAMS_PER_BATCH)


def metric_batches(metrics: Mapping[str, float], step: int
                   ) -> Iterable[list[tuple[str, float, int, int]]]:
    """``{name: value}`` metrics as ``(name, value, timestamp, step)`` batches, timestamped
    now (not when they are sent)."""
    stamp = int(time.time() * 1000)
    items = [(str(k), float(v), stamp, int(step)) for k, v in metrics.items()]
    return _chunks(items, _MAX_METRICS_PER_BATCH)


def log_batch(client: Any, run_id: str, params=(), tags=(), metrics=()) -> None:
    """Send one batch of each kind (:func:`text_batches`, :func:`metric_batches`) to the run."""
    from mlflow.entities import Metric, Param, RunTag

    client.log_batch(run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in metrics],
                     params=[Param(k, v) for k, v in params], tags=[RunTag(k, v) for k, v in tags],
                     synchronous=True)


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text[:_MAX_PARAM_LENGTH]


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
