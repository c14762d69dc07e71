"""The contract between trainers and models: trainers call only these methods (and build the
sampling and length settings that ``generate`` takes)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch



def string_list(value) -> List[str]:
    """A config list of strings; one string is a list of one (``end_strings='<|endoftext|>'``), not
    one per character."""
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(s) for s in value]


@dataclass
class SamplingParams:
    """NeMo's ``sampling_params``: greedy or temperature/top-k/top-p sampling, and end strings."""

    use_greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    end_strings: List[str] = field(default_factory=list)

    @classmethod
    def from_cfg(cls, cfg) -> "SamplingParams":
        if cfg is None:
            return cls()
        def value(key, default):  # 0 is a setting (temperature 0: the top token), only null is unset
            given = cfg.get(key, default)
            return default if given is None else given

        return cls(
            use_greedy=bool(cfg.get("use_greedy", False)), temperature=float(value("temperature", 1.0)),
            top_k=int(value("top_k", 0)), top_p=float(value("top_p", 1.0)),
            end_strings=string_list(cfg.get("end_strings")))


@dataclass
class LengthParams:
    """NeMo's ``length_params``: response length bounds in tokens."""

    max_length: int = 32
    min_length: int = 1

    @classmethod
    def from_cfg(cls, cfg) -> "LengthParams":
        if cfg is None:
            return cls()
        return cls(max_length=int(cfg.get("max_length", 32)), min_length=int(cfg.get("min_length", 1) or 0))


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
    def get_init_policy_logprobs(self, tokens, prompt_lengths=None, response_lengths=None, seconds=None) -> torch.Tensor:
        """Reference log-probs from the initial policy (weights swapped in from CPU); ``seconds``, a dict,
        receives the swap's ``swap_in`` and ``swap_out`` times."""


class SelfPlayInterface(SupervisedInterface, Inferrable):
    """A policy trained against its own earlier generations (SPIN): it generates with the
    reference (previous iterate) policy and is trained to prefer the data's responses over them."""

    @abstractmethod
    def set_KL_penalty_by_iteration(self, iteration: int) -> None:
        """Use the preference loss's beta of ``iteration`` (a schedule may give one per iteration)."""

    @abstractmethod
    def update_reference_policy(self) -> None:
        """Make the current weights the reference policy (the end of an iteration)."""

    @abstractmethod
    def get_loss_and_metrics_vanilla_sft(self, batch: Dict[str, torch.Tensor],
                                         forward_only: bool = True) -> Tuple[float, Dict[str, float]]:
        """The SFT loss (negative log-likelihood of the data's responses) of one batch."""
