"""Environments for RL from the Python API: given conversations, return rewards, done flags and
the next observations. GRPO, REINFORCE and rejection sampling play an episode on while the
environment returns done=False (up to ``max_rollout_turns``), and every turn's reward counts."""

from nemo_aligner.environments.interface import EnvironmentInterface, EnvironmentReturn  # noqa: F401
from nemo_aligner.environments.builtin_task import BuiltinTaskEnvironment  # noqa: F401
