"""The environment contract."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Dict, List, Optional

Conversation = List[Dict[str, str]]  # [{"role": "user"|"assistant"|..., "content": str}, ...]


@dataclass
class EnvironmentReturn:
    """One step for a batch: a reward and a done flag per conversation, and the next observation
    (a message to append, e.g. ``{"role": "user", "content": ...}``) where not done."""

    rewards: List[float]
    done: List[bool]
    observations: List[Optional[Dict[str, str]]] = field(default_factory=list)


class EnvironmentInterface(abc.ABC):
    """Implement ``step``; ``reset`` is optional."""

    @abc.abstractmethod
    def step(self, conversations: List[Conversation], metadata: Optional[List[dict]] = None) -> EnvironmentReturn:
        """Score the last assistant message of each conversation."""

    def reset(self) -> None:
        """Start new episodes (default: nothing to reset)."""
