"""The contract between trainers and models: trainers call only these methods."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Tuple

import torch


class SupervisedInterface(ABC):
    """A model trained on fixed batches (SFT, reward models, DPO)."""

    @abstractmethod
    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool) -> Tuple[float, Dict[str, float]]:
        """Forward (and backward unless ``forward_only``) over one global batch on this DP rank.

        Returns the loss averaged over the global batch and a dict of metrics, identical
        on every rank.
        """

    def prepare_for_training_step(self) -> None:
        """Called before each training step (e.g. zero gradients)."""

    def finish_training_step(self) -> None:
        """Called after the backward pass, before the optimizer step."""

    def prepare_for_validation_step(self) -> None:
        """Called before each validation step."""

    def finish_validation_step(self) -> None:
        """Called after each validation step."""


class Inferrable(ABC):
    """A model that can run inference: generate for a policy, score for a reward model or critic."""

    @abstractmethod
    def prepare_for_inference(self) -> None:
        """Switch to inference (eval mode, offload optimizer state, build KV caches...)."""

    @abstractmethod
    def finish_inference(self) -> None:
        """Undo ``prepare_for_inference``."""

    @abstractmethod
    def infer(self, *args, **kwargs) -> Any:
        """Generate (policy) or score (reward model, critic)."""


class CriticModelInterface(SupervisedInterface, Inferrable):
    """A PPO critic, optionally co-located with the reward model."""

    @abstractmethod
    def prepare_for_training(self) -> None:
        """Bring optimizer state back before a round of critic training."""

    @abstractmethod
    def finish_training(self) -> None:
        """Offload optimizer state after a round of critic training."""

    @abstractmethod
    def infer_rm_critic(self, *args, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(rewards, values)`` for finished sequences."""


class AlignableGenerativeInterface(SupervisedInterface, Inferrable):
    """A policy trained with on-line RL (PPO, REINFORCE, GRPO)."""

    @abstractmethod
    def prepare_for_training(self) -> None:
        """Bring optimizer state back on the device before the policy update."""

    @abstractmethod
    def finish_training(self) -> None:
        """Offload optimizer state after the policy update."""

    @abstractmethod
    def get_init_policy_logprobs(self, rollout_batches) -> torch.Tensor:
        """Reference log-probs from the initial policy (weights swapped in from CPU)."""
