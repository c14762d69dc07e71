"""Preference losses (pure functions): preference optimisation on sequence log-prob ratios, and the
Bradley-Terry pair losses of a regression reward model (``preference_pair_sums``).

``chosen``/``rejected`` are the policy-minus-reference log-prob of each response, summed (or
averaged) over its tokens; ``beta`` is ``ref_policy_kl_penalty``. Conventions follow
NeMo-Aligner: the implied reward of a response is ``beta * (log pi - log pi_ref)``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nemo_aligner.utils.errors import ConfigError

PREFERENCE_LOSSES = ("dpo", "ipo", "rpo_sq", "rpo_bwd_kl", "rpo_fwd_kl")
# NeMo-Aligner's Bradley-Terry losses for a regression reward model (model.regression.loss_func), trained on
# HelpSteer2-Preference pairs: two consecutive records, the first carrying the preference strength.
BT_LOSSES = ("regular_bt", "margin_bt", "scaled_bt")
REGRESSION_LOSSES = ("regression",) + BT_LOSSES


def sequence_logps(logps: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sum (or mean) of per-token values over the response tokens (``mask`` 1)."""
    mask = mask.to(logps.dtype)
    total = (logps * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if average else total


def preference_loss(kind: str, chosen: torch.Tensor, rejected: torch.Tensor, beta: float,
                    gt_chosen: Optional[torch.Tensor] = None, gt_rejected: Optional[torch.Tensor] = None,
                    gt_reward_scale: float = 1.0) -> torch.Tensor:
    """Per-pair preference loss (average it over the pairs that count).

    - ``dpo``: ``-log sigmoid(beta * (c - r))``
    - ``ipo``: ``(c - r - 1 / (2 beta))^2``
    - ``rpo_sq``: ``(beta * (c - r) - s * (R_c - R_r))^2`` with ground-truth rewards ``R``
    - ``rpo_bwd_kl`` / ``rpo_fwd_kl``: KL between the Bernoulli preference implied by the
      ground-truth rewards (``sigmoid(s * (R_c - R_r))``) and by the policy (``sigmoid(beta * (c - r))``),
      backward ``KL(gt || policy)`` or forward ``KL(policy || gt)``.
    """
    delta = chosen - rejected
    if kind == "dpo":
        return -F.logsigmoid(beta * delta)
    if kind == "ipo":
        return (delta - 1.0 / (2.0 * beta)) ** 2
    if gt_chosen is None or gt_rejected is None:
        raise ValueError(f"preference_loss={kind!r} needs ground-truth rewards (chosen_reward/rejected_reward)")
    gt_delta = gt_reward_scale * (gt_chosen - gt_rejected)
    if kind == "rpo_sq":
        return (beta * delta - gt_delta) ** 2
    log_policy = (F.logsigmoid(beta * delta), F.logsigmoid(-beta * delta))
    log_gt = (F.logsigmoid(gt_delta), F.logsigmoid(-gt_delta))
    if kind == "rpo_bwd_kl":
        return sum(g.exp() * (g - p) for g, p in zip(log_gt, log_policy))
    if kind == "rpo_fwd_kl":
        return sum(p.exp() * (p - g) for g, p in zip(log_gt, log_policy))
    raise ValueError(f"model.dpo.preference_loss={kind!r} must be one of {list(PREFERENCE_LOSSES)}")


def preference_objective(kind: str, chosen: torch.Tensor, rejected: torch.Tensor, chosen_logps: torch.Tensor,
                         weight: torch.Tensor, beta: float, preference_weight: float = 1.0, sft_weight: float = 0.0,
                         gt_chosen: Optional[torch.Tensor] = None, gt_rejected: Optional[torch.Tensor] = None,
                         gt_reward_scale: float = 1.0):
    """DPO's training objective over (weighted) pairs and the sums its logged metrics come from.

    ``loss = (preference_weight * sum_i w_i * preference_loss_i + sft_weight * sum_i w_i * (-chosen_logps_i)) / sum_i w_i``:
    the SFT term is the negative log-likelihood of the *chosen* responses only. ``chosen``/``rejected``
    are the policy-minus-reference log-prob ratios; the implied rewards are ``beta`` times them.
    """
    per_pair = preference_loss(kind, chosen, rejected, beta, gt_chosen, gt_rejected, gt_reward_scale)
    weight = weight.to(per_pair.dtype)
    sums = {"preference_loss_sum": (per_pair * weight).sum(), "sft_loss_sum": (-chosen_logps * weight).sum(),
            "correct": ((chosen > rejected).to(weight.dtype) * weight).sum(), "pairs": weight.sum(),
            "rewards_chosen_sum": (beta * chosen * weight).sum(), "rewards_rejected_sum": (beta * rejected * weight).sum()}
    loss = (preference_weight * sums["preference_loss_sum"] + sft_weight * sums["sft_loss_sum"]) / sums["pairs"].clamp(min=1.0)
    return loss, {k: v.detach() for k, v in sums.items()}


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl_estimate: torch.Tensor,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-sample KTO (Ethayarajh et al. 2024): ``w * (1 - sigmoid(beta * (r - z)))`` for desirable responses and
    ``w * (1 - sigmoid(beta * (z - r)))`` for undesirable ones, ``r = log pi - log pi_ref`` of the
    response and ``z`` the (detached, non-negative) KL estimate from mismatched prompt/response pairs."""
    ratio = policy_logps - ref_logps
    z = kl_estimate.detach().clamp(min=0.0)
    desirable = desirable.to(ratio.dtype)
    return desirable * desirable_weight * (1 - torch.sigmoid(beta * (ratio - z))) + \
        (1 - desirable) * undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio)))


def preference_pair_sums(first: torch.Tensor, second: torch.Tensor, strength: torch.Tensor, kind: str,
                         weight: Optional[torch.Tensor] = None):
    """Sums over pairs of NeMo-Aligner's ``regular_bt``/``margin_bt``/``scaled_bt`` loss, ``correct`` and
    ``pairs``. ``strength`` < 0: the first response is preferred, >= 0: the second; ``|strength|`` is the
    margin subtracted from the reward difference (margin_bt) or the pair's weight (scaled_bt).
    ``weight`` (0: a padding pair) multiplies each pair's terms."""
    chosen = torch.where(strength < 0, first, second)
    rejected = torch.where(strength < 0, second, first)
    margin = strength.abs()
    diff = chosen - rejected
    if kind == "regular_bt":
        losses = -F.logsigmoid(diff)
    elif kind == "margin_bt":
        losses = -F.logsigmoid(diff - margin)
    elif kind == "scaled_bt":
        losses = margin * -F.logsigmoid(diff)
    else:
        raise ConfigError(f"model.regression.loss_func={kind!r} is not one of {', '.join(REGRESSION_LOSSES)}")
    weight = torch.ones_like(diff) if weight is None else weight.to(diff.dtype)
    return {"loss_sum": (weight * losses).sum(), "correct": (weight * (diff > 0).to(diff.dtype)).sum(),
            "pairs": weight.sum()}
