"""Errors that are reported to the user as one clear line, without a traceback."""


class AlignerError(Exception):
    """Base class for user-facing errors (bad config, bad data, bad checkpoint)."""


class ConfigError(AlignerError):
    """A configuration value is missing, unknown or inconsistent; the message names the key."""


class DataError(AlignerError):
    """An input data file is missing or malformed; the message names the file and line."""


class CheckpointError(AlignerError):
    """A checkpoint is missing, corrupt or does not match the model."""


class TrainingError(AlignerError):
    """Training cannot go on (e.g. too many consecutive non-finite steps)."""


class ServerError(AlignerError):
    """A server stopped serving for a reason other than a stop signal (its Triton process died)."""
