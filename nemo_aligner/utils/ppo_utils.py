"""PPO maths as pure functions on [batch, positions] tensors.

Conventions: a sequence of ``L`` tokens (prompt + response) has ``L - 1`` log-probs; log-prob
``i`` is that of token ``i + 1`` given tokens ``0..i``. A sequence with a prompt of ``P``
tokens and ``L`` tokens in all has response tokens ``P..L-1``, i.e. log-prob positions
``P-1..L-2`` (the "actions"); the sequence reward lands on the last action, ``L - 2``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from nemo_aligner.utils.distributed import host_all_reduce


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_global_mean_var(values: torch.Tensor, mask: torch.Tensor,
                           group: Optional[dist.ProcessGroup] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mean and (population) variance over the masked entries of every rank of ``group``."""
    mask = mask.to(values.dtype)
    stats = torch.stack([(values * mask).sum(), mask.sum(), (values * values * mask).sum()]).double()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        stats = host_all_reduce(stats, group=group)
    count = stats[1].clamp(min=1.0)
    mean = stats[0] / count
    var = (stats[2] / count - mean * mean).clamp(min=0.0)
    return mean.to(values.dtype), var.to(values.dtype)


def normalize_advantages(advantages: torch.Tensor, mask: torch.Tensor,
                         group: Optional[dist.ProcessGroup] = None, eps: float = 1e-8) -> torch.Tensor:
    """Whiten advantages with the masked mean and variance over all data-parallel ranks."""
    mean, var = masked_global_mean_var(advantages, mask, group)
    return (advantages - mean) * torch.rsqrt(var + eps) * mask.to(advantages.dtype)


def create_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """1 on the log-prob positions of response tokens: ``P-1 <= i < L-1`` (float, [B, width])."""
    positions = torch.arange(width, device=prompt_lengths.device).unsqueeze(0)
    return ((positions >= (prompt_lengths - 1).unsqueeze(1)) & (positions < (response_lengths - 1).unsqueeze(1))).float()


def calculate_kl_penalty(logprobs: torch.Tensor, init_logprobs: torch.Tensor, use_absolute_kl: bool = True) -> torch.Tensor:
    """Per-token KL estimate between the policy and the initial policy: ``logp - logp_init`` (or its absolute value)."""
    kl = logprobs - init_logprobs
    return kl.abs() if use_absolute_kl else kl


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative estimate of KL(policy || reference) from samples of the policy
    (Schulman's k3): ``exp(ref - logp) - (ref - logp) - 1``, as GRPO puts it in the loss."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def calculate_ppo_rewards(rewards: torch.Tensor, response_lengths: torch.Tensor, kl: torch.Tensor,
                          kl_penalty: float) -> torch.Tensor:
    """Per-token rewards: ``-kl_penalty * kl`` everywhere, plus the sequence reward on the last action."""
    per_token = -kl_penalty * kl
    last = (response_lengths - 2).clamp(min=0)
    per_token = per_token.clone()
    per_token[torch.arange(per_token.shape[0], device=per_token.device), last] += rewards.reshape(-1).to(per_token.dtype)
    return per_token


def kl_penalised_rewards(rewards: torch.Tensor, kl: torch.Tensor, kl_penalty: float) -> torch.Tensor:
    """Sequence rewards of critic-free methods (REINFORCE/RLOO, GRPO): ``r - kl_penalty * sum_t KL_t``
    over each row's per-token KL ``kl`` [B, T] (already zero outside the response)."""
    return rewards - kl_penalty * kl.sum(-1)


def calculate_advantages_and_returns(values: torch.Tensor, rewards: torch.Tensor, discount_factor: float,
                                     gae_lambda: float, mask: Optional[torch.Tensor] = None):
    """Generalised advantage estimation; the value after the last position is 0.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lambda * A_{t+1}``,
    returns ``R_t = A_t + V_t``. Positions outside ``mask`` contribute neither values nor rewards.
    """
    if mask is not None:
        values = values * mask
        rewards = rewards * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    width = rewards.shape[1]
    for t in reversed(range(width)):
        next_value = values[:, t + 1] if t + 1 < width else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + discount_factor * next_value - values[:, t]
        running = delta + discount_factor * gae_lambda * running
        advantages[:, t] = running
    return advantages, advantages + values


def ppo_actor_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, ratio_eps: float, entropy: Optional[torch.Tensor] = None,
                   entropy_bonus: float = 0.0, init_logprobs: Optional[torch.Tensor] = None,
                   kl_loss_coef: float = 0.0) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped surrogate ``max(-A r, -A clip(r, 1 +- eps))`` masked-averaged, minus ``entropy_bonus * entropy``,
    plus ``kl_loss_coef`` times the masked mean of :func:`k3_kl` to ``init_logprobs`` (GRPO's KL in the loss).

    ``mask`` should already exclude sequences that did not end properly; with an empty mask the
    loss is zero (but still connected to the graph so every rank runs backward).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - ratio_eps, 1.0 + ratio_eps)
    surrogate = torch.max(-advantages * ratio, -advantages * clipped)
    if mask.sum() > 0:
        loss = masked_mean(surrogate, mask)
    else:
        loss = (surrogate * 0.0).sum()
    mean_entropy = masked_mean(entropy, mask) if entropy is not None else torch.zeros((), dtype=loss.dtype, device=loss.device)
    if entropy is not None and entropy_bonus:
        loss = loss - entropy_bonus * mean_entropy
    extra = {}
    if kl_loss_coef:
        if init_logprobs is None:
            raise ValueError("kl_loss_coef needs init_logprobs")
        kl = masked_mean(k3_kl(logprobs, init_logprobs), mask)
        loss = loss + kl_loss_coef * kl
        extra["kl_loss"] = kl.detach()
    with torch.no_grad():
        clip_fraction = masked_mean(((ratio - 1.0).abs() > ratio_eps).to(ratio.dtype), mask)
        approx_kl = masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask)
    return loss, {"clip_fraction": clip_fraction, "approx_kl": approx_kl, "entropy": mean_entropy.detach(),
                  "ratio_mean": masked_mean(ratio.detach(), mask), **extra}


def critic_loss(values: torch.Tensor, prev_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                clip_val: float) -> torch.Tensor:
    """``0.5 * masked_mean(max((v_clip - R)^2, (v - R)^2))``, ``v_clip = v_prev + clamp(v - v_prev, +-clip_val)``."""
    clipped = prev_values + (values - prev_values).clamp(-clip_val, clip_val)
    loss = torch.max((clipped - returns) ** 2, (values - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)


def rloo_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Leave-one-out baseline: for each sample, the mean reward of the *other* valid samples of its prompt.

    A sample whose prompt has no other valid sample gets its own reward (advantage 0).
    """
    valid = torch.ones_like(rewards) if valid is None else valid.to(rewards.dtype)
    same = (group_ids.unsqueeze(0) == group_ids.unsqueeze(1)).to(rewards.dtype)
    others = same - torch.eye(len(rewards), dtype=rewards.dtype, device=rewards.device)
    count = others @ valid
    total = others @ (rewards * valid)
    return torch.where(count > 0, total / count.clamp(min=1.0), rewards)


def select_top_n(rewards: torch.Tensor, group_ids: torch.Tensor, n: int,
                 valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices of each group's ``n`` highest-reward rows (rejection sampling), in row order. Rows
    that are not ``valid`` (cut at the length limit) are taken only when a group has too few
    valid ones; among equal rewards the earlier row wins."""
    rows = torch.arange(rewards.numel(), device=rewards.device)
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    chosen = []
    for group in torch.unique(group_ids):
        members = rows[group_ids == group]
        # sort keys: valid first, then higher reward, then earlier row (a stable sort keeps row order)
        order = sorted(members.tolist(), key=lambda i: (not bool(valid[i]), -float(rewards[i])))
        chosen.extend(order[:n])
    return torch.tensor(sorted(chosen), dtype=torch.long, device=rewards.device)
