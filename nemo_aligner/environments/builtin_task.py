"""The built-in verifiable task as an environment: one turn, reward = fraction of right characters."""

from __future__ import annotations

from typing import List, Optional

from nemo_aligner.data.nlp.builtin_task import BuiltinTask
from nemo_aligner.environments.interface import Conversation, EnvironmentInterface, EnvironmentReturn


class BuiltinTaskEnvironment(EnvironmentInterface):
    """Rewards ``reverse``/``sort`` answers; every episode ends after the first answer."""

    def step(self, conversations: List[Conversation], metadata: Optional[List[dict]] = None) -> EnvironmentReturn:
        rewards = []
        for conversation in conversations:
            prompt = next(m["content"] for m in conversation if m["role"] == "user")
            answer = next((m["content"] for m in reversed(conversation) if m["role"] == "assistant"), "")
            rewards.append(BuiltinTask.score(prompt, answer))
        return EnvironmentReturn(rewards=rewards, done=[True] * len(conversations),
                                 observations=[None] * len(conversations))
