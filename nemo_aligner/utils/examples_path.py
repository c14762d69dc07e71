"""Where the project's ``examples/`` (Hydra scripts and their configs) are.

A source checkout (a clone, ``pip install -e .``) has them beside the package; a wheel or a
``pip install .`` carries a copy inside the package, ``nemo_aligner/_examples`` (setup.py puts it
there), so the Python API, ``ppo_local`` and the demo work from either.
"""

from __future__ import annotations

import os

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT_EXAMPLES = os.path.join(os.path.dirname(_PACKAGE), "examples")
PACKAGED_EXAMPLES = os.path.join(_PACKAGE, "_examples")


def examples_dir(*parts: str) -> str:
    """``examples/<parts>``: the source checkout's when it has it, else the packaged copy's."""
    checkout = os.path.join(CHECKOUT_EXAMPLES, *parts)
    return checkout if os.path.exists(checkout) else os.path.join(PACKAGED_EXAMPLES, *parts)
