"""Alias of :mod:`nemo_aligner.trainers`."""

import nemo_aligner.trainers as _impl


def __getattr__(name):
    return getattr(_impl, name)
