"""ReinforceTrainer: critic-free policy gradient (REINFORCE with a leave-one-out baseline, RLOO).

One step::

    rollouts  = generate(prompts, num_responses_per_prompt each)   # scored as they finish
    logprobs, init_logprobs = actor(rollouts), initial_policy(rollouts)
    r_i       = reward_i - beta * sum_t KL_t                       # KL to the initial policy
    A_i       = r_i - mean(r_j of the same prompt, j != i)         # (or the group mean with i)
    actor.train(clipped surrogate with A_i on every response token) ; log ; validate ; save

The loop, rollouts, actor update, validation and checkpoints are PPOTrainer's; what differs is
the reward source (a reward-model server or a Python function, no critic) and the advantages.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import numpy as np
import torch

from nemo_aligner.algorithms.multi_turn import EpisodeStats, play_episodes
from nemo_aligner.algorithms.ppo import PPOTrainer, Timer
from nemo_aligner.utils import ppo_utils
from nemo_aligner.utils.distributed import host_all_reduce
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, leave_one_out: bool = True,
                     normalize_std: bool = False, eps: float = 1e-6,
                     valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sequence advantages against the other responses to the same prompt.

    ``leave_one_out``: ``r_i - mean_{j != i} r_j`` (RLOO); otherwise ``r_i - mean_j r_j`` over the
    whole group. ``normalize_std`` divides by the group's (population) standard deviation (GRPO).
    ``valid`` (the rows that ended, which alone are trained on): baselines, deviations and the
    all-equal test use only valid rows, as NeMo-Aligner does; invalid rows get 0. A group whose
    (valid) rewards are all equal gets exactly 0: computed, its baseline would differ from the
    rewards by rounding, which ``normalize_std`` divides by a standard deviation of 0 (+ ``eps``).
    """
    r = rewards.double()
    valid = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.bool()
    members = group_ids.unsqueeze(0) == group_ids.unsqueeze(1)
    counted = (members & valid.unsqueeze(0)).double()  # [i, j]: j is a valid member of i's group
    size = counted.sum(1).clamp(min=1.0)
    group_mean = counted @ r / size
    baseline = ppo_utils.rloo_baseline(r, group_ids, valid) if leave_one_out else group_mean
    advantages = r - baseline
    if normalize_std:
        var = counted @ (r - group_mean) ** 2 / size
        advantages = advantages / (var.sqrt() + eps)
    seen = counted.bool()
    all_equal = (torch.where(seen, r, -torch.inf).amax(1) == torch.where(seen, r, torch.inf).amin(1))
    return advantages.masked_fill(all_equal | ~valid, 0.0).to(rewards.dtype)


def check_group_sampling(rl_cfg, name: str, refuse_greedy: bool = True) -> int:
    """``num_responses_per_prompt`` of a group-baseline method, checked: at least 2, and sampled (greedy
    or temperature 0 would give identical responses, so every advantage would be 0). REINFORCE only
    warns about greedy sampling: NeMo-Aligner runs it (its CI does) and the KL term still trains."""
    n = rl_cfg.get("num_responses_per_prompt", 4)
    if n is None:
        raise ConfigError(f"model.{name}.num_responses_per_prompt=null: this key needs a value (the group size)")
    n = int(n)
    if n < 2:  # the baseline is the other responses' (or the group's) mean: with one, every advantage is 0
        raise ConfigError(f"model.{name}.num_responses_per_prompt={n}: the baseline comes from the other responses "
                          "to the same prompt, so it needs >= 2 (with 1 every advantage is 0)")
    sampling = rl_cfg.get("sampling_params") or {}
    greedy, temperature = bool(sampling.get("use_greedy", False)), sampling.get("temperature", 1.0)
    if greedy or (temperature is not None and float(temperature) <= 0):
        message = (f"model.{name}.sampling_params: use_greedy={greedy}, temperature={temperature} gives {n} "
                   "identical responses per prompt, so every advantage is 0; sample (use_greedy=False, "
                   "temperature > 0)")
        if refuse_greedy:
            raise ConfigError(message)
        logger.warning("%s (only the KL penalty trains)", message)
    return n


def check_rollout_turns(rl_cfg, name: str, reward_source, shared_rollouts: bool = False) -> int:
    """``max_rollout_turns`` (NeMo-RL's key): 1, or more with an environment, which alone can answer a turn;
    episodes are played where their prompts are, so not with ``batch_iterator.use_flask`` (``shared_rollouts``)."""
    turns = rl_cfg.get("max_rollout_turns", 1)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ConfigError(f"model.{name}.max_rollout_turns={turns!r} must be an integer >= 1")
    if turns > 1 and not getattr(reward_source, "multi_turn", False):
        raise ConfigError(f"model.{name}.max_rollout_turns={turns}: only an environment plays several turns; a reward "
                          "function or reward model scores one response (set it to 1)")
    if turns > 1 and shared_rollouts:
        raise ConfigError(f"trainer.{name}.batch_iterator.use_flask=True is not supported with model.{name}."
                          f"max_rollout_turns={turns}: an episode is played on the rank that owns its prompt (set "
                          "use_flask=False or max_rollout_turns=1)")
    return turns


class ReinforceTrainer(PPOTrainer):
    """REINFORCE/RLOO for an actor (``MegatronGPTActorModel``) with rewards from ``reward_source``."""

    def __init__(self, cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, reward_source, logger_,
                 ckpt_callback, run_timer=None, rl_cfg=None, seed: int = 1234, name: str = "reinforce"):
        rl_cfg = rl_cfg or {}
        super().__init__(cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, reward_source, logger_,
                         ckpt_callback, run_timer, ppo_cfg=rl_cfg, seed=seed,
                         responses_per_prompt=int(rl_cfg.get("num_responses_per_prompt", 4)), name=name)
        self.leave_one_out = bool(cfg.get("use_leave_one_out_baseline", True))
        self.normalize_rewards = bool(cfg.get("normalize_rewards", False))
        self.critic_warmup_steps = 0
        self.has_critic = False
        self.max_rollout_turns = check_rollout_turns(rl_cfg, name, reward_source, self.share_rollouts)
        self.episode_stats = EpisodeStats()

    # ----------------------------------------------------------------- rollouts
    def request_scores(self, out, metadata=None):
        return self.rm_critic.score(out.tokens.numpy(), out.prompt_lengths.numpy(), out.response_lengths.numpy(),
                                    metadata=metadata)

    def generate_rollouts(self, prompts: List[List[int]], micro_batch_size: int, seed: int, sampling, timer: Timer,
                          metadata: Optional[List[dict]] = None) -> Dict[str, torch.Tensor]:
        """One response per row, or with ``max_rollout_turns`` > 1 an episode per row (the environment
        answers each turn; the rewards of all turns add up)."""
        if self.max_rollout_turns == 1:
            return super().generate_rollouts(prompts, micro_batch_size, seed, sampling, timer, metadata)
        return play_episodes(self.model, self.rm_critic, prompts, metadata, micro_batch_size, seed, sampling,
                             self.max_rollout_turns, timer, self.episode_stats, f"model.{self.name}.max_rollout_turns")

    def store_answers(self, batch: Dict, answers: list) -> None:
        batch["rewards"] = torch.tensor(np.concatenate([np.asarray(a, dtype=np.float32).reshape(-1) for a in answers]))

    def make_rollout_batch(self, prompts: List[List[int]], timer: Timer, step_seed: int,
                           metadata: Optional[List[dict]] = None) -> Dict[str, torch.Tensor]:
        """``num_responses_per_prompt`` samples of each prompt, with ``group_ids`` saying whose they are."""
        repeated = [p for p in prompts for _ in range(self.responses_per_prompt)]
        if metadata is not None:
            metadata = [m for m in metadata for _ in range(self.responses_per_prompt)]
        batch = super().make_rollout_batch(repeated, timer, step_seed, metadata)
        batch["group_ids"] = torch.arange(len(prompts)).repeat_interleave(self.responses_per_prompt)
        return batch

    @staticmethod
    def trained_token_mask(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """1 on the log-prob positions of the policy's response tokens, [B, T-1]; in multi-turn episodes
        the environment's observations between turns are not the policy's actions."""
        width = batch["tokens"].shape[1] - 1
        mask = ppo_utils.create_mask(batch["prompt_lengths"], batch["response_lengths"], width)
        if "policy_mask" in batch:
            mask = mask * batch["policy_mask"][:, :width]
        return mask

    def compute_advantages(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        mask = self.trained_token_mask(batch)
        kl = self.rollout_kl(batch, mask)
        penalised = ppo_utils.kl_penalised_rewards(batch["rewards"], kl, self.kl_penalty)
        # Responses cut at max_length (no EOS) are not trained on, so they set no one's baseline either.
        advantages = group_advantages(penalised, batch["group_ids"], self.leave_one_out, self.normalize_rewards,
                                      valid=batch["is_end"])
        batch.update(mask=mask, advantages=advantages.unsqueeze(1) * mask, rewards_with_kl=penalised)
        stats = torch.tensor([batch["rewards"].sum(), batch["rewards"].numel(), kl.sum(), mask.sum(),
                              (batch["response_lengths"] - batch["prompt_lengths"]).float().sum(),
                              batch["is_end"].float().sum(), penalised.sum(), advantages.abs().sum()],
                             dtype=torch.float64)
        stats = host_all_reduce(stats, group=self.dp_group)
        n = max(float(stats[1]), 1.0)
        metrics = {"rewards": float(stats[0]) / n, "init_policy_kl": float(stats[2]) / max(float(stats[3]), 1.0),
                   "response_length": float(stats[4]) / n, "ended_fraction": float(stats[5]) / n,
                   "rewards_with_kl": float(stats[6]) / n, "advantage_abs_mean": float(stats[7]) / n}
        if "turns" in batch:
            turns = host_all_reduce(batch["turns"].sum().double().reshape(1), group=self.dp_group)
            metrics["turns"] = float(turns[0]) / n
        return metrics

    def progress_postfix(self, metrics: Dict[str, float]) -> Dict[str, str]:
        return {"reward": f"{metrics['rewards']:.3f}", "kl": f"{metrics['init_policy_kl']:.4f}"}
