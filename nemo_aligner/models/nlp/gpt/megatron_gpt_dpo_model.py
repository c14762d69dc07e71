"""DPO and its variants (IPO, RPO) on a megatron-core GPT; the reference policy's weights live on
the CPU and are swapped in to score each batch."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from nemo_aligner.models.alignable_interface import SupervisedInterface
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import next_token_batch
from nemo_aligner.models.nlp.gpt.reference_policy import ReferencePolicyMixin
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.preference_losses import PREFERENCE_LOSSES, preference_objective, sequence_logps


class MegatronGPTDPOModel(ReferencePolicyMixin, MegatronGPTModel, SupervisedInterface):
    """``model.dpo.*``: ``ref_policy_kl_penalty`` (beta), ``log_prob_forward_micro_batch_size``, ``preference_loss``, ``preference_loss_weight``,
    ``sft_loss_weight``, ``preference_average_log_probs``, ``sft_average_log_probs``, ``gt_reward_scale``."""

    section = "dpo"  # the config section (``model.<section>.*``) holding the keys above

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        dpo = cfg.get(self.section) or {}
        key = f"model.{self.section}"
        beta = self.initial_beta(dpo)  # checked before the model is built
        super().__init__(cfg, tokenizer, precision, trainable)
        self.micro_batch_size = int(cfg.get("micro_batch_size", 1))
        self.forward_micro_batch_size = int(dpo.get("log_prob_forward_micro_batch_size") or self.micro_batch_size)
        self.beta = beta
        self.loss_kind = str(dpo.get("preference_loss", "dpo"))
        if self.loss_kind not in PREFERENCE_LOSSES:
            raise ConfigError(f"{key}.preference_loss={self.loss_kind!r} must be one of {list(PREFERENCE_LOSSES)}")
        self.preference_average = bool(dpo.get("preference_average_log_probs", False))
        self.sft_average = bool(dpo.get("sft_average_log_probs", self.preference_average))
        self.preference_weight = float(dpo.get("preference_loss_weight", 1.0))
        self.sft_weight = float(dpo.get("sft_loss_weight", 0.0))
        if self.preference_weight == 0 and self.sft_weight == 0:
            raise ConfigError(f"{key}.preference_loss_weight and {key}.sft_loss_weight cannot both be 0")
        self.gt_reward_scale = float(dpo.get("gt_reward_scale", 1.0))

    @classmethod
    def initial_beta(cls, section_cfg) -> float:
        """``ref_policy_kl_penalty`` (beta), checked: 0 gives no gradient from the preference loss (IPO
        divides by it); < 0 prefers the rejected response."""
        beta = float(section_cfg.get("ref_policy_kl_penalty", 0.2))
        if not beta > 0:
            raise ConfigError(f"model.{cls.section}.ref_policy_kl_penalty={beta} (beta) must be > 0")
        return beta

    # ----------------------------------------------------------------- data
    @staticmethod
    def _stacked(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Chosen rows then rejected rows of every micro-batch, as one next-token batch."""
        data = next_token_batch(torch.cat([batch["chosen"], batch["rejected"]]))
        data["mask"] = torch.cat([batch["chosen_mask"], batch["rejected_mask"]])
        return data

    def _interleaved(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Per micro-batch: its chosen then its rejected rows, so each micro-batch holds whole pairs."""
        mbs = self.micro_batch_size
        out: Dict[str, list] = {}
        for start in range(0, batch["chosen"].shape[0], mbs):
            part = {k: v[start : start + mbs] for k, v in batch.items() if isinstance(v, torch.Tensor)}
            stacked = self._stacked(part)
            stacked.update(ref=torch.cat([part["ref_chosen"], part["ref_rejected"]]),
                           gt=torch.cat([part["chosen_rewards"], part["rejected_rewards"]]),
                           weight=torch.cat([part["weight"], part["weight"]]))
            for k, v in stacked.items():
                out.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in out.items()}

    def reference_logps(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-token reference log-probs of chosen and rejected, [B, L-1] each."""
        both = self.token_logps(torch.cat([batch["chosen"], batch["rejected"]]), 2 * self.forward_micro_batch_size,
                                reference=True)
        half = batch["chosen"].shape[0]
        return both[:half].contiguous(), both[half:].contiguous()

    # ----------------------------------------------------------------- loss
    def _loss(self, mb, per_token_ce):
        logps = -per_token_ce[:, :-1].float()
        half = logps.shape[0] // 2
        mask, weight = mb["mask"], mb["weight"][:half]
        ratio = sequence_logps(logps - mb["ref"], mask, self.preference_average)
        loss, sums = preference_objective(
            self.loss_kind, ratio[:half], ratio[half:], sequence_logps(logps[:half], mask[:half], self.sft_average),
            weight, self.beta, self.preference_weight, self.sft_weight, mb["gt"][:half], mb["gt"][half:],
            self.gt_reward_scale)
        return loss, {"loss": loss.detach().clone(), **sums}

    # ----------------------------------------------------------------- packed pairs
    def _packed_loss(self, mb, per_token_ce):
        """``_loss`` on packs (``model.data.data_impl=packed_jsonl``): each sequence's log-probs summed
        over its own positions; sequences alternate chosen, rejected."""
        from nemo_aligner.data.nlp.packing import sequence_sums

        seq, count = mb["sequence"], mb["num_sequences"]
        mask = mb["loss_mask"].float()
        policy = sequence_sums(-per_token_ce.float() * mask, seq, count)
        ratio = policy - sequence_sums(mb["ref"] * mask, seq, count)
        if self.preference_average or self.sft_average:
            tokens = sequence_sums(mask, seq, count).clamp(min=1.0)
        pref_ratio = ratio / tokens if self.preference_average else ratio
        sft_logps = policy[0::2] / tokens[0::2] if self.sft_average else policy[0::2]
        keep = torch.arange(mb["rewards"].shape[1], device=count.device).unsqueeze(0) < count.unsqueeze(1)
        gt = mb["rewards"][keep]
        rows = torch.repeat_interleave(torch.arange(count.shape[0], device=count.device), count)
        weight = mb["pack_weight"][rows[0::2]]
        loss, sums = preference_objective(self.loss_kind, pref_ratio[0::2], pref_ratio[1::2], sft_logps, weight,
                                          self.beta, self.preference_weight, self.sft_weight, gt[0::2], gt[1::2],
                                          self.gt_reward_scale)
        return loss, {"loss": loss.detach().clone(), **sums}

    def _packed_outputs(self, batch: Dict[str, torch.Tensor], forward_only: bool):
        data = {k: batch[k] for k in ("tokens", "labels", "position_ids", "attention_mask")}
        rows = self.forward_micro_batch_size  # log_prob_forward_micro_batch_size counts pairs; here packs
        rows = rows if data["tokens"].shape[0] % rows == 0 else self.micro_batch_size
        batch = dict(batch, ref=self.batch_token_logps(data, rows, reference=True))
        return self.forward_backward(batch, self._packed_loss, forward_only, self.micro_batch_size)

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool):
        """One global batch of pairs on this data-parallel rank (reference log-probs computed first)."""
        if "sequence" in batch:  # packs of pairs
            outputs = self._packed_outputs(batch, forward_only)
        else:
            batch = dict(batch)
            batch["ref_chosen"], batch["ref_rejected"] = self.reference_logps(batch)
            data = self._interleaved(batch)
            outputs = self.forward_backward(data, self._loss, forward_only, 2 * self.micro_batch_size)
        m = self.reduce_metrics(outputs, sum_keys=("preference_loss_sum", "sft_loss_sum", "correct", "pairs",
                                                   "rewards_chosen_sum", "rewards_rejected_sum"),
                                mean_keys=("loss",))
        pairs = max(m["pairs"], 1.0)
        chosen, rejected = m["rewards_chosen_sum"] / pairs, m["rewards_rejected_sum"] / pairs
        return m["loss"], {
            "loss": self.preference_weight * m["preference_loss_sum"] / pairs + self.sft_weight * m["sft_loss_sum"] / pairs,
            "preference_loss": m["preference_loss_sum"] / pairs, "sft_loss": m["sft_loss_sum"] / pairs,
            "accuracy": m["correct"] / pairs, "rewards_chosen_mean": chosen, "rewards_rejected_mean": rejected,
            "reward_margin": chosen - rejected, "pairs": m["pairs"],
        }
