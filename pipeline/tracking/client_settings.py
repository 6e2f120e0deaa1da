"""How a tracked command talks to MLflow: its HTTP client's retries and timeouts, a quiet
client, tracking URIs shown without credentials, and a run's page in the UI.

MLflow's own HTTP client retries a failed request 7 times with exponential backoff
(about 4 minutes) and waits 120 s per request by default. A tracked run lowers those
through the documented environment variables (:data:`HTTP_ENV_DEFAULTS`) unless the
user has set them.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

#: MLflow HTTP client settings for tracked runs; a value the user exported wins.
#: 2 retries with backoff factor 1 give up on a dead server within ~10 s instead of ~4 min.
HTTP_ENV_DEFAULTS: dict[str, str] = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}

#: no MLflow progress bars on stderr, and no run links on stdout, which holds only the
#: command's result (:meth:`~pipeline.tracking.run_tracker.RunTracker.close` prints the
#: link on stderr); a value the user exported wins
QUIET_ENV_DEFAULTS: dict[str, str] = {
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    # its INFO records ("Creating initial MLflow database tables...") are routine
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def import_ipython() -> None:
    """Import IPython (when installed) on the calling thread.

    MLflow's HTTP client imports it on its first request (a Databricks-notebook check), on
    the logging thread; matplotlib, drawing a fit's plots meanwhile, reads the half-imported
    module from ``sys.modules`` and raises. Imported before that thread starts, it is whole.
    """
    import importlib.util

    if importlib.util.find_spec("IPython") is not None:
        import IPython  # noqa: F401


def redacted(uri: str | None) -> str:
    """``uri`` without a ``user:password@`` part (warnings must not print credentials)."""
    parts = urlsplit(uri or "")
    if parts.password is None and parts.username is None:
        return uri or ""
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def shown_tracking_uri(uri: str | None) -> str | None:
    """``uri`` as a result line may show it: without a ``user:password@`` part."""
    return None if uri is None else redacted(uri)


def run_page_url(ui: str, experiment_id: str, run_id: str) -> str:
    """A run's page in the MLflow UI served at ``ui``, opened on the UI's model-training
    view (``workflowType=machine_learning``: MLflow 3's UI picks its view from that, not
    from the experiment's kind tag)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
