"""Rejection sampling (NeMo-Aligner's ``RSTrainer``): each step samples ``num_rollouts_per_prompt``
responses to each prompt, scores them (a reward-model server or a reward function), keeps each
prompt's ``top_n_rollouts`` best and trains on them with the SFT loss."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from nemo_aligner.algorithms.ppo import Timer
from nemo_aligner.algorithms.reinforce import ReinforceTrainer
from nemo_aligner.utils import ppo_utils
from nemo_aligner.utils.distributed import host_all_reduce
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def rs_counts(rl_cfg) -> Tuple[int, int]:
    """``model.rs.num_rollouts_per_prompt`` and ``top_n_rollouts``, checked (1 <= top_n <= rollouts)."""
    n = int(rl_cfg.get("num_rollouts_per_prompt", 4))
    top = int(rl_cfg.get("top_n_rollouts", 1))
    if n < 1:
        raise ConfigError(f"model.rs.num_rollouts_per_prompt={n} must be >= 1")
    if not 1 <= top <= n:
        raise ConfigError(f"model.rs.top_n_rollouts={top} must be within 1..model.rs.num_rollouts_per_prompt={n}")
    return n, top


def check_rs_sampling(rl_cfg) -> Tuple[int, int]:
    """:func:`rs_counts`, and a warning when the sampling settings make every response alike."""
    n, top = rs_counts(rl_cfg)
    sampling = rl_cfg.get("sampling_params") or {}
    greedy, temperature = bool(sampling.get("use_greedy", False)), sampling.get("temperature", 1.0)
    if n > 1 and (greedy or (temperature is not None and float(temperature) <= 0)):
        logger.warning("model.rs.sampling_params: use_greedy=%s, temperature=%s gives %d identical responses per "
                       "prompt: nothing to choose between (sample: use_greedy=False, temperature > 0)",
                       greedy, temperature, n)
    return n, top


class RSTrainer(ReinforceTrainer):
    """Rejection sampling for an actor trained with the SFT loss (``MegatronGPTRSActorModel``);
    rewards from ``reward_source``. ``cfg``: ``trainer.rs``; ``rl_cfg``: ``model.rs``."""

    def __init__(self, cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, reward_source, logger_,
                 ckpt_callback, run_timer=None, rl_cfg=None, seed: int = 1234, name: str = "rs"):
        rl_cfg = rl_cfg or {}
        n, self.top_n = rs_counts(rl_cfg)  # the recipe warned about the sampling settings
        super().__init__(cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, reward_source, logger_,
                         ckpt_callback, run_timer, rl_cfg=dict(rl_cfg, num_responses_per_prompt=n), seed=seed,
                         name=name)
        self.rollout_logprobs_needed = False  # no ratio and no KL: only the kept responses' forward

    def trained_rows_per_step(self) -> Tuple[int, str]:
        return (self.prompts_per_step * self.top_n,
                f"model.rs.num_rollout_samples={self.prompts_per_step} x top_n_rollouts={self.top_n}")

    # ----------------------------------------------------------------- rollouts
    def make_rollout_batch(self, prompts: List[List[int]], timer: Timer, step_seed: int,
                           metadata: Optional[List[dict]] = None) -> Dict[str, torch.Tensor]:
        """``num_rollouts_per_prompt`` samples of each prompt with their rewards (no log-prob passes)."""
        repeated = [p for p in prompts for _ in range(self.responses_per_prompt)]
        if metadata is not None:
            metadata = [m for m in metadata for _ in range(self.responses_per_prompt)]
        self.model.prepare_for_inference()
        try:
            batch = self.generate_rollouts(repeated, self.rollout_micro_batch_size, step_seed, None, timer, metadata)
            self.resolve_rewards(batch, timer)
        finally:
            self.model.finish_inference()
        batch["group_ids"] = torch.arange(len(prompts)).repeat_interleave(self.responses_per_prompt)
        return batch

    def compute_advantages(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Keep each prompt's ``top_n_rollouts`` best responses (the batch then holds only those)."""
        keep = ppo_utils.select_top_n(batch["rewards"], batch["group_ids"], self.top_n, valid=batch["is_end"])
        response = (batch["response_lengths"] - batch["prompt_lengths"]).float()
        stats = torch.tensor([batch["rewards"].sum(), batch["rewards"].numel(), response.sum(),
                              batch["is_end"].float().sum(), batch["rewards"][keep].sum(), keep.numel(),
                              batch["is_end"][keep].float().sum()], dtype=torch.float64)
        stats = host_all_reduce(stats, group=self.dp_group)
        for key in ("tokens", "prompt_lengths", "response_lengths", "is_end", "rewards", "group_ids", "policy_mask"):
            if key in batch:
                batch[key] = batch[key][keep]
        batch.update(mask=self.trained_token_mask(batch), logprobs=None, init_logprobs=None, advantages=None)
        n, kept = max(float(stats[1]), 1.0), max(float(stats[5]), 1.0)
        return {"rewards": float(stats[0]) / n, "response_length": float(stats[2]) / n,
                "ended_fraction": float(stats[3]) / n, "selected_rewards": float(stats[4]) / kept,
                "selected_ended_fraction": float(stats[6]) / kept}

    def progress_postfix(self, metrics: Dict[str, float]) -> Dict[str, str]:
        return {"reward": f"{metrics['rewards']:.3f}", "kept": f"{metrics['selected_rewards']:.3f}"}
