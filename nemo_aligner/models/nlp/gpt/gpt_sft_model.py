"""GPT for supervised fine-tuning: masked next-token loss over micro-batches and pipeline stages."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from nemo_aligner.models.alignable_interface import SupervisedInterface
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel


def masked_token_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean over trained tokens, sum, count)`` of a ``[batch, seq]`` per-token loss."""
    mask = loss_mask.to(per_token_loss.dtype)
    total = (per_token_loss.float() * mask.float()).sum()
    count = mask.float().sum()
    return total / count.clamp(min=1.0), total, count


class GPTSFTModel(MegatronGPTModel, SupervisedInterface):
    """Next-token cross-entropy on the tokens where ``loss_mask`` is 1.

    The training loss of a step is the mean over micro-batches of each micro-batch's
    per-token mean (the quantity whose gradient is applied), averaged over data-parallel
    ranks. ``token_loss`` is the exact per-token mean over the whole global batch.
    """

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        super().__init__(cfg, tokenizer, precision, trainable)
        self.micro_batch_size = int(cfg.get("micro_batch_size", 1))
        self.val_micro_batch_size = int(cfg.get("val_micro_batch_size") or self.micro_batch_size)
        self._active_micro_batch_size = self.micro_batch_size

    def loss_func(self, micro_batch: Dict[str, torch.Tensor], output: torch.Tensor):
        mean, total, count = masked_token_loss(output, micro_batch["loss_mask"])
        # clone: the schedule divides the returned loss in place by the number of micro-batches.
        return mean, {"loss": mean.detach().clone(), "loss_sum": total.detach(), "tokens": count.detach()}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool) -> Tuple[float, Dict[str, float]]:
        outputs = self.forward_backward(batch, self.loss_func, forward_only, self._active_micro_batch_size)
        m = self.reduce_metrics(outputs, sum_keys=("loss_sum", "tokens"), mean_keys=("loss",))
        m["token_loss"] = m["loss_sum"] / max(m["tokens"], 1.0)
        return m["loss"], m

    def prepare_for_training_step(self) -> None:
        self.train()
        self._active_micro_batch_size = self.micro_batch_size
        self.zero_grad()

    def prepare_for_validation_step(self) -> None:
        self.eval()
        self._active_micro_batch_size = self.val_micro_batch_size

    def finish_validation_step(self) -> None:
        self._active_micro_batch_size = self.micro_batch_size
        self.train()
