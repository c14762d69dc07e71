"""Environments for RL from the Python API: given conversations, return rewards, done flags and
the next observations (multi-step interface; the GRPO loop currently runs one turn per episode)."""

from nemo_aligner.environments.interface import EnvironmentInterface, EnvironmentReturn  # noqa: F401
from nemo_aligner.environments.builtin_task import BuiltinTaskEnvironment  # noqa: F401
