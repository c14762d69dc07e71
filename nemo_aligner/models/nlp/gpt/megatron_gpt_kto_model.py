"""KTO (Kahneman-Tversky Optimization) on a megatron-core GPT; the reference policy's weights live
on the CPU and are swapped in to score each batch."""

from __future__ import annotations

from typing import Dict

import torch

from nemo_aligner.models.alignable_interface import SupervisedInterface
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import next_token_batch
from nemo_aligner.models.nlp.gpt.reference_policy import ReferencePolicyMixin
from nemo_aligner.utils.distributed import host_all_reduce
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.preference_losses import kto_loss, sequence_logps


class MegatronGPTKTOModel(ReferencePolicyMixin, MegatronGPTModel, SupervisedInterface):
    """``model.kto.*``: ``ref_policy_kl_penalty`` (beta), ``desirable_loss_weight``,
    ``undesirable_loss_weight``, ``average_log_probs``."""

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        super().__init__(cfg, tokenizer, precision, trainable)
        kto = cfg.get("kto") or {}
        self.micro_batch_size = int(cfg.get("micro_batch_size", 1))
        self.beta = float(kto.get("ref_policy_kl_penalty", 0.1))
        self.desirable_weight = float(kto.get("desirable_loss_weight", 1.0))
        self.undesirable_weight = float(kto.get("undesirable_loss_weight", 1.0))
        for key, value in (("ref_policy_kl_penalty", self.beta), ("desirable_loss_weight", self.desirable_weight),
                           ("undesirable_loss_weight", self.undesirable_weight)):
            if value <= 0:
                raise ConfigError(f"model.kto.{key}={value} must be > 0")
        self.average = bool(kto.get("average_log_probs", False))
        self.loss_kind = "kto"
        if trainable:
            self._check_kl_batch(int(cfg.get("global_batch_size", self.micro_batch_size)))

    @staticmethod
    def _check_kl_batch(global_batch_size: int) -> None:
        """KTO's KL estimate pairs each prompt with another sample's response on the same data-parallel
        rank: with one sample per rank there is none, the estimate is always 0 and KTO silently loses
        its reference point (TRL refuses such a batch too)."""
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        if global_batch_size // max(dp, 1) < 2:
            raise ConfigError(f"model.global_batch_size={global_batch_size} gives {global_batch_size // max(dp, 1)} "
                              f"sample(s) per data-parallel rank ({dp} rank(s)); KTO's KL estimate pairs each "
                              "prompt with another sample's response on its rank, so it needs at least 2")

    @torch.no_grad()
    def kl_estimate(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """KTO's reference point z: mean policy-minus-reference log-prob of the mismatched
        (prompt i, response i+1) sequences over the whole global batch (all data-parallel ranks),
        clamped at 0; the same value on every rank."""
        from megatron.core import parallel_state

        rows = self.micro_batch_size
        policy = self.token_logps(batch["kl_tokens"], rows)
        reference = self.token_logps(batch["kl_tokens"], rows, reference=True)
        per_row = sequence_logps(policy - reference, batch["kl_mask"], self.average)
        stats = torch.stack([(per_row * batch["kl_weight"]).sum(), batch["kl_weight"].sum()]).double()
        stats = host_all_reduce(stats, group=parallel_state.get_data_parallel_group())
        return (stats[0] / stats[1].clamp(min=1.0)).float().clamp(min=0.0)

    def _loss(self, mb, per_token_ce):
        logps = -per_token_ce[:, :-1].float()
        ratio = sequence_logps(logps - mb["ref"], mb["mask"], self.average)
        weight, desirable = mb["weight"], mb["desirable"]
        count = weight.sum().clamp(min=1.0)
        per_row = kto_loss(ratio, torch.zeros_like(ratio), desirable, mb["z"][0], self.beta, self.desirable_weight,
                           self.undesirable_weight)
        loss = (per_row * weight).sum() / count
        with torch.no_grad():
            rewards = self.beta * ratio * weight
            metrics = {"loss": loss.detach().clone(), "loss_sum": (per_row * weight).sum(), "samples": weight.sum(),
                       "desirable_rows": (desirable * weight).sum(), "undesirable_rows": ((1 - desirable) * weight).sum(),
                       "rewards_desirable_sum": (rewards * desirable).sum(),
                       "rewards_undesirable_sum": (rewards * (1 - desirable)).sum()}
        return loss, metrics

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool):
        """One global batch on this data-parallel rank: the KL estimate and reference log-probs
        first, then the KTO loss (and its gradients unless ``forward_only``)."""
        z = self.kl_estimate(batch)
        data = next_token_batch(batch["tokens"])
        data.update(mask=batch["mask"], weight=batch["weight"], desirable=batch["desirable"],
                    ref=self.token_logps(batch["tokens"], self.micro_batch_size, reference=True),
                    z=z.reshape(1).expand(batch["tokens"].shape[0]).contiguous())
        outputs = self.forward_backward(data, self._loss, forward_only, self.micro_batch_size)
        m = self.reduce_metrics(outputs, sum_keys=("loss_sum", "samples", "desirable_rows", "undesirable_rows",
                                                   "rewards_desirable_sum", "rewards_undesirable_sum"),
                                mean_keys=("loss",))
        desirable = m["rewards_desirable_sum"] / max(m["desirable_rows"], 1.0)
        undesirable = m["rewards_undesirable_sum"] / max(m["undesirable_rows"], 1.0)
        return m["loss"], {"loss": m["loss_sum"] / max(m["samples"], 1.0), "kl": float(z),
                           "rewards_desirable_mean": desirable, "rewards_undesirable_mean": undesirable,
                           "reward_margin": desirable - undesirable, "samples": m["samples"]}
