"""``nemo_rl``: an import alias of :mod:`nemo_aligner`, so NeMo-RL-style code runs unchanged."""

import nemo_aligner as _impl

__version__ = _impl.__version__


def __getattr__(name):
    return getattr(_impl, name)
