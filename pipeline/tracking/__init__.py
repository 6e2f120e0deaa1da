"""MLflow tracking: the run tracker that never breaks a fit, the run's environment, what a
fit logs, and the CLI flags."""
