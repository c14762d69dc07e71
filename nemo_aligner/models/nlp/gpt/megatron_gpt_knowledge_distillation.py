"""Knowledge distillation (NeMo-Aligner's ``MegatronGPTKnowledgeDistillationModel``): a student GPT
trained towards a teacher's precomputed top-k logits (``compute_topk_logits.py``), plus an optional
SFT loss on the data's tokens."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from nemo_aligner.models.alignable_interface import SupervisedInterface
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.kd_losses import KD_LOSSES, topk_kd_loss


def vocab_parallel_gather(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logits[..., ids]`` of vocab-parallel logits ``[B, T, V/TP]`` at global token ``ids`` ``[B, T, k]``
    (differentiable; each id's value comes from the rank holding it)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits.gather(-1, ids)
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    local = ids - start
    outside = (local < 0) | (local >= part)
    picked = logits.gather(-1, local.masked_fill(outside, 0)).masked_fill(outside, 0.0)
    return reduce_from_tensor_model_parallel_region(picked)


class MegatronGPTKnowledgeDistillationModel(MegatronGPTModel, SupervisedInterface):
    """``model.knowledge_distillation.*``: ``kd_loss`` (fwd_kl | bwd_kl), ``kd_loss_weight``,
    ``sft_loss_weight``, ``target_logits_scale`` (teacher logits), ``logits_scale`` (student logits)."""

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        kd = cfg.get("knowledge_distillation") or {}
        key = "model.knowledge_distillation"
        self.kd_kind = str(kd.get("kd_loss", "fwd_kl"))
        if self.kd_kind not in KD_LOSSES:
            raise ConfigError(f"{key}.kd_loss={self.kd_kind!r} must be one of {list(KD_LOSSES)}")
        self.kd_weight = float(kd.get("kd_loss_weight", 1.0))
        self.sft_weight = float(kd.get("sft_loss_weight", 0.0))
        if self.kd_weight < 0 or self.sft_weight < 0 or (self.kd_weight == 0 and self.sft_weight == 0):
            raise ConfigError(f"{key}.kd_loss_weight={self.kd_weight} and sft_loss_weight={self.sft_weight} must be "
                              ">= 0 and not both 0")
        self.target_logits_scale = float(kd.get("target_logits_scale", 1.0))
        self.logits_scale = float(kd.get("logits_scale", 1.0))
        if kd.get("cross_tokenizer", False):
            raise ConfigError(f"{key}.cross_tokenizer=True is not supported: the teacher's top-k ids must be the "
                              "student's token ids (the same tokenizer)")
        super().__init__(cfg, tokenizer, precision, trainable)
        self.micro_batch_size = int(cfg.get("micro_batch_size", 1))

    def _forward(self, model, mb):
        return model(mb["tokens"], mb["position_ids"], None)  # logits [B, T, V/TP] on the last stage

    def _loss(self, mb, logits):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.float() * self.logits_scale
        mask = mb["loss_mask"].float()
        count = mask.sum()
        student = vocab_parallel_gather(logits, mb["topk_token_ids"])
        kd = topk_kd_loss(student, mb["topk_logits"].float() * self.target_logits_scale, self.kd_kind)
        kd_sum = (kd * mask).sum()
        sft_sum = (vocab_parallel_cross_entropy(logits.clone(), mb["labels"]) * mask).sum() if self.sft_weight else \
            torch.zeros((), device=logits.device)
        loss = (self.kd_weight * kd_sum + self.sft_weight * sft_sum) / count.clamp(min=1.0)
        return loss, {"loss": loss.detach().clone(), "kd_loss_sum": kd_sum.detach(), "sft_loss_sum": sft_sum.detach(),
                      "tokens": count.detach()}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool) -> Tuple[float, Dict[str, float]]:
        """One global batch (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``topk_logits``,
        ``topk_token_ids``): ``kd_loss_weight x KL + sft_loss_weight x NLL``, a per-token mean over
        ``loss_mask`` (each micro-batch's mean, averaged; ``kd_loss``/``sft_loss`` are exact
        per-token means over the global batch)."""
        data = {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids", "topk_logits", "topk_token_ids")}
        outputs = self.forward_backward(data, self._loss, forward_only, self.micro_batch_size, forward_fn=self._forward)
        m = self.reduce_metrics(outputs, sum_keys=("kd_loss_sum", "sft_loss_sum", "tokens"), mean_keys=("loss",))
        tokens = max(m["tokens"], 1.0)
        m["kd_loss"], m["sft_loss"] = m.pop("kd_loss_sum") / tokens, m.pop("sft_loss_sum") / tokens
        m["loss_sum"] = (self.kd_weight * m["kd_loss"] + self.sft_weight * m["sft_loss"]) * tokens
        return m["loss"], m
