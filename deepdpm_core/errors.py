"""Exceptions that name what the user got wrong (the CLI prints them as one line), and how
they list names."""


class DeepDPMError(Exception):
    """Base class of every error caused by user input (data, config, files)."""


class ConfigError(DeepDPMError, ValueError):
    """A config file or override is invalid: unknown key, wrong type, bad value."""


class DataError(DeepDPMError, ValueError):
    """Input data are unusable: NaN/inf, wrong shape or dimension, too few rows."""


class CheckpointError(DeepDPMError, ValueError):
    """A checkpoint cannot be read or does not match what is expected."""


def listed(names: list[str], at_most: int = 8) -> str:
    """``'a', 'b', ... (12 in all)``: names (columns, keys) for a one-line message."""
    shown = ", ".join(repr(n) for n in names[:at_most])
    return shown + (f", ... ({len(names)} in all)" if len(names) > at_most else "")
