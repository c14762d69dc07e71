"""Training callbacks for the Python API (``on_step_end``, ``on_validation_end``, ...): the trainer
loops' own :mod:`nemo_aligner.algorithms.callbacks`, under the API's name."""

from nemo_aligner.algorithms.callbacks import Callback, CallbackList  # noqa: F401

__all__ = ["Callback", "CallbackList"]
