"""Alias of :mod:`nemo_aligner.api`."""

from nemo_aligner.api import create_trainer, get_algorithm, list_algorithms, register_algorithm  # noqa: F401
