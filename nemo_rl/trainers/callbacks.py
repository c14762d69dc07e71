"""Alias of :mod:`nemo_aligner.trainers.callbacks`."""

from nemo_aligner.trainers.callbacks import Callback, CallbackList  # noqa: F401
