"""Exceptions that name what the user got wrong (the CLI prints them as one line)."""


class DeepDPMError(Exception):
    """Base class of every error caused by user input (data, config, files)."""


class ConfigError(DeepDPMError, ValueError):
    """A config file or override is invalid: unknown key, wrong type, bad value."""


class DataError(DeepDPMError, ValueError):
    """Input data are unusable: NaN/inf, wrong shape or dimension, too few rows."""


class CheckpointError(DeepDPMError, ValueError):
    """A checkpoint cannot be read or does not match what is expected."""
